"""CUDA-graph capture of manage + gather + remap equals the eager run; two caches fed the
same routing stay identical (the tensor-parallel contract); the nvcc-built library
backend behaves like the NVRTC one; `device_replay` counts what the CPU reference counts."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from kernel_helpers import assert_same_state

from expertcache_cli.rules.policy import LayerCache, Policy


def _setup(torch, E=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    specs = {"w13": ((32, 16), torch.bfloat16), "w2": ((16, 16), torch.bfloat16),
             "s13": ((32,), torch.float32), "s2": ((16,), torch.float32)}
    sources = {}
    for k, (shape, dt) in specs.items():
        sources[k] = torch.randn((E, *shape), generator=g).to(dt).pin_memory()
    return specs, sources


def _routing(E, steps, tokens=4, top_k=4, seed=0):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, E + 1) ** 1.1
    p = p[rng.permutation(E)] / p.sum()
    return [np.stack([rng.choice(E, top_k, replace=False, p=p) for _ in range(tokens)])
            .astype(np.int32) for _ in range(steps)]


def _assert_caches_equal(torch, a, b, ctx):
    sa, sb = a.state(), b.state()
    for key in ("table", "slot_expert", "prio"):
        assert np.array_equal(sa[key], sb[key]), f"{ctx}: {key} differs"
    for key in ("step", "misses", "miss_count", "stats"):
        assert sa[key] == sb[key], f"{ctx}: {key} differs: {sa[key]} vs {sb[key]}"
    for name in a.slots:
        assert torch.equal(a.slots[name].view(torch.uint8), b.slots[name].view(torch.uint8)), (
            f"{ctx}: slot buffer {name} differs"
        )


@pytest.mark.device
@pytest.mark.parametrize("policy,decay", [("lru", 0), ("lfu", 5)])
def test_graph_replay_equals_eager(cuda, policy, decay):
    torch = cuda
    from expertcache_cli.device.slotcache import SlotCache

    E, S = 64, 24
    specs, sources = _setup(torch, E)
    eager = SlotCache(E, S, specs, policy=policy, decay=decay, name="eager")
    graphed = SlotCache(E, S, specs, policy=policy, decay=decay, name="graphed")
    ref = LayerCache(E, S, Policy.parse(policy), decay)
    static_ids = torch.zeros((4, 4), dtype=torch.int32, device="cuda")
    graphed.check_sources(sources)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        static_out = graphed.step(static_ids, sources)
    torch.cuda.current_stream().wait_stream(side)
    assert graphed.state()["step"] == 0, "capture must not run the kernels"
    for t, row in enumerate(_routing(E, 300)):
        ids = torch.from_numpy(row).cuda()
        out = eager.step(ids, sources)
        static_ids.copy_(ids)
        g.replay()
        res = ref.step(row)
        assert torch.equal(out, static_out), f"step {t}: graph remap differs from eager"
        _assert_caches_equal(torch, eager, graphed, f"{policy} step {t}")
        assert_same_state(graphed, ref, f"graph {policy} step {t}", row, static_out, res)


@pytest.mark.device
@pytest.mark.parametrize("mode", ["count", "marks"])
def test_real_rows_in_a_graph_match_the_reference_and_the_masked_step(cuda, mode):
    """ABI 2: the manager reads the padding rows itself at each replay: the count of real
    rows (vLLM's V1 runner keeps it on the device) or a flag a row (its V2 runner's marks).
    Against the reference, and against what the plugin did before (mask the padding rows
    to -1, step, set them to slot 0): the same state, installs and slot ids, with five
    launches fewer a layer."""
    torch = cuda
    from expertcache_cli.device.slotcache import SlotCache

    E, S, rows = 64, 24, 4
    specs, sources = _setup(torch, E, seed=11)
    graphed = SlotCache(E, S, specs, policy="lru", name="graphed")
    masked = SlotCache(E, S, specs, policy="lru", name="masked")
    ref = LayerCache(E, S, Policy.LRU, 0)
    static_ids = torch.zeros((rows, 4), dtype=torch.int32, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    marks = torch.zeros(rows, dtype=torch.bool, device="cuda")
    graphed.check_sources(sources)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    given = {"real_rows": count} if mode == "count" else {"pad_rows": marks}
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        static_out = graphed.step(static_ids, sources, **given)
    torch.cuda.current_stream().wait_stream(side)
    rng = np.random.default_rng(4)
    positions = torch.arange(rows, dtype=torch.int32, device="cuda")
    seen_counts = set()
    for t, row in enumerate(_routing(E, 300, tokens=rows, seed=13)):
        row = row.copy()
        row[rng.random(row.shape) < 0.1] = -1  # padding ids inside real rows pass through
        c = int(rng.integers(0, rows + 2))  # 0 (all padding) .. past the last row
        seen_counts.add(min(c, rows))
        ids = torch.from_numpy(row).cuda()
        static_ids.copy_(ids)
        count.fill_(c)
        flags = rng.random(rows) < 0.3  # V2 marks any rows, not only the last ones
        marks.copy_(torch.from_numpy(flags))
        g.replay()
        real, pad_np = (c, None) if mode == "count" else (None, flags)
        res = ref.step(row, real_rows=real, pad_rows=pad_np)
        assert_same_state(graphed, ref, f"{mode} {c}/{flags.tolist()}, step {t}", row,
                          static_out, res, real_rows=real, pad_rows=pad_np)
        pad = ((positions >= count) if mode == "count" else marks).unsqueeze(1)
        out = torch.where(pad, 0, masked.step(torch.where(pad, -1, ids), sources))
        assert torch.equal(out, static_out), f"step {t}: folded and masked remaps differ"
        _assert_caches_equal(torch, masked, graphed, f"real rows {c}, step {t}")
    assert seen_counts == set(range(rows + 1))


@pytest.mark.device
def test_two_caches_stay_identical(cuda):
    torch = cuda
    from expertcache_cli.device.slotcache import SlotCache

    E, S = 128, 40
    specs, sources = _setup(torch, E, seed=3)
    a = SlotCache(E, S, specs, policy="lfu", decay=9, name="rank0")
    b = SlotCache(E, S, specs, policy="lfu", decay=9, name="rank1")
    for t, row in enumerate(_routing(E, 500, tokens=4, top_k=8, seed=7)):
        oa = a.step(torch.from_numpy(row).cuda(), sources)
        ob = b.step(torch.from_numpy(row).cuda(), sources)
        assert torch.equal(oa, ob), f"step {t}: remapped ids differ"
        if t % 25 == 0 or t > 480:
            _assert_caches_equal(torch, a, b, f"step {t}")


@pytest.mark.device
def test_device_replay_matches_reference(cuda):
    from expertcache_cli.device.device_replay import device_replay

    rng = np.random.default_rng(11)
    T, L, W, E, S = 400, 3, 24, 96, 16
    ids = rng.integers(0, E, size=(T, L, W))
    ids[rng.random(ids.shape) < 0.4] = -1  # padding: most steps pass the shape gate
    ids[rng.random((T, L)) < 0.1] = rng.integers(0, E)  # a few all-one-id steps
    for policy, decay, cap in (("lru", 0, None), ("lfu", 6, None), ("lru", 0, 2)):
        got = device_replay(ids, E, policy, S, decay=decay, max_inserts=cap)
        want = []
        for layer in range(L):
            ref = LayerCache(E, S, Policy.parse(policy), decay, max_inserts=cap)
            want.append(sum(ref.forward(ids[t, layer]).miss_count for t in range(T)))
        gated = int((((ids >= 0) & (ids < E)).sum(axis=2) > S).sum())
        assert gated > 0, "the trace never exercised the shape gate"
        assert got == want, f"{policy} cap={cap}: device {got} != reference {want}"


@pytest.mark.device
def test_pdl_graph_of_layers_equals_the_reference_and_the_plain_launch(cuda):
    """Programmatic dependent launch (EXPERT_CACHE_PDL=1, sm_90+): in a graph of 8 layers, each
    layer's ids written by a torch kernel just before its manager (the router's place), the
    manager starts early and must still read this replay's ids, and the gather behind it
    this step's miss list. Two sets of caches, one captured with PDL and one without,
    replayed 150 steps: identical to each other and to the reference, state and slots."""
    torch = cuda
    from expertcache_cli.device import binding
    from expertcache_cli.device.slotcache import SlotCache

    kernels = binding.get_kernels(torch.cuda.current_device())
    if not kernels.pdl_supported:
        pytest.skip("this GPU has no programmatic dependent launch (sm_90 and newer)")
    default = kernels.pdl
    E, S, L = 64, 16, 8
    specs, sources = _setup(torch, E, seed=3)
    step_in = torch.zeros((4, 4), dtype=torch.int32, device="cuda")
    ids_bufs = [torch.zeros_like(step_in) for _ in range(L)]
    sets, graphs, outs = {}, {}, {}
    try:
        for pdl in (True, False):
            kernels.set_pdl(pdl)
            caches = [SlotCache(E, S, specs, policy="lru", name=f"pdl{pdl}-{i}") for i in range(L)]
            for c in caches:
                c.check_sources(sources)
            g = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
                o = []
                for i, c in enumerate(caches):
                    # a kernel (not a copy node) writes this layer's ids right before the step
                    torch.remainder(step_in + 7 * i, E, out=ids_bufs[i])
                    o.append(c.step(ids_bufs[i], sources))
            torch.cuda.current_stream().wait_stream(side)
            sets[pdl], graphs[pdl], outs[pdl] = caches, g, o
    finally:
        kernels.set_pdl(default)  # the process default, for the tests after this one
    refs = [LayerCache(E, S, Policy.LRU, 0) for _ in range(L)]
    for t, row in enumerate(_routing(E, 150, seed=4)):
        step_in.copy_(torch.from_numpy(row))
        for pdl in (True, False):
            graphs[pdl].replay()
        torch.cuda.synchronize()
        for i in range(L):
            layer_row = (row + 7 * i) % E
            res = refs[i].step(layer_row)
            assert torch.equal(outs[True][i], outs[False][i]), f"step {t} layer {i}: remap"
            _assert_caches_equal(torch, sets[True][i], sets[False][i], f"step {t} layer {i}")
            assert_same_state(sets[True][i], refs[i], f"PDL step {t} layer {i}", layer_row,
                              outs[True][i], res)


@pytest.mark.device
@pytest.mark.parametrize("pdl", [True, False])
def test_library_backend(cuda, tmp_path, monkeypatch, pdl):
    """The nvcc shared library (EXPERT_CACHE_LIB) gives the same results as the
    reference, launched with PDL or without, and its wrappers refuse bad arguments with a
    code instead of launching."""
    torch = cuda
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH: the ahead-of-time library cannot be built here")
    from expertcache_cli.device import binding, kernel_build
    from expertcache_cli.device.slotcache import SlotCache

    major, minor = torch.cuda.get_device_capability()
    lib = kernel_build.build_shared_library(tmp_path / "libec.so", (major * 10 + minor,))
    kernels = binding.LibraryKernels(lib, torch.cuda.current_device())
    assert kernels.set_pdl(pdl) == (pdl and major >= 9)
    monkeypatch.setitem(binding._LOADED, torch.cuda.current_device(), kernels)
    E, S = 64, 24
    specs, sources = _setup(torch, E, seed=5)
    cache = SlotCache(E, S, specs, policy="lfu", decay=4)
    assert cache.backend.startswith("shared library")
    ref = LayerCache(E, S, Policy.LFU, 4)
    for t, row in enumerate(_routing(E, 200, seed=9)):
        out = cache.step(torch.from_numpy(row).cuda(), sources)
        res = ref.step(row)
        assert_same_state(cache, ref, f"library step {t}", row, out, res)
        if t % 50 == 49:  # a block list through the library's manager, against its rule
            blocks = torch.arange(-3, E + 5, dtype=torch.int32, device="cuda")
            row = torch.from_numpy(row).cuda()
            cache.step(row, sources, remap=False, blocks=blocks)  # all hits: state unchanged
            ref.step(row.cpu().numpy())
            assert torch.equal(blocks, binding.block_slots(
                torch.arange(-3, E + 5, dtype=torch.int32, device="cuda"), cache.table)), (
                f"library block list {t}")
    st = cache.state()
    for name, buf in cache.slots.items():
        for s, e in enumerate(st["slot_expert"]):
            assert torch.equal(buf[s].cpu().view(torch.uint8), sources[name][e].view(torch.uint8))
    # argument checks return a code, no launch
    lib_h = kernels.lib
    i32 = torch.zeros(4, dtype=torch.int32, device="cuda")
    p = i32.data_ptr()
    # (ids, n, is64, table, slot_expert, prio, step, miss e/s/count, out, stats, real_rows,
    #  pad_rows, row_width, blocks, n_blocks, E, S, policy, decay, max_distinct,
    #  max_inserts, stream)
    code = lib_h.expert_cache_manage(p, 4, 0, p, p, p, p, p, p, p, 0, 0, 0, 0, 1, 0, 0, 64, 0,
                                     0, 0, 0, 0, 0)
    assert code == 1001
    code = lib_h.expert_cache_manage(p, 4, 0, p, p, p, p, p, p, p, 0, 0, 0, 0, 1, 0, 0, 64, 8,
                                     7, 0, 8, 8, 0)
    assert code == 1002
    # a real-rows count or a row mask needs a row width
    for real, pad in ((p, 0), (0, p)):
        code = lib_h.expert_cache_manage(p, 4, 0, p, p, p, p, p, p, p, 0, 0, real, pad, 0, 0,
                                         0, 64, 8, 0, 0, 8, 8, 0)
        assert code == 1001
    # a block list: a length without an address, or a negative length
    assert lib_h.expert_cache_manage(p, 4, 0, p, p, p, p, p, p, p, 0, 0, 0, 0, 1, 0, 4, 64, 8,
                                     0, 0, 8, 8, 0) == 1003
    assert lib_h.expert_cache_manage(p, 4, 0, p, p, p, p, p, p, p, 0, 0, 0, 0, 1, p, -1, 64, 8,
                                     0, 0, 8, 8, 0) == 1001
    srcs = (binding.ctypes.c_void_p * 1)(p)
    dsts = (binding.ctypes.c_void_p * 1)(p)
    bad = (binding.ctypes.c_longlong * 1)(24)
    # (miss e/s/count, n_tensors, srcs, dsts, slab_bytes, spread_tensor, n_spread,
    #  spread_dsts, spread_off, spread_words, grid, stream): no spread
    assert lib_h.expert_cache_gather(p, p, p, 1, srcs, dsts, bad, -1, 0, None, None, None, 4,
                                     0) == 1005
    odd = (binding.ctypes.c_void_p * 1)(p + 4)
    ok = (binding.ctypes.c_longlong * 1)(16)
    assert lib_h.expert_cache_gather(p, p, p, 1, odd, dsts, ok, -1, 0, None, None, None, 4,
                                     0) == 1004
