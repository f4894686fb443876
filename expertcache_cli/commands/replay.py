"""`expertcache replay`: misses per policy and budget on a routing trace."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console

from ..errors import UserError
from ..files import atomic_write, check_output
from ..planning.rebatch import shared_note
from ..rules.policy import Policy, Wide
from ..rules.trace import Trace, load
from ..tables import Table
from . import (
    BATCH_HELP,
    MAX_NUM_SEQS_HELP,
    VLLM_VERSION_HELP,
    WIDE_HELP,
    demo_trace_path,
    json_text,
    parse_budgets,
    select_kernels,
    workload,
)

console = Console()
err = Console(stderr=True)


def parse_policies(text: str) -> list[Policy]:
    try:
        out = [Policy.parse(p) for p in text.split(",") if p.strip()]
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if not out:
        raise UserError("--policy needs at least one of lru, lfu, opt")
    return list(dict.fromkeys(out))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} TB"


def _trace_json(path: Path, trace: Trace) -> dict:
    return {
        "path": str(path),
        "steps": trace.steps,
        "layers": trace.num_layers,
        "width": trace.ids_per_step,
        "num_experts": trace.num_experts,
        "top_k": trace.top_k,
        "tokens": trace.tokens,
        "expert_bytes": trace.expert_bytes,
        "model": trace.model,
        "source": trace.source,
        # --batch: the streams' requests (rebatch.shared_requests), and the note when they share
        "rebatch": trace.extra.get("shared"),
        "rebatch_note": shared_note(trace),
    }


def _records(df) -> list[dict]:
    out = []
    for rec in df.to_dict(orient="records"):
        clean = {}
        for k, v in rec.items():
            if hasattr(v, "item"):
                v = v.item()
            if isinstance(v, float) and math.isnan(v):
                v = None
            clean[k] = v
        out.append(clean)
    return out


def _progress_runner(enabled: bool):
    """A rich progress bar on stderr for long sweeps; a no-op context otherwise."""
    from contextlib import contextmanager

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    @contextmanager
    def cm():
        if not enabled:
            yield None
            return
        with Progress(
            TextColumn("replaying"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} layer replays"),
            TimeElapsedColumn(),
            console=err,
            transient=True,
        ) as prog:
            task = prog.add_task("replay", total=None)

            def update(done: int, total: int) -> None:
                prog.update(task, completed=done, total=total)

            yield update

    return cm()


def replay_command(
    ctx: typer.Context,
    trace_path: Path | None = typer.Argument(
        None, metavar="[TRACE]", help="Routing trace .npz (default: the bundled demo trace)."
    ),
    slots: str | None = typer.Option(
        None, "--slots", help="Slot budgets per layer, comma list (default: three of E/8, "
        "E/4, E/2, 3E/4 of the trace's E experts above its top_k: 16,32,64 of 128 top-8)."),
    policy: str = typer.Option("lru,lfu,opt", "--policy", help="Policies: lru, lfu, opt."),
    decay: int = typer.Option(0, "--decay", min=0, help="LFU halving interval (0 = never)."),
    max_inserts: int | None = typer.Option(
        None, "--max-inserts", min=1, help="Insert cap per step (default: no cap)."
    ),
    per_layer: bool = typer.Option(
        False, "--per-layer", help="Per-layer table and a recommended per-layer budget split."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead."),
    csv: Path | None = typer.Option(None, "--csv", help="Also write the result rows to a CSV."),
    expert_bytes: int | None = typer.Option(
        None, "--expert-bytes", min=1, help="Bytes per expert per layer (else the trace's)."
    ),
    link_gbps: float | None = typer.Option(
        None, "--link-gbps", min=0.001, help="Host link GB/s for transfer time per token."
    ),
    device: str = typer.Option(
        "cpu", "--device", help="cpu (reference engine) or cuda (the real kernels)."
    ),
    wide: str = typer.Option("in-place", "--wide", help=WIDE_HELP),
    batch: int | None = typer.Option(None, "--batch", help=BATCH_HELP),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs", help=MAX_NUM_SEQS_HELP),
    vllm_version: str | None = typer.Option(None, "--vllm-version", help=VLLM_VERSION_HELP),
) -> None:
    """Replay a routing trace: experts fetched per policy and slot budget."""
    from ..planning.serving import architectures_of
    from ..planning.serving import server as serving_server
    from ..rules.replay import replay
    from ..rules.split import recommend, split_policy
    from . import passthrough_args, trace_argument

    if csv is not None:
        csv = check_output(csv, "--csv")  # before the sweep it would be written after
    trace_path, extra = trace_argument(
        trace_path, ctx.args,
        "a model's expert size goes in --expert-bytes, and `expertcache plan --model` sizes one")
    vllm_args = passthrough_args(extra)
    if batch is None and (max_num_seqs is not None or vllm_version is not None or vllm_args):
        raise UserError("--max-num-seqs, --vllm-version and the vLLM flags after -- say how "
                        "the server pads a --batch N: give --batch")
    path = trace_path if trace_path is not None else demo_trace_path()
    recorded = load(path)
    srv = None
    if batch is not None:
        srv = serving_server(vllm_args, max_num_seqs=max_num_seqs, batch=batch,
                             vllm_version=vllm_version,
                             architectures=architectures_of(None, recorded.model))
    trace, mode = workload(recorded, wide, batch,
                           srv.batch_tokens(batch) if srv and batch else None)
    budgets = parse_budgets(slots, trace.num_experts, trace.top_k)
    policies = parse_policies(policy)
    if decay and Policy.LFU not in policies:
        raise UserError(f"--decay {decay} applies to lfu only (--policy {policy})")
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and mode is not Wide.IN_PLACE:
        raise UserError(f"--wide {mode.value}: --device cuda replays the manager's in-place "
                        "rules only (the staged ones are checked by the plugin's device tests)")
    if device == "cuda":
        from ..device.kernel_check import device_arch

        # no torch or no GPU: one line now, not after the sweep
        device_arch(0, hint="--device cuda runs the real kernels; use --device cpu here")

    long_run = trace.steps * trace.num_layers * len(budgets) * 3 > 2_000_000
    with _progress_runner(long_run and err.is_terminal and not as_json) as update:
        report = replay(
            trace,
            policies,
            budgets,
            decay=decay,
            max_inserts=max_inserts,
            expert_bytes=expert_bytes,
            link_gbps=link_gbps,
            progress=update,
            wide=mode,
        )
    policy_of_split = split_policy(policies)
    splits = recommend(trace, policy_of_split, budgets, decay, mode) if per_layer else []

    device_check = None
    if device == "cuda":
        from ..device.device_replay import compare_with_engine

        select_kernels()
        device_check = compare_with_engine(trace, policies, budgets, decay, max_inserts, report)

    if csv is not None:
        frame = report.per_layer if per_layer else report.results
        atomic_write(csv, lambda tmp: frame.to_csv(tmp, index=False))

    if as_json:
        obj = {
            "trace": _trace_json(path, trace),
            "wide": mode.value,
            "batch": batch,
            "server": srv.to_json(batch) if srv else None,
            "results": _records(report.results),
            "reuse_distance": report.reuse,
        }
        if per_layer:
            obj["per_layer"] = _records(report.per_layer)
            obj["split"] = [
                {
                    "policy": policy_of_split.name.lower(),
                    "uniform_slots": s.uniform_slots,
                    "budget": s.budget,
                    "slots": s.slots,
                    "misses": s.misses,
                    "uniform_misses": s.uniform_misses,
                    "saved": s.saved,
                }
                for s in splits
            ]
        if device_check is not None:
            obj["device"] = device_check
        print(json_text(obj))
        _fail_on_device_mismatch(device_check)
        return

    _print_results(path, trace, report, link_gbps, mode,
                   srv.describe_batch(batch) if srv and batch else None)
    if per_layer:
        _print_per_layer(trace, report)
        _print_splits(policy_of_split, splits)
    if device_check is not None:
        _print_device(device_check)
    _fail_on_device_mismatch(device_check)


def _print_results(path: Path, trace: Trace, report, link_gbps: float | None,
                   mode: Wide = Wide.IN_PLACE, batch_line: str | None = None) -> None:
    what = trace.model or "unknown model"
    console.print(
        f"[bold]{path.name}[/]: {trace.steps} steps x {trace.num_layers} layers, "
        f"{trace.ids_per_step} ids/step, top-{trace.top_k} of {trace.num_experts} experts, "
        f"{trace.tokens} tokens ({what})"
    )
    if trace.source:
        console.print(f"source: {trace.source}")
    if batch_line:
        console.print(f"batch: {batch_line}")
    shared = shared_note(trace)
    if shared:
        console.print(f"[yellow]note[/]: {shared}")
    df = report.results
    has_bytes = "bytes_per_token" in df.columns
    table = Table(title="experts fetched over the host link (all layers)")
    # what is left out first when the terminal is narrow: lowest keep
    keep = {"policy": 9, "slots": 9, "misses": 9, "miss rate": 8, "requests": 2,
            "vs LRU": 4, "vs OPT": 5}
    for col in ("policy", "slots", "misses", "requests", "miss rate", "vs LRU", "vs OPT"):
        table.add_column(col, justify="right" if col != "policy" else "left", keep=keep[col])
    if mode is Wide.IN_PLACE:
        table.add_column("read-through layer-steps", justify="right", keep=1)
    else:
        table.add_column(f"{mode.value} layer-steps", justify="right", keep=1)
    if has_bytes:
        table.add_column("host bytes /token", justify="right", keep=3)
    if "transfer_ms_per_token" in df.columns:
        table.add_column(f"ms/token @{link_gbps:g} GB/s", justify="right", keep=7)
    for row in df.itertuples():
        cells = [
            row.policy,
            str(row.slots),
            f"{row.misses:,}",
            f"{row.requests:,}",
            f"{row.miss_rate:.1%}",
            f"{row.vs_lru:.3f}",
            f"{row.vs_opt:.3f}",
            f"{row.read_through_steps if mode is Wide.IN_PLACE else row.staged_steps:,}",
        ]
        if has_bytes:
            cells.append(_fmt_bytes(row.bytes_per_token))
        if "transfer_ms_per_token" in df.columns:
            cells.append(f"{row.transfer_ms_per_token:.2f}")
        table.add_row(*cells)
    console.print(table)
    r = report.reuse
    if r.get("reuses"):
        console.print(
            f"reuse distance (distinct other experts between uses of an expert): "
            f"p50 {r['p50']:.0f}, p90 {r['p90']:.0f}, p99 {r['p99']:.0f} "
            f"over {r['reuses']:,} re-uses"
        )
    rt = df[df["read_through_steps"] > 0]
    for row in rt.drop_duplicates("slots").itertuples():
        console.print(
            f"[yellow]warning[/]: at {row.slots} slots {row.read_through_steps:,} layer-steps "
            f"carry more ids than slots and read through the host (tokens x top_k > slots)"
        )
    if mode is not Wide.IN_PLACE:
        console.print(
            f"wide steps modelled as {mode.value} (the plugin's EXPERT_CACHE_WIDE="
            f"{mode.value}); compare with --wide in-place, the default")


def _print_per_layer(trace: Trace, report) -> None:
    df = report.per_layer
    pivot = df.pivot_table(
        index="layer", columns=["policy", "slots"], values="miss_rate", sort=False
    )
    table = Table(title="miss rate per layer")
    table.add_column("layer", justify="right")
    for pol, s in pivot.columns:
        table.add_column(f"{pol}\n{s}", justify="right")
    for layer, row in pivot.iterrows():
        table.add_row(str(layer), *(f"{v:.1%}" for v in row.values))
    console.print(table)


def _print_splits(policy: Policy, splits) -> None:
    table = Table(title=f"recommended per-layer split ({policy.name.lower()}, same total)")
    for col in ("uniform", "total", "misses uniform", "misses split", "saved", "per-layer slots"):
        table.add_column(col, justify="right" if col != "per-layer slots" else "left")
    for s in splits:
        table.add_row(
            str(s.uniform_slots),
            str(s.budget),
            f"{s.uniform_misses:,}",
            f"{s.misses:,}",
            f"{s.saved:,} ({s.saved_fraction:.1%})",
            ",".join(str(x) for x in s.slots),
        )
    console.print(table)


def _print_device(check: dict) -> None:
    table = Table(title="real kernels (cuda) against the CPU reference engine")
    for col in ("policy", "slots", "installs (cuda)", "installs (cpu)", "match"):
        table.add_column(col)
    for r in check["rows"]:
        table.add_row(
            r["policy"],
            str(r["slots"]),
            f"{r['device_installs']:,}",
            f"{r['cpu_installs']:,}",
            "yes" if r["match"] else "[red]NO[/]",
        )
    console.print(table)


def _fail_on_device_mismatch(check: dict | None) -> None:
    if check is not None and not check["match"]:
        err.print("[red]expertcache: the CUDA kernels disagree with the CPU reference[/]")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command(
        "replay",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        epilog="With --batch, flags after `--` are the vLLM flags the server runs with "
        "(--max-num-seqs, --max-num-batched-tokens, the CUDA-graph settings), read as "
        "`size` reads them: they decide how a batch is padded.",
    )(replay_command)
