"""vLLM's Marlin MoE experts (`MarlinExperts`) on slot buffers, bit for bit.

What Marlin reads per expert (vLLM 0.26.0 and 0.33.0, `fused_moe/experts/marlin_moe.py`,
after `process_weights_after_loading` repacked and padded everything): the packed weights
``w1``/``w2`` (the layer's ``w13_weight``/``w2_weight``, aliases of ``w13_qweight`` or
``w13_weight_packed`` for the WNA16 methods), and from the kernel's quant config the
scales, zero points (AWQ, asymmetric GPTQ), biases (gpt-oss), NVFP4's per-expert global
scales (``g1_alphas``/``g2_alphas``); in 0.26 also act-order's ``g_idx`` and sort
indices, held as attributes of the kernel object. Every one of them is a parameter of the
layer with the expert as its leading dimension, so the generic rebinding covers them
(`runtime.ArmedLayer`); the kernel attributes are aliases of those parameters and are
rebound with them (`arming.Decision.aliases`). 0.33 dropped act-order (vLLM refuses
``desc_act`` GPTQ) and with it those attributes. `layout` tells the two apart and refuses
anything else.

What differs from the Triton kernels is the order of the work. `fused_marlin_moe` sorts
the routed (token, expert) pairs into blocks by id (`moe_align_block_size`), and Marlin
spreads each GEMM's K reduction over thread blocks by the position of each block in that
order (its "stripes"): with slot ids the blocks sort by slot, the reduction of a row may be
split at other points, and fp32 partial sums round differently. So for Marlin the stock
call gets the routing ids in expert space, and the layer's cache step runs right after
vLLM built the block list (`expert_order_blocks`), in the same manager launch that rewrites
that list to slots: the blocks, their order, the block size and the padding are the stock
path's, only the weights each block reads are the slot's, and the layer launches what it
launches on Triton's experts, the manager and the gather (`SlotCache.step` with
``blocks``; the same rule in torch ops after the step costs 6.8 us a layer more in a
graph: `bench/bench_armed_layer.py`). A slot-bound call that builds no
block list, or two, is refused (the layer goes back to the stock path): its slots would
not hold what it reads. While bound to slots the layer reports ``S`` experts
(``global_num_experts``), the experts its weights hold, as an ``S``-expert layer would
(vLLM then estimates no expert-parallel share of the tokens); the block list is still
built over the real ``E``. The block size vLLM picks from those counts is its smallest (8)
on every step served from slots (tokens x top_k <= S), as on the stock path, so the
blocks match the stock call's one for one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .compat import wrap_once

#: the format of the experts behind a quant method that runs them on Marlin, by the method's
#: class name (vLLM 0.26 and 0.33), named as `size` names it (GPTQ and AWQ are W4A16 there):
#: what `config.marlin_from_env` is asked about
FORMAT_OF_METHOD = {
    "GptOssMxfp4MoEMethod": "mxfp4",
    "Mxfp4MoEMethod": "mxfp4",
    "AutoGPTQMoEMethod": "w4a16",
    "AutoAWQMoEMethod": "w4a16",
    "CompressedTensorsWNA16MarlinMoEMethod": "w4a16",
    "CompressedTensorsWNA16MoEMethod": "w4a16",
    "ModelOptNvFp4FusedMoE": "nvfp4",
    "CompressedTensorsW4A4Nvfp4MoEMethod": "nvfp4",
}


def format_of(method_name: str) -> str | None:
    """The 4-bit format of a quant method's Marlin experts, or None where it is not known
    (then only ``EXPERT_CACHE_MARLIN=1`` arms them)."""
    return FORMAT_OF_METHOD.get(method_name)

#: the experts class this module handles, by name (as `compat.KNOWN_EXPERTS`)
MARLIN_EXPERTS = "MarlinExperts"
#: module whose ``moe_align_block_size`` `fused_marlin_moe` calls by name (0.26 and 0.33)
MARLIN_MODULE = "vllm.model_executor.layers.fused_moe.experts.marlin_moe"
#: the act-order attributes 0.26's MarlinExperts holds (and 0.33's does not)
ACT_ORDER_ATTRS = ("w13_g_idx", "w2_g_idx", "w13_g_idx_sort_indices",
                   "w2_g_idx_sort_indices")
#: what every release's MarlinExperts reads from its quant config in ``apply``
QUANT_CONFIG_READS = ("w1_scale", "w2_scale", "w1_bias", "w2_bias", "g1_alphas",
                      "g2_alphas", "w1_zp", "w2_zp")

LAYOUT_026 = "0.26"
LAYOUT_033 = "0.33"


def layout(experts: Any) -> tuple[str | None, str]:
    """Which release's MarlinExperts layout ``experts`` has: (``"0.26"`` or ``"0.33"``,
    ""), or (None, why it is not one the plugin knows)."""
    name = type(experts).__name__
    qc = getattr(experts, "quant_config", None)
    if qc is None:
        return None, f"{name} has no quant_config (unknown Marlin layout)"
    cls = type(qc)
    # looked up on the class (properties are not evaluated) or the instance's own fields
    missing = [a for a in QUANT_CONFIG_READS
               if not (hasattr(cls, a) or a in getattr(qc, "__dict__", {}))]
    if missing:
        return None, (f"{name}'s quant config lacks {', '.join(missing)} (unknown Marlin "
                      "layout)")
    has = [a for a in ACT_ORDER_ATTRS if hasattr(experts, a)]
    if len(has) == len(ACT_ORDER_ATTRS) and hasattr(experts, "is_k_full"):
        return LAYOUT_026, ""
    if not has and hasattr(experts, "activation_config"):
        return LAYOUT_033, ""
    return None, (f"{name} holds {', '.join(has) or 'no act-order attributes'} and "
                  f"{'an' if hasattr(experts, 'activation_config') else 'no'} "
                  "activation_config: neither vLLM 0.26's nor 0.33's Marlin layout")


#: set for exactly the duration of a slot-bound Marlin call: its `BlockOrder`; None
#: otherwise (thread-local)
_BLOCK_SLOTS = threading.local()


def expert_order_blocks(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM's ``moe_align_block_size`` as `fused_marlin_moe` sees it: inside a
    slot-bound Marlin call the routing ids are expert ids, the blocks are built over the
    real expert count exactly as the stock call builds them, and each block's expert id is
    then replaced by the expert's slot. Outside such a call it is vLLM's own."""

    def moe_align_block_size(topk_ids: Any, block_size: int, num_experts: int,
                             expert_map: Any = None, *args: Any, **kwargs: Any) -> Any:
        order = getattr(_BLOCK_SLOTS, "value", None)
        if order is None:
            return orig(topk_ids, block_size, num_experts, expert_map, *args, **kwargs)
        sorted_ids, block_experts, padded = orig(topk_ids, block_size, order.num_experts,
                                                 expert_map, *args, **kwargs)
        return sorted_ids, order.remap(block_experts), padded

    moe_align_block_size.__wrapped__ = orig  # type: ignore[attr-defined]
    return moe_align_block_size


