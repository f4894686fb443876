"""The manager kernel against the reference (`policy.LayerCache.step`), field by field,
after every step: table, slot_expert, prio, step, miss list, miss count and the fused
remap, over six routing patterns x LRU and LFU (with decay), 21,600 steps in all."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from kernel_helpers import assert_same_state

from expertcache_cli.rules.policy import LayerCache, Policy

STEPS = 1800  # per (pattern, policy): 6 x 2 x 1800 = 21,600 steps


def _zipf_p(rng, n: int, a: float = 1.1) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1) ** a
    p = p[rng.permutation(n)]
    return p / p.sum()


def pattern(name: str, rng: np.random.Generator, steps: int):
    """(config, rows): cache shape and the routing of every step (arrays of any shape)."""
    if name == "tiny-churn":  # E=32 S=8: almost every step misses and evicts
        cfg = dict(num_experts=32, num_slots=8, max_inserts=None, dtype=np.int32)
        rows = [rng.integers(0, 32, size=rng.integers(1, 9)) for _ in range(steps)]
    elif name == "skewed":  # E=512 S=257, 50 ids a step from a Zipf law
        p = _zipf_p(rng, 512)
        cfg = dict(num_experts=512, num_slots=257, max_inserts=None, dtype=np.int64)
        rows = [rng.choice(512, size=50, p=p) for _ in range(steps)]
    elif name == "insert-cap":  # more misses than the cap allows
        cfg = dict(num_experts=64, num_slots=16, max_inserts=3, dtype=np.int32)
        rows = [rng.integers(0, 64, size=12) for _ in range(steps)]
    elif name == "read-through":  # some steps carry more distinct ids than slots
        p = _zipf_p(rng, 64, 0.8)
        cfg = dict(num_experts=64, num_slots=8, max_inserts=None, dtype=np.int32)
        rows = [rng.choice(64, size=rng.integers(2, 15), p=p) for _ in range(steps)]
    elif name == "padding":  # -1 padding, ids >= E, and whole padding rows
        p = _zipf_p(rng, 128)
        cfg = dict(num_experts=128, num_slots=32, max_inserts=None, dtype=np.int64)
        rows = []
        for _ in range(steps):
            r = rng.choice(128, size=(4, 8), p=p)
            r[rng.random(r.shape) < 0.3] = -1
            r[rng.random(r.shape) < 0.05] = 128 + int(rng.integers(0, 1000))
            if rng.random() < 0.05:
                r[:] = -1
            rows.append(r)
    elif name == "batched-decode":  # E=128 top-8 x 4 sequences, each seq with its habits
        cfg = dict(num_experts=128, num_slots=40, max_inserts=None, dtype=np.int32)
        habits = [_zipf_p(rng, 128, 1.2) for _ in range(4)]
        rows = [np.stack([rng.choice(128, size=8, replace=False, p=h) for h in habits])
                for _ in range(steps)]
    else:
        raise KeyError(name)
    return cfg, rows


PATTERNS = ["tiny-churn", "skewed", "insert-cap", "read-through", "padding", "batched-decode"]


@pytest.mark.device
@pytest.mark.parametrize("policy,decay", [(Policy.LRU, 0), (Policy.LFU, 7)], ids=["lru", "lfu"])
@pytest.mark.parametrize("name", PATTERNS)
def test_manager_matches_reference(cuda, name, policy, decay):
    torch = cuda
    from expertcache_cli.device.slotcache import SlotCache

    rng = np.random.default_rng(zlib.crc32(f"{name}/{policy.name}".encode()))
    cfg, rows = pattern(name, rng, STEPS)
    E, S, cap = cfg["num_experts"], cfg["num_slots"], cfg["max_inserts"]
    cache = SlotCache(E, S, {}, policy=policy, decay=decay, max_inserts=cap, name=name)
    ref = LayerCache(E, S, policy, decay, max_inserts=cap)
    requests = installs = read_through = capped = 0
    for t, row in enumerate(rows):
        ids = torch.from_numpy(np.ascontiguousarray(row.astype(cfg["dtype"]))).cuda()
        out = cache.step(ids, {})
        res = ref.step(row)
        assert out.dtype == ids.dtype and out.shape == ids.shape
        assert_same_state(cache, ref, f"{name}/{policy.name} step {t}", row, out, res)
        requests += res.distinct
        installs += res.miss_count
        read_through += res.read_through
        capped += res.dropped > 0
    assert cache.stats.tolist() == [requests, installs]
    if name == "read-through":
        assert read_through > 0, "the pattern never exercised the read-through gate"
    if name == "insert-cap":
        assert capped > 0, "the pattern never hit the insert cap"


@pytest.mark.device
def test_manager_refuses_bad_arguments(cuda):
    from expertcache_cli.device.slotcache import SlotCache

    with pytest.raises(ValueError, match="num_slots"):
        SlotCache(16, 0, {})
    with pytest.raises(ValueError, match="cannot run on the device"):
        SlotCache(16, 4, {}, policy="opt")
    with pytest.raises(ValueError, match="decay"):
        SlotCache(16, 4, {}, policy="lfu", decay=-1)
    cache = SlotCache(16, 4, {})
    with pytest.raises(ValueError, match="int32 or int64"):
        cache.step(cuda.zeros(4, dtype=cuda.float32, device="cuda"), {})


@pytest.mark.device
def test_reset_empties_the_slots_and_the_cache_then_matches_a_fresh_reference(cuda):
    """SlotCache.reset (weights reloaded): state as at construction, statistics kept, and
    the steps after it agree with a fresh reference cache field by field."""
    torch = cuda
    from expertcache_cli.device.slotcache import SlotCache

    rng = np.random.default_rng(3)
    cache = SlotCache(64, 16, {}, policy=Policy.LFU, decay=5)
    for _ in range(50):
        cache.step(torch.from_numpy(rng.integers(0, 64, size=8).astype(np.int32)).cuda(), {})
    stats = cache.stats.tolist()
    cache.reset()
    ref = LayerCache(64, 16, Policy.LFU, 5)
    assert_same_state(cache, ref, "after reset")
    assert cache.stats.tolist() == stats
    for t in range(200):
        row = rng.integers(0, 64, size=8)
        out = cache.step(torch.from_numpy(row.astype(np.int32)).cuda(), {})
        res = ref.step(row)
        assert_same_state(cache, ref, f"after reset, step {t}", row, out, res)
