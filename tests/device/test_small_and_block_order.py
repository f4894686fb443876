"""On the GPU, the two device pieces of the Marlin arming, without vLLM: the packed side row
(`plugin.small`) gathered by the real kernel with the weights and unpacked into compact
slot buffers equal to each slot's expert (eager and in a CUDA graph), and the block remap
(`plugin.marlin`) giving each block its expert's slot inside a captured graph."""

from __future__ import annotations

import numpy as np
import pytest


def _routing(E, steps, tokens=2, top_k=4, seed=0):
    rng = np.random.default_rng(seed)
    return [np.stack([rng.choice(E, top_k, replace=False) for _ in range(tokens)])
            .astype(np.int32) for _ in range(steps)]


def _setup(torch, E, S):
    from expertcache_cli.device.slotcache import SlotCache
    from expertcache_cli.plugin.small import SMALL_ROW, SmallTensors

    g = torch.Generator().manual_seed(0)
    weights = torch.randn((E, 64, 32), generator=g).to(torch.bfloat16).pin_memory()
    # NVFP4-like: two float32 per-expert global scales, 4 bytes an expert each
    small_src = {"g13": torch.rand(E, generator=g).pin_memory(),
                 "g2": torch.rand(E, generator=g).pin_memory()}
    small = SmallTensors([(n, (), torch.float32, 4) for n in small_src], E, S, "cuda")
    small.refresh({n: t.cuda() for n, t in small_src.items()})
    cache = SlotCache(E, S, {"w": ((64, 32), torch.bfloat16),
                             SMALL_ROW: ((small.row_bytes,), torch.uint8)})
    sources = {"w": weights, SMALL_ROW: small.source}
    return cache, small, sources, small_src, weights


def _check_slots(torch, cache, small, small_src, weights, ctx):
    slot_expert = cache.slot_expert.cpu().tolist()
    for s, e in enumerate(slot_expert):
        if e < 0:
            continue
        assert torch.equal(cache.slots["w"][s].cpu(), weights[e]), f"{ctx}: slot {s} weights"
        for n, src in small_src.items():
            assert float(small.slots[n][s]) == float(src[e]), f"{ctx}: slot {s} {n}"


@pytest.mark.device
def test_the_side_row_follows_every_install_eager_and_in_a_graph(cuda):
    torch = cuda
    from expertcache_cli.plugin.small import SMALL_ROW

    E, S = 48, 16
    cache, small, sources, small_src, weights = _setup(torch, E, S)
    static_ids = torch.zeros((2, 4), dtype=torch.int32, device="cuda")
    cache.check_sources(sources)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        cache.step(static_ids, sources, remap=False)
        small.unpack(cache.slots[SMALL_ROW])
    torch.cuda.current_stream().wait_stream(side)
    for t, row in enumerate(_routing(E, 200)):
        static_ids.copy_(torch.from_numpy(row).cuda())
        g.replay()
        torch.cuda.synchronize()
        if t % 20 == 0 or t > 190:
            _check_slots(torch, cache, small, small_src, weights, f"graph step {t}")
    eager, small_e, sources_e, src_e, w_e = _setup(torch, E, S)
    for row in _routing(E, 50, seed=1):
        eager.step(torch.from_numpy(row).cuda(), sources_e, remap=False)
        small_e.unpack(eager.slots[SMALL_ROW])
    torch.cuda.synchronize()
    _check_slots(torch, eager, small_e, src_e, w_e, "eager")


@pytest.mark.device
def test_the_block_list_gives_each_block_its_experts_slot_in_a_graph(cuda):
    """The manager step run on vLLM's block list, captured as a Marlin layer runs it (the
    list built, then the step that rewrites it): on every replay each block of the list
    (fillers -1 and 0 past the real blocks, ids out of range too) holds what
    `binding.block_slots` gives over the table the step just wrote, and every resident
    expert's block its own slot."""
    torch = cuda
    from expertcache_cli.device.binding import block_slots
    from expertcache_cli.device.slotcache import SlotCache
    from expertcache_cli.plugin import marlin

    E, S, K = 64, 12, 4
    cache = SlotCache(E, S, {"w": ((16,), torch.float32)}, policy="lfu")
    weights = torch.zeros((E, 16)).pin_memory()
    sources = {"w": weights}
    cache.check_sources(sources)
    static_ids = torch.zeros((2, K), dtype=torch.int32, device="cuda")
    static_list = torch.zeros(40, dtype=torch.int32, device="cuda")
    seen_count = []

    def align(topk_ids, block_size, num_experts, expert_map=None, **kw):
        seen_count.append(num_experts)  # the real expert count, whatever the caller passed
        return topk_ids, static_list.clone(), static_list[:1]

    wrapped = marlin.expert_order_blocks(align)
    order = marlin.BlockOrder(E)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        order.bind(lambda blocks: cache.step(static_ids, sources, remap=False, blocks=blocks))
        try:
            _, out, _ = wrapped(static_ids, 8, S)
            assert order.ran
        finally:
            order.unbind()
    torch.cuda.current_stream().wait_stream(side)
    assert seen_count == [E]
    for t, row in enumerate(_routing(E, 60, tokens=2, top_k=K, seed=3)):
        static_ids.copy_(torch.from_numpy(row).cuda())
        experts = sorted(set(row.reshape(-1).tolist()))
        filler = [-1, 0, E, E + 7, -5]
        blocks = (experts + filler * 8)[:40]
        static_list.copy_(torch.tensor(blocks, dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        table = cache.table.clone()
        want = block_slots(torch.tensor(blocks, dtype=torch.int32, device="cuda"), table)
        assert torch.equal(out, want), f"replay {t}"
        slot_expert = cache.slot_expert.cpu().tolist()
        for e, slot in zip(experts, out[:len(experts)].cpu().tolist()):
            assert slot_expert[slot] == e, f"replay {t}: expert {e} read slot {slot}"
    assert torch.equal(wrapped(static_ids, 8, E)[1], static_list)  # unbound: vLLM's own
