"""`expertcache plan`: predicted decode speed per policy and budget, and the serve command."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from ..sizing.cards import parse_vram
from ..tables import Table
from . import (
    BATCH_HELP,
    VLLM_VERSION_HELP,
    VRAM_HELP,
    WIDE_HELP,
    demo_trace_path,
    json_text,
    parse_int_list,
    select_kernels,
    workload,
)

console = Console()

#: the help panel of the two rates `plan` cannot predict without
NEEDED_PANEL = "Needed: the two rates (one of each pair)"


def _read_baseline(path: Path) -> tuple[float, str]:
    """``--baseline``'s resident arm (the harness's reader, loaded only when it is read)."""
    from ..baseline.runner import resident_from_baseline

    return resident_from_baseline(path)


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
        from ..planning import inputs, planner, serving
        from ..rules.trace import load
        from . import passthrough_args, trace_argument
        from .replay import parse_policies

        vram_gib, card = parse_vram(vram)
        trace_path, extra = trace_argument(trace_path, ctx.args, "a model goes in --model")
        inputs.check_given(link_gbps, probe_file, resident_tok_s, baseline, card)
        if save is not None:
            save = check_output(save, "--save")
        if plot is not None:
            from ..plotting import image_path as plot_path

            plot = plot_path(plot)
        path = trace_path if trace_path is not None else demo_trace_path()
        recorded = load(path)
        from ..vllm_facts.vllm_flags import plan_kwargs_from_vllm_args

        vllm_args = passthrough_args(extra)
        flags = plan_kwargs_from_vllm_args(vllm_args)
        m = inputs.plan_model(model, recorded, demo=trace_path is None,
                              vllm_quantization=flags.get("vllm_quantization"))
        srv = serving.server(vllm_args, max_num_seqs=max_num_seqs, batch=batch,
                             vllm_version=vllm_version, vram_gib=vram_gib,
                             architectures=serving.architectures_of(m, recorded.model))
        trace, mode = workload(recorded, wide, batch,
                               srv.batch_tokens(batch) if batch else None)
        policies = parse_policies(policy)
        per_expert = inputs.expert_bytes(m, model, trace,
                                         int(flags.get("tensor_parallel_size") or 1))
        fits_upto = inputs.card_slots(m, vram, mode, srv, batch)
        select_kernels()  # the environment's kernels, should the link be measured here
        link = inputs.link_rate(link_gbps, probe_file, model, card)
        resident = inputs.resident_rate(resident_tok_s, baseline, _read_baseline)
        budgets = inputs.budgets(parse_int_list(slots, "--slots") if slots else None, trace,
                                 fits_upto)
        rep = planner.plan_trace(
            trace, inputs.prediction_inputs(
                per_expert, link, resident,
                planner.read_hit_copy(probe_file) if probe_file is not None else None),
            policies, budgets,
            fits_upto=fits_upto, serve_model=inputs.serve_model(model), vram_gb=vram,
            plan_file=str(save) if save else None, vllm_args=srv.vllm_args, wide=mode,
            batch=batch, server=srv,
            model=inputs.model_facts(m, trace, per_expert[0], vram_gib, card, fits_upto))
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
        tr = rep.trace
        if tr.get("prefill_steps"):
            # one short line: the prefills warm the cache but are not decode's cost
            console.print(
                f"priced: {tr['decode_steps']:,} decode steps, {tr['decode_tokens']:,} tokens; "
                f"{tr['prefill_steps']:,} prefill step{'s' if tr['prefill_steps'] > 1 else ''} "
                f"({tr['prefill_tokens']:,} tokens) replayed, not priced")
        console.print(f"link {i.link_gbps:.1f} GB/s: {i.link_source}")
        console.print(f"resident {i.resident_tok_s:.1f} tok/s: {i.resident_source}")
        console.print(f"cache step {i.step_us:.2f} us a MoE layer: {i.step_source}")
        staged_mode = rep.trace.get("wide", "in-place") != "in-place"
        if staged_mode:
            console.print(f"staged hits copied at {i.hit_copy_gbps:,.0f} GB/s: "
                          f"{i.hit_copy_source}")
        if rep.model.get("vram_gib"):
            card = rep.model.get("card") or f"{rep.model['vram_gib']:g} GiB"
            console.print(f"card {card}: up to {rep.model['max_slots']} slots a layer fit")
        streams = (f"{rep.trace['batch']} streams (aggregate)" if rep.trace.get("batch")
                   else "as traced")
        staged = " + staged hits x expert bytes / device copy" if staged_mode else ""
        t = Table(title=f"predicted decode, {streams}: 1000/R + layer steps x cache step + "
                        f"misses/token x expert bytes / link{staged}")
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
