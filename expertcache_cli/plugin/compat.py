"""Which vLLM this is, and whether the plugin knows its MoE layout.

The plugin reaches into vLLM internals that move between releases (the MoE layer was
`FusedMoE` until 0.25; from 0.26 it is a `RoutedExperts` module driven by a `MoERunner`
through the opaque `moe_forward` custom op). Guessing on an unknown layout could corrupt
every token, so the rule is: recognise the release and the exact attributes we use, or
refuse loudly and leave vLLM on its stock path. Both checks are plain functions of
version strings and objects so that the refusals are tested without vLLM installed.

What was read (vLLM 0.26.0 and 0.33.0 sources):

- plugins: `vllm.general_plugins` entry points run in every process (API server,
  engine core, each worker), possibly more than once; `register()` must be cheap and
  idempotent and must not import CUDA code.
- weights: `Worker.load_model` -> model runner -> loader; the UVA offloader moves the
  selected parameters to pinned host memory while the model is built and re-offloads
  any that `process_weights_after_loading` replaced, marking each with
  ``_vllm_is_uva_offloaded``. So the model is final (loaded, processed, offloaded) when
  `Worker.load_model` returns, before memory profiling, compilation and graph capture.
- execution: `MoERunner._apply_quant_method` calls
  ``routed_experts.forward_modular(x=, topk_weights=, topk_ids=, shared_experts=,
  shared_experts_input=)`` by keyword after the router picked ``topk_ids``; monolithic
  methods route inside the kernel (`forward_monolithic(router_logits)`), no ids to remap.
  `forward_modular` calls ``quant_method.apply(layer=self, ...)``, which reads the weights
  from the layer's attributes and the scales/biases from
  ``quant_method.moe_kernel.fused_experts.quant_config`` (a plain attribute). 0.33 may
  return an `UnfinalizedMoEOutput` (top-k reduction deferred): it carries no expert ids,
  so it is safe to return as is.
- 0.33 adds a host-resident path in the Triton experts keyed on the
  ``_vllm_is_uva_offloaded`` flag of the weights; slot buffers do not carry it and take
  the ordinary device path.
- `MarlinExperts` (every 4-bit format vLLM runs on Hopper: GPTQ, AWQ, compressed-tensors
  W4A16, MXFP4 offloaded, NVFP4 weight-only) keeps its name from 0.26 to 0.33 but not its
  layout: 0.26 holds act-order's ``g_idx`` and sort indices as kernel attributes, 0.33
  has none (it refuses act-order GPTQ). `marlin.layout` tells them apart per layer, and
  anything else is declined.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

#: experts kernels known to index the weight tensors by the routing ids and nothing else
#: (every per-expert tensor a parameter of the layer or an alias of one): safe to feed
#: slot buffers. The Triton ones take slot-space ids; Marlin takes expert-space ids with
#: its block list remapped to slots (`marlin`), which keeps its reduction order stock.
KNOWN_EXPERTS = frozenset(
    {
        "TritonExperts",
        "TritonWNA16Experts",
        "MarlinExperts",
    }
)

#: attributes of RoutedExperts that are routing state, not expert weights (vLLM's own
#: EPLB list, plus the expert-map buffers)
NON_EXPERT_TENSORS = frozenset(
    {
        "e_score_correction_bias",
        "w13_input_scale",
        "w2_input_scale",
        "hash_indices_table",
        "_expert_map",
        "expert_mask",
        "expert_global_to_physical",
        "expert_physical_to_global",
        "expert_local_to_global",
    }
)

#: per-expert parameters vLLM reads only while loading weights (compressed-tensors records
#: each expert's original weight shape, float32 [E, 2]; no kernel reads it afterwards, in
#: 0.26 or 0.33): not mirrored
LOAD_ONLY_TENSORS = frozenset({"w13_weight_shape", "w2_weight_shape"})

#: layer attributes through which vLLM 0.34 hands a kernel its experts instead of the
#: Parameters (``getattr(layer, f"{name}_triton", ...)``, oracle/mxfp4.py
#: ``triton_weight``): a layer holding one is declined (`arming`)
TRITON_WEIGHT_VIEWS = ("w13_weight_triton", "w2_weight_triton")

#: the keyword arguments of `RoutedExperts.forward_modular` in 0.26 .. 0.34, after self
FORWARD_MODULAR_ARGS = ("x", "topk_weights", "topk_ids", "shared_experts", "shared_experts_input")

def layout_refusal(routed_experts_cls: Any, kernel_cls: Any | None = None) -> str | None:
    """Why the classes found at runtime do not match the layout read, or None.

    ``routed_experts_cls`` is vLLM's `RoutedExperts`; ``kernel_cls`` its
    `FusedMoEKernel` (modular kernel) when importable.
    """
    for attr in ("forward_modular", "forward_monolithic", "weight_loader"):
        if not callable(getattr(routed_experts_cls, attr, None)):
            return f"RoutedExperts has no {attr}() (unknown MoE layout)"
    try:
        params = list(inspect.signature(routed_experts_cls.forward_modular).parameters)
    except (TypeError, ValueError):
        params = []
    if params[1:] != list(FORWARD_MODULAR_ARGS):
        return (
            f"RoutedExperts.forward_modular{tuple(params[1:])} is not the "
            f"{FORWARD_MODULAR_ARGS} the plugin wraps (unknown MoE layout)"
        )
    if kernel_cls is not None and not isinstance(
        getattr(kernel_cls, "fused_experts", None), property
    ):
        return "FusedMoEKernel.fused_experts is not a property (unknown kernel layout)"
    return None


#: set on every function `wrap_once` installed. Not ``__wrapped__``: vLLM's own
#: ``functools.lru_cache`` functions carry that too (0.34's ``get_moe_configs``), and
#: reading it as "already wrapped" would leave them unwrapped, silently
WRAPPED_MARK = "_expertcache_wrapped"


def wrap_once(module: Any, name: str, wrap: Any) -> bool:
    """Replace ``module.name`` by ``wrap(original)``, once: a function this plugin already
    wrapped (`WRAPPED_MARK`) is left as it is, since plugins run more than once a
    process. False when ``module`` has no callable of that name (an unknown layout)."""
    orig = getattr(module, name, None)
    if not callable(orig):
        return False
    if not getattr(orig, WRAPPED_MARK, False):
        wrapped = wrap(orig)
        setattr(wrapped, WRAPPED_MARK, True)
        setattr(module, name, wrapped)
    return True


#: vLLM's workspace manager (0.26.0 and 0.33.0: ``vllm/v1/worker/workspace.py``)
WORKSPACE_MODULE = "vllm.v1.worker.workspace"


@contextlib.contextmanager
def workspace_open() -> Iterator[None]:
    """vLLM's workspace manager opened for the duration, where it is locked.

    Why: vLLM locks the manager once its graphs are captured (a kernel asking then for a
    scratch key it did not ask for while warming up raises). The sweep after new weights
    (`runtime.ArmedLayer.sweep`) runs between steps, from the worker's call that brought
    the weights, not from a forward: a kernel keyed by the current stream may find no key
    of its own. Opening it cannot move what the graphs captured: the sweep's steps are
    never wider than a call the layer already served (`runtime.Probe.rows`), so the shared
    scratch does not grow, and a new key only adds a buffer. Locked again after.
    """
    manager = None
    try:
        import importlib

        ws = importlib.import_module(WORKSPACE_MODULE)
        if ws.is_workspace_manager_initialized():
            manager = ws.current_workspace_manager()
            manager = manager if manager.is_locked() else None
    except Exception:  # no vLLM, or one without the manager: nothing is locked
        manager = None
    if manager is not None:
        manager.unlock()
    try:
        yield
    finally:
        if manager is not None:
            manager.lock()
