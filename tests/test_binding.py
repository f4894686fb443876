"""The launchers and the two backends of `binding.py`, without a GPU: each step's argument
block carries the values it must, wide gathers split into launches of at most
GATHER_MAX_TENSORS tensors, both backends receive the same sources, and refusals happen
before anything is launched. The kernels themselves are device tests."""

from __future__ import annotations

import ctypes

import pytest

from expertcache_cli.device import binding

STATE = dict(table=0x1000, slot_expert=0x2000, prio=0x3000, step=0x4000, miss_expert=0x5000,
             miss_slot=0x6000, miss_count=0x7000, stats=0x8000, num_experts=128,
             num_slots=32, policy=0, decay=0, max_distinct=64, max_inserts=32)


class Recorder(binding.Kernels):
    """A backend that records what the launchers hand it."""

    backend = "recorder"

    def __init__(self) -> None:
        self.manage_calls: list[tuple[list[int | None], int, int]] = []
        self.gather_calls: list[tuple[list[int], int]] = []

    def run_manage(self, call, stream):
        # read back through the kernel-parameter array, as cuLaunchKernel would
        n = len(binding.MANAGE_ARGS)
        ptrs = (ctypes.c_void_p * n).from_address(call.params_addr)
        vals = [type(v).from_address(ptrs[i]).value for i, v in enumerate(call.values)]
        self.manage_calls.append((vals, call.smem, stream))

    def run_gather(self, call, srcs, stream):
        self.gather_calls.append((list(srcs), stream))


def test_a_backend_must_implement_both_launches():
    class Half(binding.Kernels):
        def run_manage(self, call, stream):
            pass

    with pytest.raises(TypeError, match="run_gather"):
        Half()


def test_manage_call_rewrites_only_the_per_step_values():
    k = Recorder()
    launch = k.manage_launcher(**STATE)
    launch(0xA000, 12, True, 0xB000, stream=7)
    launch(0xC000, 3, False, 0, stream=9)
    names = [n for n, _ in binding.MANAGE_ARGS]
    (first, smem, s1), (second, _, s2) = k.manage_calls
    a, b = dict(zip(names, first)), dict(zip(names, second))
    assert (a["ids"], a["n_ids"], a["ids_is64"], a["out_ids"], s1) == (0xA000, 12, 1, 0xB000, 7)
    assert (b["ids"], b["n_ids"], b["ids_is64"], b["out_ids"], s2) == (0xC000, 3, 0, None, 9)
    for key in ("table", "prio", "miss_count", "num_experts", "num_slots", "max_inserts"):
        assert a[key] == b[key] == STATE[key]
    assert smem == binding.manage_smem_bytes(128, 32)


def test_real_rows_reach_the_kernel_only_on_the_call_that_gives_them():
    k = Recorder()
    launch = k.manage_launcher(**STATE)
    launch(0xA000, 16, False, 0xB000, stream=1, real_rows=0xD000, row_width=8)
    launch(0xA000, 16, False, 0xB000, stream=1)
    names = [n for n, _ in binding.MANAGE_ARGS]
    (first, _, _), (second, _, _) = k.manage_calls
    a, b = dict(zip(names, first)), dict(zip(names, second))
    assert (a["real_rows"], a["row_width"]) == (0xD000, 8)
    assert (b["real_rows"], b["pad_rows"], b["row_width"]) == (None, None, 1)  # all rows real
    with pytest.raises(ValueError, match="row width"):
        launch(0xA000, 16, False, 0xB000, stream=1, real_rows=0xD000, row_width=0)
    launch(0xA000, 16, False, 0xB000, stream=1, pad_rows=0xE000, row_width=8)
    c = dict(zip(names, k.manage_calls[2][0]))
    assert (c["real_rows"], c["pad_rows"], c["row_width"]) == (None, 0xE000, 8)
    assert len(k.manage_calls) == 3


def test_manage_refusals_launch_nothing():
    k = Recorder()
    with pytest.raises(ValueError, match="num_slots"):
        k.manage_launcher(**{**STATE, "num_slots": binding.MAX_SLOTS + 1})
    with pytest.raises(ValueError, match="prio"):
        k.manage_launcher(**{**STATE, "prio": 0})
    launch = k.manage_launcher(**STATE)
    with pytest.raises(ValueError, match="bad routing ids"):
        launch(0, 4, False, 0, stream=0)
    assert k.manage_calls == []


