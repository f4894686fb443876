"""Wide steps staged through the VRAM scratch on CPU torch: outputs equal to the stock path,
a failing staged step falls back and disarms, one scratch shared, planned and announced.
Stand-ins: tests/armed_standins.py. Skipped (with the reason) without torch.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="no torch: the plugin runtime tests need torch")

from armed_standins import (  # noqa: E402
    INTER,
    E,
    Experts,
    H,
    ThreeLayers,
    TileLookup,
    arm,
    fake_vllm_layout,
    routing,
    vllm_worker,
)
from ref_slotcache import RefSlotCache  # noqa: E402

from expertcache_cli.config import CacheConfig  # noqa: E402
from expertcache_cli.rules.policy import LayerCache, Policy, Wide  # noqa: E402
from expertcache_cli.vllm_facts.capture import rows_for_sizes  # noqa: E402


@pytest.mark.parametrize("wide", [Wide.STAGED, Wide.STAGED_INSTALL])
def test_wide_steps_staged_through_the_scratch_equal_the_stock_path(wide):
    """Narrow and wide steps mixed: every output equals the stock (in-place) path bit for
    bit; wide steps run on the scratch with the ids unchanged and the full expert count
    for the tiles; the cache follows the reference's wide-step rules; the counters say
    how many experts the scratch fetched from host."""
    stock, cached = Experts(seed=3), Experts(seed=3)
    TileLookup.seen.clear()
    armed = arm(cached, slots=6, wide_inserts=0 if wide is Wide.STAGED else 6)
    ref = LayerCache(E, 6, Policy.LRU, wide=wide)
    full_ptr = cached.w13_weight.data_ptr()
    scratch_ptr = armed.scratch.buffers["w13_weight"].data_ptr()
    rng = np.random.default_rng(4)
    fetched = wide_steps = 0
    for step in range(50):
        tokens = 1 if step % 3 else 5  # 5 tokens x top-2 = 10 ids > 6 slots: a wide step
        x = torch.randn(tokens, H)
        ids, w = routing(rng, tokens)
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
    armed = arm(cached, slots=6, wide_inserts=6)

    def boom(*a, **k):
        raise RuntimeError("scratch exploded")

    armed.scratch.stage = boom
    x = torch.randn(5, H)
    ids, w = routing(np.random.default_rng(1), 5)
    got = cached.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    torch.testing.assert_close(got, stock.forward_modular(x=x, topk_weights=w, topk_ids=ids),
                               rtol=0, atol=0)
    assert "staged wide step failed (RuntimeError: scratch exploded)" in caplog.text
    assert "forward_modular" not in cached.__dict__  # disarmed: the stock method again


def test_the_wide_step_scratch_is_shared_planned_and_announced(monkeypatch, caplog):
    """EXPERT_CACHE_WIDE=staged-install: one scratch for the two same-shaped layers, its
    bytes (every expert of one layer) join the slots in vLLM's memory plan, the startup
    and memory lines say so, and the sizing trap is no longer a silent bypass."""
    import expertcache_cli.device.scratch as scratch_mod
    import expertcache_cli.device.slotcache as slotcache_mod
    import expertcache_cli.plugin as plugin
    from expertcache_cli.plugin import session as session_mod
    from expertcache_cli.plugin.arming import summary_line

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    monkeypatch.setattr(scratch_mod, "cuda_copiers", scratch_mod.torch_copiers)
    monkeypatch.setattr(session_mod, "_SESSIONS", [])
    fake_vllm_layout(monkeypatch)
    worker = vllm_worker(ThreeLayers(), weights=1000)
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
    line = summary_line(sess.decisions, cfg, "0.26.0", max_num_seqs=8,
                        decode_rows=rows_for_sizes([1, 2, 4, 8]))
    assert "TRAP" not in line and "full batches (8 x 2 ids > 6 slots) are staged" in line
    in_place = summary_line(sess.decisions, CacheConfig(slots=6), "0.26.0", max_num_seqs=8,
                            decode_rows=rows_for_sizes([1, 2, 4, 8]))
    assert "TRAP" in in_place
    # a wide step through the shared scratch, then the counters line says what it fetched
    rng = np.random.default_rng(2)
    ids, w = routing(rng, 5)
    worker.model_runner.get_model().layers[0].experts.forward_modular(
        x=torch.randn(5, H), topk_weights=w, topk_ids=ids)
    sess.report()
    assert "staged steps=1 (fetched " in caplog.text


# -- the slot path can never take a server down ------------------------------------------
