"""`expertcache plan`: predicted decode speed per policy and budget, and the serve command."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import typer
from rich.console import Console

from ..errors import UserError
from ..sizing.cards import Card, parse_vram, typical_link_gbps
from ..tables import Table
from . import (
    BATCH_HELP,
    VLLM_VERSION_HELP,
    VRAM_HELP,
    WIDE_HELP,
    demo_trace_path,
    json_text,
    parse_budgets,
    select_kernels,
    workload,
)

console = Console()

#: the help panel of the two rates `plan` cannot predict without
NEEDED_PANEL = "Needed: the two rates (one of each pair)"


def _link(link_gbps: float | None, probe_file: Path | None, model: str | None,
          card: Card | None = None) -> tuple[float, str, tuple[float, str] | None]:
    """The link rate and its source, and the cache step (us, source) where measured.

    A card named by ``--vram`` and no link given: the rate its usual PCIe slot gives
    (`cards.typical_link_gbps`), said to be an estimate, rather than a probe of whatever
    GPU this machine has (a plan for another card is usually made away from it).
    """
    from ..planning import planner

    if link_gbps is not None:
        if not math.isfinite(link_gbps) or link_gbps <= 0:
            raise UserError(f"--link-gbps must be a positive number, got {link_gbps}")
        return link_gbps, "given (--link-gbps)", None
    if probe_file is not None:
        return planner.read_probe(probe_file)
    if card is not None:
        return typical_link_gbps(card), (
            f"typical for the {card.label} on {card.link} (the measured share of a Gen5 "
            "x16 link the gather reaches, scaled): an estimate; `probe-link --save FILE` on "
            "the machine and --probe FILE measure yours"), None
    from .. import probe
    from ..device.kernel_check import device_arch

    device_arch(0, hint=f"plan needs {LINK_INPUT}")
    select_kernels()
    # the gather at this model's expert slab: the rate the cache's own copies run at; and
    # the cache's step when every expert hits
    rep = probe.probe_link(model=model, repeats=3, warmup=1, only=("gather", "step"))
    row = probe.gather_row(rep.gather, rep.model["top_k"]) if rep.model else None
    if row is None or probe.is_stand_in(rep.gather_impl):
        why = "; ".join(rep.errors) or "no gather rate"
        raise UserError(f"the link could not be measured here ({why}): give --link-gbps or "
                        "--probe")
    step = (rep.step_us, f"measured now on {rep.device_name} (the cache step, every expert "
            "a hit)") if rep.step_us > 0 else None
    return row.gbps, f"measured now on {rep.device_name} (the gather, {row.path})", step


#: what each of the two rates is and how to give it (the help and the missing-input line)
LINK_INPUT = ("the link rate (--probe FILE, a saved `probe-link --json`, --link-gbps G, or "
              "--vram naming the card: its usual link, estimated)")
RESIDENT_INPUT = ("the resident rate (--resident-tok-s R, decode tok/s with every expert in "
                  "VRAM, or --baseline FILE, a `baseline` results file with a resident arm)")


def _check_given(link_gbps: float | None, probe_file: Path | None,
                 resident_tok_s: float | None, baseline: Path | None,
                 card: Card | None = None) -> None:
    """Both rates the prediction rests on are given (or the link can be estimated for a
    card named by ``--vram``, or measured here), checked before any work: one line naming
    every missing one and how to pass it."""
    if link_gbps is not None and probe_file is not None:
        raise UserError("give --link-gbps or --probe, not both")
    if resident_tok_s is not None and baseline is not None:
        raise UserError("give --resident-tok-s or --baseline, not both")
    missing, where = [], ""
    if link_gbps is None and probe_file is None and card is None:
        from ..device.kernel_check import device_arch
        from ..errors import DeviceUnavailable

        try:
            device_arch(0)
        except DeviceUnavailable:  # nothing to measure the link on
            missing.append(LINK_INPUT)
            where = ", on this machine with no GPU,"
    if resident_tok_s is None and baseline is None:
        missing.append(RESIDENT_INPUT)
    if missing:
        raise UserError(f"plan needs{where} " + " and ".join(missing))


def _resident(resident_tok_s: float | None, baseline: Path | None) -> tuple[float, str]:
    if resident_tok_s is not None:
        if not math.isfinite(resident_tok_s) or resident_tok_s <= 0:
            raise UserError(f"--resident-tok-s must be positive, got {resident_tok_s}")
        return resident_tok_s, "given (--resident-tok-s)"
    if baseline is not None:
        from ..baseline.runner import resident_from_baseline

        return resident_from_baseline(baseline)
    raise UserError(f"plan needs {RESIDENT_INPUT}")


def register(app: typer.Typer) -> None:
    @app.command(
        "plan",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        help="Predicted decode tok/s per policy and slot budget from a trace, and what to "
        "serve.\n\nIt rests on two rates; on a machine with no GPU bring both: the host "
        "link's (--probe FILE, saved by `probe-link --save` on the serving machine, or "
        "--link-gbps G) and the resident decode rate (--resident-tok-s R or --baseline FILE).",
        epilog="Flags after `--` are the vLLM flags you will serve with (context, batch, "
        "utilization): the card is sized for them, and the serve command carries them.",
    )
    def plan_command(
        ctx: typer.Context,
        trace_path: Path | None = typer.Argument(
            None, metavar="[TRACE]", help="Routing trace .npz (default: the bundled demo trace)."
        ),
        model: str | None = typer.Option(
            None, "--model", "-m", "--size-from",
            help="model to size (preset, config.json or model directory; default: the trace's "
                 "expert bytes, no card); --size-from is the same option, named as in serve"),
        vram: str | None = typer.Option(
            None, help=VRAM_HELP + ": only budgets that fit count; a card's name also gives "
            "its usual link when no link is given"),
        link_gbps: float | None = typer.Option(
            None, help="host link GB/s for expert copies. NEEDED on a machine with no GPU: "
            "this or --probe, or --vram naming a card (its usual link, an estimate); on a "
            "GPU, measured when none is given", rich_help_panel=NEEDED_PANEL),
        probe_file: Path | None = typer.Option(
            None, "--probe", help="a saved `probe-link --json` from the serving machine (its "
            "gather rate). NEEDED on a machine with no GPU: this or --link-gbps",
            rich_help_panel=NEEDED_PANEL),
        resident_tok_s: float | None = typer.Option(
            None, help="decode tok/s with every expert in VRAM. NEEDED everywhere: this or "
            "--baseline (plan never measures it)", rich_help_panel=NEEDED_PANEL),
        baseline: Path | None = typer.Option(
            None, help="a `baseline` results file: its resident arm gives --resident-tok-s. "
            "NEEDED everywhere: this or --resident-tok-s", rich_help_panel=NEEDED_PANEL),
        policy: str = typer.Option("lru,lfu", help="policies to compare: lru, lfu"),
        slots: str | None = typer.Option(None, help="budgets to predict (default: a grid)"),
        save: Path | None = typer.Option(None, help="write the plan file `serve --plan` reads"),
        plot: Path | None = typer.Option(None, help="draw predicted tok/s against slots"),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
        wide: str = typer.Option("in-place", "--wide", help=WIDE_HELP),
        batch: int | None = typer.Option(
            None, "--batch", help=BATCH_HELP + "; --resident-tok-s is then the aggregate "
            "resident rate at N streams"),
        max_num_seqs: int | None = typer.Option(
            None, "--max-num-seqs", help="the server's --max-num-seqs (wins over the flag "
            "after --; the serve command carries it): how --batch is padded, and the batch "
            "every layer must hold; default: the flag after --, else the batch, else the "
            "most the recommended budget keeps on the cache"),
        vllm_version: str | None = typer.Option(None, "--vllm-version", help=VLLM_VERSION_HELP),
    ) -> None:
        """Predicted decode tok/s per policy and slot budget from a trace, and what to serve."""
        from ..files import atomic_write, check_output
        from ..planning import planner, serving
        from ..rules.trace import load
        from ..sizing.model_size import load_model
        from . import passthrough_args
        from .replay import parse_policies

        vram_gib, card = parse_vram(vram)
        _check_given(link_gbps, probe_file, resident_tok_s, baseline, card)
        extra = list(ctx.args)
        if trace_path is not None and str(trace_path).startswith("-"):
            # no TRACE given: click took the first vLLM flag after -- for it
            extra, trace_path = [str(trace_path), *extra], None
        srv = serving.server(passthrough_args(extra), max_num_seqs=max_num_seqs, batch=batch,
                             vllm_version=vllm_version, vram_gib=vram_gib)
        vllm_args = srv.vllm_args
        if save is not None:
            save = check_output(save, "--save")
        if plot is not None:
            from ..plotting import image_path as plot_path

            plot = plot_path(plot)
        path = trace_path if trace_path is not None else demo_trace_path()
        trace, mode = workload(load(path), wide, batch,
                               srv.batch_tokens(batch) if batch else None)
        policies = parse_policies(policy)
        m = load_model(Path(model) if model and Path(model).exists() else model) if model else None
        if m is not None and (m.num_experts, m.top_k) != (trace.num_experts, trace.top_k):
            # the bundled real recording ran at fewer experts a token than its model's config
            hint = (f" (the bundled demo, recorded at {trace.top_k} experts a token): give a "
                    f"TRACE routed top-{m.top_k}, recorded with EXPERT_CACHE_TRACE or made by "
                    "`expertcache trace synth`" if trace_path is None else "")
            raise UserError(f"--model {model}: {m.num_experts} experts top-{m.top_k}, the trace "
                            f"has {trace.num_experts} top-{trace.top_k}{hint}")
        if m is not None:
            per_expert, bytes_src = m.bytes_per_expert, f"--model {model} ({m.source})"
        elif trace.expert_bytes:
            per_expert, bytes_src = int(trace.expert_bytes), "the trace's expert_bytes"
        else:
            raise UserError("the trace does not say how big an expert is: give --model M")
        fits_upto = None
        if vram is not None:
            if m is None:
                raise UserError("--vram needs --model (what to put on the card)")
            fits_upto = planner.card_fits(m, vram, mode, srv, batch)
        link, link_src, step = _link(link_gbps, probe_file, model, card)
        res, res_src = _resident(resident_tok_s, baseline)
        inputs = planner.Inputs(per_expert, bytes_src, link, link_src, res, res_src)
        if step is not None:
            inputs.step_us, inputs.step_source = step
        budgets = (parse_budgets(slots, trace.num_experts) if slots else planner.slot_grid(
            trace.num_experts, trace.top_k,
            trace.num_experts - 1 if fits_upto is None else fits_upto))
        serve_model = (str(model) if model and Path(model).is_dir()
                       else f"MODEL --size-from {model}" if model else "MODEL")
        rep = planner.plan_trace(
            trace, inputs, policies, budgets, fits_upto=fits_upto, serve_model=serve_model,
            vram_gb=vram, plan_file=str(save) if save else None, vllm_args=vllm_args,
            wide=mode, batch=batch, server=srv,
            model={"name": m.name if m else trace.model, "bytes_per_expert": per_expert,
                   "num_experts": trace.num_experts, "top_k": trace.top_k,
                   "num_moe_layers": trace.num_layers, "vram_gib": vram_gib,
                   "card": card.describe() if card else None,
                   "max_slots": fits_upto})
        rep.trace["path"] = str(path)
        data = rep.to_json()
        if save is not None:
            text = json_text(data) + "\n"
            atomic_write(save, lambda tmp: tmp.write_text(text))
        if plot is not None:
            from ..plotting import plot_prediction

            plot_prediction(rep.rows, plot)
        if as_json:
            print(json_text(data))
            return
        _print(rep, save, plot)

    def _print(rep, save: Path | None, plot: Path | None) -> None:
        i = rep.inputs
        console.print(
            f"[bold]{rep.model['name'] or 'trace'}[/]: {rep.trace['steps']} steps x "
            f"{rep.trace['layers']} layers, {rep.trace['tokens']:,} tokens; one expert "
            f"{i.bytes_per_expert:,} B ({i.bytes_source})")
        console.print(f"link {i.link_gbps:.1f} GB/s: {i.link_source}")
        console.print(f"resident {i.resident_tok_s:.1f} tok/s: {i.resident_source}")
        console.print(f"cache step {i.step_us:.2f} us a MoE layer: {i.step_source}")
        if rep.model.get("vram_gib"):
            card = rep.model.get("card") or f"{rep.model['vram_gib']:g} GiB"
            console.print(f"card {card}: up to {rep.model['max_slots']} slots a layer fit")
        streams = (f"{rep.trace['batch']} streams (aggregate)" if rep.trace.get("batch")
                   else "as traced")
        t = Table(title=f"predicted decode, {streams}: 1000/R + layer steps x cache step + "
                        "misses/token x expert bytes / link")
        for col, keep in (("policy", 9), ("slots", 9), ("misses/token", 6), ("miss rate", 5),
                          ("ms/token", 7), ("tok/s", 9), ("fits", 8)):
            t.add_column(col, justify="left" if col in ("policy", "fits") else "right",
                         keep=keep)
        for r in rep.rows:
            t.add_row(r["policy"], str(r["slots"]), f"{r['misses_per_token']:.2f}",
                      f"{100 * r['miss_rate']:.1f}%", f"{r['predicted_ms_per_token']:.2f}",
                      f"{r['predicted_tok_s']:.1f}", "yes" if r["fits"] else "no")
        console.print(t)
        rec = rep.recommended
        if rec is None:
            console.print("[yellow]no budget fits the card[/]")
        else:
            console.print(
                f"recommended: {rec['policy']} at {rec['slots']} slots/layer, "
                f"{rec['predicted_tok_s']:.1f} tok/s predicted; the per-layer split of the same "
                f"total: {rec['per_layer_predicted_tok_s']:.1f} tok/s "
                f"({rec['per_layer_misses_saved']:,} fewer misses)")
            print(f"  {rec['serve_command']}")  # plain: one line to copy, never wrapped
        for n in rep.notes:
            console.print(f"  note: {n}")
        for what, path in (("plan", save), ("plot", plot)):
            if path is not None:  # whole, never wrapped: a path is copied from here
                print(f"{what} written to {path}", file=sys.stderr)
