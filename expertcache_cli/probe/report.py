"""What probe-link found and what it means: the records (`Rate`, `LinkReport`), the link's
class, the decode ceilings a model gets from the measured rates, and the verdict in words."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

MiB = 1 << 20

#: how `LinkReport.gather_impl` begins when the cache's kernels could not be used and a
#: torch stand-in measured the gather instead (a rate nobody may plan with)
FALLBACK = "FALLBACK"


def is_stand_in(gather_impl: str) -> bool:
    """The gather was measured with the torch stand-in, not the cache's kernel."""
    return FALLBACK in gather_impl


@dataclass
class Rate:
    """One measured path at one size: the median time of a transfer and its rate."""

    path: str
    nbytes: int
    seconds: float
    gbps: float  # decimal GB/s = nbytes / seconds / 1e9
    samples: int
    spread: float  # (max - min) / median of the per-sample rates
    note: str = ""


@dataclass
class LinkReport:
    """Everything probe-link measured and concluded; ``to_json`` is the `--json` output."""

    device_index: int
    device_name: str
    pci_bus_id: str
    pcie_link: str  # what the system reports, e.g. "32.0 GT/s PCIe x16" ("" if unknown)
    numa: str  # where the process was pinned, in words
    numa_node: int
    cpus: list[int] = field(default_factory=list)  # the CPUs we pinned to ([] = not pinned)
    rates: list[Rate] = field(default_factory=list)
    gather: list[Rate] = field(default_factory=list)
    gather_impl: str = ""
    latency_us: dict[str, float] = field(default_factory=dict)
    hbm_copy_gbps: float = 0.0  # one-way device-to-device copy rate
    hbm_traffic_gbps: float = 0.0  # read + write traffic of that copy
    step_us: float = 0.0  # the cache's all-hit step per MoE layer (0: not measured)
    step_cold_us: float = 0.0  # the same with its state evicted from L2 before each layer
    stage_gbps: float = 0.0  # a staged step's hits, slots -> scratch (0: not measured)
    link_class: str = ""
    model: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    def rate(self, path: str, nbytes: int | None = None) -> Rate | None:
        """The measurement of ``path`` (at ``nbytes``, else the largest size measured)."""
        rows = [r for r in self.rates + self.gather if r.path == path]
        if nbytes is not None:
            rows = [r for r in rows if r.nbytes == nbytes]
        return max(rows, key=lambda r: r.nbytes) if rows else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def classify_link(h2d_gbps: float, integrated: bool = False) -> str:
    """Name the host link from the large-transfer pinned host->device rate.

    Practical x16 rates: Gen3 ~12-13, Gen4 ~25-27, Gen5 ~50-57 GB/s; NVLink-C2C (Grace)
    moves hundreds of GB/s. A link below its class usually means fewer lanes or a switch.
    """
    if integrated:
        return "integrated GPU: host memory is device memory"
    if h2d_gbps >= 120:
        return "coherent C2C link (Grace-class NVLink-C2C)"
    if h2d_gbps >= 70:
        return "faster than PCIe Gen5 x16 (PCIe Gen6 x16 or a coherent link)"
    if h2d_gbps >= 36:
        return "PCIe Gen5 x16"
    if h2d_gbps >= 18:
        return "PCIe Gen4 x16 (or Gen5 x8)"
    if h2d_gbps >= 9:
        return "PCIe Gen3 x16 (or Gen4 x8)"
    return "narrower than PCIe Gen3 x16 (x8/x4, or a shared switch)"


def decode_ceilings(model, gather_gbps: float, hbm_gbps: float) -> dict[str, Any]:
    """Single-stream decode ceilings from bandwidth alone (weights only, no compute, no KV).

    Resident: every weight byte a token touches (non-expert + top_k experts in each MoE
    layer) read from HBM. Offloaded, no cache: the experts' bytes cross the link at the
    measured gather rate. With a cache hitting a fraction h, (1 - h) of them do. These are
    upper bounds to compare paths with, not predictions of vLLM's tokens per second.
    """
    host = model.top_k * model.bytes_per_slot
    resident_bytes = model.non_expert_bytes + host
    t_res = resident_bytes / (hbm_gbps * 1e9)
    t_non = model.non_expert_bytes / (hbm_gbps * 1e9)

    def tok_s(hit: float) -> float:
        t = t_non + host * hit / (hbm_gbps * 1e9) + host * (1 - hit) / (gather_gbps * 1e9)
        return 1.0 / t

    off = tok_s(0.0)
    res = 1.0 / t_res
    return {
        "host_bytes_per_token": host,
        "resident_bytes_per_token": resident_bytes,
        "resident_tok_s": res,
        "offload_tok_s": off,
        "offload_penalty": res / off,
        "cache_tok_s": {f"{h:.2f}": tok_s(h) for h in (0.5, 0.8, 0.9, 0.95, 0.99)},
        "gather_gbps": gather_gbps,
        "hbm_gbps": hbm_gbps,
        "basis": "bandwidth ceilings, batch 1, weights only: upper bounds, not vLLM tok/s",
    }


