"""The kernels at the edges of their contract: expert counts past 1024 up to 4096 with the
largest slot count, int64 ids, a source tensor past 2^31 bytes (64-bit offsets in the
gather), and 100,000 steps with the statistics and the trace recorder on."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import assert_same_state

from expertcache_cli.device import binding
from expertcache_cli.rules.policy import LayerCache, Policy


def _zipf_rows(rng, e: int, steps: int, width: int) -> list[np.ndarray]:
    p = 1.0 / np.arange(1, e + 1) ** 1.05
    p = p[rng.permutation(e)] / p.sum()
    return [rng.choice(e, size=width, p=p).astype(np.int64) for _ in range(steps)]


@pytest.mark.device
@pytest.mark.parametrize("e", [1025, 2048, binding.MAX_EXPERTS // 4])
@pytest.mark.parametrize("s", [64, binding.MAX_SLOTS])
def test_manager_at_large_expert_and_slot_counts(cuda, e, s):
    """Every field equals the reference after every step (int64 ids, 64 a step; with
    1024 slots and 64 ids no step reads through, the table fills and then evicts)."""
    torch = cuda
    from expertcache_cli.device.slotcache import SlotCache

    if s >= e:
        pytest.skip("slots must be below the experts")
    rng = np.random.default_rng(e + s)
    cache = SlotCache(e, s, {}, policy="lru", name=f"E{e}S{s}")
    ref = LayerCache(e, s, Policy.LRU)
    for t, row in enumerate(_zipf_rows(rng, e, 150, 64)):
        ids = torch.from_numpy(row).cuda()
        out = cache.step(ids, {})
        res = ref.step(row)
        assert_same_state(cache, ref, f"E={e} S={s} step {t}", row, out, res)


@pytest.mark.device
def test_manager_at_the_kernel_limits(cuda):
    """E = MAX_EXPERTS, S = MAX_SLOTS, LFU with decay: 100 steps of 512 ids."""
    torch = cuda
    from expertcache_cli.device.slotcache import SlotCache

    e, s = binding.MAX_EXPERTS, binding.MAX_SLOTS
    rng = np.random.default_rng(1)
    cache = SlotCache(e, s, {}, policy="lfu", decay=3, name="limits")
    ref = LayerCache(e, s, Policy.LFU, 3)
    for t, row in enumerate(_zipf_rows(rng, e, 100, 512)):
        out = cache.step(torch.from_numpy(row).cuda(), {})
        res = ref.step(row)
        assert_same_state(cache, ref, f"limits step {t}", row, out, res)


@pytest.mark.device
def test_gather_from_a_source_past_two_gib(cuda):
    """Experts whose byte offset in the source is past 2^31: the gather's 64-bit index."""
    torch = cuda
    from expertcache_cli.device.slotcache import SlotCache

    e, slab = 80, 32 << 20  # 80 x 32 MiB = 2.5 GiB of pinned host memory
    src = torch.empty((e, slab), dtype=torch.uint8, pin_memory=True)
    for x in (0, 41, 70, 79):
        src[x].fill_(x + 1)
        src[x, :: 4096].fill_(255 - x)  # not a constant slab: a wrong offset shows
    assert 79 * slab > 2**31
    cache = SlotCache(e, 4, {"w": ((slab,), torch.uint8)}, name="2gib")
    cache.step(torch.tensor([79, 70, 0, 41], dtype=torch.int32, device="cuda"), {"w": src})
    table = cache.table.cpu().numpy()
    for x in (0, 41, 70, 79):
        got = cache.slots["w"][int(table[x])]
        assert torch.equal(got, src[x].cuda()), f"expert {x} (offset {x * slab:,} B) differs"


@pytest.mark.device
def test_a_hundred_thousand_steps_with_stats_and_trace(cuda, tmp_path):
    """The counters equal the compiled engine's over 100,000 steps; the trace recorder,
    drained as the plugin drains it, writes back exactly the routing it was fed."""
    torch = cuda
    from expertcache_cli.device.slotcache import SlotCache
    from expertcache_cli.plugin.recorder import TraceRecorder
    from expertcache_cli.rules import engine
    from expertcache_cli.rules.synth import SynthSpec, synthesize
    from expertcache_cli.rules.trace import load

    steps = 100_000
    tr = synthesize(SynthSpec(steps=steps, layers=1, experts=128, top_k=8, seed=4, tasks=4))
    seq = tr.topk_ids[:, 0, :].astype(np.int32)
    dev_seq = torch.from_numpy(seq).cuda()
    cache = SlotCache(128, 32, {}, policy="lru", name="100k")
    rec = TraceRecorder(1, 128, 8, torch.device("cuda"), spill=tmp_path / ".t.spill")
    for t in range(steps):
        row = dev_seq[t]
        rec.record(0, row)
        cache.step(row, {})
        rec.maybe_flush()
    want = engine.installs_per_step(seq, 128, Policy.LRU, 32)
    distinct = sum(len(set(r[r >= 0].tolist())) for r in seq)
    assert cache.stats.tolist() == [distinct, int(want.sum())]
    path = rec.save(tmp_path / "t.npz")
    got = load(path)
    assert got.steps == steps and not rec.overflowed
    assert np.array_equal(np.sort(got.topk_ids[:, 0, :8], axis=1), np.sort(seq, axis=1))
