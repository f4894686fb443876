"""The armed layer against the stock path, on CPU torch with a reference slot cache.

Outputs equal to the stock path token for token, every per-expert tensor and the quant
config rebound for exactly the duration of the stock call and restored after, the tile
lookup sized for the full expert count, parameters and kernel attributes under two names,
and the refusals: a quant config or kernel attribute that still points at full storage or
holds a copy. Stand-ins: tests/armed_standins.py. Skipped (with the reason) without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="no torch: the plugin runtime tests need torch")

from armed_standins import (  # noqa: E402
    INTER,
    TOPK,
    AliasedExperts,
    E,
    Experts,
    H,
    Method,
    QuantConfig,
    TileLookup,
    arm,
    mark_swept,
    routing,
    vllm_padding_marks,
)

from expertcache_cli.config import CacheConfig  # noqa: E402
from expertcache_cli.plugin.arming import plan_layer  # noqa: E402
from expertcache_cli.plugin.runtime import ArmError, patch_tile_lookup  # noqa: E402


def test_armed_layer_matches_the_stock_path_and_restores_everything():
    stock, cached = Experts(seed=1), Experts(seed=1)
    TileLookup.seen.clear()
    armed = arm(cached, slots=6)
    assert [s.name for s in armed.decision.specs] == ["w13_weight", "w2_weight", "w13_bias",
                                                      "w2_bias"]
    full_ptr = cached.w13_weight.data_ptr()
    qc_before = cached.quant_method.moe_kernel.fused_experts.quant_config
    rng = np.random.default_rng(0)
    served = 0
    for step in range(60):
        tokens = 1 if step % 7 else 4  # 4 tokens x top-2 = 8 ids > 6 slots: read-through
        x = torch.randn(tokens, H)
        ids, w = routing(rng, tokens)
        want = stock.forward_modular(x=x, topk_weights=w, topk_ids=ids)
        got = cached.forward_modular(x=x, topk_weights=w, topk_ids=ids)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        served += tokens * TOPK <= 6
        # after every call: the layer is back on its full tensors and config
        assert cached.w13_weight.data_ptr() == full_ptr
        assert cached.quant_method.moe_kernel.fused_experts.quant_config is qc_before
    # the first call swept every expert through the 6 slots first: 3 steps of 3 tokens x
    # top-2, each on the slots and on the stock path, all agreeing
    (sweep,) = armed.sweep_result.paths
    assert (sweep.path, sweep.covered, sweep.steps, sweep.worst) == ("slots", E, 3, 0.0)
    # the stock kernel sized its tiles for the 16 real experts, never for the 6 slots (the
    # extra calls: the sweep's 2 x 3, and the first slot step checked against the stock path)
    assert set(TileLookup.seen) == {E} and len(TileLookup.seen) == 121 + 2 * 3
    assert armed.checked == {"slots": 0.0, "scratch": None}
    assert cached.w13_weight.shape[0] == E and armed.slot_params["w13_weight"].shape[0] == 6
    slot_ptr = armed.cache.slots["w13_weight"].data_ptr()
    assert cached.weights_seen.count(slot_ptr) == served + 3 == armed.cache.steps
    assert cached.weights_seen.count(full_ptr) == 60 - served + 1 + 3
    assert int(armed.read_through) == 60 - served
    assert armed.slot_quant_config.w13_bias.data_ptr() == armed.cache.slots["w13_bias"].data_ptr()


def test_quant_config_still_pointing_at_full_storage_is_refused():
    layer = Experts(leak=True)
    with pytest.raises(ArmError, match="full expert storage"):
        arm(layer)


def test_a_failing_cache_step_falls_back_to_the_stock_path_and_disarms(caplog):
    layer = Experts(seed=2)
    armed = arm(layer)

    def boom(*a, **k):
        raise ValueError("per-expert slab of 12 bytes")

    armed.cache.step = boom
    x = torch.randn(1, H)
    ids, w = routing(np.random.default_rng(1), 1)
    with caplog.at_level("ERROR", logger="vllm.expertcache"):
        out = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    torch.testing.assert_close(out, Experts(seed=2).forward_modular(x=x, topk_weights=w,
                                                                    topk_ids=ids))
    assert "stock path" in caplog.text and "12 bytes" in caplog.text
    assert "forward_modular" not in layer.__dict__  # the instance hook is gone


def test_tile_lookup_sees_the_full_expert_count_only_inside_a_slot_bound_call():
    from expertcache_cli.plugin import runtime

    calls = []

    class Mod:
        @staticmethod
        def try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, M, block_shape=None):
            calls.append((w1_shape[0], w2_shape[0], tuple(w1_shape[1:]), M))

    assert patch_tile_lookup(Mod) and patch_tile_lookup(Mod)  # idempotent
    assert Mod.try_get_optimal_moe_config.__wrapped__.__name__ == "try_get_optimal_moe_config"
    Mod.try_get_optimal_moe_config((32, 8, 4), (32, 4, 4), 2, None, 1)
    runtime._TILE_EXPERTS.value = 128
    try:
        Mod.try_get_optimal_moe_config(torch.Size((32, 8, 4)), (32, 4, 4), 2, None, M=3)
    finally:
        runtime._TILE_EXPERTS.value = None
    assert calls == [(32, 32, (8, 4), 1), (128, 128, (8, 4), 3)]
    assert not patch_tile_lookup(object())


def test_a_parameter_registered_under_two_names_is_rebound_under_both():
    stock, cached = AliasedExperts(seed=2), AliasedExperts(seed=2)
    assert cached._parameters["w13_weight"] is cached._parameters["w13_qweight"]
    armed = arm(cached, slots=6)
    assert [s.name for s in armed.decision.specs][:2] == ["w13_bias", "w2_bias"]
    assert armed.param_names["w13_qweight"] == ["w13_qweight", "w13_weight"]
    rng = np.random.default_rng(3)
    for _ in range(20):
        x = torch.randn(1, H)
        ids, w = routing(rng, 1)
        want = stock.forward_modular(x=x, topk_weights=w, topk_ids=ids)
        got = cached.forward_modular(x=x, topk_weights=w, topk_ids=ids)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert armed.checked["slots"] == 0.0 and not armed._failed
    # the experts call read the slots under the name it uses, and both names are back
    assert armed.cache.slots["w13_qweight"].data_ptr() in cached.weights_seen
    assert cached._parameters["w13_weight"] is cached._parameters["w13_qweight"]
    assert cached.w13_weight.shape[0] == E


def test_a_layer_changed_under_the_cache_is_served_stock_and_left_whole(caplog):
    """A second name gone after arming (a reload that re-registers the weights): the
    rebinding fails half-way; what it swapped is put back, the call is served from the
    stock path and the layer disarmed, with the reason logged: serving goes on."""
    stock, cached = AliasedExperts(seed=5), AliasedExperts(seed=5)
    armed = arm(cached, slots=6)
    ids, w = routing(np.random.default_rng(1), 1)
    x = torch.randn(1, H)
    cached.forward_modular(x=x, topk_weights=w, topk_ids=ids)  # armed, checked
    full = cached._parameters["w13_qweight"]
    # w2's second name is no longer a registered parameter (the stock call still reads it,
    # as a plain attribute): swapping it raises KeyError after w13's names were swapped
    del cached._parameters["w2_weight"]
    object.__setattr__(cached, "w2_weight", cached._parameters["w2_qweight"])
    caplog.set_level("ERROR", logger="vllm.expertcache")
    got = cached.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    assert armed._failed and "experts call on slots failed (KeyError" in caplog.text
    assert cached._parameters["w13_qweight"] is full  # nothing left bound to slots
    assert cached._parameters["w13_weight"] is full
    want = stock.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_invalidated_slots_refill_from_the_new_weights(caplog):
    from expertcache_cli.plugin.session import Session

    layer = Experts(seed=7)
    armed = arm(layer, slots=6)
    sess = Session(CacheConfig(slots=6), [armed.decision], [armed], None)
    ids = torch.tensor([[1, 2]], dtype=torch.int32)
    w, x = torch.rand(1, TOPK), torch.randn(1, H)
    layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    with torch.no_grad():  # new weights in place, as a reload writes them
        layer.w13_weight.mul_(2.0)
    stale = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    caplog.set_level("WARNING", logger="vllm.expertcache")
    sess.invalidate("vLLM reloaded the weights")
    fresh = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    armed.uninstall()
    want = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    assert not torch.allclose(stale, want)  # the slots still held the old experts
    assert torch.allclose(fresh, want, atol=1e-5)
    assert "slots of 1 layer(s) emptied" in caplog.text


def test_serving_starts_from_an_empty_cache_whatever_the_warm_up_routed(caplog):
    """vLLM's warm-up steps (compile sizes, graph capture, the sampler's dummy run) go
    through the slots. Under LFU without decay the experts they routed to keep their
    counts and hold slots the workload's hot experts cannot take. After `serving_starts`
    the layer's cache and counters are a fresh one's: the workload installs exactly what a
    replay from empty slots (what `plan` prices) installs; without it, more."""
    from expertcache_cli.plugin.session import Session
    from expertcache_cli.rules.policy import LayerCache, Policy

    rng = np.random.default_rng(5)
    hot = np.arange(8, 14)  # the workload's six hot experts: as many as the slots

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        pool = hot if rng.random() < 0.9 else np.arange(E)
        ids = rng.choice(pool, TOPK, replace=False).astype(np.int32)[None]
        return torch.from_numpy(ids), torch.rand(1, TOPK)

    workload = [step() for _ in range(80)]
    warm_ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)  # 4 ids, within 6 slots
    fresh = LayerCache(E, 6, Policy.LFU)
    want_installs = sum(fresh.step(ids.numpy()).miss_count for ids, _ in workload)

    def serve(reset: bool) -> tuple[int, list[int]]:
        layer = Experts(seed=3)
        armed = mark_swept(arm(layer, slots=6, policy="lfu"))
        sess = Session(CacheConfig(slots=6, policy=Policy.LFU), [armed.decision], [armed],
                       None)
        for _ in range(12):  # the warm-up: one dummy batch, again and again
            layer.forward_modular(x=torch.randn(2, H), topk_weights=torch.rand(2, TOPK),
                                  topk_ids=warm_ids)
        assert int(armed.cache.stats[0]) == 12 * 4
        if reset:
            sess.serving_starts()
            assert (armed.cache.table == -1).all() and (armed.cache.slot_expert == -1).all()
            assert int(armed.cache.stats.sum()) == 0
        before = int(armed.cache.stats[1])
        for ids, w in workload:
            layer.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
        return int(armed.cache.stats[1]) - before, armed.cache.slot_expert.tolist()

    caplog.set_level("INFO", logger="vllm.expertcache")
    installs, slots = serve(reset=True)
    assert installs == want_installs
    assert slots == fresh.slot_expert.tolist()
    assert "vLLM's warm-up done: the slots of 1 layer(s) emptied" in caplog.text
    stale, stale_slots = serve(reset=False)
    assert stale > 2 * want_installs  # the warm-up's four experts kept four of six slots
    assert {0, 1, 2, 3} <= set(stale_slots)


class _CopyingMethod(Method):
    """A quant method that hands the kernel a float copy of a per-expert tensor: bound to
    the slots at arming, the copy would hold the empty slots forever."""

    def get_fused_moe_quant_config(self, layer):
        return QuantConfig(layer.w13_bias.to(torch.float64), layer.w2_bias)


def test_a_quant_config_holding_a_copy_of_a_slot_buffer_is_refused():
    layer = Experts(seed=8)
    layer.quant_method = _CopyingMethod()
    layer.quant_method.moe_kernel.fused_experts.quant_config = QuantConfig(layer.w13_bias,
                                                                          layer.w2_bias)
    with pytest.raises(ArmError, match="shaped like slot buffers but not one of them"):
        arm(layer)


class _GIdxExperts(Experts):
    """Marlin-like: the kernel object holds ``w13_g_idx`` (a per-expert input permutation,
    the layer's own parameter, bound when the kernel was made) and reads it from itself;
    an act-order-free layer's sort indices are empty [E, 0]."""

    def __init__(self, seed=0, alias=True):
        super().__init__(seed=seed)
        g = torch.Generator().manual_seed(100 + seed)
        perms = torch.stack([torch.randperm(H, generator=g) for _ in range(E)]).to(torch.int32)
        # int32 [E, 8]: 32 bytes an expert, a 16-byte multiple as the gather needs
        self.register_parameter("w13_g_idx", torch.nn.Parameter(perms, requires_grad=False))
        self.w13_g_idx._vllm_is_uva_offloaded = True
        empty = torch.nn.Parameter(torch.empty(E, 0, dtype=torch.int32), requires_grad=False)
        self.register_parameter("w13_g_idx_sort_indices", empty)
        kernel = self.quant_method.moe_kernel.fused_experts
        kernel.w13_g_idx = self.w13_g_idx if alias else self.w13_g_idx.clone()
        kernel.w13_g_idx_sort_indices = empty

    def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None,
                        shared_experts_input=None):
        kernel = self.quant_method.moe_kernel.fused_experts
        qc = kernel.quant_config
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(topk_ids.shape[1]):
                e = int(topk_ids[t, k])
                xp = x[t][kernel.w13_g_idx[e].long()]
                h = self.w13_weight[e] @ xp + qc.w13_bias[e]
                a = torch.nn.functional.silu(h[:INTER]) * h[INTER:]
                out[t] += topk_weights[t, k] * (self.w2_weight[e] @ a + qc.w2_bias[e])
        return out


