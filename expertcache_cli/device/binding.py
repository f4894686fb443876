"""The kernel ABI, in one place: argument order, C types, checks, policy codes.

`kernels/expert_cache.cu` exports two kernels (``expert_cache_manage_kernel``, which for
vLLM's Marlin experts also rewrites their block list to slots, and
``expert_cache_gather_kernel``) and, when built as a shared library, two C entry points
(``expert_cache_manage``, ``expert_cache_gather``) that validate and launch them. This
module is the only Python code that knows their signatures. It can drive either build:

* ``NvrtcKernels`` (default): the source compiled by NVRTC for this GPU (see
  `kernel_build`), loaded with the driver API from `cuda-bindings`, launched with
  ``cuLaunchKernelEx`` on the caller's stream. The checks the C wrappers would do are done
  here, before launching.
* ``LibraryKernels``: a shared library built by ``kernels/build.sh``, called through
  ctypes.

Which of the two a process loads, and whether it launches with PDL, is its caller's
choice, handed over with `select` (the plugin from its `CacheConfig`, the commands from
``EXPERT_CACHE_LIB`` and ``EXPERT_CACHE_PDL`` through `config.kernel_source`): this
module reads no environment, so the device layer does not depend on the configuration
above it.

Launchers (`ManageLauncher`, `GatherLauncher`) check and prebuild their argument blocks
once, so a call only rewrites the few values that change (ids, output, block list, source
pointers): the per-layer Python cost stays small, and nothing here ever synchronises with
the device. They hand themselves to the backend (`Kernels.run_manage` / `run_gather`),
the only code that differs between the two builds.

Both can launch with programmatic dependent launch (PDL) on sm_90 and newer
(on by default where the GPU and driver have it; ``select(pdl=False)`` turns it off): a
launch may begin while the kernel before it in the stream ends, and waits inside
(``ec_grid_wait``) before reading what that kernel wrote. It hides the launch of the
gather behind the manager, and the manager's start behind the router; CUDA graphs capture
it as programmatic edges.
If you change an argument here, change the .cu file with it and bump ``ABI_VERSION``.
"""

from __future__ import annotations

import ctypes
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

from ..rules.budget import MAX_EXPERTS, MAX_SLOTS, ONLINE_POLICIES, online_names
from ..rules.policy import Policy

ABI_VERSION = 6  # = EC_ABI_VERSION in expert_cache.cu
THREADS = 256  # = EC_THREADS: manager block size and gather block size
WARP = 32  # = EC_WARP on NVIDIA: the manager keeps one scan total a warp
# MAX_EXPERTS (= EC_MAX_EXPERTS) and MAX_SLOTS (= EC_MAX_SLOTS) are rules of the slot
# budget as well: `budget` defines them, below this module, and the checks here use them.
GATHER_MAX_TENSORS = 16  # = EC_GATHER_MAX_TENSORS: wider gathers are split across launches
VEC_BYTES = 16  # every gather lane moves 16 bytes; slabs must be multiples of it
SPREAD_MAX = 8  # = EC_SPREAD_MAX: compact targets of the one spread tensor (`GatherLauncher`)
WORD_BYTES = 4  # the spread stores 4-byte words

#: kernel policy codes (= EC_POLICY_*): exactly the `Policy` enum values
POLICY_CODES = {Policy.LRU: 0, Policy.LFU: 1}
assert all(int(p) == c for p, c in POLICY_CODES.items())
assert tuple(POLICY_CODES) == ONLINE_POLICIES  # the kernel runs every online policy

#: nonzero codes returned by the C wrappers instead of launching (CUDA errors are < 1000)
ERROR_CODES = {
    1001: "size out of range (num_experts, num_slots, n_ids or grid)",
    1002: "bad policy code or negative decay",
    1003: "null pointer",
    1004: "gather pointer not 16-byte aligned",
    1005: "per-expert slab not a positive multiple of 16 bytes",
    1006: "bad spread (tensor index, target count, a target not 4-byte aligned or outside "
          "the spread tensor's slab)",
}


