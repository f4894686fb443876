"""On the GPU, the two device pieces of the Marlin arming, without vLLM: the packed side row
(`plugin.small`) gathered by the real kernel with the weights into compact slot buffers
equal to each slot's expert (eager and in a CUDA graph), spread by the gather itself
(kernel ABI 6: bit for bit what the unpack copy gives, on both kernel backends, a spread
tensor in the second launch of a wide gather too, padding words stored nowhere) or
unpacked after each step, and the block remap (`plugin.marlin`) giving each block its
expert's slot inside a captured graph."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

#: NVFP4's two float32 per-expert global scales (4 bytes an expert each: a 16-byte row)
NVFP4 = [("g13", ()), ("g2", ())]
#: a (2,) float32, a scalar, and a (3,) float32 (24 bytes: a 32-byte row, 2 words padding)
MIXED = [("pair", (2,)), ("one", ()), ("tail", (3,))]


def _routing(E, steps, tokens=2, top_k=4, seed=0):
    rng = np.random.default_rng(seed)
    return [np.stack([rng.choice(E, top_k, replace=False) for _ in range(tokens)])
            .astype(np.int32) for _ in range(steps)]


@pytest.fixture(scope="module")
def library(cuda, tmp_path_factory):
    """The nvcc shared library, built once for this GPU (skipped without nvcc)."""
    torch = cuda
    from expertcache_cli.device import kernel_build

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH: the ahead-of-time library cannot be built here")
    major, minor = torch.cuda.get_device_capability()
    return kernel_build.build_shared_library(tmp_path_factory.mktemp("lib") / "libec.so",
                                             (major * 10 + minor,))


@pytest.fixture(scope="module")
def loaded():
    """Kernels loaded by this module, by backend (each loaded once)."""
    return {}


@pytest.fixture(params=["nvrtc", "library"])
def backend(request, cuda, loaded, monkeypatch):
    """The kernels of each build for the caches the test makes (`binding._LOADED`, put
    back after the test): NVRTC, and the nvcc shared library."""
    torch = cuda
    from expertcache_cli.device import binding

    dev = torch.cuda.current_device()
    if request.param not in loaded:
        loaded[request.param] = (
            binding.NvrtcKernels(dev) if request.param == "nvrtc"
            else binding.LibraryKernels(request.getfixturevalue("library"), dev))
    monkeypatch.setitem(binding._LOADED, dev, loaded[request.param])
    return request.param


def _setup(torch, E, S, specs=NVFP4, spread=False, seed=0):
    """A cache of one weight tensor and a side row of float32 ``specs``; ``spread``: the
    row's compact copies filled by the gather (`SmallTensors.spread_targets`)."""
    import math

    from expertcache_cli.device.slotcache import SlotCache
    from expertcache_cli.plugin.small import SMALL_ROW, SmallTensors

    g = torch.Generator().manual_seed(seed)
    weights = torch.randn((E, 64, 32), generator=g).to(torch.bfloat16).pin_memory()
    small_src = {n: torch.rand((E, *shape), generator=g).pin_memory() for n, shape in specs}
    small = SmallTensors([(n, shape, torch.float32, 4 * math.prod(shape))
                          for n, shape in specs], E, S, "cuda")
    small.refresh({n: t.cuda() for n, t in small_src.items()})
    targets = small.spread_targets()
    assert targets is not None
    cache = SlotCache(E, S, {"w": ((64, 32), torch.bfloat16),
                             SMALL_ROW: ((small.row_bytes,), torch.uint8)},
                      spread={SMALL_ROW: targets} if spread else None)
    sources = {"w": weights, SMALL_ROW: small.source}
    return cache, small, sources, small_src, weights


def _check_slots(torch, cache, small, small_src, weights, ctx):
    slot_expert = cache.slot_expert.cpu().tolist()
    for s, e in enumerate(slot_expert):
        if e < 0:
            continue
        assert torch.equal(cache.slots["w"][s].cpu(), weights[e]), f"{ctx}: slot {s} weights"
        for n, src in small_src.items():
            assert torch.equal(small.slots[n][s].cpu(), src[e]), f"{ctx}: slot {s} {n}"


