"""The armed layer and the trace recorder on CPU torch, with a reference slot cache.

The real `SlotCache` runs CUDA kernels (its own device tests prove it bit-exact against
`policy.LayerCache`). Here a host emulation of the same contract, built on that very
reference, stands in for it, so what is tested is the plugin's part: the shape gate,
the rebinding of every per-expert tensor and of the quant config for exactly the
duration of the stock call, outputs equal to the stock path token for token, the
refusal of a quant config that still points at full storage, and a recorded trace that
replays to the live install count. Skipped (with the reason) where torch is missing.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="no torch: the plugin runtime tests need torch")

from ref_slotcache import RefSlotCache  # noqa: E402

from expertcache_cli.config import CacheConfig  # noqa: E402
from expertcache_cli.plugin.arming import ARM, plan_layer  # noqa: E402
from expertcache_cli.plugin.runtime import (  # noqa: E402
    ArmedLayer,
    ArmError,
    Sweep,
    patch_tile_lookup,
)
from expertcache_cli.policy import LayerCache, Policy, Wide  # noqa: E402

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


def _arm(layer, slots=6, recorder=None, wide_inserts=None):
    d = plan_layer(layer, CacheConfig(slots=slots))
    assert d.action == ARM, d.reason
    specs = {s.name: (s.shape, s.dtype) for s in d.specs}
    cache = RefSlotCache(d.num_experts, d.num_slots, specs, wide_inserts=wide_inserts)
    scratch = None
    if wide_inserts is not None:
        from expertcache_cli.scratch import Scratch, torch_copiers

        scratch = Scratch(d.num_experts, specs, "cpu", copier=torch_copiers)
    armed = ArmedLayer(layer, d, cache, index=0, recorder=recorder, scratch=scratch)
    armed.install()
    return armed


def _routing(rng, tokens):
    ids = np.stack([rng.choice(E, TOPK, replace=False) for _ in range(tokens)])
    return torch.from_numpy(ids.astype(np.int32)), torch.rand(tokens, TOPK)


def _swept(armed):
    """Mark the layer's sweep of every expert done (an agreeing one of no steps): for the
    tests of what follows it, the check of the real call."""
    armed.sweep_result = Sweep([], 0.0)
    return armed


def test_armed_layer_matches_the_stock_path_and_restores_everything():
    stock, cached = Experts(seed=1), Experts(seed=1)
    TileLookup.seen.clear()
    armed = _arm(cached, slots=6)
    assert [s.name for s in armed.decision.specs] == ["w13_weight", "w2_weight", "w13_bias",
                                                      "w2_bias"]
    full_ptr = cached.w13_weight.data_ptr()
    qc_before = cached.quant_method.moe_kernel.fused_experts.quant_config
    rng = np.random.default_rng(0)
    served = 0
    for step in range(60):
        tokens = 1 if step % 7 else 4  # 4 tokens x top-2 = 8 ids > 6 slots: read-through
        x = torch.randn(tokens, H)
        ids, w = _routing(rng, tokens)
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
        _arm(layer)


def test_a_failing_cache_step_falls_back_to_the_stock_path_and_disarms(caplog):
    layer = Experts(seed=2)
    armed = _arm(layer)

    def boom(*a, **k):
        raise ValueError("per-expert slab of 12 bytes")

    armed.cache.step = boom
    x = torch.randn(1, H)
    ids, w = _routing(np.random.default_rng(1), 1)
    with caplog.at_level("ERROR", logger="vllm.expertcache"):
        out = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    torch.testing.assert_close(out, Experts(seed=2).forward_modular(x=x, topk_weights=w,
                                                                    topk_ids=ids))
    assert "stock path" in caplog.text and "12 bytes" in caplog.text
    assert "forward_modular" not in layer.__dict__  # the instance hook is gone


@pytest.mark.parametrize("wide", [Wide.IN_PLACE, Wide.STAGED_INSTALL])
def test_recorded_trace_replays_to_the_live_install_count(tmp_path, wide):
    """Every step is recorded, a step of more than E ids as its distinct experts with its
    real token count; replayed under the server's wide-step mode, the file gives the live
    installs (and, staged, the live scratch fetches) exactly."""
    from expertcache_cli.plugin.recorder import TraceRecorder
    from expertcache_cli.policy import replay_layer_reference
    from expertcache_cli.trace import load

    layer = Experts(seed=3)
    rec = TraceRecorder(1, E, TOPK, torch.device("cpu"), capacity=16, layer_names=[5],
                        model="tiny")
    armed = _arm(layer, slots=6, recorder=rec,
                 wide_inserts=None if wide is Wide.IN_PLACE else 6)
    rng = np.random.default_rng(5)
    for step in range(50):
        tokens = [1, 1, 2, 3, 9][step % 5]  # 3 x 2 = 6 fits; 9 x 2 = 18 > E = 16 ids a row
        ids, w = _routing(rng, tokens)
        layer.forward_modular(x=torch.randn(tokens, H), topk_weights=w, topk_ids=ids)
        rec.maybe_flush()  # the ring of 16 rows drains every 8 engine steps
    live_installs = int(armed.cache.stats[1])
    path = rec.save(tmp_path / "live.npz", live={"installs": live_installs})
    tr = load(path)
    assert tr.num_experts == E and tr.top_k == TOPK and list(tr.layers) == [5]
    assert tr.steps == 50  # the 18-id steps too, as their distinct experts
    assert list(tr.step_tokens[:5]) == [1, 1, 2, 3, 9]
    assert tr.width <= E and (tr.topk_ids[4, 0] >= 0).sum() <= E
    replay = replay_layer_reference(tr.topk_ids[:, 0, :], E, 6, Policy.LRU,
                                    widths=tr.gate_widths()[:, 0], wide=wide)
    assert sum(r.miss_count for r in replay) == live_installs > 0
    assert sum(r.staged_ids for r in replay) == int(armed.staged_fetched)
    assert (int(armed.staged_fetched) > 0) == (wide is not Wide.IN_PLACE)
    assert (tmp_path / "live.live.json").read_text().strip().startswith("{")


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


class _ThreeLayers(torch.nn.Module):
    """Three MoE layers; the middle one's quant method leaks full storage (declined)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for i, leak in enumerate([False, True, False]):
            block = torch.nn.Module()
            block.experts = Experts(leak=leak, seed=i)
            block.experts.layer_name = f"model.layers.{i}.mlp.experts"
            self.layers.append(block)


def test_arm_model_arms_declines_and_records_a_trace(tmp_path, monkeypatch, caplog):
    """The whole per-worker flow: plan, build, install, record, and close at shutdown."""
    import expertcache_cli.slotcache as slotcache_mod
    from expertcache_cli.plugin.session import arm_model
    from expertcache_cli.trace import load

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    model = _ThreeLayers()
    cfg = CacheConfig(slots=6, trace_path=str(tmp_path / "t.npz"))
    caplog.set_level("INFO", logger="vllm.expertcache")
    sess = arm_model(model, cfg, "0.26.0", max_num_seqs=2, model_name="tiny")
    assert [a.decision.layer_name for a in sess.armed] == ["model.layers.0.mlp.experts",
                                                           "model.layers.2.mlp.experts"]
    bad = sess.decisions[1]
    assert bad.action == "decline" and "arming failed" in bad.reason
    assert "armed 2 of 3 MoE layers" in caplog.text and "full expert storage" in caplog.text
    assert [a.index for a in sess.armed] == [0, 1] and sess.recorder.num_layers == 2
    rng = np.random.default_rng(9)
    for _ in range(12):
        ids, w = _routing(rng, 1)
        x = torch.randn(1, H)
        for i in (0, 1, 2):
            model.layers[i].experts.forward_modular(x=x, topk_weights=w, topk_ids=ids)
        sess.after_step()
    sess.close()
    tr = load(tmp_path / "t.npz")
    assert tr.steps == 12 and list(tr.layers) == [0, 2]
    live = json.loads((tmp_path / "t.live.json").read_text())
    assert live["installs"] == sum(int(a.cache.stats[1]) for a in sess.armed) > 0
    assert "final hit rate" in caplog.text and "routing trace written" in caplog.text
    assert ("first-call checks against the stock path: slots path 2 of 2 layers agreed "
            "(largest relative difference 0)") in caplog.text


