"""`expertcache probe-link`: host<->device bandwidth the ways the cache uses it, and a verdict."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from ..errors import UserError
from ..sizing.presets import DEFAULT_PRESET
from ..tables import Table
from . import select_kernels

console = Console()

def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--sizes takes MiB counts like 1,64,1024, not {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise UserError("--sizes takes positive MiB counts like 1,64,1024")
    return sizes


def register(app: typer.Typer) -> None:
    @app.command("probe-link")
    def probe_link(
        device: int = typer.Option(0, "--device", "-d", help="CUDA device index"),
        model: str = typer.Option(
            DEFAULT_PRESET, "--model", "-m",
            help="model whose expert slab the gather row uses (as in `size`)",
        ),
        quant: str = typer.Option(None, "--quant", help="weight format, as in `size`"),
        sizes: str = typer.Option("1,4,16,64,256,1024", help="copy sizes in MiB"),
        repeats: int = typer.Option(7, help="timed samples per figure (the median is shown)"),
        warmup: int = typer.Option(2, help="untimed runs before each figure"),
        pin: bool = typer.Option(True, "--pin/--no-pin", help="pin to the GPU's NUMA node"),
        as_json: bool = typer.Option(False, "--json", help="print every number as JSON"),
        save: Path = typer.Option(None, "--save", help="also write the JSON to this file"),
        only: str = typer.Option(
            None, "--only", help="comma-separated measurements to run (see --list); default all"),
        list_: bool = typer.Option(False, "--list", help="list the measurements and exit"),
    ) -> None:
        """Measure the host link (copy engine, zero-copy, the cache's gather) and conclude."""
        from .. import probe
        from ..files import atomic_write, check_output

        if list_:
            for key, meas in probe.MEASUREMENTS.items():
                print(f"{key:10} {meas.about}")
            return
        only_keys = [k.strip() for k in only.split(",") if k.strip()] if only else None
        if only is not None and not only_keys:
            raise UserError("--only takes measurement names like pinned,gather (see --list)")
        size_list = _parse_sizes(sizes)
        if repeats < 1 or warmup < 0:
            raise UserError(f"--repeats must be >= 1 and --warmup >= 0, got {repeats}, {warmup}")
        if save is not None:
            save = check_output(save, "--save")  # before minutes of measuring
        mdl = str(model) if not Path(model).exists() else Path(model)
        select_kernels()
        rep = probe.probe_link(device=device, model=mdl, quant=quant, sizes_mib=size_list,
                               repeats=repeats, warmup=warmup, pin=pin, only=only_keys)
        data = rep.to_json()
        if save is not None:
            text = json.dumps(data, indent=2) + "\n"
            atomic_write(save, lambda tmp: tmp.write_text(text))
        if as_json:
            print(json.dumps(data, indent=2))
            return
        console.print(
            f"[bold]{rep.device_name}[/] (cuda:{rep.device_index}, PCI {rep.pci_bus_id or '?'}"
            + (f", {rep.pcie_link}" if rep.pcie_link else "") + f"); {rep.numa}"
        )
        t = Table(title=f"host link (median of {repeats}, CUDA events)")
        for col in ("path", "size", "GB/s", "time", "spread"):
            t.add_column(col, justify="right" if col != "path" else "left", text=col == "path",
                         keep={"path": 9, "GB/s": 8}.get(col, 0))
        for r in rep.rates:
            t.add_row(probe.row_label(r.path), probe.fmt_bytes(r.nbytes), f"{r.gbps:.1f}",
                      f"{r.seconds * 1e6:.0f} us", f"{100 * r.spread:.1f}%")
        if rep.rates:
            console.print(t)
        if rep.gather:
            g = Table(title=f"gather at {rep.model['name']}'s expert slab: {rep.gather_impl}")
            for col in ("experts a step", "bytes a step", "GB/s", "time a step", "spread"):
                g.add_column(col, justify="right")
            for r in rep.gather:
                g.add_row(r.path.split("_")[1], probe.fmt_bytes(r.nbytes), f"{r.gbps:.1f}",
                          f"{r.seconds * 1e6:.0f} us", f"{100 * r.spread:.1f}%")
            console.print(g)
        if rep.latency_us:
            lat = rep.latency_us
            console.print(
                f"one 4 KiB host->device copy: {lat['h2d_4KiB_device_us']:.1f} us on the device "
                f"(back to back), {lat['h2d_4KiB_roundtrip_us']:.1f} us enqueue-to-synchronised"
            )
        if rep.step_us:
            console.print(
                f"the cache's step when every expert hits: {rep.step_us:.2f} us per MoE layer "
                f"(a CUDA graph of {probe.STEP_LAYERS} layers; `plan --probe` adds it per layer)")
        if rep.step_cold_us:
            console.print(
                f"the same with its state evicted from L2 before each layer, as between two "
                f"calls of a layer in decoding: {rep.step_cold_us:.2f} us per MoE layer")
        for line in probe.summary_lines(rep):
            style = "red" if "failed" in line or "FALLBACK" in line else "bold"
            console.print(f"[{style}]{line}[/]")
