"""How many expert slots fit on a card, and what to tell vLLM (docs/design.md, The sizing model).

The model comes from `model_size.load_model` (formats in `formats`, the user's vLLM flags
in `vllm_flags`); :func:`plan` puts it on a card: ``slots = (VRAM x utilisation - non-expert - KV -
  runtime overhead) / bytes per slot``, the ``--cpu-offload-gb`` that moves every MoE
  layer's experts to the host, the verdict, and the sizing trap
  (``max_num_seqs x top_k > slots`` makes batched decode bypass the cache silently).

Units: VRAM is given in GiB (a "24 GB" card reports 24 GiB), and vLLM's
``--cpu-offload-gb`` is GiB too (vLLM multiplies it by 1024**3). Byte counts are exact.

Nothing here imports torch: sizing must answer on a machine without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..rules import budget as rules
from ..rules.policy import Wide
from ..vllm_facts import capture, installed_vllm, vllm_experts
from ..vllm_facts.vllm_flags import ONLINE_FORMATS
from . import cards, formats, hybrid_pages
from .cards import GiB
from .formats import ceil_div
from .model_size import ModelSize, load_model

#: vLLM's `vllm serve` defaults (V1 engine): on cards with >= 70 GiB it raises both.
VLLM_DEFAULT_UTILIZATION = 0.9
_BIG_CARD_GIB = 70

#: Fixed part of the runtime overhead estimate: cuBLAS/NCCL workspaces and allocator
#: slack. An estimate, not a measurement: --overhead-gb replaces the whole runtime figure
#: with what vLLM's startup log reports on the user's machine.
FIXED_OVERHEAD_BYTES = GiB // 2

#: CUDA-graph memory per captured batch size and decoder layer: it grows with the number
#: of graphs, not the tokens each captures. Measured; source in docs/design.md, measured constants.
GRAPH_BYTES_PER_LAYER = int(0.95 * GiB / (51 * 48))

#: Bytes per logit of the sampler's warm-up (vLLM samples ``max_num_seqs`` dummy requests
#: with top-k and top-p on after the KV cache is allocated): fp32 logits, the sorted
#: values and their int64 indices, softmax and cumulative probabilities, and masks live
#: at once. Source in docs/design.md, measured constants.
SAMPLER_BYTES_PER_LOGIT = 32


# --------------------------------------------------------------------------- the plan


def vllm_defaults(vram_gib: float) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) that `vllm serve` picks on a card this big."""
    return (1024, 8192) if vram_gib >= _BIG_CARD_GIB else (256, 2048)


def runtime_overhead_bytes(model: ModelSize, max_num_seqs: int, max_num_batched_tokens: int,
                           graph_sizes: int = 0) -> int:
    """What vLLM holds besides weights and KV: an estimate, overridable with --overhead-gb.

    Fixed workspaces, the CUDA graphs of ``graph_sizes`` captured batch sizes (each graph
    costs about the same whatever its size), the sampler's warm-up over ``max_num_seqs``
    rows of the vocabulary, and the peak activations of one prefill chunk of
    ``max_num_batched_tokens`` (residual stream copies plus the fused-MoE scratch of top_k
    gate/up/down rows per token, at 16 bits). Why each term is there: the plan hands vLLM
    its KV cache size, so nothing of vLLM's own profile shrinks the KV cache to make room
    for what this leaves out; the graphs and the sampler are what grow with the batch.
    """
    sampler = max_num_seqs * model.vocab_size * SAMPLER_BYTES_PER_LOGIT
    graphs = graph_sizes * model.num_layers * GRAPH_BYTES_PER_LAYER
    per_tok = 2 * (8 * model.hidden_size
                   + model.top_k * (3 * model.moe_intermediate_size + model.hidden_size))
    return FIXED_OVERHEAD_BYTES + graphs + sampler + max_num_batched_tokens * per_tok


def online_format(model: ModelSize, vllm_quantization: str | None) -> str | None:
    """The format vLLM will hold an unquantised model in when ``--quantization`` asks it to
    quantise while loading (a slot holds what vLLM holds), or None."""
    if model.quant not in ("bf16", "fp16"):
        return None
    return ONLINE_FORMATS.get((vllm_quantization or "").lower())


def online_note(flag_value: str, fmt: str) -> str:
    return f"--quantization {flag_value}: sized as vLLM will hold it ({fmt}, quantised at load)"


def model_as_held(model: ModelSize, spec: str | Path | None, quant: str | None,
                  vllm_quantization: str | None) -> ModelSize:
    """``model`` (read from ``spec``) as vLLM will hold it: where no ``quant`` was given (None) and
    ``--quantization`` asks vLLM to quantise an unquantised model while loading
    (`online_format`), the model read again in that format, with a note that says so;
    else ``model`` itself. Why: a slot holds what vLLM holds, so sizing the checkpoint's
    bf16 would plan more bytes than an expert takes."""
    online = online_format(model, vllm_quantization) if quant is None else None
    if not online:
        return model
    held = load_model(spec, online)
    held.notes.append(online_note(vllm_quantization or "", online))
    return held


def _card_budget(
    vram_gb: float, device_total_gib: float | None, utilization: float | None
) -> tuple[float, float, float, int, list[str]]:
    """(card GiB, GPU GiB, vLLM's utilization, budget bytes, notes) for `plan`.

    vLLM's utilization is a fraction of the GPU it runs on. On the card itself that is
    the card; on a bigger GPU the card is a share of it, so the card's 0.9 becomes
    ``0.9 x card / GPU`` (floored to 4 places), and a utilization the user gave is
    vLLM's, of the GPU, and may not ask for more than the card.
    """
    notes: list[str] = []
    device = float(device_total_gib) if device_total_gib else vram_gb
    if device < vram_gb:
        notes.append(f"this GPU has {device:.2f} GiB, less than --vram {vram_gb:g}: "
                     f"sized for {device:.2f} GiB")
        vram_gb = device
    if utilization is None and device == vram_gb:
        utilization = VLLM_DEFAULT_UTILIZATION
    if utilization is None:
        budget = int(vram_gb * GiB * VLLM_DEFAULT_UTILIZATION)
        utilization = math.floor(budget / (device * GiB) * 1e4) / 1e4
    else:
        budget = int(device * GiB * utilization)
        if budget > vram_gb * GiB * (1 + 1e-9):
            raise UserError(
                f"--gpu-memory-utilization {utilization:g} of this {device:.2f} GiB GPU is "
                f"{budget / GiB:.2f} GiB, more than --vram {vram_gb:g}: leave the "
                "utilization out and it is planned for the card"
            )
    if device > vram_gb:
        notes.append(f"a {vram_gb:g} GiB share of a {device:.2f} GiB GPU: vLLM gets "
                     f"--gpu-memory-utilization {utilization:g} ({budget / GiB:.2f} GiB)")
    return vram_gb, device, utilization, budget, notes


