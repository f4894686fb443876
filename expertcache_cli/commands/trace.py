"""`expertcache trace synth|import|info`: make synthetic routing traces, convert other engines'
recordings, and describe trace files."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from ..errors import UserError
from ..tables import Table
from . import json_text

console = Console()
trace_app = typer.Typer(help="Routing trace files: synthesise, import and inspect.",
                        no_args_is_help=True)

KINDS = ("zipf", "tasks", "batched")


@trace_app.command("synth")
def synth_command(
    out: Path = typer.Argument(..., help="Output .npz path."),
    kind: str = typer.Option("zipf", "--kind", help="zipf | tasks | batched."),
    steps: int = typer.Option(2000, "--steps", min=1),
    layers: int = typer.Option(16, "--layers", min=1),
    experts: int = typer.Option(64, "--experts", min=2),
    top_k: int = typer.Option(8, "--top-k", min=1),
    alpha: float = typer.Option(1.0, "--alpha", min=0.0, help="Zipf exponent of popularity."),
    layer_skew: float = typer.Option(
        0.5, "--layer-skew", min=0.0, help="How much steeper deep layers' popularity is."
    ),
    stickiness: float = typer.Option(
        0.35, "--stickiness", min=0.0, max=0.99, help="Chance a pick repeats the last token's."
    ),
    tasks: int = typer.Option(4, "--tasks", min=1, help="Tasks interleaved (kind=tasks)."),
    segment: int = typer.Option(250, "--segment", min=1, help="Steps per task segment."),
    batch: int = typer.Option(4, "--batch", min=1, help="Sequences per step (kind=batched)."),
    seed: int = typer.Option(0, "--seed"),
    expert_bytes: int | None = typer.Option(None, "--expert-bytes", min=1),
    model: str | None = typer.Option(None, "--model", help="Model label stored in the trace."),
) -> None:
    """Write a synthetic routing trace (labelled synthetic in its `source`)."""
    from ..files import check_output
    from ..rules.synth import SynthSpec, synthesize
    from ..rules.trace import npz_path, save

    if kind not in KINDS:
        raise UserError(f"--kind must be one of {', '.join(KINDS)}, got {kind!r}")
    # the file `save` will write, checked before the synthesis (missing directories are
    # made); a directory is refused as one, not written beside as DIR.npz
    out = check_output(out if out.expanduser().is_dir() else npz_path(out), "OUT",
                       make_parents=True)
    spec = SynthSpec(
        steps=steps,
        layers=layers,
        experts=experts,
        top_k=top_k,
        alpha=alpha,
        layer_skew=layer_skew,
        stickiness=stickiness,
        tasks=tasks if kind == "tasks" else 1,
        segment=segment,
        batch=batch if kind == "batched" else 1,
        seed=seed,
        expert_bytes=expert_bytes,
        model=model,
    )
    try:
        trace = synthesize(spec)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    path = save(trace, out)
    console.print(
        f"wrote {path}: {trace.steps} steps x {trace.num_layers} layers x {trace.width} ids "
        f"(top-{trace.top_k} of {trace.num_experts}), {trace.source}"
    )


@trace_app.command("import")
def import_command(
    src: list[Path] = typer.Argument(
        ..., help="Recordings of one model: route_trace v1 CSVs (llama.cpp-based --route-trace), "
        "routing JSONL files (capture_routing.py) or token-pairs JSONL files (nvmoe's "
        "trace_post.py); several are joined in the order given."),
    out: Path = typer.Argument(..., help="Output .npz path."),
    decode_only: bool = typer.Option(
        False, "--decode-only", help="Drop the prefill steps (default: each prefill is one step "
        "of all its positions)."),
    expert_bytes: int | None = typer.Option(
        None, "--expert-bytes", min=1, help="Bytes of one expert (default: the file's per-layer "
        "sizes, averaged; the JSONL format gives none)."),
    experts: int | None = typer.Option(
        None, "--experts", min=1, help="The model's experts a layer: required for token-pairs "
        "JSONL, which does not say."),
    model: str | None = typer.Option(None, "--model", help="Model label (default: the file's)."),
    source: str | None = typer.Option(
        None, "--source", help="Where the recording comes from, stored in the trace (default: "
        "the files' names and format)."),
) -> None:
    """Convert other engines' routing recordings into a trace `replay` and `plan` read."""
    from ..files import check_output
    from ..rules.trace import DECODE, TraceError, npz_path, save
    from ..rules.trace_import import default_source, join, read_recording, recording_trace

    out = check_output(out if out.expanduser().is_dir() else npz_path(out), "OUT",
                       make_parents=True)
    recs = [read_recording(p, experts) for p in src]
    names = [p.name for p in src]
    traces = []
    for p, rec in zip(src, recs):
        try:
            traces.append(recording_trace(rec, prefill=not decode_only))
        except TraceError as exc:  # which of the recordings it is
            raise TraceError(f"{p}: {exc}") from None
    trace = join(traces, names, expert_bytes=expert_bytes, model=model,
                 source=source or default_source(recs, names))
    path = save(trace, out)
    decode = int((trace.step_kinds() == DECODE).sum())  # as `plan` will tell them apart
    joined = f" from {len(src)} recordings" if len(src) > 1 else ""
    console.print(
        f"wrote {path}: {trace.steps} steps ({decode} decode, {trace.steps - decode} prefill) x "
        f"{trace.num_layers} layers, top-{trace.top_k} of {trace.num_experts}, "
        f"{trace.tokens} tokens{joined}"
    )


@trace_app.command("info")
def info_command(
    path: Path = typer.Argument(..., help="Routing trace .npz."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Describe a trace file (validating it)."""
    from ..rules.trace import describe, load

    facts = describe(load(path))
    if as_json:
        print(json_text({"path": str(path), **facts}))
        return
    table = Table(title=str(path), show_header=False)
    table.add_column("field")
    table.add_column("value", text=True)
    for k, v in facts.items():
        if k == "layer_ids":
            v = f"{v[0]}..{v[-1]}" if len(v) > 1 else str(v[0])
        elif isinstance(v, float):
            v = f"{v:.3f}"
        table.add_row(k, str(v))
    console.print(table)


def register(app: typer.Typer) -> None:
    app.add_typer(trace_app, name="trace")