def test_a_kernel_attribute_aliasing_a_layer_parameter_is_rebound_with_it():
    stock, cached = _GIdxExperts(seed=11), _GIdxExperts(seed=11)
    armed = arm(cached, slots=6)
    assert armed.decision.aliases == [("experts", "w13_g_idx", "w13_g_idx")]
    assert "w13_g_idx_sort_indices" not in [s.name for s in armed.decision.specs]  # empty
    kernel = cached.quant_method.moe_kernel.fused_experts
    full = kernel.w13_g_idx
    rng = np.random.default_rng(11)
    for _ in range(40):
        x = torch.randn(1, H)
        ids, w = routing(rng, 1)
        torch.testing.assert_close(cached.forward_modular(x=x, topk_weights=w, topk_ids=ids),
                                   stock.forward_modular(x=x, topk_weights=w, topk_ids=ids),
                                   rtol=0, atol=0)
        assert kernel.w13_g_idx is full  # put back after every call
    assert armed.checked["slots"] == 0.0 and "forward_modular" in cached.__dict__


def test_a_kernel_attribute_that_is_a_copy_is_declined():
    layer = _GIdxExperts(seed=12, alias=False)
    d = plan_layer(layer, CacheConfig(slots=6))
    assert d.action == "decline"
    assert "holds per-expert tensor(s) w13_g_idx outside the layer" in d.reason


