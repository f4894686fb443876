"""The compiled replay engine against the plain reference, and properties of the policies."""

from __future__ import annotations

import numpy as np
import pytest

from expertcache_cli.rules import engine
from expertcache_cli.rules.policy import LayerCache, Policy, Wide, replay_layer_reference
from expertcache_cli.rules.synth import SynthSpec, synthesize


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


@pytest.mark.parametrize("wide", [Wide.STAGED, Wide.STAGED_INSTALL])
@pytest.mark.parametrize("policy", [Policy.LRU, Policy.LFU, Policy.OPT])
def test_engine_equals_reference_on_wide_steps(policy, wide):
    """Steps wider than the slots (W up to 3 x S): every step's installs, and the totals of
    scratch fetches and requests, equal the reference's in each wide-step mode."""
    rng = np.random.default_rng(int(policy) * 7 + wide.code)
    for _ in range(20):
        e = int(rng.integers(6, 40))
        s = int(rng.integers(1, e // 2 + 1))
        w = int(rng.integers(1, 3 * s + 2))
        seq = random_seq(rng, 200, w, e)
        decay = int(rng.integers(0, 6)) if policy is Policy.LFU else 0
        cap = None if rng.random() < 0.5 else int(rng.integers(1, s + 1))
        ref = replay_layer_reference(seq, e, s, policy, decay, cap, wide=wide)
        fast = engine.installs_per_step(seq, e, policy, s, decay, cap, wide=wide)
        assert fast.tolist() == [r.miss_count for r in ref], (e, s, w, decay, cap)
        (c,) = engine.sweep(seq[:, None, :], e, [policy], [s], decay, cap, wide=wide)
        assert c.staged_ids == sum(r.staged_ids for r in ref)
        assert c.staged_hits == sum(r.staged_hits for r in ref)
        assert c.staged_steps == sum(r.staged for r in ref)
        assert c.read_through_steps == 0 and c.read_through_ids == 0
        assert c.dropped == sum(r.dropped for r in ref)
        assert c.requests == sum(r.distinct for r in ref)


def test_wide_step_modes_by_hand():
    """Two slots hold 1 and 2 (LRU); a wide step routes 1, 3, 4 (three ids > two slots)."""
    def warm(wide):
        c = LayerCache(8, 2, Policy.LRU, wide=wide)
        c.forward([1]), c.forward([2])
        return c

    c = warm(Wide.IN_PLACE)
    r = c.forward([1, 3, 4])
    assert r.read_through and r.distinct == 3 and c.step_count == 2  # untouched
    c = warm(Wide.STAGED)
    r = c.forward([1, 3, 4])
    # 1 is a hit, refreshed (prio = step 3); 3 and 4 go to the scratch; nothing installed
    assert (r.staged, r.staged_ids, r.misses, r.staged_hits) == (True, 2, [], 1)
    assert c.step_count == 3 and c.prio[c.table[1]] == 3 and c.table[3] == -1
    slot_of_2 = int(c.table[2])
    assert c.forward([5]).misses == [(5, slot_of_2)]  # 2 is now the least recently used
    c = warm(Wide.STAGED_INSTALL)
    r = c.forward([1, 3, 4])
    # slot of 2 is the only evictable one: 3 (the lowest missing id) is installed, 4 staged
    assert r.misses == [(3, 1)] and r.staged_ids == 1 and c.table[2] == -1
    assert r.staged_hits == 1  # 1, copied from its slot into the scratch
    assert warm(Wide.IN_PLACE).forward([1, 3, 4]).staged_hits == 0  # read through: no copy


def test_staged_modes_against_in_place():
    """In place a wide step reads every routed expert; staged fetches only what the slots
    lack. Without installs on wide steps, only narrow steps fill the slots: on all-wide
    traffic `staged` equals in place, and `staged-install` is what wins there."""
    wide_only = synthesize(SynthSpec(steps=300, layers=2, experts=32, top_k=4, batch=4, seed=3))
    mixed = synthesize(SynthSpec(steps=300, layers=2, experts=32, top_k=4, batch=1, seed=3))
    # every fourth step of the mixed trace is a 4-token step (16 ids > 8 slots)
    ids = mixed.topk_ids.copy()
    wide_ids = np.full((ids.shape[0], ids.shape[1], 16), -1, ids.dtype)
    wide_ids[:, :, :4] = ids
    wide_ids[::4] = wide_only.topk_ids[::4]

    def moved(topk, wide):
        counts = engine.sweep(topk, 32, [Policy.LRU], [8], wide=wide)
        return sum(c.installs + c.read_through_ids + c.staged_ids for c in counts)

    assert moved(wide_only.topk_ids, Wide.STAGED) == moved(wide_only.topk_ids, Wide.IN_PLACE)
    assert moved(wide_only.topk_ids, Wide.STAGED_INSTALL) < moved(wide_only.topk_ids,
                                                                  Wide.IN_PLACE)
    assert moved(wide_ids, Wide.STAGED) < moved(wide_ids, Wide.IN_PLACE)
