"""``--vram``: ask the sizing library (`expertcache size`) how much to offload.

The baseline must serve its offload arms with the same ``--cpu-offload-gb`` that
`expertcache serve` would pick, or the comparison answers a question nobody deploys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

from ..errors import UserError


@dataclass
class OffloadPlan:
    cpu_offload_gb: float
    top_k: int
    trap_ids: int  # max_num_seqs x top_k
    max_slots: int
    text: str
    #: vLLM flags every arm needs to run as the card would on a bigger GPU (its share of
    #: the GPU's memory, the card's batch default), those the user did not give
    share_args: list[str] = field(default_factory=list)


def offload_from_vram(
    sizing: ModuleType, model: str, vram: float, vllm_args: list[str],
    device_total_gib: float | None = None,
) -> OffloadPlan:
    """The plan's ``--cpu-offload-gb``; refuses when offload would mean nothing."""
    p = sizing.plan(model, vram_gb=vram, device_total_gib=device_total_gib,
                    **sizing.plan_kwargs_from_vllm_args(vllm_args))
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
        share_args=_share_args(sizing, p, vllm_args),
    )


def _share_args(sizing: ModuleType, p: object, vllm_args: list[str]) -> list[str]:
    if not p.shares_device:  # type: ignore[attr-defined]
        return []
    planned = p.vllm_args()  # type: ignore[attr-defined]
    out: list[str] = []
    for flag in ("--gpu-memory-utilization", "--max-num-batched-tokens"):
        if sizing.vllm_flag_value(vllm_args, flag) is None:
            out += [flag, planned[planned.index(flag) + 1]]
    return out