class KernelError(RuntimeError):
    """A kernel launch was refused or failed; the message names the code and its meaning."""


def manage_smem_bytes(num_experts: int, num_slots: int) -> int:
    """Dynamic shared memory of the manager (= EC_MANAGE_SMEM)."""
    return (num_slots * 24 + THREADS // WARP * 4 + num_experts + 15) // 16 * 16


def policy_code(policy: str | int | Policy) -> int:
    """The kernel's code for an online policy; Belady needs the future and is CPU-only."""
    p = Policy.parse(policy)
    if p not in POLICY_CODES:
        raise ValueError(
            f"policy {p.name.lower()} cannot run on the device (it needs the future routing); "
            f"choose {online_names()}"
        )
    return POLICY_CODES[p]


def check_manage_config(
    num_experts: int, num_slots: int, decay: int, max_distinct: int, max_inserts: int
) -> None:
    """The manager's argument checks (what the C wrapper refuses with EC_ERR_*)."""
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts={num_experts} outside 1..{MAX_EXPERTS}")
    if not 1 <= num_slots <= MAX_SLOTS:
        raise ValueError(f"num_slots={num_slots} outside 1..{MAX_SLOTS}")
    if decay < 0:
        raise ValueError(f"decay={decay} must be >= 0")
    if not 0 <= max_distinct < 2**31:
        raise ValueError("max_distinct must be in 0..2**31-1")
    if not 0 <= max_inserts <= num_slots:
        # the manager lists at most S misses in shared memory: more would overrun it
        # (and installs never exceed the slots anyway)
        raise ValueError(f"max_inserts={max_inserts} outside 0..num_slots={num_slots}")


def check_slab(name: str, nbytes: int) -> None:
    """A per-expert slab must be a positive multiple of 16 bytes: refused, never truncated."""
    if nbytes <= 0 or nbytes % VEC_BYTES:
        raise ValueError(
            f"{name}: per-expert slab of {nbytes} bytes is not a positive multiple of "
            f"{VEC_BYTES} bytes (the gather moves 16 bytes a lane and never truncates)"
        )


def check_aligned(name: str, ptr: int) -> None:
    if ptr % VEC_BYTES:
        raise ValueError(f"{name}: address {ptr:#x} is not 16-byte aligned")


class GatherParams(ctypes.Structure):
    """Mirror of ``struct EcGatherParams`` (the gather kernel's by-value argument)."""

    _fields_ = [
        ("src", ctypes.c_void_p * GATHER_MAX_TENSORS),
        ("dst", ctypes.c_void_p * GATHER_MAX_TENSORS),
        ("vecs", ctypes.c_longlong * GATHER_MAX_TENSORS),
        ("per_miss", ctypes.c_longlong),
        ("n_tensors", ctypes.c_int),
        ("spread_tensor", ctypes.c_int),
        ("spread_dst", ctypes.c_void_p * SPREAD_MAX),
        ("spread_off", ctypes.c_int * SPREAD_MAX),
        ("spread_words", ctypes.c_int * SPREAD_MAX),
        ("n_spread", ctypes.c_int),
        ("reserved", ctypes.c_int),
    ]


assert ctypes.sizeof(GatherParams) == 536


def check_spread(spread: tuple[int, Sequence[tuple[int, int, int]]] | None,
                 slab_bytes: Sequence[int], names: Sequence[str]
                 ) -> tuple[int, list[tuple[int, int, int]]]:
    """The spread of a gather (`GatherLauncher`), checked as the C wrapper checks it (what it
    refuses with EC_ERR_SPREAD or EC_ERR_NULL): ``(tensor index, [(address, first word,
    words), ...])`` or None; returns ``(-1, [])`` for none."""
    if spread is None:
        return -1, []
    index, targets = spread
    index, targets = int(index), [(int(a), int(o), int(w)) for a, o, w in targets]
    if not 0 <= index < len(slab_bytes):
        raise ValueError(f"spread tensor index {index} outside 0..{len(slab_bytes) - 1}")
    name = names[index]
    if not 1 <= len(targets) <= SPREAD_MAX:
        raise ValueError(f"{name}: {len(targets)} spread targets, the kernel takes 1.."
                         f"{SPREAD_MAX}")
    slab_words = int(slab_bytes[index]) // WORD_BYTES
    for i, (addr, off, words) in enumerate(targets):
        if not addr:
            raise ValueError(f"{name}: spread target {i} is a null pointer")
        if addr % WORD_BYTES:
            raise ValueError(f"{name}: spread target {i} address {addr:#x} is not 4-byte "
                             "aligned")
        if off < 0 or words < 1 or off + words > min(slab_words, 2**31 - 1):
            raise ValueError(f"{name}: spread target {i} (first word {off}, {words} words) "
                             f"is not inside the slab's {slab_words} words")
    return index, targets


# The manager's arguments, in order, with their C types (kernel and C wrapper alike; the
# wrapper adds the stream last).
MANAGE_ARGS: tuple[tuple[str, type], ...] = (
    ("ids", ctypes.c_void_p),
    ("n_ids", ctypes.c_int),
    ("ids_is64", ctypes.c_int),
    ("table", ctypes.c_void_p),
    ("slot_expert", ctypes.c_void_p),
    ("prio", ctypes.c_void_p),
    ("step", ctypes.c_void_p),
    ("miss_expert", ctypes.c_void_p),
    ("miss_slot", ctypes.c_void_p),
    ("miss_count", ctypes.c_void_p),
    ("out_ids", ctypes.c_void_p),
    ("stats", ctypes.c_void_p),
    ("real_rows", ctypes.c_void_p),
    ("pad_rows", ctypes.c_void_p),
    ("row_width", ctypes.c_int),
    ("blocks", ctypes.c_void_p),
    ("n_blocks", ctypes.c_int),
    ("num_experts", ctypes.c_int),
    ("num_slots", ctypes.c_int),
    ("policy", ctypes.c_int),
    ("decay", ctypes.c_int),
    ("max_distinct", ctypes.c_int),
    ("max_inserts", ctypes.c_int),
)


# The C wrapper of the gather's arguments, in order, with their C types (the stream last,
# added by the caller); its kernel takes a `GatherParams` instead.
GATHER_ARGS: tuple[tuple[str, type], ...] = (
    ("miss_expert", ctypes.c_void_p),
    ("miss_slot", ctypes.c_void_p),
    ("miss_count", ctypes.c_void_p),
    ("n_tensors", ctypes.c_int),
    ("srcs", ctypes.c_void_p),
    ("dsts", ctypes.c_void_p),
    ("slab_bytes", ctypes.c_void_p),
    ("spread_tensor", ctypes.c_int),
    ("n_spread", ctypes.c_int),
    ("spread_dsts", ctypes.c_void_p),
    ("spread_off", ctypes.c_void_p),
    ("spread_words", ctypes.c_void_p),
    ("grid", ctypes.c_int),
)


def block_slots(blocks, table):
    """The manager's block-list rule (its ``blocks`` argument), with torch ops (any
    device): the slot of each block's expert, its id clamped into ``0..E-1`` (vLLM's filler
    past the last block is 0 or -1) and a non-resident expert's -1 read as slot 0 (only
    padding rows route there, and their output is dropped). The reference the kernel is
    tested against, and what the tests' reference cache and the benches' torch-ops arm
    run in its place (the plugin has no path without the kernel)."""
    index = blocks.clamp(0, table.shape[0] - 1)
    return table.clamp(min=0).index_select(0, index.to(table.device)).to(blocks.dtype)


#: the first driver whose stream capture records programmatic dependent launches
PDL_MIN_DRIVER = 12030


def driver_version() -> int:
    """The CUDA driver's version (12030 = 12.3), 0 where none can be asked."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        return v.value if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 else 0
    except OSError:
        return 0


def pdl_possible(capability_major: int, driver: int) -> bool:
    """PDL needs sm_90 or newer and a driver whose CUDA graphs capture it; anything older
    launches plainly (a refused launch inside vLLM's graph capture would end the capture)."""
    return capability_major >= 9 and driver >= PDL_MIN_DRIVER


class Kernels(ABC):
    """A loaded build of the kernels for one device; use `get_kernels`.

    The one interface the launchers call: a launcher prepares its argument block once and
    hands itself to ``run_manage`` / ``run_gather`` each step; how the block reaches the
    GPU (``cuLaunchKernel`` or the C wrappers) is the backend's business alone.
    """

    backend = "?"
    description = ""
    #: whether launches use programmatic dependent launch now (`set_pdl`)
    pdl = False
    #: whether this GPU and driver have it (`pdl_possible`)
    pdl_supported = False

    def set_pdl(self, on: bool) -> bool:
        """Launch with PDL from now on where the GPU has it; returns what is in force.

        Why a switch and not a constant: the benches time both ways in one process, and
        ``EXPERT_CACHE_PDL=0`` is the way back should a driver mishandle it.
        """
        self.pdl = bool(on) and self.pdl_supported
        return self.pdl

    def manage_launcher(self, **fixed: int) -> ManageLauncher:
        return ManageLauncher(self, **fixed)

    @abstractmethod
    def run_manage(self, call: ManageLauncher, stream: int) -> None:
        """Launch one manager step with ``call``'s current argument values."""

    @abstractmethod
    def run_gather(self, call: GatherLauncher, srcs: Sequence[int], stream: int) -> None:
        """Launch ``call``'s gather(s) from the checked source addresses ``srcs``."""


class NvrtcKernels(Kernels):
    """The kernels compiled by NVRTC (cached per user) and launched via the driver API."""

    backend = "nvrtc"

    def __init__(self, device_index: int, pdl: bool = True) -> None:
        import torch

        from . import kernel_build

        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise kernel_build.KernelBuildError(
                f"cuda-bindings is missing ({exc}): `pip install cuda-bindings`"
            ) from None
        self._driver = driver
        major, minor = torch.cuda.get_device_capability(device_index)
        self.pdl_supported = pdl_possible(major, driver_version())
        self._pdl_configs: dict[tuple[int, int, int], object] = {}
        self.image = kernel_build.cached_image(major * 10 + minor)
        with torch.cuda.device(device_index):
            torch.empty(1, device=f"cuda:{device_index}")  # make the primary context current
            self._check(driver.cuInit(0)[0], "cuInit")
            err, ctx = driver.cuCtxGetCurrent()
            self._check(err, "cuCtxGetCurrent")
            if int(ctx) == 0:
                err, dev = driver.cuDeviceGet(device_index)
                self._check(err, "cuDeviceGet")
                err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
                self._check(err, "cuDevicePrimaryCtxRetain")
                self._check(driver.cuCtxSetCurrent(ctx)[0], "cuCtxSetCurrent")
            data = self.image.path.read_bytes()
            if self.image.kind == "ptx" and not data.endswith(b"\0"):
                data += b"\0"
            err, self._module = driver.cuModuleLoadData(data)
            self._check(err, f"loading {self.image.path}")
            err, self.manage_fn = driver.cuModuleGetFunction(
                self._module, b"expert_cache_manage_kernel"
            )
            self._check(err, "cuModuleGetFunction(expert_cache_manage_kernel)")
            err, self.gather_fn = driver.cuModuleGetFunction(
                self._module, b"expert_cache_gather_kernel"
            )
            self._check(err, "cuModuleGetFunction(expert_cache_gather_kernel)")
        self.set_pdl(pdl)
        self.description = (
            f"NVRTC {self.image.kind} for sm_{self.image.arch} ({self.image.path}"
            f"{', cached' if self.image.cached else ', compiled now'})"
            f"{', programmatic dependent launch' if self.pdl else ''}"
        )

    def _check(self, err, what: str) -> None:
        if int(err) != 0:
            _, name = self._driver.cuGetErrorName(err)
            raise KernelError(f"{what} failed: {name.decode() if name else int(err)}")

    def _pdl_config(self, fn, grid: int, smem: int):
        """The launch configuration with the PDL attribute, built once per (kernel, grid,
        shared memory): a call only sets its stream."""
        key = (int(fn), grid, smem)
        cfg = self._pdl_configs.get(key)
        if cfg is None:
            d = self._driver
            attr = d.CUlaunchAttribute()
            attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg = d.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = THREADS, 1, 1
            cfg.sharedMemBytes = smem
            cfg.attrs = [attr]
            cfg.numAttrs = 1
            self._pdl_configs[key] = cfg
        return cfg

    def launch(self, fn, grid: int, smem: int, stream: int, params_addr: int) -> None:
        if self.pdl:
            cfg = self._pdl_config(fn, grid, smem)
            cfg.hStream = self._driver.CUstream(stream)
            (err,) = self._driver.cuLaunchKernelEx(cfg, fn, params_addr, 0)
            what = "cuLaunchKernelEx"
        else:
            (err,) = self._driver.cuLaunchKernel(
                fn, grid, 1, 1, THREADS, 1, 1, smem, stream, params_addr, 0
            )
            what = "cuLaunchKernel"
        if int(err) != 0:
            self._check(err, what)

    def run_manage(self, call: ManageLauncher, stream: int) -> None:
        self.launch(self.manage_fn, 1, call.smem, stream, call.params_addr)

    def run_gather(self, call: GatherLauncher, srcs: Sequence[int], stream: int) -> None:
        # the kernel takes at most GATHER_MAX_TENSORS tensors: one launch per group
        for first, cnt, p, _arr, addr in call.groups:
            for t in range(cnt):
                p.src[t] = int(srcs[first + t])
            self.launch(self.gather_fn, call.grid, 0, stream, addr)


class LibraryKernels(Kernels):
    """A shared library built by nvcc (``kernels/build.sh``), called through ctypes."""

    backend = "library"

    def __init__(self, path: str | Path, device_index: int | None = None,
                 pdl: bool = True) -> None:
        from . import kernel_build

        path = Path(path)
        if not path.is_file():
            raise kernel_build.KernelBuildError(
                f"{path}: no such file (build it with kernels/build.sh "
                "or `expertcache build-kernels --library`)"
            )
        missing = kernel_build.missing_entry_points(
            path.read_bytes(), kernel_build.LIBRARY_ENTRY_POINTS
        )
        lib = ctypes.CDLL(str(path))
        version = lib.expert_cache_abi_version() if hasattr(lib, "expert_cache_abi_version") else 0
        # an older build lacks the newer entry points: its ABI says why, and what to do
        if version != ABI_VERSION:
            raise kernel_build.KernelBuildError(
                f"{path} has kernel ABI {version}, this package needs {ABI_VERSION}: rebuild it "
                "(kernels/build.sh or `expertcache build-kernels --library`)"
            )
        if missing:
            raise kernel_build.KernelBuildError(
                f"{path} does not export {', '.join(missing)}: rebuild it (kernels/build.sh "
                "or `expertcache build-kernels --library`)")
        lib.expert_cache_manage.restype = ctypes.c_int
        lib.expert_cache_manage.argtypes = [t for _, t in MANAGE_ARGS] + [ctypes.c_void_p]
        lib.expert_cache_set_pdl.restype = ctypes.c_int
        lib.expert_cache_set_pdl.argtypes = [ctypes.c_int]
        lib.expert_cache_gather.restype = ctypes.c_int
        lib.expert_cache_gather.argtypes = [t for _, t in GATHER_ARGS] + [ctypes.c_void_p]
        self.lib = lib
        self.path = path
        if device_index is not None:
            import torch

            self.pdl_supported = pdl_possible(
                torch.cuda.get_device_capability(device_index)[0], driver_version())
        self.set_pdl(pdl)
        self.description = (f"shared library {path}"
                            f"{', programmatic dependent launch' if self.pdl else ''}")

    def set_pdl(self, on: bool) -> bool:
        # the library's switch is one per process: every device it serves shares it
        self.lib.expert_cache_set_pdl(int(super().set_pdl(on)))
        return self.pdl

    def run_manage(self, call: ManageLauncher, stream: int) -> None:
        raise_for_code(self.lib.expert_cache_manage(*call.values, stream), "expert_cache_manage")

    def run_gather(self, call: GatherLauncher, srcs: Sequence[int], stream: int) -> None:
        # the C wrapper takes plain arrays and splits wide gathers itself
        for i, s in enumerate(srcs):
            call.lib_srcs[i] = int(s)
        raise_for_code(
            self.lib.expert_cache_gather(*call.miss, call.n, call.lib_srcs, call.lib_dsts,
                                         call.lib_bytes, call.spread_tensor,
                                         len(call.spread_targets), call.lib_spread_dsts,
                                         call.lib_spread_off, call.lib_spread_words,
                                         call.grid, stream),
            "expert_cache_gather",
        )


def raise_for_code(code: int, what: str) -> None:
    """Turn a C wrapper's return code into a `KernelError` (0 = success)."""
    if code:
        meaning = ERROR_CODES.get(code, "CUDA error")
        raise KernelError(f"{what} returned {code}: {meaning}")


class _ArgBlock:
    """A kernel's arguments as ctypes values in ``args`` order (rewritten in place per
    call: the C wrappers take them as they are) and the array of their addresses that
    ``cuLaunchKernel`` takes as its kernelParams, built once: what every launcher keeps."""

    def __init__(self, args: tuple[tuple[str, type], ...], fixed: dict[str, int]) -> None:
        #: the arguments in ``args`` order, as ctypes values rewritten in place per call
        self.values = [ctype(fixed[name]) for name, ctype in args]
        self._at = {name: i for i, (name, _) in enumerate(args)}
        self._params = (ctypes.c_void_p * len(self.values))(
            *[ctypes.addressof(v) for v in self.values]
        )
        #: the address of the kernel-parameter array (cuLaunchKernel's kernelParams)
        self.params_addr = ctypes.addressof(self._params)

    def value(self, name: str):
        """The ctypes value of argument ``name``, to rewrite in place."""
        return self.values[self._at[name]]


class ManageLauncher:
    """One cache's manager call: the state pointers fixed, the ids and output per call."""

    def __init__(
        self,
        kernels: Kernels,
        *,
        table: int,
        slot_expert: int,
        prio: int,
        step: int,
        miss_expert: int,
        miss_slot: int,
        miss_count: int,
        stats: int,
        num_experts: int,
        num_slots: int,
        policy: int,
        decay: int,
        max_distinct: int,
        max_inserts: int,
    ) -> None:
        check_manage_config(num_experts, num_slots, decay, max_distinct, max_inserts)
        if policy not in POLICY_CODES.values():
            raise ValueError(f"policy code {policy} is not LRU (0) or LFU (1)")
        for name, ptr in (("table", table), ("slot_expert", slot_expert), ("prio", prio),
                          ("step", step), ("miss_expert", miss_expert),
                          ("miss_slot", miss_slot), ("miss_count", miss_count)):
            if not ptr:
                raise ValueError(f"manager state pointer {name} is null")
        self.kernels = kernels
        fixed = dict(
            ids=0, n_ids=0, ids_is64=0, table=table, slot_expert=slot_expert, prio=prio,
            step=step, miss_expert=miss_expert, miss_slot=miss_slot, miss_count=miss_count,
            out_ids=0, stats=stats, real_rows=0, pad_rows=0, row_width=1, blocks=0,
            n_blocks=0, num_experts=num_experts,
            num_slots=num_slots,
            policy=policy, decay=decay, max_distinct=max_distinct, max_inserts=max_inserts,
        )
        block = _ArgBlock(MANAGE_ARGS, fixed)
        self.values, self.params_addr, self._block = block.values, block.params_addr, block
        (self._ids, self._n, self._is64, self._out, self._real, self._pad, self._width,
         self._blocks, self._n_blocks) = (
            block.value(k) for k in ("ids", "n_ids", "ids_is64", "out_ids", "real_rows",
                                     "pad_rows", "row_width", "blocks", "n_blocks"))
        self.smem = manage_smem_bytes(num_experts, num_slots)

    def __call__(self, ids: int, n_ids: int, ids_is64: bool, out_ids: int, stream: int,
                 real_rows: int = 0, row_width: int = 1, pad_rows: int = 0,
                 blocks: int = 0, n_blocks: int = 0) -> None:
        """Launch one manager step on ``stream`` (raw pointers; `SlotCache` checks tensors).

        CUDA-graph padding rows, kept out of the step and remapped to slot 0 by the kernel
        itself (no mask launches), ``row_width`` ids a row: ``real_rows``, the device
        address of an int32 count of the rows that are real (0: all are), and/or
        ``pad_rows``, of one byte a row, nonzero for a padding row (0: none marked).
        ``blocks``: the address of ``n_blocks`` int32 expert ids (vLLM Marlin's block
        list), rewritten in place to slots by the same launch (`block_slots`' rule)."""
        if n_ids < 0 or n_ids >= 2**31 or (n_ids and not ids):
            raise ValueError(f"bad routing ids: n_ids={n_ids}, pointer={ids:#x}")
        if (real_rows or pad_rows) and not 1 <= row_width < 2**31:
            raise ValueError(f"bad row width {row_width} for the padding rows")
        if n_blocks < 0 or n_blocks >= 2**31 or (n_blocks and not blocks):
            raise ValueError(f"bad block list: n_blocks={n_blocks}, pointer={blocks:#x}")
        self._ids.value = ids or None
        self._n.value = n_ids
        self._is64.value = 1 if ids_is64 else 0
        self._out.value = out_ids or None
        self._real.value = real_rows or None
        self._pad.value = pad_rows or None
        self._width.value = row_width
        self._blocks.value = blocks or None
        self._n_blocks.value = n_blocks
        self.kernels.run_manage(self, stream)


class GatherLauncher:
    """One cache's gather: miss list and slot buffers fixed, source pointers per call.

    ``spread``: ``(tensor index, [(address, first word, words), ...])``, one tensor whose
    gathered slab is also written, word by word, into up to `SPREAD_MAX` compact device
    arrays of ``[S, words]`` 4-byte words each (the kernel's EcGatherParams says how): the
    plugin's packed side row (`plugin.small`), whose compact copies are then filled by the
    installs themselves. None: no spread.
    """

    def __init__(
        self,
        kernels: Kernels,
        *,
        miss_expert: int,
        miss_slot: int,
        miss_count: int,
        dsts: Sequence[int],
        slab_bytes: Sequence[int],
        grid: int,
        names: Sequence[str] | None = None,
        spread: tuple[int, Sequence[tuple[int, int, int]]] | None = None,
    ) -> None:
        n = len(dsts)
        if n < 1 or len(slab_bytes) != n:
            raise ValueError("gather needs at least one tensor and one slab size per tensor")
        if grid < 1:
            raise ValueError(f"gather grid {grid} must be >= 1")
        self.names = list(names) if names is not None else [f"tensor{i}" for i in range(n)]
        for name, d, b in zip(self.names, dsts, slab_bytes):
            check_slab(name, int(b))
            check_aligned(f"{name} slots", int(d))
        #: the spread tensor's index over all tensors (-1: none) and its targets
        self.spread_tensor, self.spread_targets = check_spread(spread, slab_bytes, self.names)
        self.kernels = kernels
        self.grid = grid
        self.n = n
        self.miss = (ctypes.c_void_p(miss_expert), ctypes.c_void_p(miss_slot),
                     ctypes.c_void_p(miss_count))
        #: (first tensor, count, GatherParams, kernel-parameter array, its address) per launch
        self.groups: list[tuple[int, int, GatherParams, ctypes.Array, int]] = []
        for first in range(0, n, GATHER_MAX_TENSORS):
            cnt = min(GATHER_MAX_TENSORS, n - first)
            p = GatherParams()
            for t in range(cnt):
                p.dst[t] = int(dsts[first + t])
                p.vecs[t] = int(slab_bytes[first + t]) // VEC_BYTES
            p.per_miss = sum(p.vecs[t] for t in range(cnt))
            p.n_tensors = cnt
            p.spread_tensor = -1
            if first <= self.spread_tensor < first + cnt:  # the launch that holds it
                p.spread_tensor = self.spread_tensor - first
                p.n_spread = len(self.spread_targets)
                for i, (addr, off, words) in enumerate(self.spread_targets):
                    p.spread_dst[i], p.spread_off[i], p.spread_words[i] = addr, off, words
            arr = (ctypes.c_void_p * 4)(*[ctypes.addressof(v) for v in self.miss],
                                        ctypes.addressof(p))
            self.groups.append((first, cnt, p, arr, ctypes.addressof(arr)))
        # the C wrapper's form: plain arrays over every tensor
        self.lib_srcs = (ctypes.c_void_p * n)()
        self.lib_dsts = (ctypes.c_void_p * n)(*[int(d) for d in dsts])
        self.lib_bytes = (ctypes.c_longlong * n)(*[int(b) for b in slab_bytes])
        # (one unused entry where there is no spread: the wrapper reads none of it then)
        addrs, offs, words = zip(*(self.spread_targets or [(0, 0, 0)]))
        self.lib_spread_dsts = (ctypes.c_void_p * len(addrs))(*addrs)
        self.lib_spread_off = (ctypes.c_int * len(offs))(*offs)
        self.lib_spread_words = (ctypes.c_int * len(words))(*words)

    def __call__(self, srcs: Sequence[int], stream: int) -> None:
        """Launch the gather(s) on ``stream``; ``srcs`` are the [E, slab] source addresses."""
        if len(srcs) != self.n:
            raise ValueError(f"gather expects {self.n} source pointers, got {len(srcs)}")
        for name, s in zip(self.names, srcs):
            if not s:
                raise ValueError(f"{name}: source pointer is null")
            check_aligned(f"{name} source", int(s))
        self.kernels.run_gather(self, srcs, stream)


def default_gather_grid(device_index: int) -> int:
    """Blocks of the gather: 4 per SM keeps enough 16-byte reads in flight to fill the
    host link, and stays fixed so the launch can be captured in a CUDA graph."""
    import torch

    return 4 * torch.cuda.get_device_properties(device_index).multi_processor_count


_LOADED: dict[int, Kernels] = {}
_LOCK = threading.Lock()
#: (library path or None for NVRTC, PDL): the caller's choice, `select`
_SOURCE: tuple[str | None, bool] = (None, True)


def select(library: str | os.PathLike[str] | None = None, pdl: bool = True) -> None:
    """Where this process's kernels come from and how they launch, for devices not loaded
    yet: a prebuilt shared library (``library``) or, without one, the source compiled with
    NVRTC; with programmatic dependent launch where the GPU has it (``pdl``).

    Why the caller says it: the binding sits below the configuration, and a process knows
    its own choice (the plugin has its `CacheConfig`, a command reads the environment
    through `config.kernel_source`, a bench sets what it times). Unselected, a process
    gets NVRTC with PDL, what an unset environment means.
    """
    global _SOURCE
    with _LOCK:
        _SOURCE = (os.fspath(library) if library else None, bool(pdl))


def get_kernels(device_index: int) -> Kernels:
    """The kernels for one device, loaded once per process from the `select`-ed source."""
    with _LOCK:
        k = _LOADED.get(device_index)
        if k is None:
            lib, pdl = _SOURCE
            k = (LibraryKernels(lib, device_index, pdl) if lib
                 else NvrtcKernels(device_index, pdl))
            _LOADED[device_index] = k
        return k