def test_a_block_list_reaches_the_manager_only_on_the_call_that_gives_it():
    """vLLM Marlin's block list rides on the manager's own launch (no remap launch of its
    own): its address and length on the call that gives it, none on the next."""
    k = Recorder()
    launch = k.manage_launcher(**STATE)
    launch(0xA000, 12, False, 0, stream=3, blocks=0xF000, n_blocks=7)
    launch(0xA000, 12, False, 0xB000, stream=3)
    names = [n for n, _ in binding.MANAGE_ARGS]
    (first, _, _), (second, _, _) = k.manage_calls
    a, b = dict(zip(names, first)), dict(zip(names, second))
    assert (a["blocks"], a["n_blocks"], a["out_ids"]) == (0xF000, 7, None)
    assert (b["blocks"], b["n_blocks"], b["out_ids"]) == (None, 0, 0xB000)
    with pytest.raises(ValueError, match="bad block list"):
        launch(0xA000, 12, False, 0, stream=3, blocks=0, n_blocks=4)
    assert len(k.manage_calls) == 2


def test_the_library_takes_the_block_list_in_the_managers_argument_order():
    lib_k = object.__new__(binding.LibraryKernels)
    seen = []

    class Lib:
        code = 0

        def expert_cache_manage(self, *args):
            seen.append(args)
            return self.code

    lib_k.lib = Lib()
    launch = binding.ManageLauncher(lib_k, **STATE)
    launch(0xA000, 12, False, 0, stream=9, blocks=0xF000, n_blocks=600)
    names = [n for n, _ in binding.MANAGE_ARGS]
    args = dict(zip(names, (getattr(v, "value", v) for v in seen[0][:-1])))
    assert (args["blocks"], args["n_blocks"], seen[0][-1]) == (0xF000, 600, 9)
    lib_k.lib.code = 1003
    with pytest.raises(binding.KernelError, match="1003: null pointer"):
        launch(0xA000, 12, False, 0, stream=9, blocks=0xF000, n_blocks=600)


def test_the_block_list_rule_clamps_the_ids_and_reads_a_missing_expert_as_slot_0():
    torch = pytest.importorskip("torch", reason="no torch: the rule's torch ops need it")
    table = torch.tensor([5, -1, 2, 7], dtype=torch.int32)
    blocks = torch.tensor([0, 2, 3, 1, -1, 4, 99], dtype=torch.int32)
    # ids clamped into 0..3 (-1 -> 0, 4 and 99 -> 3); expert 1 not resident -> slot 0
    assert binding.block_slots(blocks, table).tolist() == [5, 2, 7, 0, 5, 7, 7]
    assert binding.block_slots(blocks, table).dtype == torch.int32


def _gather(kernels, n: int, spread=None) -> binding.GatherLauncher:
    return binding.GatherLauncher(
        kernels, miss_expert=0x100, miss_slot=0x200, miss_count=0x300,
        dsts=[0x10_0000 * (i + 1) for i in range(n)], slab_bytes=[16 * (i + 1) for i in range(n)],
        grid=528, names=[f"t{i}" for i in range(n)], spread=spread)


#: three compact targets of a side row: a (2,) float32, then two scalars (tensor 17's slab
#: is 288 bytes, 72 words: the words past 5 are padding)
SPREAD = [(0x7000_0000, 0, 2), (0x7100_0004, 2, 1), (0x7200_0008, 4, 1)]


def test_nvrtc_backend_splits_a_wide_gather_and_fills_each_launch():
    """Twenty tensors: two launches (16 + 4), each block holding its tensors' sources,
    destinations and 16-byte vector counts; the grid is the launcher's. Act-order GPTQ's
    ten tensors are one launch."""
    k = object.__new__(binding.NvrtcKernels)  # no driver: launch is replaced below
    k.gather_fn = "gather"
    launched = []

    def launch(fn, grid, smem, stream, addr):
        arr = (ctypes.c_void_p * 4).from_address(addr)
        p = binding.GatherParams.from_address(arr[3])
        launched.append((fn, grid, smem, stream, p.n_tensors, list(p.src[: p.n_tensors]),
                         list(p.dst[: p.n_tensors]), list(p.vecs[: p.n_tensors]), p.per_miss,
                         ctypes.c_void_p.from_address(arr[0]).value))

    k.launch = launch
    g = _gather(k, 20)
    srcs = [0x9000_0000 + 0x1000 * i for i in range(20)]
    g(srcs, stream=5)
    assert [x[4] for x in launched] == [16, 4]
    assert launched[0][5] + launched[1][5] == srcs
    assert launched[1][6] == [0x10_0000 * i for i in range(17, 21)]
    assert launched[0][7] == list(range(1, 17)) and launched[0][8] == sum(range(1, 17))
    assert all(x[:4] == ("gather", 528, 0, 5) and x[9] == 0x100 for x in launched)
    launched.clear()
    _gather(k, 10)([0x9000_0000 + 0x1000 * i for i in range(10)], stream=5)
    assert [x[4] for x in launched] == [10]