def _check_inputs(**values: float | None) -> None:
    """Every number a plan takes, checked before any work: one line naming the option.

    Unset (None) means vLLM's default; zero is never a default, it is refused like any
    other value out of range.
    """
    for name, value in values.items():
        if value is None:
            continue
        flag = "--vram" if name == "vram_gb" else "--" + name.replace("_", "-")
        if isinstance(value, bool) or not math.isfinite(value):
            raise UserError(f"{flag} must be a finite number, got {value}")
        if name == "gpu_memory_utilization":
            if not 0 < value <= 1:
                raise UserError(f"{flag} must be in (0, 1], got {value:g}")
        elif name == "overhead_gb":
            if value < 0:
                raise UserError(f"{flag} must be >= 0 GiB, got {value:g}")
        elif value <= 0:
            raise UserError(f"{flag} must be positive, got {value:g}")
        if name != "vram_gb" and name.endswith(("len", "seqs", "tokens", "size")) and (
                value != int(value)):
            raise UserError(f"{flag} must be a whole number, got {value:g}")


#: the context a plan whose KV crowds the card is tried again at, in a note
SHORT_CONTEXT = "--max-model-len 8192"


class Verdict(str, Enum):
    """What sizing decides for a model on a card, one name each.

    A ``str`` so that the JSON of `size --json` and the plan file keep the names they
    always had; code compares members, never spellings."""

    FITS_OUTRIGHT = "fits_outright"
    CACHE = "cache"
    OFFLOAD_NO_CACHE = "offload_no_cache"
    DOES_NOT_FIT = "does_not_fit"

    @property
    def offloads(self) -> bool:
        """The experts live in host memory (with the cache or without it): vLLM gets
        ``--cpu-offload-gb``, and what cannot be offloaded is refused."""
        return self in (Verdict.CACHE, Verdict.OFFLOAD_NO_CACHE)


@dataclass
class SizePlan:
    """A model on a card: the slot budget, the vLLM flags, the verdict, the trap."""

    model: str
    quant: str
    num_experts: int
    top_k: int
    num_moe_layers: int
    bytes_per_expert: int
    bytes_per_slot: int
    expert_bytes: int
    non_expert_bytes: int
    rope_cache_bytes: int  # vLLM's rotary caches, held beside the non-expert weights
    kv_bytes_per_token: int
    vram_gib: float
    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_reserved_bytes: int
    overhead_bytes: int
    budget_bytes: int  # VRAM x utilisation
    slot_budget_bytes: int  # what is left for expert slots
    max_slots: int  # slots that fit (capped at num_experts)
    slots: int  # slots planned (max_slots unless forced)
    fits_outright: bool
    verdict: Verdict
    verdict_text: str
    cpu_offload_gb: int
    trap: bool
    trap_ids: int  # padded_batch x top_k: routing ids of the widest batched decode step
    safe_max_num_seqs: int  # the largest max_num_seqs that keeps decode on the cache
    padded_batch: int  # tokens of a full decode batch once vLLM pads it to a CUDA graph
    graphs: str  # where the capture sizes came from (flags, defaults, eager)
    device_total_gib: float  # the GPU vLLM runs on (= vram_gib unless told otherwise)
    tensor_parallel_size: int  # the plan is for one GPU of this many
    utilization_to_fit_outright: float | None
    aligned: bool
    notes: list[str] = field(default_factory=list)
    wide: Wide = Wide.IN_PLACE  # what steps wider than the slots do
    #: speculative decoding's draft tokens a sequence carries into each verify step (vLLM's
    #: ``--speculative-config`` num_speculative_tokens): a full decode step is
    #: ``max_num_seqs x (1 + k)`` tokens before padding (0: no speculative decoding)
    speculative_tokens: int = 0
    scratch_bytes: int = 0  # the staged modes' scratch: one layer's experts (0 in place)
    #: decoded tokens a prompt below which the scratch pays for itself (`scratch_break_even`;
    #: None: no scratch, or full batches wider than the slots, which it serves anyway)
    scratch_break_even_tokens: int | None = None
    #: flags the format needs to stay offloaded on a kernel the cache arms (MXFP4, and
    #: 4-bit on a vLLM that prefers Humming on Hopper: --moe-backend marlin;
    #: `vllm_experts.offload_backend_args`), passed with the offload
    offload_args: list[str] = field(default_factory=list)
    #: the KV cache bytes vLLM is handed (``--kv-cache-memory-bytes``) where experts are
    #: offloaded: what the budget leaves after weights, slots, scratch and runtime, so that
    #: vLLM's profile step (which counts a cold compile's temporaries) cannot shrink it
    kv_cache_bytes: int = 0
    #: True when the user gave the KV size (``--kv-cache-memory-bytes``): the plan sized
    #: around theirs and passes nothing
    kv_given: bool = False
    #: the one line that says which ``--max-num-seqs`` the plan chose and how to change it
    #: (None: the user gave the batch, or vLLM's default already keeps decode on the cache)
    batch_choice: str | None = None
    #: the card planned for, by name (`cards.Card.describe`), when ``--vram`` named one
    card: str | None = None

    @property
    def resident_bytes(self) -> int:
        """What the plan holds in VRAM beside the slots (`ModelSize.resident_bytes`)."""
        return self.non_expert_bytes + self.rope_cache_bytes

    @property
    def shares_device(self) -> bool:
        """The card is a share of a bigger GPU (another tenant, or an emulated small card)."""
        return self.device_total_gib > self.vram_gib

    def vllm_args(self) -> list[str]:
        """The flags to pass to `vllm serve` for this plan.

        On a share of a bigger GPU, vLLM would pick its batch defaults for that GPU
        (8192 batched tokens on >= 70 GiB) and profile a wider step than planned, so the
        card's default is passed too.
        """
        args = [
            "--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}",
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
        ]
        if self.shares_device:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if not self.fits_outright and self.verdict.offloads:
            if self.kv_cache_bytes and not self.kv_given:
                args += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
            args += ["--cpu-offload-gb", str(self.cpu_offload_gb)]
            args += ["--cpu-offload-params", "experts", *self.offload_args]
        return args

    @property
    def where(self) -> str:
        """What the plan is for, in words: the card by name, or the GiB given."""
        return self.card or f"{self.vram_gib:g} GiB"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["wide"] = self.wide.value
        d["verdict"] = self.verdict.value
        d["vllm_args"] = self.vllm_args()
        return d