def _check_spread_is_the_unpack(torch, cache, small, ctx):
    """The compact buffers the gather spread into are, bit for bit, what `unpack` makes of
    the gathered rows (every slot: one never installed is zeros both ways)."""
    from expertcache_cli.plugin.small import SMALL_ROW

    spread = {n: t.clone() for n, t in small.slots.items()}
    small.unpack(cache.slots[SMALL_ROW])
    for n, t in small.slots.items():
        assert torch.equal(spread[n].view(torch.uint8), t.view(torch.uint8)), f"{ctx}: {n}"


@pytest.mark.device
@pytest.mark.parametrize("mode", ["unpack", "spread"])
@pytest.mark.parametrize("specs", [NVFP4, MIXED], ids=["nvfp4", "mixed"])
def test_the_side_row_follows_every_install_eager_and_in_a_graph(cuda, backend, mode, specs):
    """Unpacked after each step, or spread by the gather with no copy at all (the graph
    then captures the cache step alone): every slot's compact copies are its expert's,
    and the spread ones what the unpack gives, bit for bit."""
    torch = cuda
    from expertcache_cli.plugin.small import SMALL_ROW

    spread = mode == "spread"
    E, S = 48, 16
    cache, small, sources, small_src, weights = _setup(torch, E, S, specs, spread)
    assert cache.backend.startswith("shared library" if backend == "library" else "NVRTC")
    static_ids = torch.zeros((2, 4), dtype=torch.int32, device="cuda")
    cache.check_sources(sources)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        cache.step(static_ids, sources, remap=False)
        if not spread:
            small.unpack(cache.slots[SMALL_ROW])
    torch.cuda.current_stream().wait_stream(side)
    for t, row in enumerate(_routing(E, 200)):
        static_ids.copy_(torch.from_numpy(row).cuda())
        g.replay()
        torch.cuda.synchronize()
        if t % 20 == 0 or t > 190:
            _check_slots(torch, cache, small, small_src, weights, f"graph step {t}")
    assert cache.stats[1].item() > S  # evictions: slots rewritten, spread again
    if spread:
        _check_spread_is_the_unpack(torch, cache, small, "graph")
    eager, small_e, sources_e, src_e, w_e = _setup(torch, E, S, specs, spread, seed=1)
    for row in _routing(E, 50, seed=1):
        eager.step(torch.from_numpy(row).cuda(), sources_e, remap=False)
        if not spread:
            small_e.unpack(eager.slots[SMALL_ROW])
    torch.cuda.synchronize()
    _check_slots(torch, eager, small_e, src_e, w_e, "eager")
    if spread:
        _check_spread_is_the_unpack(torch, eager, small_e, "eager")
        # new weights: the slots emptied, and the next installs spread the new values
        for t in src_e.values():
            t.mul_(3.0)
        small_e.refresh({n: t.cuda() for n, t in src_e.items()})
        eager.reset()
        for row in _routing(E, 20, seed=2):
            eager.step(torch.from_numpy(row).cuda(), sources_e, remap=False)
        torch.cuda.synchronize()
        _check_slots(torch, eager, small_e, src_e, w_e, "after a reload")