def test_library_backend_gets_the_same_sources_as_plain_arrays_and_its_codes_raise():
    k = object.__new__(binding.LibraryKernels)
    seen, spreads = [], []

    class Lib:
        code = 0

        def expert_cache_gather(self, me, ms, mc, n, srcs, dsts, nbytes, spread_tensor,
                                n_spread, spread_dsts, spread_off, spread_words, grid,
                                stream):
            seen.append((me.value, n, list(srcs), list(dsts), list(nbytes), grid, stream))
            spreads.append((spread_tensor, n_spread, list(spread_dsts)[:n_spread],
                            list(spread_off)[:n_spread], list(spread_words)[:n_spread]))
            return self.code

    k.lib = Lib()
    g = _gather(k, 10)
    srcs = [0x9000_0000 + 0x1000 * i for i in range(10)]
    g(srcs, stream=3)
    me, n, s, d, nb, grid, stream = seen[0]
    assert (me, n, s, grid, stream) == (0x100, 10, srcs, 528, 3)
    assert d[0] == 0x10_0000 and nb == [16 * (i + 1) for i in range(10)]
    assert spreads[0] == (-1, 0, [], [], [])  # no spread
    k.lib.code = 1004
    with pytest.raises(binding.KernelError, match="1004: gather pointer not 16-byte aligned"):
        g(srcs, stream=3)
    # a spread: its index over all tensors (the wrapper finds the launch), its targets
    k.lib.code = 0
    _gather(k, 20, spread=(17, SPREAD))(srcs * 2, stream=3)
    assert spreads[-1] == (17, 3, [a for a, _, _ in SPREAD], [0, 2, 4], [2, 1, 1])
    k.lib.code = 1006
    with pytest.raises(binding.KernelError, match="1006: bad spread"):
        g(srcs, stream=3)


def test_the_spread_reaches_only_the_launch_that_holds_its_tensor():
    """Tensor 17 of twenty is the spread one: the second launch (tensors 16..19) carries it
    as its tensor 1, with every target; the first carries no spread (-1, none)."""
    k = object.__new__(binding.NvrtcKernels)
    k.gather_fn = "gather"
    params = []

    def launch(fn, grid, smem, stream, addr):
        arr = (ctypes.c_void_p * 4).from_address(addr)
        p = binding.GatherParams.from_address(arr[3])
        params.append((p.spread_tensor, p.n_spread, list(p.spread_dst[: p.n_spread]),
                       list(p.spread_off[: p.n_spread]), list(p.spread_words[: p.n_spread])))

    k.launch = launch
    _gather(k, 20, spread=(17, SPREAD))([0x9000_0000 + 0x1000 * i for i in range(20)], 5)
    assert params == [(-1, 0, [], [], []),
                      (1, 3, [a for a, _, _ in SPREAD], [0, 2, 4], [2, 1, 1])]
    params.clear()
    _gather(k, 20)([0x9000_0000 + 0x1000 * i for i in range(20)], 5)
    assert params == [(-1, 0, [], [], [])] * 2