#: Measured, not modelled: how far a warm staged server's profile step peaked above the
#: runtime estimate at 8,192 batched tokens (nothing at 2,048, `vllm serve`'s default
#: under 70 GiB). Unexplained, so a staged plan wider than ``STAGED_PEAK_FREE_TOKENS``
#: counts it as runtime memory rather than promise it to KV. Source in
#: docs/design.md, measured constants.
STAGED_WARM_PEAK_GIB = 0.82
STAGED_PEAK_FREE_TOKENS = 2048


def scratch_break_even(slots: int, num_experts: int, top_k: int, cost_slots: float) -> int:
    """Decoded tokens a prompt below which a wide-step scratch saves more than it costs.

    Why: when every decode batch fits the slots, the scratch only serves prefills, and it
    is paid for in slots. A prefill chunk staged reads the ``slots`` experts the layer
    holds from VRAM instead of host memory (in place reads every routed expert from host:
    a 512-token prompt took 580 ms in place and 318 staged at 24 layers, bench/results/
    wide-steps.md), so it saves about
    ``slots`` host reads a layer; every decoded token misses about ``top_k x cost_slots / E``
    more experts a layer with ``cost_slots`` fewer slots, if routing were uniform (real
    routing's locality changes both sides; `plan --wide` on a trace prices it exactly).
    Equal when a prompt decodes ``slots x E / (top_k x cost_slots)`` tokens.
    """
    if cost_slots <= 0:
        return 0
    return int(round(slots * num_experts / (top_k * cost_slots)))


def plan(
    model_spec: str | Path | ModelSize | None = None,
    vram_gb: float | str = 24.0,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    gpu_memory_utilization: float | None = None,
    slots: int | None = None,
    fraction: float | None = None,
    **options: Any,
) -> SizePlan:
    """Size the cache for ``model_spec`` on a card (docs/design.md, sizing): `_plan_for`'s
    plan, on the card ``vram_gb`` names (GiB, or a card by name: `cards`), with the batch
    chosen where the user left it to vLLM.

    Why the batch is chosen here: vLLM's default ``--max-num-seqs`` (256 under 70 GiB)
    makes a full decode step wider than any slot budget a small card holds, and such
    steps read through the host copies silently (the sizing trap). Where the user gave no
    ``--max-num-seqs`` and steps are served in place, the plan takes the widest batch
    whose padded decode step stays on the slots (`_choose_batch`) and says so in
    ``batch_choice``; a batch the user gave is planned as given, trap and all, for
    `serve` to refuse. Staged wide modes stage a full batch instead, so nothing is chosen.
    ``wide`` (an option of `_plan_for`) is a `Wide`; text from a library caller is parsed
    here, once, with one line on a bad name.
    """
    if "wide" in options and not isinstance(options["wide"], Wide):
        try:
            options["wide"] = Wide.parse(options["wide"])
        except ValueError as exc:
            raise UserError(f"--wide: {exc}") from None
    gib, card = cards.parse_vram(vram_gb)
    size = _plan_for(model_spec, gib, max_model_len, max_num_seqs, gpu_memory_utilization,
                     slots, fraction, **options)
    if max_num_seqs is None and size.trap:
        size = _choose_batch(size, lambda n: _plan_for(
            model_spec, gib, max_model_len, n, gpu_memory_utilization, slots, fraction,
            **options), options.get("narrowest"))
    size.card = card.describe() if card is not None else None
    return size


def _choose_batch(first: SizePlan, replan: Any, narrowest: int | None = None) -> SizePlan:
    """The plan at the widest ``--max-num-seqs`` whose decode steps stay on the slots (on
    a per-layer plan's ``narrowest`` layer, which reads through first).

    A smaller batch frees runtime memory (fewer logit rows), so the slots it allows may
    grow, and with them the batch that fits: iterate from the trap plan's safe batch while
    each re-plan allows a wider one and stays free of the trap. ``first`` is returned as
    it is when no batch of one or more sequences keeps decode on the cache.
    """
    best, seqs = None, first.safe_max_num_seqs
    while seqs > 0:
        nxt = replan(seqs)
        if nxt.verdict is not Verdict.CACHE or nxt.trap:
            break
        best = nxt
        if nxt.safe_max_num_seqs <= seqs:
            break
        seqs = nxt.safe_max_num_seqs
    if best is None:
        return first
    where = (f"the plan's narrowest layer ({narrowest} slots)"
             if narrowest and narrowest < best.slots else f"the {best.slots} slots")
    best.batch_choice = (
        f"--max-num-seqs {best.max_num_seqs}, the widest batch whose decode steps stay on "
        f"{where} (vLLM's default {first.max_num_seqs} would read through the host "
        "copies); choose another with -- --max-num-seqs N (wider is refused as the sizing "
        "trap), or --wide staged-install to stage wide batches through a VRAM scratch"
    )
    return best