def _fake_vllm_layout(monkeypatch):
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


def _worker(model, weights=1000, runner_attr=True, kv_cache_memory_bytes=None):
    runner = SimpleNamespace(get_model=lambda: model)
    if runner_attr:
        runner.model_memory_usage = weights
    vc = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=2),
                         model_config=SimpleNamespace(model="tiny"))
    return SimpleNamespace(model_runner=runner, vllm_config=vc,
                           cache_config=SimpleNamespace(
                               kv_cache_memory_bytes=kv_cache_memory_bytes))


def test_slot_bytes_join_the_weights_vllm_plans_its_kv_cache_around(monkeypatch, caplog):
    """vLLM's KV sizing reads model_runner.model_memory_usage as the weights; the
    slots must be in it (else the KV cache takes their memory), exactly their bytes, and a
    declined layer adds nothing."""
    import expertcache_cli.plugin as plugin
    import expertcache_cli.slotcache as slotcache_mod
    from expertcache_cli.plugin import session as session_mod

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    monkeypatch.setattr(session_mod, "_SESSIONS", [])
    _fake_vllm_layout(monkeypatch)
    worker = _worker(_ThreeLayers(), weights=1000)
    caplog.set_level("INFO", logger="vllm.expertcache")
    sess = plugin._arm_worker(worker, CacheConfig(slots=6), "0.26.0")
    assert [a.decision.layer_name for a in sess.armed] == ["model.layers.0.mlp.experts",
                                                           "model.layers.2.mlp.experts"]
    # per expert: w13 8x8 + w2 8x4 + biases 8 + 8, float32 = 448 B; 6 slots; 2 armed layers
    per_expert = (2 * INTER * H + H * INTER + 2 * INTER + H) * 4
    assert sess.slot_bytes == 2 * 6 * per_expert == 5376
    real = sum(buf.numel() * buf.element_size() for a in sess.armed
               for buf in a.cache.slots.values())
    assert sess.slot_bytes == real
    assert worker.model_runner.model_memory_usage == 1000 + 5376 == sess.weights_bytes

    plugin._log_memory_plan(worker, sess, 3 * 2**30)
    assert "GiB of slots counted as weights" in caplog.text
    assert "vLLM chose 3.00 GiB of KV cache" in caplog.text
    worker.cache_config.kv_cache_memory_bytes = 2**30
    plugin._log_memory_plan(worker, sess, 2**30)
    assert "--kv-cache-memory-bytes fixes the KV cache at 1.00 GiB" in caplog.text
    assert "cannot hold one" not in caplog.text  # this worker says nothing of its KV specs


def test_a_kv_cache_too_small_for_one_sequence_says_how_many_slots_to_drop(monkeypatch, caplog):
    """vLLM refuses to start when its KV cache cannot hold one --max-model-len sequence;
    after the slots took their share, the plugin says so first, with the fix in slots."""
    import expertcache_cli.plugin as plugin
    import expertcache_cli.slotcache as slotcache_mod
    from expertcache_cli.plugin import session as session_mod

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    monkeypatch.setattr(session_mod, "_SESSIONS", [])
    _fake_vllm_layout(monkeypatch)
    worker = _worker(_ThreeLayers(), weights=1000)
    worker.vllm_config.model_config.max_model_len = 8192

    class Spec:  # vLLM's KVCacheSpec: what one max-model-len sequence needs
        def max_memory_usage_bytes(self, config):
            assert config is worker.vllm_config
            return 10_000

    worker.get_kv_cache_spec = lambda: {"l0": Spec(), "l1": Spec()}
    caplog.set_level("INFO", logger="vllm.expertcache")
    sess = plugin._arm_worker(worker, CacheConfig(slots=6), "0.26.0")
    row = sess.slot_bytes // 6  # one slot fewer in both armed layers: 896 B
    plugin._log_memory_plan(worker, sess, 20_000)
    assert "cannot hold one" not in caplog.text  # 20,000 B hold the 20,000 B sequence
    plugin._log_memory_plan(worker, sess, 20_000 - 2 * row + 1)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].startswith(
        "expertcache: after the slots, vLLM's KV cache (0.00 GiB) cannot hold one "
        "--max-model-len 8192 sequence (0.00 GiB), so vLLM will refuse to start; serve "
        "with 2 fewer slots a layer (EXPERT_CACHE_SLOTS=4, or `expertcache serve --slots 4`)"
        " or --max-model-len at most about 7458"), errors