def test_the_gather_params_mirror_the_kernels_struct():
    """`GatherParams` has the kernel's fields in the kernel's order, at the offsets a 64-bit
    C compiler gives them, and its size is the one the .cu asserts."""
    import re
    from pathlib import Path

    src = (Path(binding.__file__).parents[1] / "kernels" / "expert_cache.cu").read_text()
    body = re.search(r"struct EcGatherParams \{(.*?)\n\};", src, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    names = re.findall(r"(\w+)(?:\[\w+\])?;", body)
    assert names == [n for n, _ in binding.GatherParams._fields_]
    size = int(re.search(r"sizeof\(EcGatherParams\) == (\d+)", src).group(1))
    assert ctypes.sizeof(binding.GatherParams) == size == 536
    offsets = {n: getattr(binding.GatherParams, n).offset for n, _ in binding.GatherParams._fields_}
    assert offsets == {"src": 0, "dst": 128, "vecs": 256, "per_miss": 384, "n_tensors": 392,
                       "spread_tensor": 396, "spread_dst": 400, "spread_off": 464,
                       "spread_words": 496, "n_spread": 528, "reserved": 532}


@pytest.mark.parametrize(("spread", "needle"), [
    ((2, SPREAD), r"spread tensor index 2 outside 0\.\.1"),
    ((-1, SPREAD), r"spread tensor index -1 outside"),
    ((1, []), r"t1: 0 spread targets, the kernel takes 1\.\.8"),
    ((1, [(0x7000_0000 + 4 * i, i, 1) for i in range(9)]), r"t1: 9 spread targets"),
    ((1, [(0x7000_0002, 0, 1)]), r"t1: spread target 0 address 0x70000002 is not 4-byte "
                                 "aligned"),
    ((1, [(0, 0, 1)]), r"t1: spread target 0 is a null pointer"),
    ((1, [(0x7000_0000, 0, 4), (0x7100_0000, 6, 3)]),
     r"t1: spread target 1 \(first word 6, 3 words\) is not inside the slab's 8 words"),
    ((1, [(0x7000_0000, -1, 2)]), r"target 0 \(first word -1, 2 words\) is not inside"),
    ((1, [(0x7000_0000, 0, 0)]), r"target 0 \(first word 0, 0 words\) is not inside"),
])
def test_spread_refusals_name_what_is_wrong_and_launch_nothing(spread, needle):
    """The C wrapper's spread checks (EC_ERR_SPREAD, EC_ERR_NULL), made in Python first:
    t1's slab is 32 bytes, 8 words."""
    k = Recorder()
    with pytest.raises(ValueError, match=needle):
        _gather(k, 2, spread=spread)
    assert k.gather_calls == []
    _gather(k, 2, spread=(1, [(0x7000_0000, 0, 4), (0x7100_0000, 4, 4)]))  # the whole slab


def test_a_cache_spreads_one_tensor_of_its_own():
    """`SlotCache`'s ``spread``: at most one tensor (the kernel spreads one slab a gather),
    named among the cache's tensors; the targets go to the launcher as they are."""
    from expertcache_cli.device.slotcache import spread_of

    specs = {"w": None, "row": None}
    assert spread_of(specs, None) == {}
    assert spread_of(specs, {"row": [(0x100, 0, 1)]}) == {"row": [(0x100, 0, 1)]}
    with pytest.raises(ValueError, match=r"L3: the gather spreads one tensor, not 2 \(w, row\)"):
        spread_of(specs, {"w": [(0x100, 0, 1)], "row": [(0x200, 0, 1)]}, "L3: ")
    with pytest.raises(ValueError, match="spread tensor 'scale' is not one of the cache's"):
        spread_of(specs, {"scale": [(0x100, 0, 1)]})


def test_gather_refusals_launch_nothing():
    k = Recorder()
    with pytest.raises(ValueError, match="not a positive multiple of 16"):
        binding.GatherLauncher(k, miss_expert=1, miss_slot=2, miss_count=3, dsts=[0x1000],
                               slab_bytes=[24], grid=1)
    g = _gather(k, 2)
    with pytest.raises(ValueError, match="t1: source pointer is null"):
        g([0x1000, 0], stream=0)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        g([0x1000, 0x1008], stream=0)
    with pytest.raises(ValueError, match="expects 2 source pointers"):
        g([0x1000], stream=0)
    assert k.gather_calls == []
    g([0x1000, 0x2000], stream=4)
    assert k.gather_calls == [([0x1000, 0x2000], 4)]


class FakeDriver:
    """The cuda-bindings calls `NvrtcKernels.launch` makes, recorded; the launch-config
    structs are the real ones (they need no GPU), so a misuse of their API fails here."""

    def __init__(self) -> None:
        from cuda.bindings import driver

        self.real = driver
        self.CUlaunchAttribute = driver.CUlaunchAttribute
        self.CUlaunchAttributeID = driver.CUlaunchAttributeID
        self.CUlaunchConfig = driver.CUlaunchConfig
        self.CUstream = driver.CUstream
        self.calls: list[tuple] = []

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.calls.append(("plain", fn, gx, bx, smem, stream, params))
        return (0,)

    def cuLaunchKernelEx(self, cfg, fn, params, extra):
        attrs = [(a.id, a.value.programmaticStreamSerializationAllowed)
                 for a in cfg.attrs[: cfg.numAttrs]]
        self.calls.append(("ex", fn, cfg.gridDimX, cfg.blockDimX, cfg.sharedMemBytes,
                           int(cfg.hStream), params, attrs))
        return (0,)


def _nvrtc_without_gpu(supported: bool) -> binding.NvrtcKernels:
    pytest.importorskip("cuda.bindings")
    k = object.__new__(binding.NvrtcKernels)
    k._driver = FakeDriver()
    k._pdl_configs = {}
    k.pdl_supported = supported
    return k


def test_pdl_launches_carry_the_attribute_and_each_call_its_own_stream():
    k = _nvrtc_without_gpu(supported=True)
    assert k.set_pdl(True) is True
    k.launch(7, 528, 0, 11, 0x100)
    k.launch(7, 528, 0, 12, 0x200)
    k.launch(9, 1, 4096, 12, 0x300)
    pss = k._driver.real.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert k._driver.calls == [
        ("ex", 7, 528, binding.THREADS, 0, 11, 0x100, [(pss, 1)]),
        ("ex", 7, 528, binding.THREADS, 0, 12, 0x200, [(pss, 1)]),
        ("ex", 9, 1, binding.THREADS, 4096, 12, 0x300, [(pss, 1)]),
    ]
    assert len(k._pdl_configs) == 2  # one config per (kernel, grid, smem), reused
    k.set_pdl(False)
    k.launch(7, 528, 0, 13, 0x400)
    assert k._driver.calls[-1] == ("plain", 7, 528, binding.THREADS, 0, 13, 0x400)


def test_pdl_is_never_used_where_the_gpu_lacks_it():
    k = _nvrtc_without_gpu(supported=False)
    assert k.set_pdl(True) is False and k.pdl is False
    k.launch(7, 528, 0, 11, 0x100)
    assert k._driver.calls[0][0] == "plain"


def test_library_pdl_switch_reaches_the_library_only_where_supported():
    k = object.__new__(binding.LibraryKernels)
    seen = []

    class Lib:
        def expert_cache_set_pdl(self, on):
            seen.append(on)
            return 0

    k.lib = Lib()
    k.pdl_supported = True
    assert k.set_pdl(True) is True and k.set_pdl(False) is False
    k.pdl_supported = False
    assert k.set_pdl(True) is False
    assert seen == [1, 0, 0]


@pytest.mark.parametrize(("major", "driver", "want"), [
    (9, 12030, True), (12, 13000, True), (9, 12020, False), (8, 13000, False), (9, 0, False),
])
def test_pdl_needs_hopper_or_newer_and_a_driver_that_captures_it(major, driver, want):
    assert binding.pdl_possible(major, driver) is want


def test_driver_version_is_zero_without_a_driver(monkeypatch):
    def no_lib(name):
        raise OSError(name)

    monkeypatch.setattr(binding.ctypes, "CDLL", no_lib)
    assert binding.driver_version() == 0


def test_the_caller_selects_the_kernels_a_device_loads(monkeypatch):
    """`select` decides what `get_kernels` loads for a device not loaded yet: a library or
    NVRTC, with PDL or without; unselected, NVRTC with PDL (an unset environment)."""
    made = []
    monkeypatch.setattr(binding, "NvrtcKernels", lambda *a: made.append(("nvrtc", *a)) or a)
    monkeypatch.setattr(binding, "LibraryKernels", lambda *a: made.append(("lib", *a)) or a)
    monkeypatch.setattr(binding, "_LOADED", {})
    monkeypatch.setattr(binding, "_SOURCE", binding._SOURCE)
    binding.get_kernels(0)
    binding.select("/opt/libexpertcache.so", pdl=False)
    binding.get_kernels(1)
    binding.get_kernels(0)  # loaded once per device: the earlier choice stays
    binding.select(None, pdl=False)
    binding.get_kernels(2)
    assert made == [("nvrtc", 0, True), ("lib", "/opt/libexpertcache.so", 1, False),
                    ("nvrtc", 2, False)]


def test_the_binding_reads_no_environment():
    """Where the kernels come from is handed in (`select`), never read here: the device
    layer sits below the configuration (tests/test_layout.py checks the imports)."""
    import re
    from pathlib import Path

    assert re.search(r"\benviron\b|getenv", Path(binding.__file__).read_text()) is None
