"""`expertcache baseline`: offload vs no-offload vs cache, replicated across server restarts.

`expertcache baseline MODEL [OPTIONS] [-- VLLM ARGS]` runs the experiment;
`expertcache baseline report FILE` summarises a results file again. The work is in
`expertcache_cli.baseline`; this module only parses options.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console
from typer.core import TyperGroup

from ..errors import UserError
from . import json_text, passthrough_args

console = Console()
err = Console(stderr=True, highlight=False)


class _DefaultRunGroup(TyperGroup):
    """`baseline MODEL ...` means `baseline run MODEL ...`; `baseline report FILE` stays."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


baseline_app = typer.Typer(
    cls=_DefaultRunGroup,
    help=(
        "Offload vs no-offload vs cache serving runs, replicated across server restarts. "
        "`expertcache baseline MODEL [OPTIONS] [-- VLLM ARGS]` runs it (same as "
        "`baseline run`); `expertcache baseline report FILE` re-summarises a results file."
    ),
    no_args_is_help=True,
    add_completion=False,
)


def _vram_offload(model: str, vram: str, vllm_args: list[str], arms: list, concurrency: int,
                  device_gib: float | None):
    """--cpu-offload-gb from the sizing library, warnings on the sizing trap, and (on a GPU
    of ``device_gib`` bigger than the card) the flags that make every arm's server budget
    as the card."""
    from ..baseline.sizing_bridge import offload_from_vram

    p = offload_from_vram(model, vram, vllm_args, device_gib)
    err.print(f"--vram {vram} ({p.where}): {p.text}; offload arms get --cpu-offload-gb "
              f"{p.cpu_offload_gb:g}")
    if p.batch_choice:
        err.print(f"batch: {p.batch_choice}")
    if p.share_args:
        err.print(f"--vram {vram}: every arm gets {' '.join(p.share_args)}")
    for warning in p.arm_warnings(arms, concurrency):
        err.print(f"[yellow]warning:[/yellow] {warning}")
    return p.cpu_offload_gb, p.share_args


def _print_summary(path: Path, plot: Path | None, as_json: bool) -> None:
    from ..baseline.runner import load_summary
    from ..baseline.summary import render

    summary, records = load_summary(path)
    if as_json:
        print(json_text(summary.to_dict()))
    else:
        render(summary, console)
    if plot is not None:
        from ..baseline.plot import plot as draw

        out = draw(summary, records, plot)
        print(f"plot written to {out}", file=sys.stderr)  # whole: a path is copied


