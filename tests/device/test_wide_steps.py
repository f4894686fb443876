"""Wide steps on the GPU: `SlotCache.step_wide` against the reference's staged rules field
by field, the scratch holding exactly the routed experts' bytes (hits from slots, misses
from pinned host memory), and a CUDA graph of narrow and wide steps replaying to the
eager run."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import assert_same_state

from expertcache_cli.rules.policy import LayerCache, Policy, Wide


def _sources(torch, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    specs = {"w13": ((32, 16), torch.bfloat16), "w2": ((16, 16), torch.bfloat16),
             "s13": ((32,), torch.float32)}
    return specs, {k: torch.randn((E, *shape), generator=g).to(dt).pin_memory()
                   for k, (shape, dt) in specs.items()}


def _rows(E, steps, seed):
    """Mostly single tokens (top-4), every fifth step a 12-token chunk (48 ids > slots)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, E + 1) ** 1.1
    p = p[rng.permutation(E)] / p.sum()
    return [np.stack([rng.choice(E, 4, replace=False, p=p)
                      for _ in range(12 if t % 5 == 4 else 1)]).astype(np.int32)
            for t in range(steps)]


def _check_scratch(torch, scratch, cache, sources, row, ctx):
    routed = sorted({int(e) for e in row.ravel() if e >= 0})
    for name, buf in scratch.buffers.items():
        got = buf[routed].cpu()
        want = sources[name][routed]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
            f"{ctx}: scratch {name} differs from the host copies for experts {routed}")


@pytest.mark.device
@pytest.mark.parametrize("wide", [Wide.STAGED, Wide.STAGED_INSTALL])
@pytest.mark.parametrize("policy,decay", [(Policy.LRU, 0), (Policy.LFU, 5)], ids=["lru", "lfu"])
def test_wide_steps_match_the_reference_and_stage_the_right_bytes(cuda, wide, policy, decay):
    torch = cuda
    from expertcache_cli.device.scratch import Scratch
    from expertcache_cli.device.slotcache import SlotCache

    E, S = 64, 16
    specs, sources = _sources(torch, E)
    inserts = 0 if wide is Wide.STAGED else S
    cache = SlotCache(E, S, specs, policy=policy, decay=decay, wide_inserts=inserts, name="w")
    scratch = Scratch(E, specs, "cuda")
    ref = LayerCache(E, S, policy, decay, wide=wide)
    fetched = staged = 0
    for t, row in enumerate(_rows(E, 400, seed=int(policy) + 3 * wide.code)):
        ids = torch.from_numpy(row).cuda()
        if cache.fits(ids.numel()):
            out = cache.step(ids, sources)
            res = ref.forward(row)
            assert_same_state(cache, ref, f"{wide.value} narrow step {t}", row, out, res)
            continue
        cache.step_wide(ids, sources)
        scratch.stage(ids, cache.table, cache.slots, sources)
        res = ref.forward(row)
        assert res.staged, f"step {t}: the reference did not see a wide step"
        assert_same_state(cache, ref, f"{wide.value} wide step {t}", result=res)
        assert scratch.counts.tolist() == [res.distinct - res.staged_ids, res.staged_ids], t
        _check_scratch(torch, scratch, cache, sources, row, f"{wide.value} step {t}")
        fetched += res.staged_ids
        staged += 1
    assert staged == 80 and fetched > 0


@pytest.mark.device
def test_a_graph_of_narrow_and_wide_steps_replays_to_the_eager_run(cuda):
    torch = cuda
    from expertcache_cli.device.scratch import Scratch
    from expertcache_cli.device.slotcache import SlotCache

    E, S = 64, 16
    specs, sources = _sources(torch, E, seed=5)
    eager = SlotCache(E, S, specs, wide_inserts=S, name="eager")
    graphed = SlotCache(E, S, specs, wide_inserts=S, name="graphed")
    s_eager, s_graph = Scratch(E, specs, "cuda"), Scratch(E, specs, "cuda")
    narrow_ids = torch.zeros((1, 4), dtype=torch.int32, device="cuda")
    wide_ids = torch.zeros((12, 4), dtype=torch.int32, device="cuda")
    graphed.check_sources(sources)
    graphs = {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for key, static in (("narrow", narrow_ids), ("wide", wide_ids)):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
            if key == "narrow":
                graphed.step(static, sources)
            else:
                graphed.step_wide(static, sources)
                s_graph.stage(static, graphed.table, graphed.slots, sources)
        graphs[key] = g
    torch.cuda.current_stream().wait_stream(side)
    assert graphed.state()["step"] == 0, "capture must not run the kernels"
    for t, row in enumerate(_rows(E, 200, seed=11)):
        ids = torch.from_numpy(row).cuda()
        if row.size == 4:
            eager.step(ids, sources)
            narrow_ids.copy_(ids)
            graphs["narrow"].replay()
        else:
            eager.step_wide(ids, sources)
            s_eager.stage(ids, eager.table, eager.slots, sources)
            wide_ids.copy_(ids)
            graphs["wide"].replay()
            routed = sorted({int(e) for e in row.ravel()})
            for name in specs:
                assert torch.equal(s_eager.buffers[name][routed].view(torch.uint8),
                                   s_graph.buffers[name][routed].view(torch.uint8)), t
        a, b = eager.state(), graphed.state()
        for key in ("table", "slot_expert", "prio"):
            assert np.array_equal(a[key], b[key]), f"step {t}: {key} differs"
        assert a["stats"] == b["stats"], t