class _WritingMethod(Method):
    """vLLM 0.34's FlashInfer/HPC FP8 and NVFP4 config builders write derived tensors into
    the layer while they build (oracle/fp8.py: ``replace_parameter(layer, "g1_alphas",
    ...)``, ``refill_derived(layer, "_a1_gscale", ...)``): on the slots, the layer's own
    tensor would become the slots' S rows."""

    def get_fused_moe_quant_config(self, layer):
        layer._a1_gscale = layer.w13_bias[:, :1].clone()  # refill_derived: shape differs
        return QuantConfig(layer.w13_bias, layer.w2_bias)


def test_a_quant_config_builder_that_writes_into_the_layer_is_refused():
    layer = Experts(seed=9)
    layer.quant_method = _WritingMethod()
    layer.quant_method.moe_kernel.fused_experts.quant_config = (
        layer.quant_method.get_fused_moe_quant_config(layer))
    with pytest.raises(ArmError, match=r"changed the layer's own tensors \(_a1_gscale\)"):
        arm(layer)


@dataclass
class _PerTensorConfig(QuantConfig):
    """A quant config with a dynamic per-tensor INT8 activation scale for the second GEMM
    (the fields TritonExperts reads: vLLM 0.34 ``act_scale_is_tensor_wide``)."""

    a2_scale: torch.Tensor | None = None
    is_per_tensor: bool = True
    use_int8_w8a8: bool = True
    use_fp8_w8a8: bool = False

    def act_scale_is_tensor_wide(self, scale):  # vLLM 0.34's config.py:324-344
        return scale is None and self.is_per_tensor and (self.use_fp8_w8a8
                                                         or self.use_int8_w8a8)


