"""``--vram``: ask the sizing library (`expertcache size`) how much to offload.

The baseline must serve its offload arms with the same ``--cpu-offload-gb`` that
`expertcache serve` would pick, or the comparison answers a question nobody deploys.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from ..errors import UserError

#: vLLM flags that change the plan, and the plan() keyword each feeds.
_PLAN_FLAGS = {
    "--max-model-len": ("max_model_len", int),
    "--max-num-seqs": ("max_num_seqs", int),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int),
    "--kv-cache-dtype": ("kv_cache_dtype", str),
}


@dataclass
class OffloadPlan:
    cpu_offload_gb: float
    top_k: int
    trap_ids: int  # max_num_seqs x top_k
    max_slots: int
    text: str


def plan_kwargs(vllm_args: list[str]) -> dict[str, object]:
    """The sizing-relevant flags among the arguments passed through to vLLM."""
    out: dict[str, object] = {}
    i = 0
    while i < len(vllm_args):
        word = vllm_args[i]
        flag, eq, value = word.partition("=")
        if flag in _PLAN_FLAGS:
            if not eq:
                if i + 1 >= len(vllm_args):
                    raise UserError(f"{flag} needs a value")
                value = vllm_args[i + 1]
                i += 1
            key, conv = _PLAN_FLAGS[flag]
            try:
                out[key] = conv(value)
            except ValueError:
                raise UserError(f"{flag}: bad value {value!r}") from None
        i += 1
    return out


def offload_from_vram(
    sizing: ModuleType, model: str, vram: float, vllm_args: list[str]
) -> OffloadPlan:
    """The plan's ``--cpu-offload-gb``; refuses when offload would mean nothing."""
    p = sizing.plan(model, vram_gb=vram, **plan_kwargs(vllm_args))
    if p.verdict == "does_not_fit":
        raise UserError(f"--vram {vram:g}: {p.verdict_text}")
    if p.fits_outright or p.cpu_offload_gb <= 0:
        raise UserError(
            f"--vram {vram:g}: {p.verdict_text}; to measure the offload penalty anyway, "
            "pass --cpu-offload-gb GB instead of --vram"
        )
    return OffloadPlan(
        cpu_offload_gb=float(p.cpu_offload_gb),
        top_k=int(p.top_k),
        trap_ids=int(p.trap_ids),
        max_slots=int(p.max_slots),
        text=p.verdict_text,
    )
