"""Stand-ins shaped like vLLM 0.26-0.33 MoE objects, for the plugin's CPU tests.

They carry exactly the attributes the plugin's planner reads from a `RoutedExperts`
(``local_num_experts``, ``quant_method.moe_kernel.fused_experts``, parameters with the
offloader's ``_vllm_is_uva_offloaded`` flag, ...), so the arming rules are tested without
torch or vLLM. The names of the classes matter: the planner recognises experts kernels
by class name, as it does on the real objects.
"""

from __future__ import annotations

import itertools
from math import prod
from types import SimpleNamespace
from typing import Any

_ptr = itertools.count(0x10000, 0x10000)

SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1, "uint8": 1, "int32": 4}


class FakeTensor:
    def __init__(self, shape: tuple[int, ...], dtype: str = "bfloat16", *, device: str = "cuda",
                 uva: bool = False, contiguous: bool = True) -> None:
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = SimpleNamespace(type=device, index=0 if device == "cuda" else None)
        self._contig = contiguous
        self._ptr = next(_ptr)
        if uva:
            self._vllm_is_uva_offloaded = True

    def element_size(self) -> int:
        return SIZES[self.dtype]

    def is_contiguous(self) -> bool:
        return self._contig

    def data_ptr(self) -> int:
        return self._ptr

    def numel(self) -> int:
        return prod(self.shape)


class TritonExperts:
    def __init__(self) -> None:
        self.quant_config = SimpleNamespace()


class TrtLlmBf16ExpertsModular(TritonExperts):
    """An experts kernel the planner does not know (name not in its list)."""


class HummingIndexedExperts(TritonExperts):
    """vLLM 0.33+'s Humming experts, its default for 4-bit formats on Hopper."""


class UnquantizedFusedMoEMethod:
    def __init__(self, experts: Any = None, monolithic: bool = False) -> None:
        self.is_monolithic = monolithic
        self.moe_kernel = SimpleNamespace(fused_experts=experts or TritonExperts())
        self.moe_quant_config = None


class RoutedExperts:
    """A vLLM RoutedExperts as the planner sees it."""

    def __init__(self, *, num_experts: int = 128, hidden: int = 64, inter: int = 32,
                 dtype: str = "bfloat16", uva: bool = True, device: str = "cuda",
                 top_k: int = 8, name: str = "model.layers.3.mlp.experts",
                 quant_method: Any = None, use_ep: bool = False, expert_map: Any = None,
                 lora: bool = False,
                 extra_params: dict[str, FakeTensor] | None = None,
                 buffers: dict[str, FakeTensor] | None = None) -> None:
        self.layer_name = name
        self.local_num_experts = num_experts
        self.global_num_experts = num_experts
        self.top_k = top_k
        self.expert_map = expert_map
        self.moe_config = SimpleNamespace(moe_parallel_config=SimpleNamespace(use_ep=use_ep),
                                          is_lora_enabled=lora)
        self.quant_method = quant_method or UnquantizedFusedMoEMethod()
        where = {"uva": uva, "device": device}
        self._params = {
            "w13_weight": FakeTensor((num_experts, 2 * inter, hidden), dtype, **where),
            "w2_weight": FakeTensor((num_experts, hidden, inter), dtype, **where),
            # routing state with a leading dim of E: must be left alone
            "e_score_correction_bias": FakeTensor((num_experts,), "float32"),
        }
        self._params.update(extra_params or {})
        self._buffers = {"_expert_map": None, **(buffers or {})}

    def named_parameters(self, recurse: bool = True):
        assert recurse is False, "the planner must only look at the layer's own tensors"
        seen: set[int] = set()  # as torch: a Parameter under two names is listed once
        return iter([(n, t) for n, t in self._params.items()
                     if t is None or not (id(t) in seen or seen.add(id(t)))])

    def named_buffers(self, recurse: bool = True):
        assert recurse is False
        return iter(self._buffers.items())

    def forward_modular(self, **kwargs: Any) -> Any:  # pragma: no cover - shape only
        return kwargs


class SubstitutedRoutedExperts(RoutedExperts):
    """vLLM 0.33's MoNE layer (`expert_substitution.SubstitutedRoutedExperts`): weights only
    for the retained experts, and a ``forward_modular`` that first remaps the logical ids
    in ``topk_ids`` to physical rows in place (``transform_routes``), then calls the base
    method."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.expert_substitution = SimpleNamespace(num_logical_experts=160)

    def forward_modular(self, **kwargs: Any) -> Any:  # pragma: no cover - shape only
        return super().forward_modular(**kwargs)


class FakeModel:
    def __init__(self, layers: list[Any]) -> None:
        self.layers = layers

    def named_modules(self):
        yield "", self
        for i, layer in enumerate(self.layers):
            yield f"model.layers.{i}.mlp", SimpleNamespace()
            yield f"model.layers.{i}.mlp.experts", layer