def _decide(model: ModelSize, *, budget: int, slot_budget: int, kv_reserved: int,
            overhead: int, planned: int, max_slots: int, forced: bool, fits_outright: bool,
            util_fit: float | None, gpu_memory_utilization: float, moe_backend: str | None,
            notes: list[str]) -> tuple[Verdict, int, str]:
    """The verdict ladder, in one place: (verdict, slots planned, the verdict in words).

    Why one function: every rung is a decision `size`, `serve`, `plan` and `baseline` act
    on, and the order matters (a card that cannot hold the resident part fails before a
    forced budget is weighed; the kernel's refusals before the room for top_k). The budget
    terms are computed by the caller; nothing here sizes, it only decides. A note it adds
    (the kernel's slot limit) goes to ``notes``.
    """
    E, k, per_slot = model.num_experts, model.top_k, model.bytes_per_slot
    if forced and planned == E:
        fits_outright = slot_budget >= model.expert_bytes
    gib = lambda b: b / GiB  # noqa: E731

    if slot_budget < 0:
        verdict = Verdict.DOES_NOT_FIT
        text = (
            "does not fit even with offload: non-expert weights and rotary cache "
            f"{gib(model.resident_bytes):.2f}"
            f" + KV {gib(kv_reserved):.2f} + runtime {gib(overhead):.2f} GiB exceed the "
            f"{gib(budget):.2f} GiB budget"
        )
        planned = 0
    elif fits_outright and (not forced or planned == E):
        verdict, planned = Verdict.FITS_OUTRIGHT, E
        text = (
            f"fits outright: all {E} experts ({gib(model.expert_bytes):.2f} GiB) stay in VRAM "
            f"with {gib(slot_budget - model.expert_bytes):.2f} GiB to spare; no offload, no cache"
        )
    elif forced and planned * per_slot > slot_budget:
        verdict = Verdict.DOES_NOT_FIT
        text = (
            f"{planned} slots need {gib(planned * per_slot):.2f} GiB but only "
            f"{gib(slot_budget):.2f} GiB is left after non-expert weights, KV and runtime "
            f"(at most {max_slots} slots)"
        )
    elif ragged := formats.ragged_refusal(model.expert_tensors):
        verdict = Verdict.OFFLOAD_NO_CACHE
        text = f"runs only fully offloaded: {ragged}; no cache"
        planned = 0
    elif (declined := vllm_experts.declined_kernel(model.quant, moe_backend)) and not forced:
        verdict = Verdict.OFFLOAD_NO_CACHE
        text = f"runs only fully offloaded: {declined}; no cache"
        planned = 0
    elif planned < k:
        verdict = Verdict.OFFLOAD_NO_CACHE
        text = (
            f"runs only fully offloaded: room for {planned} slot{'s' * (planned != 1)}, "
            f"fewer than top_k={k}, so "
            "not even one token's experts fit; no cache"
        )
        planned = 0
    else:
        verdict = Verdict.CACHE
        if planned > rules.slot_limit(E):
            planned = rules.slot_limit(E)
            notes.append(f"the cache kernel holds at most {rules.MAX_SLOTS} slots a layer: "
                         f"planned {planned}, though more fit")
        text = f"cache at {planned} of {E} slots ({100 * planned / E:.0f}% of the experts)"
        if util_fit is not None and util_fit > gpu_memory_utilization and not forced:
            text += f"; fits outright with --gpu-memory-utilization {util_fit:g}"
    return verdict, planned, text


