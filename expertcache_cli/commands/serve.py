"""`expertcache serve`: size the cache for a card and launch `vllm serve` with it armed."""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console

from ..errors import UserError
from ..planning.launch import make_plan, plugin_missing, start_refusal, vllm_refusal
from ..sizing.sizing import Verdict
from . import VRAM_HELP, passthrough_args, wide_option

console = Console(stderr=True)


def register(app: typer.Typer) -> None:
    @app.command(
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        epilog="Everything after `--` goes to `vllm serve` unchanged.",
    )
    def serve(
        ctx: typer.Context,
        model: str = typer.Argument(..., help="the model to serve (HF id or local directory)"),
        vram: str = typer.Option(..., help=VRAM_HELP),
        slots: int = typer.Option(None, help="force this many slots per MoE layer"),
        fraction: float = typer.Option(None, help="force this fraction of the experts as slots"),
        policy: str = typer.Option("lru", help="replacement policy: lru or lfu"),
        decay: int = typer.Option(0, help="LFU: halve priorities every N steps (0 = never)"),
        size_from: str = typer.Option(
            None, help="size from this config.json / model dir / preset instead of MODEL"
        ),
        plan: str = typer.Option(
            None, "--plan", help="serve a plan file from `expertcache plan --save` (per-layer "
            "budgets and policy)"
        ),
        allow_trap: bool = typer.Option(
            False, help="serve even when a full batch would bypass the cache (sizing trap)"
        ),
        dry_run: bool = typer.Option(False, help="print the plan and the command, run nothing"),
        wide: str | None = typer.Option(
            None, "--wide", help="steps wider than the slots: in-place, or staged / "
            "staged-install through a VRAM scratch (EXPERT_CACHE_WIDE; sized with the slots); "
            "default: the --plan's mode, else in-place"),
    ) -> None:
        """Launch `vllm serve MODEL` with experts offloaded and the slot cache sized and armed."""
        from ..device.gpu_info import device_total_gib
        from ..sizing import hub

        hub.GIVE_CONFIG.set("give its config.json with --size-from PATH (vLLM still loads "
                            "MODEL)")
        plan_file = plan
        plan = make_plan(
            model, vram, slots=slots, fraction=fraction, policy=policy, decay=decay,
            size_from=size_from, allow_trap=allow_trap, vllm_args=passthrough_args(ctx.args),
            device_total_gib=device_total_gib(), plan_file=plan_file,
            wide=None if wide is None else wide_option(wide),
        )
        s = plan.size
        console.print(f"[bold]expertcache serve[/]: {s.model} on {s.where}: {s.verdict_text}")
        if s.verdict is Verdict.CACHE:
            pad = f" (a CUDA graph of {s.padded_batch})" if s.padded_batch != s.max_num_seqs else ""
            if plan.per_layer:
                n = plan.per_layer
                what = (f"slots {min(n)}-{max(n)} of {s.num_experts} per MoE layer from "
                        f"{plan_file} = {sum(n) * s.bytes_per_expert / 2**30:.2f} GiB; policy "
                        f"{plan.env.get('EXPERT_CACHE_POLICY')}")
            else:
                what = (f"slots {s.slots} of {s.num_experts} per MoE layer x "
                        f"{s.num_moe_layers} layers = {s.slots * s.bytes_per_slot / 2**30:.2f} "
                        f"GiB; policy {policy}")
            console.print(
                f"  {what}; experts offloaded with --cpu-offload-gb {s.cpu_offload_gb}; "
                f"max_num_seqs {s.max_num_seqs}{pad} x top_k {s.top_k} = {s.trap_ids} ids per "
                "batched decode step"
            )
        if s.batch_choice:
            console.print(f"  batch: {s.batch_choice}")
        if s.kv_cache_bytes and "--kv-cache-memory-bytes" in plan.argv:
            console.print(f"  KV cache: {s.kv_cache_bytes / 2**30:.2f} GiB, handed to vLLM "
                          "(--kv-cache-memory-bytes) so that a first start's compile cannot "
                          "shrink it")
        for note in plan.notes:
            console.print(f"  note: {note}")
        missing = plugin_missing(plan)
        if missing and dry_run:
            console.print("  [yellow]warning: the expertcache vLLM plugin is not installed in "
                          "this environment (pip install expertcache), nothing would arm[/]")
        unknown = vllm_refusal(plan) if dry_run else None
        if unknown:
            console.print(f"  [yellow]warning: {unknown}[/]")
        if dry_run:
            print(plan.shell())
            return
        why = start_refusal(plan, missing)
        if why:
            raise UserError(why)
        console.print(f"  running: {plan.shell()}")
        sys.stderr.flush()
        env = {**os.environ, **plan.env}
        try:
            os.execvpe(plan.argv[0], plan.argv, env)
        except OSError as exc:
            raise UserError(f"cannot start {plan.argv[0]}: {exc.strerror}") from None
