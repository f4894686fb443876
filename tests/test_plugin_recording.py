"""The trace recorder on CPU torch: a recorded trace replays to the live install count
(with padding masked, with wide steps staged), spills to disk, one file per replica and stage.
Stand-ins: tests/armed_standins.py. Skipped (with the reason) without torch.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="no torch: the plugin runtime tests need torch")

from armed_standins import (  # noqa: E402
    TOPK,
    E,
    Experts,
    H,
    arm,
    routing,
    vllm_padding_marks,
)

from expertcache_cli.rules.policy import Policy, Wide  # noqa: E402


@pytest.mark.parametrize("wide", [Wide.IN_PLACE, Wide.STAGED_INSTALL])
def test_recorded_trace_replays_to_the_live_install_count(tmp_path, wide):
    """Every step is recorded, a step of more than E ids as its distinct experts with its
    real token count; replayed under the server's wide-step mode, the file gives the live
    installs (and, staged, the live scratch fetches) exactly."""
    from expertcache_cli.plugin.recorder import TraceRecorder
    from expertcache_cli.rules.policy import replay_layer_reference
    from expertcache_cli.rules.trace import load

    layer = Experts(seed=3)
    rec = TraceRecorder(1, E, TOPK, torch.device("cpu"), capacity=16, layer_names=[5],
                        model="tiny")
    armed = arm(layer, slots=6, recorder=rec,
                 wide_inserts=None if wide is Wide.IN_PLACE else 6)
    rng = np.random.default_rng(5)
    for step in range(50):
        tokens = [1, 1, 2, 3, 9][step % 5]  # 3 x 2 = 6 fits; 9 x 2 = 18 > E = 16 ids a row
        ids, w = routing(rng, tokens)
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


def test_the_trace_starts_with_the_cache_after_vllms_warm_up(tmp_path):
    """The warm-up's steps are dropped from the trace when the session empties the slots
    after vLLM's warm-up (spilled ones too): the file then replays from empty slots to the
    live counters, which start there."""
    from expertcache_cli.config import CacheConfig
    from expertcache_cli.plugin.recorder import TraceRecorder
    from expertcache_cli.plugin.session import Session
    from expertcache_cli.rules.policy import replay_layer_reference
    from expertcache_cli.rules.trace import load

    layer = Experts(seed=4)
    spill = tmp_path / ".live.npz.spill"
    rec = TraceRecorder(1, E, TOPK, torch.device("cpu"), capacity=8, spill=spill)
    armed = arm(layer, slots=6, recorder=rec)
    sess = Session(CacheConfig(slots=6), [armed.decision], [armed], rec)
    rng = np.random.default_rng(8)

    def steps(n: int) -> None:
        for _ in range(n):
            ids, w = routing(rng, 1)
            layer.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
            rec.maybe_flush()

    steps(12)  # the warm-up, part of it drained to the spill file
    assert spill.exists()
    sess.serving_starts()
    assert not spill.exists() and rec.rows == 0
    steps(30)
    live_installs = int(armed.cache.stats[1])
    tr = load(rec.save(tmp_path / "live.npz"))
    assert tr.steps == 30
    replay = replay_layer_reference(tr.topk_ids[:, 0, :], E, 6, Policy.LRU)
    assert sum(r.miss_count for r in replay) == live_installs > 0


def test_the_recorder_spills_to_disk_and_writes_the_same_trace(tmp_path):
    """Host memory stays bounded: drained rows go to a spill file, not a Python list; the
    trace written from the spill equals the one from memory, and the spill is removed."""
    from expertcache_cli.plugin.recorder import TraceRecorder
    from expertcache_cli.rules.trace import load

    spill = tmp_path / ".live.npz.spill"
    recs = [TraceRecorder(2, E, TOPK, torch.device("cpu"), capacity=8, spill=s)
            for s in (None, spill)]
    rng = np.random.default_rng(11)
    for _ in range(40):
        ids, _ = routing(rng, int(rng.integers(1, 4)))
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


def test_a_trace_with_masked_padding_replays_to_the_live_counters(tmp_path, monkeypatch):
    """One gate for live and replay: padded rows vLLM masks still count toward the live
    shape gate (the step is as wide as vLLM ran it), and the replay of the recorded trace
    uses the recorded tokens x top_k, not the valid ids, so both read through alike."""

    from expertcache_cli.plugin.recorder import TraceRecorder
    from expertcache_cli.rules import engine
    from expertcache_cli.rules.trace import load

    state = {"mask": None}
    vllm_padding_marks(monkeypatch, lambda: state["mask"])

    layer = Experts(seed=8)
    rec = TraceRecorder(1, E, TOPK, torch.device("cpu"), capacity=64)
    armed = arm(layer, slots=6, recorder=rec)
    rng = np.random.default_rng(4)
    for step in range(40):
        real = [1, 2, 3][step % 3]
        padded = 4 if real == 3 else real  # 3 sequences run as the 4-graph: 8 ids > 6 slots
        state["mask"] = torch.tensor([i >= real for i in range(padded)])
        ids, w = routing(rng, padded)
        layer.forward_modular(x=torch.randn(padded, H), topk_weights=w, topk_ids=ids)
        rec.maybe_flush()
    live = armed.cache.stats.tolist()
    tr = load(rec.save(tmp_path / "t.npz"))
    (c,) = engine.sweep(tr.topk_ids, E, [Policy.LRU], [6], widths=tr.gate_widths())
    assert (c.requests - c.read_through_ids, c.installs) == (live[0], live[1])
    assert c.read_through_steps == int(armed.read_through) > 0
    (old,) = engine.sweep(tr.topk_ids, E, [Policy.LRU], [6])  # the valid-ids gate
    assert old.read_through_steps == 0  # would have disagreed with the live server
