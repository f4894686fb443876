"""The compiled replay engine against the plain reference, and properties of the policies."""

from __future__ import annotations

import numpy as np
import pytest

from expertcache_cli import engine
from expertcache_cli.policy import Policy, replay_layer_reference
from expertcache_cli.synth import SynthSpec, synthesize


def random_seq(rng: np.random.Generator, t: int, w: int, e: int) -> np.ndarray:
    """Skewed routing with padding and out-of-range ids mixed in."""
    seq = rng.integers(-2, e + 2, size=(t, w))
    hot = rng.random((t, w)) < 0.6
    seq = np.where(hot, seq % max(1, e // 3), seq)
    return seq.astype(np.int32)


@pytest.mark.parametrize("policy", [Policy.LRU, Policy.LFU, Policy.OPT])
def test_engine_equals_reference_step_by_step(policy):
    rng = np.random.default_rng(int(policy) + 11)
    for _ in range(25):
        e = int(rng.integers(4, 48))
        s = int(rng.integers(1, e))
        w = int(rng.integers(1, 12))
        seq = random_seq(rng, 250, w, e)
        decay = int(rng.integers(0, 6)) if policy is Policy.LFU else 0
        cap = None if rng.random() < 0.5 else int(rng.integers(1, s + 1))
        ref = [r.miss_count for r in replay_layer_reference(seq, e, s, policy, decay, cap)]
        fast = engine.installs_per_step(seq, e, policy, s, decay, cap)
        assert fast.tolist() == ref, (e, s, w, decay, cap)


def test_sweep_counters_match_reference_totals():
    rng = np.random.default_rng(5)
    ids = np.stack([random_seq(rng, 300, 6, 20) for _ in range(3)], axis=1)
    counts = engine.sweep(ids, 20, [Policy.LRU, Policy.LFU], [4, 8], decay=3)
    for c in counts:
        ref = replay_layer_reference(ids[:, c.layer, :], 20, c.slots, c.policy, decay=3)
        assert c.installs == sum(r.miss_count for r in ref)
        assert c.read_through_steps == sum(r.read_through for r in ref)
        assert c.read_through_ids == sum(r.distinct for r in ref if r.read_through)
        assert c.requests == sum(r.distinct for r in ref)
        assert c.served_steps + c.read_through_steps == 300


def _totals(counts, policy, slots):
    return sum(
        c.installs + c.read_through_ids for c in counts if c.policy is policy and c.slots == slots
    )


@pytest.mark.parametrize("seed", range(6))
def test_belady_never_worse_than_online_policies(seed):
    trace = synthesize(SynthSpec(steps=600, layers=3, experts=32, top_k=4, seed=seed, tasks=2))
    slots = [4, 8, 16]
    counts = engine.sweep(trace.topk_ids, 32, [Policy.LRU, Policy.LFU, Policy.OPT], slots, 4)
    for s in slots:
        opt = _totals(counts, Policy.OPT, s)
        assert opt <= _totals(counts, Policy.LRU, s)
        assert opt <= _totals(counts, Policy.LFU, s)


@pytest.mark.parametrize("seed", range(6))
def test_lru_misses_do_not_grow_with_slots(seed):
    rng = np.random.default_rng(100 + seed)
    ids = np.stack([random_seq(rng, 400, 4, 24) for _ in range(2)], axis=1)
    slots = list(range(1, 24))
    counts = engine.sweep(ids, 24, [Policy.LRU], slots)
    misses = [_totals(counts, Policy.LRU, s) for s in slots]
    assert all(a >= b for a, b in zip(misses, misses[1:])), misses


def test_read_through_when_steps_are_wider_than_slots():
    # 4 sequences x top-2 = 8 ids per step: 6 slots can never serve a step
    trace = synthesize(SynthSpec(steps=50, layers=1, experts=16, top_k=2, batch=4))
    (c,) = engine.sweep(trace.topk_ids, 16, [Policy.LRU], [6])
    assert c.read_through_steps == 50 and c.installs == 0
    assert c.read_through_ids == c.requests
