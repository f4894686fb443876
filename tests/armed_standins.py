"""Stand-ins for the armed layer's world on CPU torch, shared by the tests/test_plugin_*.py
files of the plugin at run time (the armed layer, the session, padding rows, recording, wide
steps, the fallbacks).

The real `SlotCache` runs CUDA kernels (its own device tests prove it bit-exact against
`policy.LayerCache`). Here a host emulation of the same contract, built on that very
reference (tests/ref_slotcache.py), stands in for it, so what the tests check is the
plugin's part. `Experts` is a RoutedExperts-shaped module whose stock forward is a plain
MoE in torch; importing this module points the plugin's tile-lookup patch at `TileLookup`
(once a process, as in vLLM). Import it after ``pytest.importorskip("torch")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
from ref_slotcache import RefSlotCache

from expertcache_cli.config import CacheConfig
from expertcache_cli.plugin.arming import ARM, plan_layer
from expertcache_cli.plugin.runtime import (
    ArmedLayer,
    Sweep,
    patch_tile_lookup,
)

E, H, INTER, TOPK = 16, 8, 4, 2


class TileLookup:
    """Stands for vLLM's triton_moe module: records the expert count tiles are sized for."""

    seen: list[int] = []

    @staticmethod
    def try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, M, block_shape=None):
        TileLookup.seen.append(w2_shape[0])
        return {"BLOCK_SIZE_M": 16}


patch_tile_lookup(TileLookup)


@dataclass
class QuantConfig:
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None


class Method:
    """An unquantized-style quant method with biases carried by its quant config."""

    is_monolithic = False

    def __init__(self, leak: bool = False):
        self.leak = leak
        self.moe_quant_config = None
        self.moe_kernel = SimpleNamespace(fused_experts=type("TritonExperts", (), {})())

    def get_fused_moe_quant_config(self, layer):
        if self.leak:  # a method that caches the tensors it saw at load time
            return QuantConfig(self._seen[0], layer.w2_bias)
        return QuantConfig(layer.w13_bias, layer.w2_bias)


class Experts(torch.nn.Module):
    """A RoutedExperts-shaped module whose stock forward is a plain MoE in torch."""

    def __init__(self, leak=False, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layer_name = "model.layers.5.mlp.experts"
        self.local_num_experts = self.global_num_experts = E
        self.top_k = TOPK
        self.expert_map = None
        self.moe_config = SimpleNamespace(moe_parallel_config=SimpleNamespace(use_ep=False))
        for name, shape in (("w13_weight", (E, 2 * INTER, H)), ("w2_weight", (E, H, INTER)),
                            ("w13_bias", (E, 2 * INTER)), ("w2_bias", (E, H))):
            p = torch.nn.Parameter(torch.randn(shape, generator=g), requires_grad=False)
            self.register_parameter(name, p)
            # host tensors standing for UVA views (on a GPU they sit on the cuda device)
            p._vllm_is_uva_offloaded = True
        self.quant_method = Method(leak)
        self.quant_method._seen = [self.w13_bias]  # hidden in a list: past the planner
        self.quant_method.moe_kernel.fused_experts.quant_config = (
            self.quant_method.get_fused_moe_quant_config(self)
        )
        self.weights_seen: list[int] = []

    def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None,
                        shared_experts_input=None):
        qc = self.quant_method.moe_kernel.fused_experts.quant_config
        self.weights_seen.append(self.w13_weight.data_ptr())
        TileLookup.try_get_optimal_moe_config(self.w13_weight.shape, self.w2_weight.shape,
                                              TOPK, None, x.shape[0])
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(topk_ids.shape[1]):
                e = int(topk_ids[t, k])
                h = self.w13_weight[e] @ x[t] + qc.w13_bias[e]
                a = torch.nn.functional.silu(h[:INTER]) * h[INTER:]
                out[t] += topk_weights[t, k] * (self.w2_weight[e] @ a + qc.w2_bias[e])
        return out