def conclude(rep: LinkReport, model, integrated: bool = False) -> None:
    """Fill the conclusions from whatever was measured: the link's class needs the large
    pinned host->device copies; the decode ceilings need the gather and the HBM copy. A
    conclusion whose inputs were not measured (``--only``, or a failure) is left empty."""
    big = [r for r in rep.rates if r.path == "h2d_pinned" and r.nbytes >= 64 * MiB]
    h2d = max((r.gbps for r in big), default=0.0)
    if h2d:
        rep.link_class = classify_link(h2d, integrated)
    if model is None:
        return
    rep.model = {
        "name": model.name,
        "quant": model.quant,
        "num_experts": model.num_experts,
        "top_k": model.top_k,
        "num_moe_layers": model.num_moe_layers,
        "bytes_per_expert": model.bytes_per_expert,
        "bytes_per_slot": model.bytes_per_slot,
        "non_expert_bytes": model.non_expert_bytes,
    }
    best = gather_row(rep.gather, model.top_k)
    if best is not None and rep.hbm_traffic_gbps:
        rep.decode = decode_ceilings(model, best.gbps, rep.hbm_traffic_gbps)
        rep.decode["gather_row"] = best.path


def gather_row(rows: list[Rate], top_k: int) -> Rate | None:
    """The gather row (``gather_N``) whose experts a step are nearest the model's top_k:
    the rate a single decode stream's misses move at."""
    if not rows:
        return None
    return min(rows, key=lambda r: abs(int(r.path.split("_")[1]) - top_k))


def summary_lines(rep: LinkReport) -> list[str]:
    """The verdict in a few sentences (used by the CLI and the bench log)."""
    lines = []
    h2d = rep.rate("h2d_pinned")
    if rep.link_class and h2d:
        lines.append(f"link: {rep.link_class} (pinned host->device {h2d.gbps:.1f} GB/s"
                     + (f"; system reports {rep.pcie_link}" if rep.pcie_link else "") + ")")
    d = rep.decode
    if d:
        m = rep.model
        lines.append(
            f"{m['name']} decode ceilings (batch 1, weights only): fully resident "
            f"{d['resident_tok_s']:.0f} tok/s ({d['resident_bytes_per_token'] / 1e9:.2f} GB a "
            f"token over HBM at {d['hbm_gbps']:.0f} GB/s, read+write copy traffic); experts "
            f"offloaded, no cache {d['offload_tok_s']:.1f} tok/s "
            f"({d['host_bytes_per_token'] / 1e9:.2f} GB a token over the link at "
            f"{d['gather_gbps']:.1f} GB/s)"
        )
        c = d["cache_tok_s"]
        lines.append(
            f"offload penalty {d['offload_penalty']:.1f}x: a cache hitting 80% would reach "
            f"{c['0.80']:.0f} tok/s, 90% {c['0.90']:.0f}, 95% {c['0.95']:.0f}, 99% {c['0.99']:.0f}"
        )
        if d["offload_penalty"] < 1.3:
            lines.append("offload is already cheap on this link: a cache has little to win")
        elif d["offload_penalty"] > 3:
            lines.append("offload is expensive on this link: a cache has much to win back")
    if rep.errors:
        lines.append(f"{len(rep.errors)} measurement(s) failed: " + "; ".join(rep.errors))
    return lines


def fmt_bytes(n: int) -> str:
    """1048576 -> "1 MiB"; 4732928 -> "4.51 MiB"."""
    if n >= MiB:
        v = n / MiB
        return f"{v:.0f} MiB" if v == int(v) else f"{v:.2f} MiB"
    if n >= 1024:
        return f"{n / 1024:.0f} KiB"
    return f"{n} B"