@baseline_app.command(
    "run",
    context_settings={"allow_extra_args": True},
    help=(
        "Run the experiment: for each restart round, each arm (rotated order) gets a fresh "
        "server, a discarded warm-up request and --runs measured streaming requests. Every "
        "run is appended to --out as it finishes. Arguments after `--` go to vLLM."
    ),
)
def run_cmd(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="Model name or directory, as vLLM takes it."),
    arms: str = typer.Option(
        "resident,offload,cache:64",
        help="Comma-separated arms: resident | offload | "
        "cache:SLOTS[:lru|lfu][:staged|staged-install].",
    ),
    restarts: int = typer.Option(3, help="Restart rounds: fresh servers for every arm each round."),
    runs: int = typer.Option(5, help="Measured requests per server (after one warm-up)."),
    max_tokens: int = typer.Option(200, help="Tokens per request (ignore_eos: always this many)."),
    concurrency: int = typer.Option(
        1, help="Streams sent together per run (each the next --prompt, when several)."),
    prompt: list[str] | None = typer.Option(
        None, metavar="TEXT",
        help="Prompt of the requests (default: a built-in one). Given more than once, the "
        "warm-up, the runs and a run's streams take them in turn, in the same order in every "
        "server: no run repeats the last one's prefix cache and routing."),
    out: Path = typer.Option(Path("results.jsonl"), help="Results file (JSON Lines)."),
    resume: bool = typer.Option(False, help="Continue an interrupted --out file."),
    retry_failed: bool = typer.Option(False, help="With --resume: run failed blocks again."),
    server_cmd: str | None = typer.Option(
        None,
        help=(
            "Server command template. Placeholders: {model} {host} {port} {python} {arm} "
            "{arm_args} {vllm_args}; the last two are appended when absent. Default: "
            "`vllm serve {model} --host {host} --port {port} {arm_args} {vllm_args}`."
        ),
    ),
    cpu_offload_gb: float | None = typer.Option(
        None, help="--cpu-offload-gb for the offload and cache arms."
    ),
    vram: str | None = typer.Option(
        None, help="The card (GiB, or a name such as rtx-4090 or l4): let `size` choose "
        "--cpu-offload-gb."
    ),
    host: str = typer.Option("127.0.0.1", help="Address the servers listen on."),
    port: int = typer.Option(0, help="Server port (0: a free port for every server)."),
    start_timeout: float = typer.Option(1800.0, help="Seconds a server may take to be healthy."),
    request_timeout: float = typer.Option(600.0, help="Seconds one request may take."),
    stop_grace: float = typer.Option(
        30.0, help="Seconds a server gets to exit on SIGINT before SIGTERM, then SIGKILL."
    ),
    stats: int | None = typer.Option(
        None, help="Set EXPERT_CACHE_STATS=N on cache arms (the plugin logs its counters)."
    ),
    log_dir: Path | None = typer.Option(None, help="Server logs (default: OUT-stem-logs/)."),
    plot: Path | None = typer.Option(None, help="Also draw tok/s per arm to this image."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    from ..baseline.arms import parse_arms, plugin_refusals
    from ..baseline.runner import DEFAULT_PROMPT, BaselineConfig, run_baseline
    from ..baseline.sizing_bridge import offload_checks

    vllm_args = passthrough_args(ctx.args)
    if plot is not None:
        from ..plotting import image_path as plot_path

        plot = plot_path(plot)  # checked before any server starts
    arm_list = parse_arms(arms)
    if cpu_offload_gb is not None and vram is not None:
        raise UserError("give --cpu-offload-gb or --vram, not both")
    from ..device.gpu_info import device_total_gib

    device_gib = device_total_gib()  # None: no NVIDIA GPU here (vLLM's CPU build)
    if vram is not None:
        cpu_offload_gb, share = _vram_offload(model, vram, vllm_args, arm_list, concurrency,
                                              device_gib)
        vllm_args += share
    offload_args, note = offload_checks(model, vllm_args, arm_list,
                                        cuda=device_gib is not None)
    if note:
        err.print(f"note: {note} (offload and cache arms; resident stays stock)")
    cfg = BaselineConfig(
        model=model,
        arms=arm_list,
        out=out,
        restarts=restarts,
        runs=runs,
        max_tokens=max_tokens,
        concurrency=concurrency,
        prompt=DEFAULT_PROMPT if not prompt else prompt[0] if len(prompt) == 1 else prompt,
        resume=resume,
        server_cmd=server_cmd,
        vllm_args=vllm_args,
        cpu_offload_gb=cpu_offload_gb,
        offload_args=offload_args,
        host=host,
        port=port,
        start_timeout_s=start_timeout,
        request_timeout_s=request_timeout,
        stop_grace_s=stop_grace,
        stats_every=stats,
        log_dir=log_dir,
        retry_failed=retry_failed,
    )
    if retry_failed and not resume:
        raise UserError("--retry-failed only makes sense with --resume")
    for why in plugin_refusals(arm_list, server_cmd):
        raise UserError(why)
    run_baseline(cfg, say=lambda s: err.print(s, markup=False))
    err.print(f"results in {out}")
    _print_summary(out, plot, json_out)


@baseline_app.command("report", help="Summarise a results file again (and optionally plot it).")
def report_cmd(
    file: Path = typer.Argument(..., help="A results file written by `expertcache baseline`."),
    plot: Path | None = typer.Option(None, help="Draw tok/s per arm to this image."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    _print_summary(file, plot, json_out)


def register(app: typer.Typer) -> None:
    app.add_typer(baseline_app, name="baseline")