@pytest.mark.device
@pytest.mark.parametrize("before", [1, 17], ids=["first-launch", "second-launch"])
def test_the_spread_stores_each_targets_words_and_nothing_else(cuda, backend, before):
    """The kernel's word rule on a 32-byte row of 8 words with gaps between its targets:
    words 0-1, 4 and 5-6 go to three targets (the first and last after padding words 2-3
    and before 7), at ``slot * words``; guard words around every target stay untouched.
    The row is the cache's tensor 1 (one launch) or 17 (the second launch of a wide
    gather, which carries it as its tensor 1)."""
    torch = cuda
    from expertcache_cli.device.slotcache import SlotCache

    E, S = 40, 8
    g = torch.Generator().manual_seed(before)
    specs = {f"w{i}": ((16,), torch.uint8) for i in range(before)}
    specs["row"] = ((32,), torch.uint8)
    specs["after"] = ((48,), torch.uint8)
    sources = {n: torch.randint(0, 256, (E, *shape), generator=g, dtype=torch.uint8)
               .pin_memory() for n, (shape, _) in specs.items()}
    layout = [(0, 2), (4, 1), (5, 2)]  # (first word, words) of each target
    guard = 3  # words each side of every target
    fill = 0x5A5A5A5A
    arenas = [torch.full((S * words + 2 * guard,), fill, dtype=torch.int32, device="cuda")
              for _, words in layout]
    targets = [(a[guard:].data_ptr(), off, words) for a, (off, words) in zip(arenas, layout)]
    cache = SlotCache(E, S, specs, spread={"row": targets})
    rng = np.random.default_rng(before)
    for _ in range(30):
        cache.step(torch.from_numpy(rng.integers(0, E, size=(2, 3)).astype(np.int32)).cuda(),
                   sources)
    torch.cuda.synchronize()
    assert cache.stats[1].item() > S
    row_words = sources["row"].view(torch.int32)  # [E, 8]
    for s, e in enumerate(cache.slot_expert.cpu().tolist()):
        assert e >= 0
        for a, (off, words) in zip(arenas, layout):
            got = a[guard + s * words: guard + (s + 1) * words].cpu()
            assert torch.equal(got, row_words[e, off:off + words]), (s, e, off)
    for a, (_, words) in zip(arenas, layout):
        assert (a[:guard].cpu() == fill).all() and (a[guard + S * words:].cpu() == fill).all()
    for name, buf in cache.slots.items():  # the slabs themselves, as ever
        for s, e in enumerate(cache.slot_expert.cpu().tolist()):
            assert torch.equal(buf[s].cpu(), sources[name][e]), (name, s)


@pytest.mark.device
def test_the_library_refuses_a_bad_spread_with_its_code(cuda, library):
    """The C wrapper's own spread checks (EC_ERR_SPREAD, EC_ERR_NULL): a code, no launch."""
    torch = cuda
    import ctypes

    from expertcache_cli.device import binding

    h = binding.LibraryKernels(library, torch.cuda.current_device()).lib
    buf = torch.zeros(1024, dtype=torch.uint8, device="cuda")
    p = buf.data_ptr()
    ptrs = (ctypes.c_void_p * 2)(p, p + 256)
    slabs = (ctypes.c_longlong * 2)(32, 16)
    ints = torch.zeros(4, dtype=torch.int32, device="cuda").data_ptr()

    def gather(tensor, n, dsts, offs, words):
        return h.expert_cache_gather(ints, ints, ints, 2, ptrs, ptrs, slabs, tensor, n,
                                     (ctypes.c_void_p * max(n, 1))(*dsts),
                                     (ctypes.c_int * max(n, 1))(*offs),
                                     (ctypes.c_int * max(n, 1))(*words), 1, None)

    assert gather(-1, 0, [0], [0], [0]) == 0  # no spread
    assert gather(0, 2, [p + 512, p + 640], [0, 2], [2, 6]) == 0  # the whole 8 words
    assert gather(2, 1, [p + 512], [0], [1]) == 1006  # no tensor 2
    assert gather(-1, 1, [p + 512], [0], [1]) == 1006  # targets without a tensor
    assert gather(0, 9, [p + 512] * 9, [0] * 9, [1] * 9) == 1006  # more than EC_SPREAD_MAX
    assert gather(0, 1, [p + 514], [0], [1]) == 1006  # not 4-byte aligned
    assert gather(1, 1, [p + 512], [2], [3]) == 1006  # past tensor 1's 4 words
    assert gather(0, 1, [p + 512], [0], [0]) == 1006  # no words
    assert gather(0, 1, [0], [0], [1]) == 1003  # a null target
    torch.cuda.synchronize()


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