class AliasedExperts(Experts):
    """vLLM's WNA16 methods (0.26's Marlin ones, 0.33's moe_wna16 on every backend):
    ``w13_qweight`` registered, then ``layer.w13_weight = layer.w13_qweight``: one Parameter
    under two names, listed once (the first), read by the experts call under the second."""

    def __init__(self, seed=0):
        super().__init__(seed=seed)
        for alias, name in (("w13_weight", "w13_qweight"), ("w2_weight", "w2_qweight")):
            p = self._parameters.pop(alias)
            self.register_parameter(name, p)
            setattr(self, alias, p)  # torch registers the alias, after the first name


def arm(layer, slots=6, recorder=None, wide_inserts=None, policy="lru"):
    """``layer`` armed with a reference slot cache of ``slots`` under ``policy`` (and a CPU
    scratch when ``wide_inserts`` is given), installed."""
    d = plan_layer(layer, CacheConfig(slots=slots))
    assert d.action == ARM, d.reason
    specs = {s.name: (s.shape, s.dtype) for s in d.specs}
    cache = RefSlotCache(d.num_experts, d.num_slots, specs, policy=policy,
                         wide_inserts=wide_inserts)
    scratch = None
    if wide_inserts is not None:
        from expertcache_cli.device.scratch import Scratch, torch_copiers

        scratch = Scratch(d.num_experts, specs, "cpu", copier=torch_copiers)
    armed = ArmedLayer(layer, d, cache, index=0, recorder=recorder, scratch=scratch)
    armed.install()
    return armed


def routing(rng, tokens):
    """Routing ids and weights of ``tokens`` tokens, distinct experts a token."""
    ids = np.stack([rng.choice(E, TOPK, replace=False) for _ in range(tokens)])
    return torch.from_numpy(ids.astype(np.int32)), torch.rand(tokens, TOPK)


def mark_swept(armed):
    """Mark the layer's sweep of every expert done (an agreeing one of no steps): for the
    tests of what follows it, the check of the real call."""
    armed.sweep_result = Sweep([], 0.0)
    return armed


class ThreeLayers(torch.nn.Module):
    """Three MoE layers; the middle one's quant method leaks full storage (declined)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for i, leak in enumerate([False, True, False]):
            block = torch.nn.Module()
            block.experts = Experts(leak=leak, seed=i)
            block.experts.layer_name = f"model.layers.{i}.mlp.experts"
            self.layers.append(block)


def fake_vllm_layout(monkeypatch):
    """Just enough of vLLM's module tree for `_arm_worker`'s layout check."""
    import sys
    import types

    class RoutedExperts:
        def forward_modular(self, x, topk_weights, topk_ids, shared_experts,
                            shared_experts_input):  # pragma: no cover - signature only
            pass

        def forward_monolithic(self):  # pragma: no cover
            pass

        def weight_loader(self):  # pragma: no cover
            pass

    names = ["vllm", "vllm.model_executor", "vllm.model_executor.layers",
             "vllm.model_executor.layers.fused_moe",
             "vllm.model_executor.layers.fused_moe.routed_experts"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].RoutedExperts = RoutedExperts


def vllm_worker(model, weights=1000, runner_attr=True, kv_cache_memory_bytes=None):
    """A vLLM worker as `_arm_worker` reads it: its runner (``weights`` as vLLM counts them),
    scheduler, model and cache configs."""
    runner = SimpleNamespace(get_model=lambda: model)
    if runner_attr:
        runner.model_memory_usage = weights
    vc = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=2),
                         model_config=SimpleNamespace(model="tiny"))
    return SimpleNamespace(model_runner=runner, vllm_config=vc,
                           cache_config=SimpleNamespace(
                               kv_cache_memory_bytes=kv_cache_memory_bytes))


def vllm_padding_marks(monkeypatch, marks):
    """vLLM's forward context as the plugin's padding reader finds it (the V2 runner's
    ``is_padding``): ``marks()`` is read at each step, so a test may change it between
    steps."""
    import sys
    import types

    fc = types.ModuleType("vllm.forward_context")
    fc.is_forward_context_available = lambda: True
    fc.get_forward_context = lambda: SimpleNamespace(is_padding=marks())
    for name in ("vllm", "vllm.forward_context"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["vllm.forward_context"] = fc
