"""One worker's session on CPU torch: arming a model layer by layer, the slots in vLLM's
memory plan, the final and periodic report lines, per-layer budgets and the shutdown audit.
Stand-ins: tests/armed_standins.py. Skipped (with the reason) without torch.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="no torch: the plugin runtime tests need torch")

from armed_standins import (  # noqa: E402
    INTER,
    TOPK,
    Experts,
    H,
    ThreeLayers,
    arm,
    fake_vllm_layout,
    routing,
    vllm_worker,
)
from ref_slotcache import RefSlotCache  # noqa: E402

from expertcache_cli.config import CacheConfig  # noqa: E402
from expertcache_cli.plugin.arming import plan_layer  # noqa: E402
from expertcache_cli.plugin.runtime import ArmedLayer  # noqa: E402
from expertcache_cli.vllm_facts.capture import rows_for_sizes  # noqa: E402


def test_arm_model_arms_declines_and_records_a_trace(tmp_path, monkeypatch, caplog):
    """The whole per-worker flow: plan, build, install, record, and close at shutdown."""
    import expertcache_cli.device.slotcache as slotcache_mod
    from expertcache_cli.plugin.session import arm_model
    from expertcache_cli.rules.trace import load

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    model = ThreeLayers()
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
        ids, w = routing(rng, 1)
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


def test_slot_bytes_join_the_weights_vllm_plans_its_kv_cache_around(monkeypatch, caplog):
    """vLLM's KV sizing reads model_runner.model_memory_usage as the weights; the
    slots must be in it (else the KV cache takes their memory), exactly their bytes, and a
    declined layer adds nothing."""
    import expertcache_cli.device.slotcache as slotcache_mod
    import expertcache_cli.plugin as plugin
    from expertcache_cli.plugin import session as session_mod

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    monkeypatch.setattr(session_mod, "_SESSIONS", [])
    fake_vllm_layout(monkeypatch)
    worker = vllm_worker(ThreeLayers(), weights=1000)
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
    import expertcache_cli.device.slotcache as slotcache_mod
    import expertcache_cli.plugin as plugin
    from expertcache_cli.plugin import session as session_mod

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    monkeypatch.setattr(session_mod, "_SESSIONS", [])
    fake_vllm_layout(monkeypatch)
    worker = vllm_worker(ThreeLayers(), weights=1000)
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

    import expertcache_cli.device.slotcache as slotcache_mod
    import expertcache_cli.plugin as plugin
    from expertcache_cli.plugin import memory
    from expertcache_cli.plugin import session as session_mod

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    monkeypatch.setattr(session_mod, "_SESSIONS", [])
    fake_vllm_layout(monkeypatch)
    counter = types.SimpleNamespace(num_inductor_compiles=0)
    for name in ("vllm.compilation", "vllm.compilation.counter"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["vllm.compilation.counter"].compilation_counter = counter
    # Inductor's cache counters (torch._dynamo.utils.counters), empty: caches off
    inductor: dict[str, dict[str, object]] = {}
    for name in ("torch._dynamo", "torch._dynamo.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["torch._dynamo.utils"].counters = inductor
    worker = vllm_worker(ThreeLayers(), weights=1000)
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
    import expertcache_cli.device.slotcache as slotcache_mod
    import expertcache_cli.plugin as plugin

    made: list[int] = []

    class Counting(RefSlotCache):
        def __init__(self, *a, **k):
            made.append(1)
            super().__init__(*a, **k)

    monkeypatch.setattr(slotcache_mod, "SlotCache", Counting)
    fake_vllm_layout(monkeypatch)
    model = ThreeLayers()
    caplog.set_level("INFO", logger="vllm.expertcache")
    worker = vllm_worker(model, runner_attr=False)
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
        ids, w = routing(rng, tokens)
        layer.forward_modular(x=torch.randn(tokens, H), topk_weights=w, topk_ids=ids)
    assert int(armed.read_through) == 2 and int(armed.read_through_decode) == 1
    caplog.set_level("INFO", logger="vllm.expertcache")
    Session(CacheConfig(slots=6), [d], [armed], None).report(final=True)
    got = parse_stats_line(caplog.text)
    assert got["final"] and got["read_through_steps"] == 2
    assert got["read_through_decode_steps"] == 1 and got["layers"] == 1


def test_the_shutdown_audit_passes_served_slots_and_names_a_corrupted_one(caplog):
    """EXPERT_CACHE_AUDIT=1: at shutdown every occupied slot is compared, byte for byte,
    with its expert's source, and the table with the slots; a slot whose bytes changed
    after its install (what a racing gather would leave) is named in an error line."""
    from expertcache_cli.plugin.session import Session

    layer = Experts(seed=3)
    armed = arm(layer, slots=6)
    sess = Session(CacheConfig(slots=6, audit=True), [armed.decision], [armed], None)
    rng = np.random.default_rng(4)
    for _ in range(10):
        ids, w = routing(rng, 2)
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


def test_per_layer_budgets_arm_each_layer_with_its_own_slots(monkeypatch, caplog):
    """EXPERT_CACHE_SLOTS=6,5,4 (a plan's split): layer i gets the i-th budget; the startup
    line lists them; a list of the wrong length (a plan for another model) arms nothing."""
    import expertcache_cli.device.slotcache as slotcache_mod
    from expertcache_cli.config import from_env
    from expertcache_cli.plugin.session import arm_model

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    caplog.set_level("INFO", logger="vllm.expertcache")
    sess = arm_model(ThreeLayers(), from_env({"EXPERT_CACHE_SLOTS": "6,5,4"}), "0.26.0")
    assert [(a.decision.layer_name, a.decision.num_slots) for a in sess.armed] == [
        ("model.layers.0.mlp.experts", 6), ("model.layers.2.mlp.experts", 4)]
    assert "4-6 of 16 experts/layer as slots (per layer: 6,4)" in caplog.text
    assert "per-layer budgets (EXPERT_CACHE_SLOTS, 3 values)" in caplog.text
    assert sess.slot_bytes == (6 + 4) * sess.armed[0].decision.slot_bytes // 6
    wrong = arm_model(ThreeLayers(), from_env({"EXPERT_CACHE_SLOTS": "6,5"}), "0.26.0")
    assert wrong.armed == [] and "lists 2 per-layer budgets for 3 MoE layers" in caplog.text


def test_periodic_reports_never_wait_for_the_device(monkeypatch, caplog):
    """EXPERT_CACHE_STATS: at a due step the counters' copy to pinned memory is started and
    nothing is logged; later steps log it once the copy's event says it has landed; a
    report falling due while one is on its way is skipped; close() reads the final
    numbers itself."""
    from expertcache_cli.baseline.counters import parse_stats_line
    from expertcache_cli.plugin import session as session_mod

    layer = Experts(seed=13)
    armed = arm(layer)
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
    ids, w = routing(np.random.default_rng(13), 1)
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


def test_arm_model_takes_the_decode_width_from_vllms_rows(monkeypatch):
    """vLLM 0.34 hands the decode width in as requests -> rows (`plugin._decode_rows`):
    each armed layer's decode-width counter gets the full batch's rows: 0.26-0.33's
    capture sizes pad max_num_seqs x (1 + draft tokens); without it (eager) that
    product is the width."""
    import expertcache_cli.device.slotcache as slotcache_mod
    from expertcache_cli.plugin.session import arm_model

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    sess = arm_model(ThreeLayers(), CacheConfig(slots=6), "0.34.0", max_num_seqs=5,
                     decode_rows=lambda n: 6 * n)
    assert sess.armed and {a.decode_tokens for a in sess.armed} == {30}
    old = arm_model(ThreeLayers(), CacheConfig(slots=6), "0.33.0", max_num_seqs=3,
                    decode_rows=rows_for_sizes([1, 2, 4, 8], 1 + 1), spec_tokens=1)
    assert {a.decode_tokens for a in old.armed} == {8}
    eager = arm_model(ThreeLayers(), CacheConfig(slots=6), "0.33.0", max_num_seqs=3,
                      spec_tokens=1)
    assert {a.decode_tokens for a in eager.armed} == {6}