def _plan_for(
    model_spec: str | Path | ModelSize | None = None,
    vram_gb: float = 24.0,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    gpu_memory_utilization: float | None = None,
    slots: int | None = None,
    fraction: float | None = None,
    *,
    quant: str | None = None,
    max_num_batched_tokens: int | None = None,
    kv_cache_dtype: str = "auto",
    mamba_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
    kv_tokens: int | None = None,
    overhead_gb: float | None = None,
    graphs: capture.GraphSettings | None = None,
    device_total_gib: float | None = None,
    tensor_parallel_size: int | None = None,
    vllm_quantization: str | None = None,
    wide: Wide = Wide.IN_PLACE,
    moe_backend: str | None = None,
    kv_cache_memory_bytes: int | None = None,
    narrowest: int | None = None,
    speculative_tokens: int = 0,
    prefix_caching: bool | None = None,
    hybrid_kv_cache_manager: bool | None = None,
    block_size: int | None = None,
) -> SizePlan:
    """Size the cache for ``model_spec`` on a ``vram_gb`` GiB card, the batch as given.

    Defaults are vLLM's: ``max_model_len`` = the model's context, ``max_num_seqs`` and
    ``max_num_batched_tokens`` as `vllm serve` chooses for the card, utilisation 0.9.
    The KV reservation is ``kv_tokens`` (default ``max_model_len``: the one full-length
    sequence vLLM insists on before it starts) at the model's KV bytes per token.
    ``slots`` or ``fraction`` (of the experts) force the slot count instead of the largest
    that fits; the verdict then says whether that forced count fits.

    ``device_total_gib`` is the GPU vLLM will run on, when it is known and is not the
    card itself (``serve`` and ``baseline`` read it from the GPU): vLLM's
    ``--gpu-memory-utilization`` is a fraction of that GPU, so on a bigger one the card
    is a share of it. Then the planned utilisation (0.9 of the card by default) becomes
    ``0.9 x vram / device`` for vLLM, and a utilisation the user gave is taken as vLLM
    takes it, of the device. A GPU smaller than ``vram_gb`` is sized as what it is.
    ``graphs`` are the CUDA-graph settings (default: vLLM's, for the installed release):
    a decode batch is padded to the next capture size, and the trap counts padded ids.
    ``tensor_parallel_size``: plan one GPU of that many (`ModelSize.per_rank`); ``vram_gb``
    is then each GPU's memory, and slots and ``--cpu-offload-gb`` are per GPU, as vLLM
    takes them.
    ``wide``: staged modes (`policy.Wide`) keep a scratch of one layer's experts in VRAM
    for steps wider than the slots; it comes out of the slots' room, and a full batch
    wider than the slots is staged rather than a trap.
    ``moe_backend``: vLLM's ``--moe-backend``; where the experts kernel it leads to is one
    the plugin declines on every layer (`vllm_experts.declined_kernel`: 4-bit formats on
    FlashInfer, Humming or the emulation backends, the others on any but Triton), the
    verdict is offload without the cache, unless ``slots``/``fraction`` force one (a kernel
    trial).
    ``narrowest``: a per-layer plan's smallest budget (`serve --plan`): its layer reads
    through first, so the trap and the safe batch are judged against it.
    ``mamba_cache_dtype``, ``mamba_ssm_cache_dtype``: vLLM's flags of those names, the
    dtypes of a linear-attention model's state (`ModelSize.with_state_dtypes`).
    ``prefix_caching``: vLLM's ``--[no-]enable-prefix-caching`` (None: the installed
    vLLM's default); a hybrid model keeps a second state page a sequence with it.
    ``hybrid_kv_cache_manager``: vLLM's ``--[no-]disable-hybrid-kv-cache-manager`` as whether
    it is on (None: vLLM decides); with it off, sliding-window and chunked layers keep every
    token (`hybrid_pages.local_attention_paged`).
    ``block_size``: vLLM's ``--block-size`` (None: its kernel's, `kv_block_tokens`); one
    sequence's KV is reserved in whole blocks.
    ``kv_cache_memory_bytes``: the user's ``--kv-cache-memory-bytes``; the plan then sizes
    around that KV cache (it must hold one ``max_model_len`` sequence) instead of one
    sequence's worth, and hands vLLM nothing of its own.

    Where experts are offloaded the plan hands vLLM its KV cache size
    (``kv_cache_bytes``, passed as ``--kv-cache-memory-bytes``): vLLM otherwise derives it
    from a profile step that also compiles the model, and on a cold compile cache it counts
    the compile's temporaries as activations (vLLM issue #54122): the first start of a
    tightly planned card then got less KV than one sequence and was refused, where a
    restart served. With the size given, the profile still runs (and compiles) but no
    longer decides the KV cache.
    """
    wide_mode = wide
    _check_inputs(vram_gb=vram_gb, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, kv_tokens=kv_tokens,
                  overhead_gb=overhead_gb, gpu_memory_utilization=gpu_memory_utilization,
                  tensor_parallel_size=tensor_parallel_size, block_size=block_size)
    model = model_spec if isinstance(model_spec, ModelSize) else model_as_held(
        load_model(model_spec, quant), model_spec, quant, vllm_quantization)
    model = model.with_state_dtypes(mamba_cache_dtype, mamba_ssm_cache_dtype).per_rank(
        int(tensor_parallel_size or 1))
    unpaged = hybrid_pages.local_attention_paged(
        windows=bool(model.window_layers), chunks=bool(model.chunked_layers),
        manager=hybrid_kv_cache_manager, speculative_tokens=int(speculative_tokens or 0))
    if unpaged:
        model = model.all_full_attention()
    vram_gb, device, gpu_memory_utilization, budget, notes_device = _card_budget(
        float(vram_gb), device_total_gib, gpu_memory_utilization)
    graphs = capture.for_model(
        graphs if graphs is not None else capture.settings_from_vllm_args([]),
        model.architectures)
    forced_slots = _forced_slots(model, slots, fraction)
    d_seqs, d_batched = vllm_defaults(vram_gb)
    max_model_len = int(max_model_len if max_model_len is not None
                        else model.max_position_embeddings)
    max_num_seqs = int(max_num_seqs if max_num_seqs is not None else d_seqs)
    max_num_batched_tokens = int(max_num_batched_tokens if max_num_batched_tokens is not None
                                 else d_batched)
    kv_tokens = int(kv_tokens if kv_tokens is not None else max_model_len)
    release = installed_vllm.version()
    kv_per_tok, kv_reserved = _kv_reserve(
        model, kv_cache_dtype=kv_cache_dtype, kv_tokens=kv_tokens, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_num_batched_tokens=max_num_batched_tokens,
        speculative_tokens=max(int(speculative_tokens or 0), 0),
        prefix_caching=(prefix_caching if prefix_caching is not None
                        else hybrid_pages.prefix_caching_default(release)),
        checkpoints=hybrid_pages.prefill_checkpoints(release), block_size=block_size)
    overhead, staged_peak = _runtime_reserve(
        model, wide_mode, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, graphs=graphs, overhead_gb=overhead_gb)
    overhead, compile_note = _compile_room(model, overhead, kv_reserved,
                                           compiles=not graphs.eager)
    resident_need = model.resident_bytes + kv_reserved + overhead
    slot_budget, scratch, max_slots, fits_outright = _slot_room(
        model, wide_mode, budget - resident_need)
    util_fit = _utilization_to_fit(resident_need + model.expert_bytes, vram_gb, device)

    forced = forced_slots is not None
    planned = forced_slots if forced_slots is not None else max_slots
    notes = list(model.notes) + notes_device
    if compile_note:
        notes.append(compile_note)
    if unpaged:
        notes.append(f"{unpaged}: the model's sliding-window and chunked layers keep every "
                     "token of a sequence, reserved as full attention")
    verdict, planned, text = _decide(
        model, budget=budget, slot_budget=slot_budget, kv_reserved=kv_reserved,
        overhead=overhead, planned=planned, max_slots=max_slots, forced=forced,
        fits_outright=fits_outright, util_fit=util_fit,
        gpu_memory_utilization=gpu_memory_utilization, moe_backend=moe_backend, notes=notes)

    step = _decode_step(model, verdict, planned, narrowest=narrowest, scratch=scratch,
                        max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, graphs=graphs,
                        speculative_tokens=speculative_tokens)
    if step.trap:
        notes.append(rules.trap_text(max_num_seqs, step.widest, model.top_k, step.judged,
                                     step.safe, graphs.source, step.q - 1))
    break_even = None
    if scratch and verdict.offloads:
        cost = scratch / model.bytes_per_slot
        if verdict is Verdict.CACHE and not step.wide_batch:
            break_even = scratch_break_even(planned, model.num_experts, model.top_k, cost)
        notes.append(_scratch_note(
            model, wide_mode, verdict, scratch=scratch, cost=cost, planned=planned, step=step,
            break_even=break_even,
            staged_peak=bool(staged_peak and overhead_gb is None)))
    # a long context's KV that takes a tenth of the card, or more than the card has: what
    # the common 8,192 tokens would leave
    if ((verdict.offloads or verdict is Verdict.DOES_NOT_FIT) and not forced
            and max_model_len > 8192 and kv_tokens == max_model_len
            and kv_reserved > budget // 10):
        short = _plan_for(model, vram_gb, 8192, max_num_seqs, gpu_memory_utilization,
                     max_num_batched_tokens=max_num_batched_tokens,
                     kv_cache_dtype=kv_cache_dtype, overhead_gb=overhead_gb, graphs=graphs,
                     device_total_gib=device, wide=wide_mode,
                     speculative_tokens=speculative_tokens, prefix_caching=prefix_caching,
                     hybrid_kv_cache_manager=hybrid_kv_cache_manager, block_size=block_size)
        if short.max_slots > max_slots or short.verdict != verdict:
            notes.append(
                f"KV for one {max_model_len}-token sequence takes {kv_reserved / GiB:.2f} GiB; "
                f"{SHORT_CONTEXT} leaves room for {short.max_slots} slots: "
                f"{short.verdict_text}"
            )
    offload = math.ceil(model.expert_bytes / GiB + 0.5) if verdict.offloads else 0
    kv_handed = _kv_handed(verdict, kv_reserved=kv_reserved, slot_budget=slot_budget,
                           planned=planned, per_slot=model.bytes_per_slot, scratch=scratch,
                           given=kv_cache_memory_bytes is not None)
    # (a --moe-backend that cannot offload this format is refused here, in one line)
    offload_args, backend_note = vllm_experts.offload_backend_args(
        model.quant, ["--moe-backend", moe_backend] if moe_backend else [], None,
        humming=vllm_experts.humming_ranked_first(),
        cached=verdict is Verdict.CACHE) if offload else ([], None)
    if backend_note:
        notes.append(backend_note)
    return SizePlan(
        speculative_tokens=step.q - 1,
        model=model.name,
        quant=model.quant,
        num_experts=model.num_experts,
        top_k=model.top_k,
        num_moe_layers=model.num_moe_layers,
        bytes_per_expert=model.bytes_per_expert,
        bytes_per_slot=model.bytes_per_slot,
        expert_bytes=model.expert_bytes,
        non_expert_bytes=model.non_expert_bytes,
        rope_cache_bytes=model.rope_cache_bytes,
        kv_bytes_per_token=kv_per_tok,
        vram_gib=float(vram_gb),
        gpu_memory_utilization=float(gpu_memory_utilization),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_reserved_bytes=kv_reserved,
        overhead_bytes=overhead,
        budget_bytes=budget,
        slot_budget_bytes=slot_budget,
        max_slots=max_slots,
        slots=planned,
        fits_outright=verdict is Verdict.FITS_OUTRIGHT,
        verdict=verdict,
        verdict_text=text,
        cpu_offload_gb=offload,
        offload_args=offload_args,
        trap=step.trap,
        trap_ids=step.trap_ids,
        safe_max_num_seqs=step.safe,
        padded_batch=step.widest,
        graphs=graphs.source,
        device_total_gib=device,
        tensor_parallel_size=model.tensor_parallel,
        utilization_to_fit_outright=util_fit,
        aligned=model.aligned,
        notes=notes,
        wide=wide_mode,
        scratch_bytes=scratch,
        scratch_break_even_tokens=break_even,
        kv_cache_bytes=int(kv_handed),
        kv_given=kv_cache_memory_bytes is not None,
    )


def _forced_slots(model: ModelSize, slots: int | None, fraction: float | None) -> int | None:
    """The slot count ``--slots`` or ``--fraction`` forces (None: the largest that fits),
    checked against the expert count and the kernel's slot rule (`rules.check_slots`)."""
    if slots is not None and fraction is not None:
        raise UserError("give --slots or --fraction, not both")
    if fraction is not None:
        try:
            rules.check_fraction(fraction)
        except ValueError as exc:
            raise UserError(f"--fraction: {exc}") from None
    if slots is not None and not 0 <= slots <= model.num_experts:
        raise UserError(f"--slots must be between 0 and {model.num_experts} (the expert count)")
    if slots is not None and slots < model.num_experts:  # (all of them: no cache, checked)
        try:
            rules.check_slots(slots, model.num_experts)
        except ValueError as exc:
            raise UserError(f"--slots {exc}") from None
    if fraction is not None:
        return rules.slots_from_fraction(fraction, model.num_experts)
    return None if slots is None else int(slots)


#: KV bytes per element against the model's dtype, per ``--kv-cache-dtype``
KV_DTYPE_SCALE: dict[str, float] = {"auto": 1.0, "bfloat16": 1.0, "float16": 1.0, "fp8": 0.5,
                                    "fp8_e4m3": 0.5, "fp8_e5m2": 0.5}


#: vLLM's KV block on NVIDIA GPUs (tokens), where no hybrid state widens it
KV_BLOCK_TOKENS = hybrid_pages.GPU_BLOCK_ALIGN
#: the largest block an MLA kernel of vLLM's takes (0.26-0.33: CUTLASS MLA on Blackwell; FlashMLA's
#: 64 on Hopper divides it), where GQA models page in vLLM's default 16-token blocks
MLA_KV_BLOCK_TOKENS = 128
#: batches vLLM keeps in flight (async scheduling, on by default): a sliding window's
#: blocks are freed only once the tokens scheduled past it are processed
IN_FLIGHT_BATCHES = 2


def window_reserve(model: ModelSize, *, kv_scale: float, max_model_len: int,
                   max_num_batched_tokens: int, block: int = KV_BLOCK_TOKENS,
                   in_flight_batches: int = IN_FLIGHT_BATCHES) -> int:
    """The KV vLLM holds for one sequence in a model's sliding-window layers: the window
    less one token, plus every token in flight (``in_flight_batches`` x
    ``max_num_batched_tokens``), at most the context, in whole blocks and one more (the
    window need not start at a block's edge): vLLM's ``SlidingWindowSpec`` in 0.26-0.33.
    Far more than the window itself once batches are wide: gpt-oss's 128-token window at
    2,048 batched tokens holds 4,240 tokens a layer."""
    held = min(model.sliding_window - 1 + in_flight_batches * max_num_batched_tokens,
               max_model_len)
    return _local_reserve(model.window_layers, model.sliding_window,
                          model.kv_window_bytes_per_seq, held, kv_scale=kv_scale, block=block,
                          spare_blocks=1)


def chunk_reserve(model: ModelSize, *, kv_scale: float, max_model_len: int,
                  max_num_batched_tokens: int, block: int = KV_BLOCK_TOKENS,
                  in_flight_batches: int = IN_FLIGHT_BATCHES) -> int:
    """The KV vLLM holds for one sequence in a model's chunked local-attention layers: the
    chunk plus every token in flight, at most the context, in whole blocks (vLLM's
    ``ChunkedLocalAttentionSpec`` in 0.26-0.33; a chunk starts at a multiple of its
    size, so no extra block). Llama 4 Scout's 36 chunked layers at 131,072 tokens of
    context hold 8,192 + 2 x 2,048 tokens each, not 131,072."""
    held = min(model.attention_chunk + in_flight_batches * max_num_batched_tokens,
               max_model_len)
    return _local_reserve(model.chunked_layers, model.attention_chunk,
                          model.kv_chunk_bytes_per_seq, held, kv_scale=kv_scale, block=block,
                          spare_blocks=0)


def _local_reserve(layers: int, span: int, span_kv: int, held: int, *, kv_scale: float,
                   block: int, spare_blocks: int) -> int:
    """``layers`` local-attention layers (``span_kv`` bytes for their ``span`` tokens, in
    the model's dtype) each holding ``held`` tokens in whole blocks, and ``spare_blocks``
    more: what `window_reserve` and `chunk_reserve` share."""
    if not layers or not span:
        return 0
    layer_token = ceil_div(span_kv, layers * span)
    return layers * int(layer_token * kv_scale) * block * (ceil_div(held, block) + spare_blocks)


def kv_block_tokens(model: ModelSize, block_size: int | None = None) -> int:
    """The tokens of one KV block vLLM pages ``model`` in: the user's ``--block-size``,
    else what its attention kernel takes (vLLM's ``get_preferred_block_size``): 16 for
    GQA, up to `MLA_KV_BLOCK_TOKENS` for latent attention."""
    if block_size:
        return int(block_size)
    return MLA_KV_BLOCK_TOKENS if model.kv_kind.startswith("MLA") else KV_BLOCK_TOKENS


def _kv_reserve(model: ModelSize, *, kv_cache_dtype: str, kv_tokens: int, max_model_len: int,
                max_num_seqs: int, kv_cache_memory_bytes: int | None,
                max_num_batched_tokens: int,
                speculative_tokens: int = 0, prefix_caching: bool = False,
                checkpoints: bool = False, block_size: int | None = None) -> tuple[int, int]:
    """(KV bytes a token, the KV the plan reserves): ``kv_tokens`` of KV in whole blocks
    (vLLM checks a start against ``max_model_len`` rounded up to its block) plus the
    sliding windows and chunks of the sequences they make; for a hybrid linear-attention
    model, the pages vLLM holds its KV and state in (`hybrid_pages.LinearState.reserve`);
    or the user's ``--kv-cache-memory-bytes``, which must hold one ``max_model_len``
    sequence or vLLM refuses to start."""
    kv_scale = KV_DTYPE_SCALE.get(kv_cache_dtype.lower())
    if kv_scale is None:
        raise UserError(f"--kv-cache-dtype {kv_cache_dtype!r}: not one the plan can size "
                        f"the KV cache for ({', '.join(KV_DTYPE_SCALE)})")
    kv_per_tok = int(model.kv_bytes_per_token * kv_scale)
    seqs_for_window = max(1, min(max_num_seqs, kv_tokens // max(1, max_model_len)))
    block = kv_block_tokens(model, block_size)
    local = {"kv_scale": kv_scale, "max_model_len": max_model_len,
             "max_num_batched_tokens": max_num_batched_tokens, "block": block}
    window = window_reserve(model, **local) + chunk_reserve(model, **local)
    hybrid = model.linear_state

    def reserve(tokens: int, seqs: int) -> int:
        if hybrid is None:
            return (ceil_div(tokens, block) * block * kv_per_tok
                    + (window + model.state_bytes_per_seq) * seqs)
        return window * seqs + hybrid.reserve(
            tokens, seqs, kv_scale=kv_scale, speculative_tokens=speculative_tokens,
            prefix_caching=prefix_caching, checkpoints=checkpoints)

    kv_reserved = reserve(kv_tokens, seqs_for_window)
    if kv_cache_memory_bytes is not None:
        one_seq = reserve(max_model_len, 1)
        if kv_cache_memory_bytes < one_seq:
            raise UserError(
                f"--kv-cache-memory-bytes {kv_cache_memory_bytes:,} cannot hold one "
                f"--max-model-len {max_model_len} sequence ({one_seq:,} B): vLLM would refuse "
                "to start; give more, or a shorter --max-model-len")
        kv_reserved = int(kv_cache_memory_bytes)
    return kv_per_tok, kv_reserved


def _runtime_reserve(model: ModelSize, wide: Wide, *, max_num_seqs: int,
                     max_num_batched_tokens: int, graphs: capture.GraphSettings,
                     overhead_gb: float | None) -> tuple[int, int]:
    """(the runtime's bytes, of which the staged warm-restart peak): ``overhead_gb`` where
    given, else `runtime_overhead_bytes` at the captured sizes plus the staged peak past
    `STAGED_PEAK_FREE_TOKENS` batched tokens."""
    staged_peak = (int(STAGED_WARM_PEAK_GIB * GiB) if wide is not Wide.IN_PLACE
                   and max_num_batched_tokens > STAGED_PEAK_FREE_TOKENS else 0)
    if overhead_gb is not None:
        return int(overhead_gb * GiB), staged_peak
    # the sizes vLLM records as captured (from 0.34: prefill and decode graphs together)
    sizes = len(capture.graph_sizes(max_num_seqs, max_num_batched_tokens, graphs))
    return (runtime_overhead_bytes(model, max_num_seqs, max_num_batched_tokens, sizes)
            + staged_peak, staged_peak)


def _compile_room(model: ModelSize, overhead: int, kv_reserved: int,
                  compiles: bool = True) -> tuple[int, str | None]:
    """(the runtime reserve, a note where it grew) so that a first start's compile has
    room for a second copy of the rotary caches (``compiles`` False: ``--enforce-eager``,
    under which vLLM runs no torch.compile).

    Inductor's combo-kernel benchmark (on in vLLM 0.26-0.33 wherever torch.compile runs)
    allocates random copies of the inputs of the kernel it times, the rope kernel's whole
    cos/sin cache among them, while vLLM compiles, before it allocates the KV cache. What
    is free then is the KV reserve and the runtime reserve, so the runtime reserve covers
    what the KV reserve does not. Only a cache of gigabytes (Llama 4's 10M positions)
    comes near it; elsewhere this changes nothing.
    """
    need = model.rope_cache_bytes - kv_reserved
    if not compiles or need <= overhead:
        return overhead, None
    return need, (f"vLLM's rotary cache takes {model.rope_cache_bytes / GiB:.2f} GiB "
                  f"({model.max_position_embeddings:,} positions), and a first start's "
                  "compile briefly holds a second copy before the KV cache is allocated: "
                  f"the runtime reserve is {need / GiB:.2f} GiB to leave room for it")


def _slot_room(model: ModelSize, wide: Wide, room: int) -> tuple[int, int, int, bool]:
    """(the slots' budget, the scratch, the most slots it holds, whether every expert fits)
    from ``room``, what the card leaves past weights, KV and runtime. The scratch of a
    staged mode comes out of the slots' room, except where no expert is offloaded."""
    from ..device.scratch import scratch_bytes

    fits_outright = room >= model.expert_bytes
    scratch = (0 if wide is Wide.IN_PLACE or fits_outright
               else scratch_bytes(model.num_experts, model.bytes_per_expert))
    slot_budget = room - scratch
    max_slots = (max(0, min(model.num_experts, slot_budget // model.bytes_per_slot))
                 if slot_budget > 0 else 0)
    return slot_budget, scratch, max_slots, fits_outright


def _utilization_to_fit(need: int, vram_gb: float, device: float) -> float | None:
    """The ``--gpu-memory-utilization`` at which ``need`` bytes fit outright (None: more
    than 0.99 of the card), in vLLM's terms: a fraction of the GPU it runs on."""
    need_card = need / (vram_gb * GiB)
    if need_card > 0.99:
        return None
    return (math.ceil(need_card * vram_gb / device * 1e4) / 1e4 if device > vram_gb
            else round(math.ceil(need_card * 100) / 100, 2))


@dataclass(frozen=True)
class _DecodeStep:
    """A full decode step against the slots: its padded width, ids and the verdict on it."""

    q: int  # tokens a sequence in one step (1 + speculative tokens)
    widest: int  # the full batch, padded to its CUDA graph
    trap_ids: int
    judged: int  # the slots it must fit (a per-layer plan's narrowest)
    wide_batch: bool  # wider than the slots
    trap: bool  # wider, and no scratch to stage it
    safe: int  # the widest --max-num-seqs that stays on the slots


def _decode_step(model: ModelSize, verdict: Verdict, planned: int, *, narrowest: int | None,
                 scratch: int, max_num_seqs: int, max_num_batched_tokens: int,
                 graphs: capture.GraphSettings, speculative_tokens: int) -> _DecodeStep:
    """The sizing trap's terms: a full batch wider than the slots is staged through the
    scratch, else it reads through the host (the trap); speculative decoding's verify step
    carries every sequence's draft tokens."""
    q = 1 + max(int(speculative_tokens or 0), 0)
    widest = capture.padded_batch(max_num_seqs, max_num_batched_tokens, graphs, q)
    trap_ids = widest * model.top_k
    judged = min(planned, narrowest) if narrowest else planned
    wide_batch = verdict is Verdict.CACHE and trap_ids > judged
    safe = (capture.safe_max_num_seqs(judged, model.top_k, max_num_batched_tokens, graphs, q)
            if verdict is Verdict.CACHE else 0)
    return _DecodeStep(q, widest, trap_ids, judged, wide_batch, wide_batch and not scratch,
                       safe)


def _scratch_note(model: ModelSize, wide: Wide, verdict: Verdict, *, scratch: int,
                  cost: float, planned: int, step: _DecodeStep, break_even: int | None,
                  staged_peak: bool) -> str:
    """What the staged scratch (``cost`` slots a layer) costs and buys, in one note."""
    return (
        f"wide steps {wide.value}: the scratch (one layer's {model.num_experts} experts, "
        f"{scratch / GiB:.2f} GiB) costs {cost:.1f} slots a layer"
        + (f"; a full batch ({step.trap_ids} ids > {planned} slots) is staged through it"
           if step.wide_batch else "")
        + ("; it leaves fewer than top_k slots: it costs more than it saves, serve in "
           "place instead" if verdict is Verdict.OFFLOAD_NO_CACHE else "")
        + (f"; with every decode batch narrow it saves only prefills: under uniform "
           f"routing it pays while requests decode fewer than ~{break_even:,} tokens a "
           "prompt, and costs more than it saves past that"
           if break_even is not None else "")
        + ("; `plan --wide` prices the trade on your trace"
           if verdict is Verdict.CACHE else "")
        + (f"; the runtime estimate includes the {STAGED_WARM_PEAK_GIB:.2f} GiB a staged "
           f"server's profile step peaked above it at more than "
           f"{STAGED_PEAK_FREE_TOKENS:,} batched tokens (measured, not modelled)"
           if staged_peak else ""))


def _kv_handed(verdict: Verdict, *, kv_reserved: int, slot_budget: int, planned: int,
               per_slot: int, scratch: int, given: bool) -> int:
    """The KV cache vLLM is handed (``--kv-cache-memory-bytes``): the reserve plus what
    whole slots leave of their room (and the scratch, where no cache allocates it); the
    user's own size as given; nothing where no expert is offloaded."""
    if given:
        return kv_reserved
    if verdict is Verdict.CACHE:
        return kv_reserved + slot_budget - planned * per_slot
    if verdict is Verdict.OFFLOAD_NO_CACHE:
        return kv_reserved + slot_budget + scratch
    return 0


#: Cards the no-``--vram`` table shows, by name (`cards.CARDS`): 16 to 141 GB as sold.
COMMON_CARDS: list[str] = ["rtx-4080", "l4", "rtx-4090", "rtx-5090", "a100-40", "l40s",
                           "a6000", "a100-80", "h200"]