def test_a_cold_compile_in_the_profile_step_is_named_in_the_memory_lines(monkeypatch, caplog):
    """vLLM counts a cold torch.compile's temporaries as activations in the profile step
    that sizes the KV cache (vLLM #54122): where this process compiled, the memory line and
    the shortfall line say so, so the user restarts before giving up slots."""
    import sys
    import types

    import expertcache_cli.plugin as plugin
    import expertcache_cli.slotcache as slotcache_mod
    from expertcache_cli.plugin import memory
    from expertcache_cli.plugin import session as session_mod

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    monkeypatch.setattr(session_mod, "_SESSIONS", [])
    _fake_vllm_layout(monkeypatch)
    counter = types.SimpleNamespace(num_inductor_compiles=0)
    for name in ("vllm.compilation", "vllm.compilation.counter"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["vllm.compilation.counter"].compilation_counter = counter
    # Inductor's cache counters (torch._dynamo.utils.counters), empty: caches off
    inductor: dict[str, dict[str, object]] = {}
    for name in ("torch._dynamo", "torch._dynamo.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["torch._dynamo.utils"].counters = inductor
    worker = _worker(_ThreeLayers(), weights=1000)
    worker.vllm_config.model_config.max_model_len = 8192

    class Spec:
        def max_memory_usage_bytes(self, config):
            return 10_000

    worker.get_kv_cache_spec = lambda: {"l0": Spec()}
    caplog.set_level("INFO", logger="vllm.expertcache")
    sess = plugin._arm_worker(worker, CacheConfig(slots=6), "0.26.0")
    plugin._log_memory_plan(worker, sess, 3 * 2**30)  # warm: nothing compiled here
    assert "compiled" not in caplog.text and memory.compiled_here() == 0
    counter.num_inductor_compiles = 3
    plugin._log_memory_plan(worker, sess, 3 * 2**30)
    plugin._log_memory_plan(worker, sess, 5_000)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[-3].endswith("vLLM chose 3.00 GiB of KV cache; this start compiled 3 "
                              "graph(s) inside vLLM's memory profile, which counts a cold "
                              "compile's temporaries as activations (vLLM issue #54122): a "
                              "restart with the compile cache now warm may get more KV cache")
    assert "so vLLM will refuse to start" in lines[-1] and lines[-1].endswith(
        "a restart with the compile cache now warm may get more KV cache")
    counter.num_inductor_compiles = True  # not a count: said nothing of
    assert memory.compiled_here() == 0 and memory.cold_compile_note(0) == ""
    # a warm start: vLLM's cache missed but Inductor's served every graph (the H200, vLLM
    # 0.26: 46 counted by vLLM, loaded in 1.9 s): no note
    counter.num_inductor_compiles = 46
    inductor["inductor"] = {"fxgraph_cache_hit": 46}
    assert memory.compiled_here() == 0
    inductor["aot_autograd"] = {"autograd_cache_hit": 46}
    inductor["inductor"] = {}
    assert memory.compiled_here() == 0
    # a cold one: Inductor generated code for 49 graphs, whatever vLLM counted
    inductor["inductor"] = {"fxgraph_cache_miss": 49, "fxgraph_cache_hit": 2}
    assert memory.compiled_here() == 49


def test_the_shortfall_line_without_slots_to_spare_names_the_context():
    from expertcache_cli.plugin.memory import kv_shortfall_line

    assert kv_shortfall_line(5, 5, 8192, 1, [4]) is None
    line = kv_shortfall_line(2 * 2**30, 8 * 2**30, 8192, 2**20, [3, 3])
    assert line.endswith("so vLLM will refuse to start; lower --max-model-len to about 2048")
    per_layer = kv_shortfall_line(2 * 2**30, 3 * 2**30, 8192, 2**29, [40, 52])
    assert per_layer.endswith("serve with 2 fewer slots a layer (each entry of the per-layer "
                              "plan) or --max-model-len at most about 5461")


def test_a_runner_that_cannot_count_slots_is_not_armed(monkeypatch, caplog):
    """No model_memory_usage: the slots could not enter vLLM's plan, so nothing is
    allocated and the model serves on the stock path, with the reason logged."""
    import expertcache_cli.plugin as plugin
    import expertcache_cli.slotcache as slotcache_mod

    made: list[int] = []

    class Counting(RefSlotCache):
        def __init__(self, *a, **k):
            made.append(1)
            super().__init__(*a, **k)

    monkeypatch.setattr(slotcache_mod, "SlotCache", Counting)
    _fake_vllm_layout(monkeypatch)
    model = _ThreeLayers()
    caplog.set_level("INFO", logger="vllm.expertcache")
    worker = _worker(model, runner_attr=False)
    sess = plugin._arm_worker(worker, CacheConfig(slots=6), "0.26.0")
    assert made == [] and sess.armed == [] and sess.slot_bytes == 0
    assert [d.action for d in sess.decisions] == ["decline"] * 3
    assert "model_memory_usage is not a byte count" in sess.decisions[0].reason
    assert "armed 0 of 3 MoE layers" in caplog.text and "not armed:" in caplog.text
    assert "forward_modular" not in vars(model.layers[0].experts)
    assert not hasattr(worker.model_runner, "model_memory_usage")


def test_read_through_decode_steps_are_counted_apart_and_the_line_parses(caplog):
    """A decode-width step (no wider than the padded full batch) that reads through is what
    the sizing trap is about; prefill reads through by design. The final line carries both
    counts, in the shape `baseline` parses (one format, pinned across the two modules)."""
    from expertcache_cli.baseline.counters import parse_stats_line
    from expertcache_cli.plugin.session import Session

    layer = Experts()
    d = plan_layer(layer, CacheConfig(slots=6))
    cache = RefSlotCache(d.num_experts, d.num_slots, {s.name: (s.shape, s.dtype) for s in d.specs})
    armed = ArmedLayer(layer, d, cache, index=0, decode_tokens=4)
    armed.install()
    rng = np.random.default_rng(2)
    for tokens in (1, 3, 4, 9):  # 3 x 2 = 6 ids fit 6 slots; 4 x 2 = 8 do not
        ids, w = _routing(rng, tokens)
        layer.forward_modular(x=torch.randn(tokens, H), topk_weights=w, topk_ids=ids)
    assert int(armed.read_through) == 2 and int(armed.read_through_decode) == 1
    caplog.set_level("INFO", logger="vllm.expertcache")
    Session(CacheConfig(slots=6), [d], [armed], None).report(final=True)
    got = parse_stats_line(caplog.text)
    assert got["final"] and got["read_through_steps"] == 2
    assert got["read_through_decode_steps"] == 1 and got["layers"] == 1


def test_a_parameter_registered_under_two_names_is_rebound_under_both():
    stock, cached = AliasedExperts(seed=2), AliasedExperts(seed=2)
    assert cached._parameters["w13_weight"] is cached._parameters["w13_qweight"]
    armed = _arm(cached, slots=6)
    assert [s.name for s in armed.decision.specs][:2] == ["w13_bias", "w2_bias"]
    assert armed.param_names["w13_qweight"] == ["w13_qweight", "w13_weight"]
    rng = np.random.default_rng(3)
    for _ in range(20):
        x = torch.randn(1, H)
        ids, w = _routing(rng, 1)
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
    armed = _arm(cached, slots=6)
    ids, w = _routing(np.random.default_rng(1), 1)
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


def test_rows_vllm_marks_as_padding_install_nothing_and_count_nothing(monkeypatch):
    """vLLM's V2 runner marks CUDA-graph padding rows in
    forward_context.is_padding; their ids must not reach the manager (no installs, no
    requests), the real rows' outputs stay those of the stock path, and the rows the kernel
    sees for padding are valid slots."""
    import sys
    import types

    mask = torch.tensor([False, False, True])
    fc = types.ModuleType("vllm.forward_context")
    fc.is_forward_context_available = lambda: True
    fc.get_forward_context = lambda: SimpleNamespace(is_padding=mask)
    for name in ("vllm", "vllm.forward_context"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["vllm.forward_context"] = fc

    layer = Experts(seed=4)
    d = plan_layer(layer, CacheConfig(slots=6))
    cache = RefSlotCache(d.num_experts, d.num_slots, {s.name: (s.shape, s.dtype) for s in d.specs})
    seen: list[torch.Tensor] = []
    step = cache.step
    cache.step = lambda ids, src, **kw: seen.append(ids.clone()) or step(ids, src, **kw)
    armed = ArmedLayer(layer, d, cache, index=0)
    armed.install()
    ids = torch.tensor([[1, 2], [2, 3], [14, 15]], dtype=torch.int32)  # row 2 is padding
    w, x = torch.rand(3, TOPK), torch.randn(3, H)
    got = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    # the manager gets the ids as they are and vLLM's marks (it leaves the rows out itself)
    assert seen[-1].tolist() == ids.tolist()  # (after the sweep's steps, which mark none)
    assert cache.pad_rows_seen[-1] == [False, False, True] and armed.checked["slots"] == 0.0
    assert np.flatnonzero(np.asarray(cache.ref.table) >= 0).tolist() == [1, 2, 3]  # no 14, 15
    assert cache.stats.tolist() == [3, 3]  # requests: the 3 real distinct ids only
    armed.uninstall()
    want = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    assert torch.allclose(got[:2], want[:2], atol=1e-5)


def _v1_worker(count_buf, **parallel):
    runner_cls = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu_model_runner"})
    runner = runner_cls()
    runner.query_start_loc = SimpleNamespace(gpu=count_buf)
    pc = SimpleNamespace(data_parallel_size=1, use_ubatching=False,
                         use_sequence_parallel_moe=False)
    pc.__dict__.update(parallel)
    return SimpleNamespace(model_runner=runner, vllm_config=SimpleNamespace(parallel_config=pc))


def test_the_v1_runner_real_token_count_is_read_live_and_only_where_rows_are_tokens():
    from expertcache_cli.plugin import padding

    buf = torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32)  # 2 real tokens, padded to 4 reqs
    count, why = padding.v1_token_count(_v1_worker(buf))
    assert count is not None and int(count) == 2 and "query_start_loc" in why
    buf[-1] = 3
    assert int(count) == 3  # a view: the next step's value, as a graph replay reads it
    for kw, word in (({"data_parallel_size": 2}, "data parallel"),
                     ({"use_ubatching": True}, "use_ubatching"),
                     ({"use_sequence_parallel_moe": True}, "use_sequence_parallel_moe")):
        got, why = padding.v1_token_count(_v1_worker(buf, **kw))
        assert got is None and word in why
    v2 = _v1_worker(buf)
    v2.model_runner.__class__.__module__ = "vllm.v1.worker.gpu.model_runner"
    assert padding.v1_token_count(v2) == (None, "not vLLM's V1 model runner")


def test_v1_padding_rows_are_masked_inside_graphs_only(monkeypatch):
    """Rows at or past the real count are padding, read when a graph is captured (replays
    read the live count); eager calls (dummy runs with a stale count, the first-call check)
    see every row as real."""
    from expertcache_cli.plugin import padding

    buf = torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32)
    read = padding.mask_reader(buf[-1:], max_tokens=8)
    monkeypatch.setattr(padding, "capturing", lambda: False)
    assert read(4) is None
    monkeypatch.setattr(padding, "capturing", lambda: True)
    assert read(4).tolist() == [False, False, True, True]
    buf[-1] = 3
    assert read(4).tolist() == [False, False, False, True]
    assert read(9) is None  # wider than any graph: not a padded decode batch


def test_the_plugin_says_once_where_padding_rows_come_from(monkeypatch, caplog):
    import expertcache_cli.plugin as plugin
    from expertcache_cli.plugin import padding

    caplog.set_level("DEBUG", logger="vllm.expertcache")
    buf = torch.tensor([0, 1, 1], dtype=torch.int32)
    worker = _v1_worker(buf)
    worker.vllm_config.scheduler_config = SimpleNamespace(max_num_batched_tokens=8)
    read = plugin._padding_reader(worker)
    assert ("CUDA-graph padding rows are kept out of the cache (vLLM's V1 runner: rows past "
            "query_start_loc's last entry)") in caplog.text
    monkeypatch.setattr(padding, "capturing", lambda: True)
    assert read(2).tolist() == [False, True]
    plugin._padding_reader(_v1_worker(buf, data_parallel_size=2))
    assert "padding rows from vLLM's V2 marks only (data parallel" in caplog.text


@pytest.mark.parametrize("route", ["count", "mask"])
def test_v1_padding_rows_install_nothing_and_count_nothing(monkeypatch, route):
    """Captured on V1, the manager gets the real-rows count and the ids as they are (no
    mask launches); with a mask-only reader (a trace being recorded takes this path too),
    the padded ids are masked first. Both: nothing installed or counted for the padding."""
    from expertcache_cli.plugin import padding, runtime

    buf = torch.tensor([0, 1, 2, 2], dtype=torch.int32)  # 2 real tokens of a 3-row graph
    monkeypatch.setattr(padding, "capturing", lambda: True)
    monkeypatch.setattr(runtime, "_capturing", lambda: True)
    layer = Experts(seed=4)
    d = plan_layer(layer, CacheConfig(slots=6))
    cache = RefSlotCache(d.num_experts, d.num_slots, {s.name: (s.shape, s.dtype) for s in d.specs})
    seen: list[torch.Tensor] = []
    step = cache.step
    cache.step = lambda ids, src, **kw: seen.append(ids.clone()) or step(ids, src, **kw)
    reader = padding.mask_reader(buf[-1:], max_tokens=8)
    armed = ArmedLayer(layer, d, cache, index=0,
                       padding=reader if route == "count" else (lambda n: reader(n)))
    armed.install()
    ids = torch.tensor([[1, 2], [2, 3], [14, 15]], dtype=torch.int32)  # row 2 is padding
    w, x = torch.rand(3, TOPK), torch.randn(3, H)
    got = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    if route == "count":
        assert cache.real_rows_seen == [2] and seen[0].tolist() == ids.tolist()
    else:
        assert cache.real_rows_seen == [None] and seen[0].tolist() == [[1, 2], [2, 3],
                                                                      [-1, -1]]
    assert np.flatnonzero(np.asarray(cache.ref.table) >= 0).tolist() == [1, 2, 3]  # no 14, 15
    assert cache.stats.tolist() == [3, 3]
    armed.uninstall()
    want = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    assert torch.allclose(got[:2], want[:2], atol=1e-5)


@pytest.mark.parametrize("route,launches", [
    ("count", []),
    ("marks", []),
    ("mask", ["ge", "scalar_tensor", "where", "scalar_tensor", "where"])])
def test_a_captured_v1_step_launches_no_torch_kernel_besides_the_cache_step(
        monkeypatch, route, launches):
    """What an armed layer adds to a captured decode graph, beside the cache's own step
    and the experts call: on V1 with the count, nothing (kernel ABI 2 reads it); with a
    torch mask, a compare and two torch.where with the scalars they fill (on the GPU each
    a kernel, so five graph nodes a layer; with them the all-hit layer cost ~12 us served
    against a 4.1 us step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from expertcache_cli.plugin import padding, runtime

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    class Quiet(Experts):  # a stock call that launches nothing, to see the plugin's own
        def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None,
                            shared_experts_input=None):
            return x

    layer = Quiet()
    d = plan_layer(layer, CacheConfig(slots=6))
    cache = RefSlotCache(d.num_experts, d.num_slots, {s.name: (s.shape, s.dtype) for s in d.specs})
    # the cache step launches kernels of its own (what the probe times), no torch op
    cache.step = lambda ids, sources, **rows: ids
    buf = torch.tensor([0, 1, 1], dtype=torch.int32)
    reader = padding.mask_reader(buf[-1:], max_tokens=8)
    if route == "marks":  # vLLM's V2 runner: its marks in the forward context
        import sys
        import types

        fc = types.ModuleType("vllm.forward_context")
        fc.is_forward_context_available = lambda: True
        marks = torch.tensor([False, True])  # vLLM's buffer, made before the step
        fc.get_forward_context = lambda: SimpleNamespace(is_padding=marks)
        for name in ("vllm", "vllm.forward_context"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        sys.modules["vllm.forward_context"] = fc
        reader = padding.mask_reader()
    armed = ArmedLayer(layer, d, cache, index=0,
                       padding=reader.__call__ if route == "mask" else reader)
    armed.install()
    armed.checked["slots"] = 0.0  # (the first-call check is an eager call's business)
    monkeypatch.setattr(padding, "capturing", lambda: True)
    monkeypatch.setattr(runtime, "_capturing", lambda: True)
    x, w = torch.randn(2, H), torch.rand(2, TOPK)
    ids = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    with Ops() as ops:
        layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    views = {"slice", "unsqueeze", "view", "alias", "detach", "expand", "select"}
    assert [n for n in ops.names if n not in views] == launches


def test_the_real_rows_count_is_given_only_where_the_mask_would_come_from_it(monkeypatch):
    from expertcache_cli.plugin import padding

    buf = torch.tensor([0, 1, 2, 2], dtype=torch.int32)
    read = padding.mask_reader(buf[-1:], max_tokens=8)
    monkeypatch.setattr(padding, "capturing", lambda: False)
    assert read.rows(3) is None  # eager: dummy runs and the first-call check see every row
    monkeypatch.setattr(padding, "capturing", lambda: True)
    assert int(read.rows(3)["real_rows"]) == 2
    assert read.rows(9) is None  # wider than any graph
    wide = padding.mask_reader(torch.tensor([0, 2], dtype=torch.int64)[-1:], max_tokens=8)
    assert wide.rows(2) is None and wide(2).tolist() == [False, False]  # the kernel reads int32


def test_the_recorder_spills_to_disk_and_writes_the_same_trace(tmp_path):
    """Host memory stays bounded: drained rows go to a spill file, not a Python list; the
    trace written from the spill equals the one from memory, and the spill is removed."""
    from expertcache_cli.plugin.recorder import TraceRecorder
    from expertcache_cli.trace import load

    spill = tmp_path / ".live.npz.spill"
    recs = [TraceRecorder(2, E, TOPK, torch.device("cpu"), capacity=8, spill=s)
            for s in (None, spill)]
    rng = np.random.default_rng(11)
    for _ in range(40):
        ids, _ = _routing(rng, int(rng.integers(1, 4)))
        for rec in recs:
            for layer in (0, 1):
                rec.record(layer, ids)
            rec.maybe_flush()
    assert recs[1].chunks == [] and spill.stat().st_size > 0  # nothing kept in memory
    a, b = (load(rec.save(tmp_path / f"t{i}.npz")) for i, rec in enumerate(recs))
    assert a.steps == b.steps == 40
    assert np.array_equal(a.topk_ids, b.topk_ids) and np.array_equal(a.step_tokens,
                                                                    b.step_tokens)
    assert not spill.exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "t0.npz", "t1.npz"]


def test_replicas_and_stages_write_their_own_trace_files():
    from expertcache_cli.plugin.session import replica_path

    assert replica_path("/t/run.npz", {"tp": 0, "pp": 0, "dp": 0}) == "/t/run.npz"
    assert replica_path("/t/run.npz", {"tp": 1, "pp": 0, "dp": 0}) == "/t/run.tp1.npz"
    assert replica_path("/t/run.npz", {"tp": 0, "pp": 1, "dp": 2}) == "/t/run.pp1.dp2.npz"
    assert replica_path("/t/run.npz") == "/t/run.npz"  # no vLLM here: rank 0 everywhere


def test_invalidated_slots_refill_from_the_new_weights(caplog):
    from expertcache_cli.plugin.session import Session

    layer = Experts(seed=7)
    armed = _arm(layer, slots=6)
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


def test_the_shutdown_audit_passes_served_slots_and_names_a_corrupted_one(caplog):
    """EXPERT_CACHE_AUDIT=1: at shutdown every occupied slot is compared, byte for byte,
    with its expert's source, and the table with the slots; a slot whose bytes changed
    after its install (what a racing gather would leave) is named in an error line."""
    from expertcache_cli.plugin.session import Session

    layer = Experts(seed=3)
    armed = _arm(layer, slots=6)
    sess = Session(CacheConfig(slots=6, audit=True), [armed.decision], [armed], None)
    rng = np.random.default_rng(4)
    for _ in range(10):
        ids, w = _routing(rng, 2)
        layer.forward_modular(x=torch.randn(2, H), topk_weights=w, topk_ids=ids)
    caplog.set_level("INFO", logger="vllm.expertcache")
    assert sess.audit()
    occupied = int((armed.cache.slot_expert >= 0).sum())
    assert occupied == 6
    assert (f"slot audit at shutdown: {occupied} occupied slots in 1 layers hold their "
            "experts' bytes in all 4 mirrored tensors") in caplog.text
    s = 2
    e = int(armed.cache.slot_expert[s])
    armed.cache.slots["w2_bias"][s, 0] += 1.0  # one element of one tensor of one slot
    caplog.clear()
    sess.close()  # the final report, then the audit
    err = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(err) == 1 and err[0].getMessage() == (
        "expertcache: slot audit at shutdown FAILED in 1 of 1 layers (6 occupied slots): "
        f"model.layers.5.mlp.experts: slot {s} (expert {e}): w2_bias differs from the "
        "expert's source")


def test_a_trace_with_masked_padding_replays_to_the_live_counters(tmp_path, monkeypatch):
    """One gate for live and replay: padded rows vLLM masks still count toward the live
    shape gate (the step is as wide as vLLM ran it), and the replay of the recorded trace
    uses the recorded tokens x top_k, not the valid ids, so both read through alike."""
    import sys
    import types

    from expertcache_cli import engine
    from expertcache_cli.plugin.recorder import TraceRecorder
    from expertcache_cli.trace import load

    state = {"mask": None}
    fc = types.ModuleType("vllm.forward_context")
    fc.is_forward_context_available = lambda: True
    fc.get_forward_context = lambda: SimpleNamespace(is_padding=state["mask"])
    for name in ("vllm", "vllm.forward_context"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["vllm.forward_context"] = fc

    layer = Experts(seed=8)
    rec = TraceRecorder(1, E, TOPK, torch.device("cpu"), capacity=64)
    armed = _arm(layer, slots=6, recorder=rec)
    rng = np.random.default_rng(4)
    for step in range(40):
        real = [1, 2, 3][step % 3]
        padded = 4 if real == 3 else real  # 3 sequences run as the 4-graph: 8 ids > 6 slots
        state["mask"] = torch.tensor([i >= real for i in range(padded)])
        ids, w = _routing(rng, padded)
        layer.forward_modular(x=torch.randn(padded, H), topk_weights=w, topk_ids=ids)
        rec.maybe_flush()
    live = armed.cache.stats.tolist()
    tr = load(rec.save(tmp_path / "t.npz"))
    (c,) = engine.sweep(tr.topk_ids, E, [Policy.LRU], [6], widths=tr.gate_widths())
    assert (c.requests - c.read_through_ids, c.installs) == (live[0], live[1])
    assert c.read_through_steps == int(armed.read_through) > 0
    (old,) = engine.sweep(tr.topk_ids, E, [Policy.LRU], [6])  # the valid-ids gate
    assert old.read_through_steps == 0  # would have disagreed with the live server


def test_per_layer_budgets_arm_each_layer_with_its_own_slots(monkeypatch, caplog):
    """EXPERT_CACHE_SLOTS=6,5,4 (a plan's split): layer i gets the i-th budget; the startup
    line lists them; a list of the wrong length (a plan for another model) arms nothing."""
    import expertcache_cli.slotcache as slotcache_mod
    from expertcache_cli.config import from_env
    from expertcache_cli.plugin.session import arm_model

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    caplog.set_level("INFO", logger="vllm.expertcache")
    sess = arm_model(_ThreeLayers(), from_env({"EXPERT_CACHE_SLOTS": "6,5,4"}), "0.26.0")
    assert [(a.decision.layer_name, a.decision.num_slots) for a in sess.armed] == [
        ("model.layers.0.mlp.experts", 6), ("model.layers.2.mlp.experts", 4)]
    assert "4-6 of 16 experts/layer as slots (per layer: 6,4)" in caplog.text
    assert "per-layer budgets (EXPERT_CACHE_SLOTS, 3 values)" in caplog.text
    assert sess.slot_bytes == (6 + 4) * sess.armed[0].decision.slot_bytes // 6
    wrong = arm_model(_ThreeLayers(), from_env({"EXPERT_CACHE_SLOTS": "6,5"}), "0.26.0")
    assert wrong.armed == [] and "lists 2 per-layer budgets for 3 MoE layers" in caplog.text


@pytest.mark.parametrize("wide", [Wide.STAGED, Wide.STAGED_INSTALL])
def test_wide_steps_staged_through_the_scratch_equal_the_stock_path(wide):
    """Narrow and wide steps mixed: every output equals the stock (in-place) path bit for
    bit; wide steps run on the scratch with the ids unchanged and the full expert count
    for the tiles; the cache follows the reference's wide-step rules; the counters say
    how many experts the scratch fetched from host."""
    stock, cached = Experts(seed=3), Experts(seed=3)
    TileLookup.seen.clear()
    armed = _arm(cached, slots=6, wide_inserts=0 if wide is Wide.STAGED else 6)
    ref = LayerCache(E, 6, Policy.LRU, wide=wide)
    full_ptr = cached.w13_weight.data_ptr()
    scratch_ptr = armed.scratch.buffers["w13_weight"].data_ptr()
    rng = np.random.default_rng(4)
    fetched = wide_steps = 0
    for step in range(50):
        tokens = 1 if step % 3 else 5  # 5 tokens x top-2 = 10 ids > 6 slots: a wide step
        x = torch.randn(tokens, H)
        ids, w = _routing(rng, tokens)
        want = stock.forward_modular(x=x, topk_weights=w, topk_ids=ids)
        got = cached.forward_modular(x=x, topk_weights=w, topk_ids=ids)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        r = ref.forward(ids.numpy())
        fetched += r.staged_ids
        wide_steps += r.staged
        assert np.array_equal(armed.cache.ref.table, ref.table), step
        assert cached.w13_weight.data_ptr() == full_ptr
    assert int(armed.read_through) == 0
    assert int(armed.staged) == wide_steps == 17
    assert int(armed.staged_fetched) == fetched > 0
    # (and the sweep's one wide step routing all 16 experts through the scratch)
    # (its first call had 5 rows: 2 scratch steps of 5 x top-2 ids)
    assert [(p.path, p.covered, p.steps) for p in armed.sweep_result.paths] == [
        ("slots", E, 3), ("scratch", E, 2)]
    assert cached.weights_seen.count(scratch_ptr) == wide_steps + 2
    assert set(TileLookup.seen) == {E}
    assert armed.scratch_quant_config.w13_bias.data_ptr() == (
        armed.scratch.buffers["w13_bias"].data_ptr())


def test_a_failing_staged_step_falls_back_to_the_stock_path_and_disarms(caplog):
    stock, cached = Experts(seed=2), Experts(seed=2)
    armed = _arm(cached, slots=6, wide_inserts=6)

    def boom(*a, **k):
        raise RuntimeError("scratch exploded")

    armed.scratch.stage = boom
    x = torch.randn(5, H)
    ids, w = _routing(np.random.default_rng(1), 5)
    got = cached.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    torch.testing.assert_close(got, stock.forward_modular(x=x, topk_weights=w, topk_ids=ids),
                               rtol=0, atol=0)
    assert "staged wide step failed (RuntimeError: scratch exploded)" in caplog.text
    assert "forward_modular" not in cached.__dict__  # disarmed: the stock method again


def test_the_wide_step_scratch_is_shared_planned_and_announced(monkeypatch, caplog):
    """EXPERT_CACHE_WIDE=staged-install: one scratch for the two same-shaped layers, its
    bytes (every expert of one layer) join the slots in vLLM's memory plan, the startup
    and memory lines say so, and the sizing trap is no longer a silent bypass."""
    import expertcache_cli.plugin as plugin
    import expertcache_cli.scratch as scratch_mod
    import expertcache_cli.slotcache as slotcache_mod
    from expertcache_cli.plugin import session as session_mod
    from expertcache_cli.plugin.arming import summary_line

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    monkeypatch.setattr(scratch_mod, "cuda_copiers", scratch_mod.torch_copiers)
    monkeypatch.setattr(session_mod, "_SESSIONS", [])
    _fake_vllm_layout(monkeypatch)
    worker = _worker(_ThreeLayers(), weights=1000)
    caplog.set_level("INFO", logger="vllm.expertcache")
    cfg = CacheConfig(slots=6, wide=Wide.STAGED_INSTALL)
    sess = plugin._arm_worker(worker, cfg, "0.26.0")
    a, b = sess.armed
    assert a.scratch is b.scratch and a.cache.wide_inserts == 6
    per_expert = (2 * INTER * H + H * INTER + 2 * INTER + H) * 4
    assert sess.scratch_bytes == E * per_expert == a.scratch.nbytes
    assert worker.model_runner.model_memory_usage == 1000 + 2 * 6 * per_expert + E * per_expert
    assert "wide steps staged-install through a 0.00 GiB scratch" in caplog.text
    plugin._log_memory_plan(worker, sess, 2**30)
    assert "GiB of slots and 0.00 GiB of wide-step scratch counted as weights" in caplog.text
    line = summary_line(sess.decisions, cfg, "0.26.0", max_num_seqs=8, capture_sizes=[1, 2, 4, 8])
    assert "TRAP" not in line and "full batches (8 x 2 ids > 6 slots) are staged" in line
    in_place = summary_line(sess.decisions, CacheConfig(slots=6), "0.26.0", max_num_seqs=8,
                            capture_sizes=[1, 2, 4, 8])
    assert "TRAP" in in_place
    # a wide step through the shared scratch, then the counters line says what it fetched
    rng = np.random.default_rng(2)
    ids, w = _routing(rng, 5)
    worker.model_runner.get_model().layers[0].experts.forward_modular(
        x=torch.randn(5, H), topk_weights=w, topk_ids=ids)
    sess.report()
    assert "staged steps=1 (fetched " in caplog.text


# -- the slot path can never take a server down ------------------------------------------

def _one_call_with_a_slot_variant(caplog, seed, variant, swept=False):
    """Arm a layer whose experts call is ``variant(out, on_slots)`` of the stock one, serve
    one decode step (``swept``: with the sweep of every expert marked done); returns the
    armed layer, what it served and what the stock path gives."""
    layer = Experts(seed=seed)
    armed = _arm(layer)
    if swept:
        _swept(armed)
    assert "forward_modular" in layer.__dict__  # the instance hook is installed
    stock_forward = Experts.forward_modular

    def changed(self, x, topk_weights, topk_ids, **kw):
        return variant(lambda: stock_forward(self, x, topk_weights, topk_ids, **kw),
                       self.w13_weight.shape[0] != E)

    armed._stock = changed.__get__(layer)
    x = torch.randn(1, H)
    ids, w = _routing(np.random.default_rng(seed), 1)
    with caplog.at_level("ERROR", logger="vllm.expertcache"):
        out = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    want = Experts(seed=seed).forward_modular(x=x, topk_weights=w, topk_ids=ids)
    assert layer.w13_weight.shape[0] == E  # the full tensors are back
    return layer, armed, out, want


def test_an_experts_call_that_raises_on_slot_buffers_falls_back_and_disarms(caplog):
    """The stock kernel refusing the slot buffers (any exception, at serve time) sends the
    layer back to the stock path; the call is served from there."""
    def picky(call, on_slots):
        if on_slots:
            raise RuntimeError("illegal memory access (stand-in)")
        return call()

    layer, _, out, want = _one_call_with_a_slot_variant(caplog, 4, picky)
    torch.testing.assert_close(out, want)
    assert "experts call on slots failed (RuntimeError: illegal memory access" in caplog.text
    assert "forward_modular" not in layer.__dict__


@pytest.mark.parametrize("swept", [False, True])
def test_a_slot_path_that_computes_something_else_is_caught_at_its_first_call(caplog, swept):
    """A quant method whose kernel reads something the rebinding does not follow (here: a
    stand-in that scales its output when it sees slot-shaped weights) gives a different output;
    the sweep of every expert at the first call catches it before the call is served (and,
    were the sweep done, the check of the call itself would), and the stock output is
    served."""
    def off_by_one(call, on_slots):
        return call() * 1.5 if on_slots else call()

    layer, armed, out, want = _one_call_with_a_slot_variant(caplog, 5, off_by_one, swept)
    torch.testing.assert_close(out, want)
    if swept:
        assert armed.checked["slots"] > 0.02
        assert "the slots path's output differs from the stock path's on the same step" in (
            caplog.text)
    else:
        assert armed.sweep_result.failed and armed.checked["slots"] is None
        assert ("the slots path's output differs from the stock path's on experts [0, 1] of "
                "a synthetic step (relative difference of a row 0.5 > 0.02); layer back on "
                "the stock path") in caplog.text
    assert "forward_modular" not in layer.__dict__


def test_all_zero_steps_do_not_count_as_checked():
    """vLLM's dummy runs feed zeros: equal outputs that prove nothing; the check waits for
    a real step, and gives up after CHECK_ATTEMPTS such steps."""
    from expertcache_cli.plugin import runtime

    layer = Experts(seed=6)
    for bias in ("w13_bias", "w2_bias"):
        getattr(layer, bias).data.zero_()
    armed = _arm(layer)
    ids, w = _routing(np.random.default_rng(6), 1)
    layer.forward_modular(x=torch.zeros(1, H), topk_weights=w, topk_ids=ids)
    assert armed.checked["slots"] is None
    assert armed._check_attempts["slots"] == runtime.CHECK_ATTEMPTS - 1
    layer.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
    assert armed.checked["slots"] == 0.0


def test_the_staged_path_is_checked_at_its_first_wide_step():
    layer = Experts(seed=7)
    armed = _arm(layer, slots=6, wide_inserts=6)
    ids, w = _routing(np.random.default_rng(7), 5)  # 10 ids > 6 slots: staged
    out = layer.forward_modular(x=torch.randn(5, H), topk_weights=w, topk_ids=ids)
    assert out.shape == (5, H) and armed.checked == {"slots": None, "scratch": 0.0}


def test_the_check_reruns_only_the_first_rows_of_a_wide_step(monkeypatch):
    """The reference call of the check runs the stock path on the first CHECK_ROWS tokens
    only (its activations would add to vLLM's profile peak); the path's output is served
    whole, and it agrees with a full stock call."""
    from expertcache_cli.plugin import runtime

    monkeypatch.setattr(runtime, "CHECK_ROWS", 2)
    layer = Experts(seed=7)
    armed = _swept(_arm(layer, slots=6, wide_inserts=6))
    seen = []
    stock_forward = armed._stock

    def counting(**kw):
        seen.append((kw["topk_ids"].shape[0], kw["topk_weights"].shape[0], kw["x"].shape[0]))
        return stock_forward(**kw)

    armed._stock = counting
    ids, w = _routing(np.random.default_rng(7), 5)  # 10 ids > 6 slots: staged
    x = torch.randn(5, H)
    want = Experts.forward_modular(layer, x.clone(), w, ids)
    out = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    assert seen == [(5, 5, 5), (2, 2, 2)]  # the path (on the scratch), then 2 rows
    assert armed.checked["scratch"] == 0.0
    torch.testing.assert_close(out, want)


def test_a_failed_check_on_first_rows_serves_the_whole_stock_step(monkeypatch, caplog):
    """A path that computes something else, caught on the first rows: the whole step is
    served from the stock path (every row, not the reference's few)."""
    from expertcache_cli.plugin import runtime

    monkeypatch.setattr(runtime, "CHECK_ROWS", 2)
    layer = Experts(seed=8)
    armed = _swept(_arm(layer, slots=6, wide_inserts=6))
    stock_forward = armed._stock

    def wrong_on_scratch(**kw):
        out = stock_forward(**kw)
        return out * 1.5 if layer.w13_weight.data_ptr() != armed.layer_w13_ptr else out

    armed.layer_w13_ptr = layer.w13_weight.data_ptr()
    armed._stock = wrong_on_scratch
    ids, w = _routing(np.random.default_rng(8), 5)
    x = torch.randn(5, H)
    want = Experts.forward_modular(layer, x.clone(), w, ids)
    with caplog.at_level(logging.ERROR, logger="vllm.expertcache"):
        out = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    assert armed.checked["scratch"] > 0.02
    assert out.shape == (5, H)
    torch.testing.assert_close(out, want)
    assert "the scratch path's output differs" in caplog.text


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
        _arm(layer)


def test_output_difference():
    from expertcache_cli.plugin.runtime import output_difference as diff

    a = torch.randn(4, 3)
    assert diff(a, a.clone()) == 0.0
    assert diff((a, a), (a, a + 0.1)) > 0
    assert diff(a * 1.001, a) == pytest.approx(0.001, rel=1e-3)
    assert diff("deferred", a) is None and diff(a, a[:2]) is None
    assert diff(torch.zeros(2), torch.zeros(2)) is None  # nothing proven
    assert diff(torch.ones(2), torch.zeros(2)) == float("inf")
    bad = a.clone()
    bad[0, 0] = float("nan")
    assert diff(bad, a) == float("inf")
    # padded rows are garbage on both paths: left out
    keep = torch.tensor([True, True, False, True])
    skewed = a.clone()
    skewed[2] += 100
    assert diff(skewed, a, keep) == 0.0
    assert diff((a, None), (a, None)) == 0.0


def test_row_differences():
    """Per row: one wrong row stands out at its own size however many rows agree; a row
    the reference left at zero proves nothing (not covered) unless the path's is not
    zero; non-finite values the reference has not differ by inf; shared experts' tuples
    compare row by row over their tensors."""
    from expertcache_cli.plugin.runtime import output_difference, row_differences

    a = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    wrong = a.clone()
    wrong[5] *= 1.5
    d, covered = row_differences(wrong, a, 32)
    assert d[5] == pytest.approx(0.5) and float(d[torch.arange(32) != 5].max()) == 0.0
    assert bool(covered.all())
    # over the step, the same row is diluted by the other 31
    assert output_difference(wrong, a) == pytest.approx(0.5 * float(a[5].norm() / a.norm()))
    assert output_difference(wrong, a) < 0.2
    zero = a.clone()
    zero[3] = 0
    d, covered = row_differences(zero, zero, 32)
    assert not bool(covered[3]) and int(covered.sum()) == 31 and float(d.max()) == 0.0
    off = zero.clone()
    off[3, 0] = 1.0
    d, _ = row_differences(off, zero, 32)
    assert d[3] == float("inf")
    nan = a.clone()
    nan[7, 2] = float("nan")
    d, _ = row_differences(nan, a, 32)
    assert d[7] == float("inf") and float(d[:7].max()) == 0.0
    d, covered = row_differences((a, wrong), (a, a), 32)
    assert d[5] > 0 and float(d[:5].max()) == 0.0 and bool(covered.all())
    assert row_differences("deferred", a, 32) is None
    assert row_differences(a, a, 16) is None  # no tensor with the step's rows


# -- kernel attributes that alias layer parameters (Marlin's g_idx) -----------------------

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
    armed = _arm(cached, slots=6)
    assert armed.decision.aliases == [("experts", "w13_g_idx", "w13_g_idx")]
    assert "w13_g_idx_sort_indices" not in [s.name for s in armed.decision.specs]  # empty
    kernel = cached.quant_method.moe_kernel.fused_experts
    full = kernel.w13_g_idx
    rng = np.random.default_rng(11)
    for _ in range(40):
        x = torch.randn(1, H)
        ids, w = _routing(rng, 1)
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


def test_periodic_reports_never_wait_for_the_device(monkeypatch, caplog):
    """EXPERT_CACHE_STATS: at a due step the counters' copy to pinned memory is started and
    nothing is logged; later steps log it once the copy's event says it has landed; a
    report falling due while one is on its way is skipped; close() reads the final
    numbers itself."""
    from expertcache_cli.baseline.counters import parse_stats_line
    from expertcache_cli.plugin import session as session_mod

    layer = Experts(seed=13)
    armed = _arm(layer)
    sess = session_mod.Session(CacheConfig(slots=6, stats_every=2), [armed.decision], [armed],
                               None)
    real_rows = sess._counter_rows
    landed = {"now": False}
    copies: list[object] = []

    class DeviceRows:  # the counters as if they lived on a GPU
        def __init__(self):
            self.value = real_rows()
            self.device = SimpleNamespace(type="cuda")
            self.shape, self.dtype = self.value.shape, self.value.dtype

    class Pinned:
        def __init__(self, shape, dtype, pin_memory):
            assert pin_memory
            self.value = None

        def copy_(self, src, non_blocking):
            assert non_blocking
            self.value = src.value.clone()
            copies.append(self)

        def tolist(self):
            return self.value.tolist()

    class Event:
        def record(self):
            pass

        def query(self):
            return landed["now"]

    monkeypatch.setattr(sess, "_counter_rows", DeviceRows)
    monkeypatch.setattr(torch, "empty", Pinned)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    caplog.set_level("INFO", logger="vllm.expertcache")
    ids, w = _routing(np.random.default_rng(13), 1)
    layer.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
    sess.after_step()  # 1 layer-step: not due
    sess.after_step()  # due: the copy starts, nothing logged
    assert len(copies) == 1 and "hit rate" not in caplog.text
    sess.after_step()
    sess.after_step()  # due again while the first is on its way: skipped
    assert len(copies) == 1 and "hit rate" not in caplog.text
    landed["now"] = True
    sess.after_step()  # landed: logged, from the snapshot
    live = parse_stats_line(caplog.text)
    assert live and not live["final"] and live["requests"] == TOPK
    monkeypatch.undo()
    sess.close()
    assert parse_stats_line(caplog.text.splitlines()[-2])["final"]


@pytest.mark.parametrize("swept", [False, True])
def test_the_check_is_not_fooled_by_an_output_in_a_reused_workspace(swept):
    """A kernel returning a view of a workspace the next call overwrites would make the
    reference call overwrite the path's output (equal by aliasing): the sweep and the
    check compare a copy, and serve that copy."""
    layer = Experts(seed=14)
    armed = _arm(layer)
    if swept:
        _swept(armed)
    workspace = torch.zeros(8, H)
    stock_forward = Experts.forward_modular

    def in_workspace(self, x, topk_weights, topk_ids, **kw):
        out = stock_forward(self, x, topk_weights, topk_ids, **kw)
        if self.w13_weight.shape[0] != E:
            out = out * 1.5  # the slot path computes something else
        view = workspace[:x.shape[0]]
        view.copy_(out)
        return view

    armed._stock = in_workspace.__get__(layer)
    ids, w = _routing(np.random.default_rng(14), 1)
    layer.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
    assert "forward_modular" not in layer.__dict__
    if swept:
        assert armed.checked["slots"] > 0.02
    else:
        assert armed.sweep_result.failed and armed.sweep_result.paths[0].worst > 0.02


def test_bookkeeping_that_fails_never_takes_serving_down(caplog):
    """A periodic report or a trace drain that raises is logged once and stops; the step
    goes on, and shutdown still logs the final counters."""
    from expertcache_cli.plugin.session import Session

    layer = Experts(seed=15)
    armed = _arm(layer)

    class BadRecorder:
        calls = 0

        def maybe_flush(self):
            BadRecorder.calls += 1
            raise OSError("disk full")

    sess = Session(CacheConfig(slots=6, stats_every=1), [armed.decision], [armed],
                   BadRecorder())

    def broken():
        raise RuntimeError("no pinned memory")

    sess._counter_rows = broken
    caplog.set_level("INFO", logger="vllm.expertcache")
    for _ in range(3):
        sess.after_step()
    assert caplog.text.count("periodic stats failed (RuntimeError: no pinned memory)") == 1
    assert caplog.text.count("draining the routing trace failed (OSError: disk full)") == 1
    assert BadRecorder.calls == 1 and sess.cfg.stats_every == 0
    del sess._counter_rows  # the final report reads the real counters
    sess.recorder = None
    sess.close()
    assert "final hit rate" in caplog.text


def test_the_first_agreeing_check_is_announced_once_a_process(monkeypatch, caplog):
    from expertcache_cli.plugin import runtime

    monkeypatch.setattr(runtime, "_ANNOUNCED", {})
    caplog.set_level("INFO", logger="vllm.expertcache")
    layers = [Experts(seed=16), Experts(seed=17)]
    for layer in layers:
        _arm(layer)
        ids, w = _routing(np.random.default_rng(16), 1)
        layer.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
    lines = [r for r in caplog.records if "agreed with the stock path" in r.getMessage()
             and r.levelname == "INFO"]
    assert len(lines) == 1 and "every armed layer is checked once" in lines[0].getMessage()


# -- the sweep of every expert, and failures once captured --------------------------------

def _corrupting(armed, expert):
    """Wrap the layer's cache step: every install of ``expert`` leaves its slot's bytes
    wrong (a slot the gather got wrong), every other expert's right."""
    step = armed.cache.step

    def corrupt(ids, sources, **kw):
        out = step(ids, sources, **kw)
        s = int(armed.cache.table[expert])
        if s >= 0:
            armed.cache.slots["w2_weight"][s] *= -1.0
        return out

    armed.cache.step = corrupt


def test_the_sweep_catches_a_wrong_expert_the_warm_up_never_routes(caplog):
    """vLLM's dummy warm-up routes every row to the same top_k experts: a check on it alone
    compares those few. The sweep routes every expert through the slots, so a slot that
    is wrong only for expert 13 is caught at the first call, named, and the layer serves
    the stock path; the check of the call alone (the sweep done) sees nothing."""
    ids = torch.tensor([[0, 1]] * 3, dtype=torch.int32)  # the warm-up's routing
    w, x = torch.rand(3, TOPK), torch.randn(3, H)
    want = Experts(seed=21).forward_modular(x=x, topk_weights=w, topk_ids=ids)

    blind = Experts(seed=21)
    armed = _swept(_arm(blind))
    _corrupting(armed, 13)
    blind.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    assert armed.checked["slots"] == 0.0 and not armed._failed  # blind to expert 13

    layer = Experts(seed=21)
    armed = _arm(layer)
    _corrupting(armed, 13)
    with caplog.at_level("ERROR", logger="vllm.expertcache"):
        got = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    torch.testing.assert_close(got, want)
    (sweep,) = armed.sweep_result.paths
    assert armed.sweep_result.failed and 13 in sweep.bad_experts and sweep.worst > 0.02
    assert "differs from the stock path's on experts [12, 13] of a synthetic step" in (
        caplog.text)
    assert "forward_modular" not in layer.__dict__


def test_the_sweep_leaves_a_fresh_cache_and_its_counters_as_they_were():
    """After the sweep the cache is what a fresh one is: the first real step installs what
    a fresh reference cache installs, the counters count only served steps; each sweep
    step computed at most S // top_k rows and never more than the call (its scratch:
    the rows' outputs)."""
    layer = Experts(seed=22)
    armed = _arm(layer, slots=6)
    rows = []
    stock_forward = armed._stock

    def counting(**kw):
        rows.append(kw["x"].shape[0])
        return stock_forward(**kw)

    armed._stock = counting
    ids, w = _routing(np.random.default_rng(22), 2)
    layer.forward_modular(x=torch.randn(2, H), topk_weights=w, topk_ids=ids)
    ref = LayerCache(E, 6, Policy.LRU)
    ref.step(ids.numpy())
    assert np.array_equal(armed.cache.ref.table, ref.table)
    assert np.array_equal(armed.cache.ref.slot_expert, ref.slot_expert)
    assert armed.cache.stats.tolist() == [len(set(ids.flatten().tolist()))] * 2
    assert int(armed.read_through) == int(armed.staged) == 0
    # sweep steps as wide as the call (2 rows of the 3 the slots take): 4 on slots and on
    # the stock path, then the call and its check
    assert [p.steps for p in armed.sweep_result.paths] == [4]
    assert rows == [2] * 8 + [2, 2]


def test_a_layer_failing_after_capture_stops_the_server_with_one_line(monkeypatch, caplog):
    """A captured graph replays the layer's cache path whatever the plugin does later: a
    failure once the path is captured stops the server (a SystemExit, which vLLM lets end
    the engine) with one critical line, rather than leave the graphs serving it. A
    failure while capturing, before any capture held the path, puts the layer back on the
    stock path as before (that graph captures the stock call)."""
    from expertcache_cli.plugin import runtime

    rng = np.random.default_rng(23)
    layer = Experts(seed=23)
    armed = _arm(layer)
    ids, w = _routing(rng, 1)
    layer.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)  # eager, swept
    assert armed.sweep_result is not None and not armed.captured
    monkeypatch.setattr(runtime, "_capturing", lambda: True)
    layer.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)  # captured
    monkeypatch.setattr(runtime, "_capturing", lambda: False)
    assert armed.captured

    def broken(*a, **k):
        raise RuntimeError("source moved")

    armed.cache.step = broken
    caplog.set_level("ERROR", logger="vllm.expertcache")
    with pytest.raises(SystemExit) as stop:
        layer.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
    assert isinstance(stop.value, runtime.CacheFault)
    lines = [r for r in caplog.records if r.levelname == "CRITICAL"]
    assert len(lines) == 1 and lines[0].getMessage() == str(stop.value)
    assert "\n" not in str(stop.value)
    assert str(stop.value).startswith(
        "expertcache: model.layers.5.mlp.experts: cache step failed (RuntimeError: source "
        "moved); its cache path is in vLLM's captured CUDA graphs")
    assert "the server stops rather than serve it" in str(stop.value)

    fresh = Experts(seed=24)
    armed = _arm(fresh)
    fresh.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
    armed.cache.step = broken
    monkeypatch.setattr(runtime, "_capturing", lambda: True)
    x = torch.randn(1, H)
    out = fresh.forward_modular(x=x, topk_weights=w, topk_ids=ids)  # fails while capturing
    torch.testing.assert_close(out, Experts(seed=24).forward_modular(x, w, ids))
    assert armed._failed and not armed.captured


def test_one_line_sums_up_the_sweeps_and_their_time(caplog):
    """Once every armed layer has swept, one line says how many agreed, over how many
    experts and paths, and what it cost (steps and seconds); a layer that differed is
    counted as such and the line is a warning."""
    from expertcache_cli.plugin.session import Session

    caplog.set_level("INFO", logger="vllm.expertcache")
    layers = [Experts(seed=25), Experts(seed=26)]
    armed = [_arm(layer) for layer in layers]
    sess = Session(CacheConfig(slots=6), [a.decision for a in armed], armed, None)
    _corrupting(armed[1], 15)
    ids, w = _routing(np.random.default_rng(25), 1)
    layers[0].forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
    assert "check of every expert" not in caplog.text  # one layer of two swept
    layers[1].forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
    lines = [r for r in caplog.records if "check of every expert" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "WARNING"
    text = lines[0].getMessage()
    import re

    assert re.fullmatch(
        r"expertcache: startup check of every expert \(16 a layer, each through the slots and "
        r"the stock path\): 1 of 2 layers agreed \(largest row difference 0\), 1 differed and "
        r"went back to the stock path; 16 synthetic steps in \d+\.\d\d s", text), text
    assert sess.sweep_line() == text
