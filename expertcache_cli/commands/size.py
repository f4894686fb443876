"""`expertcache size`: how many expert slots fit on a card, and the vLLM flags for it."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer
from rich.console import Console

from ..errors import UserError
from ..sizing import cards, formats, model_size, sizing
from ..sizing.presets import DEFAULT_PRESET, PRESETS
from ..sizing.sizing import Verdict
from ..tables import Table
from ..vllm_facts import installed_vllm, releases, vllm_experts, vllm_flags
from . import VRAM_HELP, json_text, model_word, passthrough_args, wide_option

console = Console()


def _gib(n: float) -> str:
    return f"{n / sizing.GiB:.2f} GiB"


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _model_table(m: model_size.ModelSize) -> Table:
    t = Table(title=f"{m.name} ({m.quant}, from {m.source})", show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column(text=True)
    t.add_row("MoE layers", f"{m.num_moe_layers} of {m.num_layers}")
    t.add_row("experts / top_k", f"{m.num_experts} / {m.top_k}")
    t.add_row(
        "one expert, one layer",
        f"{m.bytes_per_expert:,} B ({_mb(m.bytes_per_expert)}): "
        + " + ".join(f"{x.name} {x.nbytes:,}" for x in m.expert_tensors)
        if m.source != "checkpoint"
        else f"{m.bytes_per_expert:,} B ({_mb(m.bytes_per_expert)}), from safetensors",
    )
    t.add_row(
        "one slot (all MoE layers)",
        f"{m.bytes_per_slot:,} B ({_mb(m.bytes_per_slot)}, "
        f"{m.bytes_per_slot / sizing.GiB:.3f} GiB)",
    )
    t.add_row("all experts", f"{_gib(m.expert_bytes)} ({m.expert_bytes:,} B)")
    t.add_row("everything else", f"{_gib(m.non_expert_bytes)} ({m.non_expert_bytes:,} B)")
    if m.rope_cache_bytes >= cards.MiB:
        t.add_row("rotary cache (vLLM's)",
                  f"{_gib(m.rope_cache_bytes)} ({m.max_position_embeddings:,} positions; in "
                  "no checkpoint)")
    kv = f"{m.kv_bytes_per_token:,} B ({m.kv_kind})"
    if m.kv_window_bytes_per_seq:
        kv += f" + {m.kv_window_bytes_per_seq:,} B per sequence for the windows"
    if m.kv_chunk_bytes_per_seq:
        kv += f" + {m.kv_chunk_bytes_per_seq:,} B per sequence for the chunks"
    if m.state_bytes_per_seq:
        kv += (f" + {m.state_bytes_per_seq:,} B of linear-attention state per sequence, "
               "paged with the KV")
    t.add_row("KV per token (bf16)", kv)
    ragged = [x.name for x in m.expert_tensors if not x.aligned]
    slabs = ("yes" if not ragged else f"yes ({', '.join(ragged)} in the packed side row)"
             if m.aligned else "[red]NO: the cache refuses this model[/]")
    t.add_row("16-byte slabs", slabs)
    return t


def _plan_table(p: sizing.SizePlan) -> Table:
    where = (f"on each of {p.tensor_parallel_size} GPUs of {p.where} (tensor parallel)"
             if p.tensor_parallel_size > 1 else f"on {p.where}")
    t = Table(title=where, show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column(text=True)
    t.add_row(
        "budget",
        f"{_gib(p.budget_bytes)} = {p.vram_gib:g} GiB x {p.gpu_memory_utilization:g}",
    )
    t.add_row("  - non-expert weights", _gib(p.non_expert_bytes))
    if p.rope_cache_bytes >= cards.MiB:
        t.add_row("  - rotary cache", _gib(p.rope_cache_bytes))
    t.add_row(
        "  - KV reserve",
        f"{_gib(p.kv_reserved_bytes)} ("
        + ("--kv-cache-memory-bytes, yours" if p.kv_given
           else f"one {p.max_model_len}-token sequence") + ")",
    )
    t.add_row(
        "  - runtime (estimate)",
        f"{_gib(p.overhead_bytes)} (max_num_seqs {p.max_num_seqs}, "
        f"batched tokens {p.max_num_batched_tokens})",
    )
    if p.scratch_bytes:
        t.add_row("  - wide-step scratch", f"{_gib(p.scratch_bytes)} (one layer's "
                  f"{p.num_experts} experts, --wide {p.wide.value})")
    t.add_row("  = for expert slots", _gib(p.slot_budget_bytes))
    colour = {Verdict.FITS_OUTRIGHT: "green", Verdict.CACHE: "cyan",
              Verdict.OFFLOAD_NO_CACHE: "yellow", Verdict.DOES_NOT_FIT: "red"}[p.verdict]
    t.add_row("verdict", f"[{colour}]{p.verdict_text}[/]")
    if p.batch_choice:
        t.add_row("batch", p.batch_choice)
    if p.kv_cache_bytes and not p.kv_given:
        t.add_row("KV cache", f"{_gib(p.kv_cache_bytes)}: the reserve and what whole slots "
                  "leave, handed to vLLM (--kv-cache-memory-bytes) so that a first start's "
                  "compile cannot shrink it")
    if p.verdict is Verdict.CACHE:
        t.add_row(
            "cache slots",
            f"{p.slots} per MoE layer ({_gib(p.slots * p.bytes_per_slot)}): "
            f"EXPERT_CACHE_SLOTS={p.slots} (`expertcache serve` sets it)",
        )
    for n in p.notes:
        style = "yellow" if n.startswith("sizing trap") else "dim"
        t.add_row("note", f"[{style}]{n}[/]")
    return t


_SHORT = {
    Verdict.FITS_OUTRIGHT: "fits outright",
    Verdict.CACHE: "cache",
    Verdict.OFFLOAD_NO_CACHE: "offloaded, no room for a cache",
    Verdict.DOES_NOT_FIT: "does not fit",
}


def _cards_table(m: model_size.ModelSize, rows: list[tuple[str, sizing.SizePlan]]) -> Table:
    t = Table(title=f"{m.name}: slot budget by card (vLLM defaults unless given)")
    for col, keep in (("card", 14), ("max-model-len", 1), ("max-num-seqs", 1), ("slots", 9),
                      ("verdict", 8),
                      ("--cpu-offload-gb", 2), ("trap", 3)):
        t.add_column(col, keep=keep, text=col in ("verdict", "trap"))
    for label, p in rows:
        t.add_row(
            label,
            str(p.max_model_len),
            str(p.max_num_seqs) + (" (chosen)" if p.batch_choice else ""),
            f"{p.slots} of {p.num_experts}",
            _SHORT[p.verdict]
            + (f"; fits at utilization {p.utilization_to_fit_outright:.2f}"
               if p.verdict is Verdict.CACHE and p.utilization_to_fit_outright else ""),
            str(p.cpu_offload_gb) if p.cpu_offload_gb else "-",
            f"{p.trap_ids} ids > {p.slots}" if p.trap else "-",
        )
    return t


def register(app: typer.Typer) -> None:
    @app.command(
        "size",
        options_metavar="[MODEL] [OPTIONS]",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        epilog="Flags after `--` are read as `vllm serve` would take them (max-model-len, "
        "max-num-seqs, utilization, batched tokens, KV dtype, CUDA-graph settings); the "
        "options above win where both are given.",
    )
    def size(
        ctx: typer.Context,
        model: str = typer.Option(
            None, "--model", "-m",
            help="a Hugging Face id, a preset name (see --list), a config.json path, or a "
            f"local model directory; also the first word, as `serve MODEL` takes it "
            f"[default: {DEFAULT_PRESET}]",
        ),
        quant: str = typer.Option(
            None, "--quant",
            help=f"weight format when the config does not say: {', '.join(formats.QUANTS)}",
        ),
        vram: str = typer.Option(
            None, "--vram", help=VRAM_HELP + "; without it, a table of common cards",
        ),
        max_model_len: int = typer.Option(None, help="vLLM --max-model-len (default: the model's)"),
        max_num_seqs: int = typer.Option(None, help="vLLM --max-num-seqs (default: vLLM's)"),
        gpu_memory_utilization: float = typer.Option(
            None, help="vLLM --gpu-memory-utilization (default 0.9)"
        ),
        max_num_batched_tokens: int = typer.Option(None, help="vLLM --max-num-batched-tokens"),
        kv_cache_dtype: str = typer.Option(
            None, help="vLLM --kv-cache-dtype: auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2"),
        tensor_parallel_size: int = typer.Option(
            None, "--tensor-parallel-size", "-tp",
            help="vLLM --tensor-parallel-size: plan one GPU of that many (--vram is per GPU)"),
        kv_tokens: int = typer.Option(
            None, help="KV tokens to reserve (default: one max-model-len sequence)"
        ),
        overhead_gb: float = typer.Option(
            None, help="runtime memory besides weights and KV, GiB (default: estimated)"
        ),
        slots: int = typer.Option(None, help="force this many slots and check that they fit"),
        fraction: float = typer.Option(None, help="force this fraction of the experts as slots"),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
        list_models: bool = typer.Option(False, "--list", help="list the built-in presets"),
        wide: str = typer.Option(
            "in-place", "--wide", help="steps wider than the slots: in-place, or staged / "
            "staged-install through a scratch of one layer's experts (sized here)"),
    ) -> None:
        """Slots that fit on a card, the --cpu-offload-gb for vLLM, and the sizing trap."""
        if list_models:
            if as_json:
                print(json_text({n: {"hf_id": p.hf_id, "quant": p.quant}
                                 for n, p in PRESETS.items()}))
                return
            t = Table(title="built-in models")
            for col in ("preset", "stands for", "format"):
                t.add_column(col)
            for n, p in PRESETS.items():
                t.add_row(n + (" (default)" if n == DEFAULT_PRESET else ""), p.hf_id, p.quant)
            console.print(t)
            return
        word, extra = model_word(ctx.args)
        if word is not None and model is not None:
            raise UserError(f"the model is given twice: {word!r} and --model {model!r}")
        model = word or model or DEFAULT_PRESET
        args = passthrough_args(extra)  # first: a --revision there is the one sized
        m = model_size.load_model(Path(model) if Path(model).exists() else model, quant)
        common = vllm_flags.plan_kwargs_from_vllm_args(args)
        given = dict(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_dtype=kv_cache_dtype,
            tensor_parallel_size=tensor_parallel_size,
        )
        common.update({k: v for k, v in given.items() if v is not None})
        m = sizing.model_as_held(m, Path(model) if Path(model).exists() else model,
                                 quant or None, common.get("vllm_quantization"))
        why = vllm_experts.triton_refusal(m.quant, args, vllm_experts.wna16_triton_available(),
                                          installed_vllm.release())
        if why:
            raise UserError(why)
        unknown = releases.installed_refusal()
        if unknown:  # sized all the same: the numbers hold for a known release
            m.notes.append(f"{unknown}: the cache would not arm in it, and `serve` refuses "
                           f"to start it (pip install '{releases.pip_pin()}')")
        if slots is not None or fraction is not None:  # else the verdict itself says it
            kernel = vllm_experts.kernel_note(m.quant, args, installed_vllm.release())
            if kernel:
                m.notes.append(kernel)
        common.update(slots=slots, fraction=fraction, kv_tokens=kv_tokens,
                      overhead_gb=overhead_gb, wide=wide_option(wide))
        if vram is None:
            rows = [(cards.CARDS[name].describe(), sizing.plan(m, name, **common))
                    for name in sizing.COMMON_CARDS]
            if as_json:
                out = m.to_json()
                out["cards"] = [p.to_json() | {"card": label} for label, p in rows]
                print(json_text(out))
                return
            console.print(_model_table(m))
            console.print(_cards_table(m, rows))
            return
        p = sizing.plan(m, vram, **common)
        if p.verdict.offloads:  # a kernel that cannot offload: refused
            vllm_experts.offload_backend_args(m.quant, args, vllm_experts.mxfp4_marlin_available(),
                                              installed_vllm.release())
        if as_json:
            print(json_text(m.to_json() | p.to_json()))
            return
        console.print(_model_table(m))
        console.print(_plan_table(p))
        if p.verdict.offloads:
            # plain print: a command to copy is one line, never wrapped by rich
            print(f"vLLM:\n  vllm serve MODEL {shlex.join(p.vllm_args())}")