class _PerTensorMethod(Method):
    def get_fused_moe_quant_config(self, layer):
        return _PerTensorConfig(layer.w13_bias, layer.w2_bias)


class _PerTensorExperts(Experts):
    """Stock experts as vLLM 0.34's TritonExperts runs them for a dynamic per-tensor
    activation scale: rows whose id is -1 (what its router writes for padding rows) are
    skipped, and the second GEMM's input is quantized with one scale reduced over the
    routed rows only (``masked_amax_scale(row_valid=topk_ids >= 0)``)."""

    def __init__(self, seed=0):
        super().__init__(seed=seed)
        self.quant_method = _PerTensorMethod()
        self.quant_method.moe_kernel.fused_experts.quant_config = (
            self.quant_method.get_fused_moe_quant_config(self))

    def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None,
                        shared_experts_input=None):
        qc = self.quant_method.moe_kernel.fused_experts.quant_config
        acts = {}
        for t in range(x.shape[0]):
            for k in range(topk_ids.shape[1]):
                e = int(topk_ids[t, k])
                if e < 0:
                    continue
                h = self.w13_weight[e] @ x[t] + qc.w13_bias[e]
                acts[t, k] = torch.nn.functional.silu(h[:INTER]) * h[INTER:]
        scale = max(float(a.abs().max()) for a in acts.values()) / 127
        out = torch.zeros_like(x)
        for (t, k), a in acts.items():
            e = int(topk_ids[t, k])
            q = torch.round(a / scale) * scale
            out[t] += topk_weights[t, k] * (self.w2_weight[e] @ q + qc.w2_bias[e])
        return out


