"""``--vram``: ask the sizing library (`expertcache size`) how much to offload.

The baseline must serve its offload arms with the same ``--cpu-offload-gb`` that
`expertcache serve` would pick, or the comparison answers a question nobody deploys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import UserError
from ..sizing import sizing
from ..sizing.sizing import Verdict
from ..vllm_facts import capture, vllm_flags

if TYPE_CHECKING:
    from .arms import Arm


@dataclass
class OffloadPlan:
    cpu_offload_gb: float
    top_k: int
    padded_batch: int  # a full decode batch as vLLM runs it (CUDA-graph padding)
    max_num_seqs: int
    max_slots: int
    text: str
    #: vLLM flags every arm needs to run as the card would on a bigger GPU (its share of
    #: the GPU's memory, the card's batch default), those the user did not give
    share_args: list[str] = field(default_factory=list)
    graphs: str = ""
    #: the largest safe --max-num-seqs for a slot count, as `size` computes it
    safe_for: Callable[[int], int] = lambda slots: 0
    #: `size` planned no cache at all (ragged slabs, a kernel the plugin declines): why
    no_cache: str | None = None
    #: the card planned for, in words (`sizing.SizePlan.where`)
    where: str = ""
    #: `size` chose the batch (the user gave none): the line that says so; every arm then
    #: runs it (``--max-num-seqs`` is in ``share_args``), as `serve` would
    batch_choice: str | None = None

    def arm_warnings(self, arms: list, concurrency: int) -> list[str]:
        """What a careful engineer would say about each cache arm's slots before running:
        too many to fit, too few for the streams each run sends, or below the trap."""
        from ..rules.budget import trap_text

        out = []
        k = self.top_k
        for arm in (a for a in arms if a.kind == "cache"):
            if self.no_cache:
                out.append(f"{arm.name}: `size` plans no cache for this model ({self.no_cache}): "
                           "the arm will likely measure the offload floor")
                continue
            if arm.slots > self.max_slots:
                out.append(f"{arm.name}: only {self.max_slots} slots fit")
            if arm.slots < concurrency * k:
                out.append(
                    f"{arm.name}: {concurrency} stream(s) x top_k {k} = {concurrency * k} ids "
                    f"per decode step exceed {arm.slots} slots: every step reads through, the "
                    "cache cannot engage"
                )
            elif arm.slots < self.padded_batch * k:
                out.append(f"{arm.name}: " + trap_text(
                    self.max_num_seqs, self.padded_batch, k, arm.slots,
                    self.safe_for(arm.slots), self.graphs)
                    + " (this test's runs send fewer streams and will not show it)")
        return out


def offload_from_vram(
    model: str, vram: float | str, vllm_args: list[str], device_total_gib: float | None = None,
) -> OffloadPlan:
    """The plan's ``--cpu-offload-gb``; refuses when offload would mean nothing."""
    kwargs = vllm_flags.plan_kwargs_from_vllm_args(vllm_args)
    p = sizing.plan(model, vram_gb=vram, device_total_gib=device_total_gib, **kwargs)
    if p.verdict is Verdict.DOES_NOT_FIT:
        raise UserError(f"--vram {vram}: {p.verdict_text}")
    if p.fits_outright or p.cpu_offload_gb <= 0:
        raise UserError(
            f"--vram {vram}: {p.verdict_text}; to measure the offload penalty anyway, "
            "pass --cpu-offload-gb GB instead of --vram"
        )
    return OffloadPlan(
        cpu_offload_gb=float(p.cpu_offload_gb),
        top_k=int(p.top_k),
        padded_batch=int(p.padded_batch),
        max_num_seqs=int(p.max_num_seqs),
        max_slots=int(p.max_slots),
        text=p.verdict_text,
        no_cache=p.verdict_text if p.verdict is Verdict.OFFLOAD_NO_CACHE else None,
        share_args=_share_args(p, vllm_args),
        graphs=p.graphs,
        where=p.where,
        batch_choice=p.batch_choice,
        safe_for=lambda slots: capture.safe_max_num_seqs(
            slots, p.top_k, p.max_num_batched_tokens,
            kwargs.get("graphs") or capture.settings_from_vllm_args([])),
    )


def _share_args(p: sizing.SizePlan, vllm_args: list[str]) -> list[str]:
    """The planned flags every arm needs: the card's share of a bigger GPU, and the batch
    the plan chose where the user gave none."""
    planned = p.vllm_args()
    flags = ["--max-num-seqs"] if p.batch_choice else []
    if p.shares_device:
        flags += ["--gpu-memory-utilization", "--max-num-batched-tokens"]
    out: list[str] = []
    for flag in flags:
        if vllm_flags.vllm_flag_value(vllm_args, flag) is None:
            out += [flag, planned[planned.index(flag) + 1]]
    return out


def offload_checks(model: str, vllm_args: list[str], arms: list[Arm],
                   cuda: bool = True) -> tuple[list[str], str | None]:
    """What the offloaded arms need, checked before any server: the flags only they get,
    and the note that says why (None: nothing to say).

    ``--quantization`` on an unquantised model is refused (vLLM cannot offload experts it
    quantises while loading), as a 4-bit format vLLM would run on a Triton kernel it does
    not have; a format that needs a flag to stay offloaded gets it (MXFP4: ``--moe-backend
    marlin``), for the offloaded arms only: the resident arm stays stock. With a cache arm,
    the formats the cache arms on Triton get ``--moe-backend triton`` pinned (floor and
    cache then run one kernel), where vLLM runs on an NVIDIA GPU (``cuda``; vLLM's CPU
    build runs its own kernels and refuses that flag). No offloaded arm, or a model sizing
    cannot read (an HF id it does not know): nothing to check here, vLLM says what it
    refuses.
    """
    from ..sizing.model_size import load_model
    from ..vllm_facts import installed_vllm, vllm_experts

    if not any(a.offloaded for a in arms):
        return [], None
    try:
        m = load_model(model)
    except UserError:
        return [], None
    why = vllm_flags.online_quantization_refusal(vllm_args, m.quant, m.name,
                                                 installed_vllm.version())
    why = why or vllm_experts.triton_refusal(m.quant, vllm_args,
                                             vllm_experts.wna16_triton_available(),
                                             installed_vllm.release())
    if why:
        raise UserError(why)
    flags, note = vllm_experts.offload_backend_args(
        m.quant, vllm_args, vllm_experts.mxfp4_marlin_available(), installed_vllm.release(),
        humming=vllm_experts.humming_ranked_first(),
        cached=cuda and any(a.kind == "cache" for a in arms))
    return flags, note
