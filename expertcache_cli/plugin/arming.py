"""Which MoE layers get a slot cache, decided from the layer objects alone.

The decision is kept apart from the CUDA work for two reasons. It is where correctness
is won or lost (a per-expert tensor left pointing at full storage means wrong tokens,
silently), so it must be readable and tested; and it must run in CI, where there is no
torch. So this module only reads attributes (``shape``, ``dtype``, ``is_contiguous()``,
``element_size()``, the offloader's ``_vllm_is_uva_offloaded`` flag) and works on vLLM's
real `RoutedExperts` as well as on the stand-ins the tests build.

The rules, in order (the first that applies decides):

1. expert parallelism (an expert map, or ``use_ep``): declined, the local ids are not
   the global ids the cache would be indexed by;
   MoE LoRA (adapter tensors indexed by expert id outside the layer): declined too;
2. a monolithic quant method (routing inside the kernel): declined, there are no ids to
   remap;
3. no modular kernel, or an experts kernel not known to index weights purely by id:
   declined; vLLM's Marlin experts only in a layout read from 0.26 or 0.33 (`marlin`);
4. per-expert tensors are the layer's parameters with leading dimension ``E`` (vLLM's
   own EPLB notion, minus its routing-state exceptions); an unknown per-expert buffer,
   or a per-expert tensor held by the quant method or the kernel object instead of the
   layer, is declined (it could not be rebound);
5. none of them offloaded: not armed (skipped, nothing to gain);
6. offloaded without UVA (parameters on the CPU device): declined, vLLM copies them in
   per forward through ``functional_call`` and no pointer is stable;
7. the budget must be below ``E``; every slab contiguous; a slab that is not a multiple
   of 16 bytes (NVFP4's per-expert global scales) travels in the layer's packed side row
   (`small`), up to `formats.SIDE_ROW_LIMIT` an expert, and is declined past that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from math import prod
from typing import Any

from ..config import CacheConfig
from ..sizing.formats import SIDE_ROW_LIMIT, side_row_bytes
from . import marlin
from .compat import KNOWN_EXPERTS, LOAD_ONLY_TENSORS, NON_EXPERT_TENSORS, TRITON_WEIGHT_VIEWS
from .small import spreadable

ARM, SKIP, DECLINE = "arm", "skip", "decline"


@dataclass(frozen=True)
class TensorSpec:
    """One per-expert tensor to mirror: its per-expert shape and dtype, as `SlotCache` takes."""

    name: str
    shape: tuple[int, ...]
    dtype: Any
    bytes_per_expert: int
    offloaded: bool


@dataclass
class Decision:
    """What happens to one MoE layer, and why (the reason is logged verbatim)."""

    layer_name: str
    action: str
    reason: str = ""
    num_experts: int = 0
    num_slots: int = 0
    top_k: int = 0
    specs: list[TensorSpec] = field(default_factory=list)
    #: (owner, attribute, parameter): a kernel or quant-method attribute that is the very
    #: tensor of a mirrored layer parameter (bound at kernel creation, e.g. Marlin's
    #: ``w13_g_idx``), rebound to that parameter's slots with it; owner is "experts" or
    #: "quant_method"
    aliases: list[tuple[str, str, str]] = field(default_factory=list)
    #: per-expert tensors whose slab is not a multiple of 16 bytes: moved in the layer's
    #: packed side row (`small.SmallTensors`), not gathered one by one
    small: list[TensorSpec] = field(default_factory=list)
    #: the experts kernel's class name, and for Marlin the vLLM layout it has ("0.26",
    #: "0.33"; `marlin.layout`)
    kernel: str = ""
    layout: str = ""

    @property
    def armed(self) -> bool:
        return self.action == ARM

    @property
    def marlin(self) -> bool:
        """Served with expert-space ids and a remapped block list (`marlin`)."""
        return self.kernel == marlin.MARLIN_EXPERTS

    @property
    def small_row_bytes(self) -> int:
        """Bytes of the packed side row of one expert (0 without small tensors)."""
        return side_row_bytes([s.bytes_per_expert for s in self.small])

    @property
    def bytes_per_slot(self) -> int:
        """VRAM one slot takes: one expert's every mirrored tensor (small ones twice: in
        the packed row and in the compact copy the kernel reads)."""
        small = self.small_row_bytes + sum(s.bytes_per_expert for s in self.small)
        return sum(s.bytes_per_expert for s in self.specs) + small

    @property
    def fixed_bytes(self) -> int:
        """VRAM of the layer's cache whatever its slots: the small tensors' device rows and
        copies of every expert (a few KiB)."""
        if not self.small:
            return 0
        per = self.small_row_bytes + sum(s.bytes_per_expert for s in self.small)
        return self.num_experts * per

    @property
    def slot_bytes(self) -> int:
        """VRAM the slots of this layer take."""
        return self.num_slots * self.bytes_per_slot + self.fixed_bytes


def is_tensor(obj: Any) -> bool:
    """Duck-typed: a torch tensor (or a test stand-in) without importing torch."""
    return (
        hasattr(obj, "shape")
        and hasattr(obj, "dtype")
        and callable(getattr(obj, "data_ptr", None))
    )


def _leading(t: Any) -> int | None:
    shape = tuple(t.shape)
    return int(shape[0]) if len(shape) >= 1 else None


def is_empty(t: Any) -> bool:
    """A tensor with no elements ([E, 0]: e.g. Marlin's g_idx without act order): nothing
    to mirror and nothing a kernel can read by expert id."""
    return any(int(d) == 0 for d in tuple(t.shape))


def _per_expert_attrs(obj: Any, num_experts: int) -> list[str]:
    """Tensor attributes of a plain object (quant method, kernel) with leading dim E."""
    found = []
    for key, value in vars(obj).items() if hasattr(obj, "__dict__") else []:
        if key in ("_parameters", "_buffers", "_modules"):
            # an nn.Module's registries: handled as parameters/buffers of that module
            for sub_name, sub in (value or {}).items():
                if is_tensor(sub) and _leading(sub) == num_experts:
                    found.append(sub_name)
            continue
        if is_tensor(value) and _leading(value) == num_experts and not is_empty(value):
            found.append(key)
    return found


def _named(layer: Any, what: str) -> Iterable[tuple[str, Any]]:
    fn = getattr(layer, what, None)
    if fn is None:
        return []
    return list(fn(recurse=False))


def describe_dtype(dtype: Any) -> str:
    text = str(dtype)
    return text.removeprefix("torch.")


#: the methods through which routing ids reach the experts; a subclass of vLLM's
#: `RoutedExperts` that overrides one sees the ids the plugin hands the stock method
ROUTING_HOOKS = ("forward_modular",)


def routing_override(layer: Any) -> str | None:
    """Why a layer whose class changes how routing ids reach its experts cannot be armed,
    or None. vLLM 0.33's `SubstitutedRoutedExperts` (MoNE checkpoints) overrides
    ``forward_modular`` to remap logical ids to physical rows in place: under the plugin
    it would remap slot ids (wrong experts, and an index past the slots). Any subclass
    between the layer's class and `RoutedExperts` that defines a routing hook, an
    ``expert_substitution`` on the layer, or a hook already replaced on the instance, is
    declined before any call."""
    mro = type(layer).__mro__
    base = next((i for i, c in enumerate(mro) if c.__name__ == "RoutedExperts"), None)
    for cls in mro[:base] if base is not None else ():
        for hook in ROUTING_HOOKS:
            if hook in vars(cls):
                return (f"{cls.__name__} overrides {hook}, which changes how routing ids "
                        "reach the experts (the cache would hand it slot ids): served on "
                        "the stock path")
    if getattr(layer, "expert_substitution", None) is not None:
        return ("the layer substitutes experts (expert_substitution: logical ids remapped "
                "to physical rows), which the cache's slot ids would bypass: served on the "
                "stock path")
    own = getattr(layer, "__dict__", {})
    for hook in ROUTING_HOOKS:
        if hook in own:
            return (f"{hook} is already replaced on this layer (another plugin?): served on "
                    "the stock path")
    return None


def plan_layer(layer: Any, cfg: CacheConfig, name: str | None = None,
               index: int | None = None) -> Decision:
    """Decide for one vLLM `RoutedExperts` (or stand-in), the ``index``-th MoE layer of the
    model (per-layer budgets are looked up by it); never raises on odd layers."""
    lname = name or getattr(layer, "layer_name", None) or type(layer).__name__
    try:
        return _plan(layer, cfg, lname, index)
    except Exception as exc:  # an unknown layout must decline, never crash serving
        why = f"unrecognised layer layout ({exc.__class__.__name__}: {exc})"
        return Decision(lname, DECLINE, why)


def _plan(layer: Any, cfg: CacheConfig, lname: str, index: int | None = None) -> Decision:
    num_experts = int(getattr(layer, "local_num_experts", 0) or 0)
    global_experts = int(getattr(layer, "global_num_experts", num_experts) or 0)
    top_k = int(getattr(layer, "top_k", 0) or 0)

    def decline(reason: str) -> Decision:
        return Decision(lname, DECLINE, reason, num_experts, 0, top_k)

    if num_experts <= 0:
        return decline("no expert count on the layer (unknown layout)")
    override = routing_override(layer)
    if override:
        return decline(override)
    moe_config = getattr(layer, "moe_config", None)
    parallel = getattr(moe_config, "moe_parallel_config", None)
    if getattr(layer, "expert_map", None) is not None or getattr(parallel, "use_ep", False):
        return decline("expert parallelism: local expert ids are not the global ids")
    if getattr(moe_config, "is_lora_enabled", False):
        return decline("LoRA on the experts: adapter weights are indexed by expert id elsewhere")
    if global_experts != num_experts:
        return decline(f"{num_experts} local of {global_experts} global experts (sharded experts)")

    qm = getattr(layer, "quant_method", None)
    if qm is None:
        return decline("no quant method on the layer (unknown layout)")
    qm_name = type(qm).__name__
    params = dict(_named(layer, "named_parameters"))
    # by identity, not name: Marlin WNA16 and AWQ alias ``w13_weight`` to ``w13_qweight``
    # (one Parameter, two names), which named_parameters lists once, under the first
    outside = {n: t for n in ("w13_weight", "w2_weight")
               if (t := getattr(layer, n, None)) is not None
               and not any(t is p for p in params.values())}
    if outside:  # said first: it is about memory, whatever the cache could do
        kind = type(next(iter(outside.values()))).__name__
        return decline(
            f"{qm_name} holds the experts ({', '.join(outside)}: {kind}) outside the layer's "
            "parameters, where vLLM's offloader cannot move them: they are in VRAM whatever "
            "--cpu-offload-gb says (MXFP4 on triton_kernels; --moe-backend marlin keeps "
            "them on the host)")
    # vLLM 0.34's triton_kernels paths (MXFP4, online MXFP4, Quark) keep the swizzled
    # experts in the Parameters' storage but hand the kernel ``layer.w13_weight_triton``
    # (``oracle.mxfp4.triton_weight``): a view that rebinding the Parameters never reaches
    views = [n for n in TRITON_WEIGHT_VIEWS if getattr(layer, n, None) is not None]
    if views:
        return decline(
            f"{qm_name} hands its experts kernel {', '.join(views)} (triton_kernels views "
            "of the weights) instead of the layer's parameters: slot buffers would not "
            "reach it (MXFP4 on triton_kernels; --moe-backend marlin is armed)")
    if getattr(qm, "is_monolithic", False):
        return decline(f"{qm_name} routes inside the kernel (monolithic): no ids to remap"
                       f"{_backend_hint(qm_name, '')}")
    kernel = getattr(qm, "moe_kernel", None)
    if kernel is None:
        return decline(f"{qm_name} has no modular kernel (moe_kernel is None)")
    experts = getattr(kernel, "fused_experts", None)
    experts_name = type(experts).__name__
    if experts is None or experts_name not in KNOWN_EXPERTS:
        return decline(
            f"experts kernel {experts_name} is not known to index weights by id only "
            f"(known: {', '.join(sorted(KNOWN_EXPERTS))}){_backend_hint(qm_name, experts_name)}"
        )
    if not hasattr(experts, "quant_config"):
        return decline(f"{experts_name} has no quant_config attribute (unknown layout)")
    layout = ""
    if experts_name == marlin.MARLIN_EXPERTS:
        from ..config import marlin_from_env
        from ..vllm_facts.vllm_experts import marlin_declined

        fmt = marlin.format_of(qm_name)
        if not marlin_from_env(quant=fmt):
            return decline(f"{experts_name}: " + marlin_declined(
                f"{qm_name}'s experts", fmt))
        found, why = marlin.layout(experts)
        if found is None:
            return decline(why)
        layout = found

    # Rule 4: the per-expert tensors, and nothing per-expert we could not rebind.
    specs_src: list[tuple[str, Any]] = []
    for pname, p in params.items():
        if (pname in NON_EXPERT_TENSORS or pname in LOAD_ONLY_TENSORS or p is None
                or getattr(p, "retired", False)):  # 0.34: kept as loaded, read by no kernel
            continue
        if _leading(p) == num_experts and not is_empty(p):
            specs_src.append((pname, p))
    for bname, b in _named(layer, "named_buffers"):
        if bname in NON_EXPERT_TENSORS or b is None:
            continue
        if _leading(b) == num_experts and not is_empty(b):
            return decline(f"per-expert buffer {bname} of an unknown role")
    by_ptr = {(p.data_ptr(), tuple(p.shape)): pname for pname, p in specs_src}
    aliases: list[tuple[str, str, str]] = []
    for owner, role, label in ((qm, "quant_method", qm_name), (experts, "experts", experts_name)):
        held = []
        for attr in _per_expert_attrs(owner, num_experts):
            t = getattr(owner, attr, None)
            pname = by_ptr.get((t.data_ptr(), tuple(t.shape))) if is_tensor(t) else None
            if pname is None:
                held.append(attr)
            else:
                aliases.append((role, attr, pname))
        if held:
            return decline(
                f"{label} holds per-expert tensor(s) {', '.join(held)} outside the layer"
            )
    if not specs_src:
        return decline("no per-expert parameters found (unknown layout)")

    # Rule 5/6: where the weights live.
    # (the UVA offloader leaves its tensors on the accelerator device, flagged)
    on_cpu = [
        n for n, p in specs_src
        if getattr(getattr(p, "device", None), "type", "") == "cpu"
        and not getattr(p, "_vllm_is_uva_offloaded", False)
    ]
    if on_cpu:
        return decline(
            f"{', '.join(on_cpu)} offloaded without UVA (copied in per forward): "
            "unset VLLM_WEIGHT_OFFLOADING_DISABLE_UVA"
        )
    offloaded = {n for n, p in specs_src if getattr(p, "_vllm_is_uva_offloaded", False)}
    if not offloaded:
        why = "experts resident on the GPU (nothing to gain)"
        return Decision(lname, SKIP, why, num_experts, 0, top_k)

    # Rule 7: budget and slabs.
    try:
        slots = cfg.slots_for(num_experts, index)
    except ValueError as exc:
        return decline(str(exc))
    specs: list[TensorSpec] = []
    small: list[TensorSpec] = []
    for pname, p in specs_src:
        if not p.is_contiguous():
            return decline(f"{pname} is not contiguous")
        per_shape = tuple(int(d) for d in tuple(p.shape)[1:])
        nbytes = prod(per_shape) * int(p.element_size())
        spec = TensorSpec(pname, per_shape, p.dtype, nbytes, pname in offloaded)
        (small if nbytes % 16 else specs).append(spec)
    ragged = sum(s.bytes_per_expert for s in small)
    if ragged > SIDE_ROW_LIMIT:
        names = ", ".join(f"{s.name} ({s.bytes_per_expert} B)" for s in small)
        return decline(
            f"{names}: {ragged} bytes per expert in slabs that are not multiples of 16 "
            f"(ragged), more than the {SIDE_ROW_LIMIT} the packed side row carries")
    if not specs:
        return decline("every per-expert tensor is a ragged slab (unknown layout)")
    return Decision(lname, ARM, "", num_experts, slots, top_k, specs, aliases, small,
                    experts_name, layout)


def _backend_hint(qm_name: str, experts_name: str) -> str:
    """How to run a declined layer on a kernel the cache arms: the ``--moe-backend`` that
    `serve` passes (vLLM picks others on some GPUs: `vllm_experts`' module docstring)."""
    if experts_name.startswith("Humming"):
        return ("; vLLM 0.32+ runs 4-bit experts on Humming on Hopper unless told "
                "--moe-backend marlin, which the cache arms (expertcache serve passes it)")
    backend = "marlin" if marlin.format_of(qm_name) else "triton"
    return (f"; --moe-backend {backend} runs it on a kernel the cache arms (expertcache "
            "serve passes it)")


def summary_line(
    decisions: list[Decision], cfg: CacheConfig, vllm_version: str, max_num_seqs: int | None = None,
    scratch_bytes: int = 0,
    spec_tokens: int = 0,
    decode_rows: Callable[[int], int] | None = None,
) -> str:
    """The one startup line: what is armed, on how many layers, budget, policy, tensors.

    ``decode_rows``: requests -> the rows vLLM runs a decode step of them at (CUDA-graph
    padding included: `plugin._decode_rows`, from vLLM's resolved grids); that padded
    width is what the shape gate compares with the slots, so the TRAP counts it. None:
    eager, ``n x (1 + spec_tokens)`` rows.
    """
    armed = [d for d in decisions if d.armed]
    skipped = [d for d in decisions if d.action == SKIP]
    declined = [d for d in decisions if d.action == DECLINE]
    policy = cfg.policy.name.lower() + (f" decay={cfg.decay}" if cfg.decay else "")
    head = f"expertcache: vLLM {vllm_version}: "
    if not armed:
        why = "; ".join(sorted({d.reason for d in declined + skipped})) or "no MoE layers found"
        return head + f"armed 0 of {len(decisions)} MoE layers ({why}); serving on the stock path"
    first = armed[0]
    gib = sum(d.slot_bytes for d in armed) / 2**30
    # packed: in the side row; spread: its words written into the compact copies the
    # kernel reads by the gather itself, else copied there after every step (`small`)
    packed = ", packed" + (", spread" if cfg.spread and spreadable(
        [s.bytes_per_expert for s in first.small]) else ", unpacked a step")
    tensors = ", ".join(
        f"{s.name}[{describe_dtype(s.dtype)} {'x'.join(map(str, s.shape)) or '1'}"
        f"{packed if s in first.small else ''}]"
        for s in first.specs + first.small
    )
    counts = [d.num_slots for d in armed]
    if len(set(counts)) == 1:
        budget = f"{first.num_slots} of {first.num_experts} experts/layer as slots"
    else:
        budget = (f"{min(counts)}-{max(counts)} of {first.num_experts} experts/layer as slots "
                  f"(per layer: {','.join(map(str, counts))})")
    parts = [
        f"armed {len(armed)} of {len(decisions)} MoE layers",
        f"{budget} [{cfg.budget_text()}]",
        f"{gib:.2f} GiB of slots",
        f"policy {policy}",
        f"mirrored {tensors}",
    ]
    if first.marlin:
        parts.append(f"experts kernel {first.kernel} (vLLM {first.layout} layout, blocks "
                     "kept in expert order)")
    from ..rules.policy import Wide

    staged = cfg.wide is not Wide.IN_PLACE
    if staged:
        parts.append(f"wide steps {cfg.wide.value} through a {scratch_bytes / 2**30:.2f} GiB "
                     "scratch")
    if skipped:
        parts.append(f"{len(skipped)} resident layer(s) not armed")
    if declined:
        parts.append(f"{len(declined)} declined (see warnings)")
    if max_num_seqs is not None and first.top_k:
        from ..rules.budget import trap_text
        from ..vllm_facts.capture import rows_for_sizes, safe_for_rows

        # speculative decoding: each sequence's verify step carries its draft tokens
        rows = decode_rows or rows_for_sizes([], 1 + spec_tokens)
        k, slots = first.top_k, min(counts)  # the narrowest layer reads through first
        widest = rows(max_num_seqs)
        if widest * k > slots and staged:
            parts.append(f"full batches ({widest} x {k} ids > {slots} slots) are staged "
                         "through the scratch")
        elif widest * k > slots:
            safe = safe_for_rows(slots, k, rows)
            parts.append("TRAP: " + trap_text(max_num_seqs, widest, k, slots, safe,
                                              "vLLM's capture sizes", spec_tokens).removeprefix(
                                                  "sizing trap: "))
    return head + "; ".join(parts)