def test_rows_the_router_left_unrouted_stay_out_of_a_tensor_wide_activation_scale(
        monkeypatch):
    """vLLM marks CUDA-graph padding rows and its routers write -1 ids (and 0 weights) for
    them; a stock kernel with a dynamic per-tensor activation scale reduces it over routed
    rows only. On the slot path those rows must stay -1 (the manager gives padded rows
    slot 0): computed on slot 0, a padded row's garbage would set every real row's
    scale."""
    mask = torch.tensor([False, False, True])
    vllm_padding_marks(monkeypatch, lambda: mask)

    stock, cached = _PerTensorExperts(seed=12), _PerTensorExperts(seed=12)
    armed = mark_swept(arm(cached, slots=6))
    assert armed.keep_unrouted
    ids = torch.tensor([[1, 2], [2, 3], [-1, -1]], dtype=torch.int32)  # row 2: padding
    w = torch.tensor([[0.5, 0.5], [0.7, 0.3], [0.0, 0.0]])
    x = torch.randn(3, H)
    x[2] *= 100  # garbage in the padding row, as a replayed graph may hold
    got = cached.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    want = stock.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    torch.testing.assert_close(got[:2], want[:2], rtol=0, atol=0)
    assert armed.checked["slots"] == 0.0


def test_only_a_release_that_masks_unrouted_rows_keeps_them_apart():
    """0.26-0.33 reduce a per-tensor scale over every row on the stock path too (no
    ``act_scale_is_tensor_wide``): the slot path leaves their ids as the manager wrote."""
    from expertcache_cli.plugin.runtime import tensor_wide_act_scale

    assert tensor_wide_act_scale(_PerTensorConfig(None, None)) is True
    assert tensor_wide_act_scale(_PerTensorConfig(None, None, a2_scale=torch.ones(1))) is False
    older = SimpleNamespace(a2_scale=None, is_per_tensor=True, use_int8_w8a8=True)
    assert tensor_wide_act_scale(older) is False
    assert tensor_wide_act_scale(None) is False