def patch_block_order(module: Any) -> bool:
    """Install `expert_order_blocks` in ``module`` once; False when it has no such name."""
    return wrap_once(module, "moe_align_block_size", expert_order_blocks)


class BlockOrder:
    """One armed Marlin layer's slot step, deferred to the point where vLLM's Marlin call
    has built its block list (`expert_order_blocks`): the layer's real expert count, and
    for the call it is bound to, the step to run on that list (the cache's manager and
    gather, the list rewritten to slots in place)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = int(num_experts)
        self._step: Callable[[Any], None] | None = None
        #: whether the bound call's step ran (once: a call that builds no block list, or a
        #: second one, is refused by the caller and the one who raised)
        self.ran = False

    def remap(self, blocks: Any) -> Any:
        """Run the bound call's step on ``blocks`` (rewritten to slots in place); returns
        them."""
        step = self._step
        if step is None:
            raise RuntimeError("vLLM's Marlin call built a second block list in one call "
                               "(unknown Marlin layout)")
        self._step = None
        step(blocks)
        self.ran = True
        return blocks

    def bind(self, step: Callable[[Any], None]) -> None:
        """Bind the next slot-bound Marlin call on this thread to ``step``."""
        self._step, self.ran = step, False
        _BLOCK_SLOTS.value = self

    def unbind(self) -> None:
        self._step = None
        _BLOCK_SLOTS.value = None
