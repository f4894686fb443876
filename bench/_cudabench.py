"""Shared helpers of the kernel benchmarks: tiny baseline kernels and graph timing.

Every benchmark measures a baseline in the same run (an empty kernel node, a copy-engine
memcpy, an SM read of one contiguous buffer) and times CUDA-graph replays with events
over many iterations, so launch overhead and timer resolution do not pollute the numbers.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BASELINE_SRC = r"""
extern "C" __global__ void ec_empty_kernel() {}

// Read one contiguous buffer (host UVA or device) into device memory, 16 bytes a lane,
// the same unroll as the gather so the comparison is about layout, not code quality.
extern "C" __global__ void __launch_bounds__(256) ec_sm_read(
        const uint4* __restrict__ src, uint4* __restrict__ dst, long long n) {
    const long long stride = (long long)gridDim.x * 256;
    for (long long i = (long long)blockIdx.x * 256 + threadIdx.x; i < n; i += stride * 4) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) if (i + u * stride < n) v[u] = src[i + u * stride];
#pragma unroll
        for (int u = 0; u < 4; ++u) if (i + u * stride < n) dst[i + u * stride] = v[u];
    }
}
"""


class Baselines:
    """The baseline kernels, compiled with NVRTC for the current device."""

    def __init__(self, torch) -> None:
        from cuda.bindings import driver, nvrtc

        self.driver = driver
        major, minor = torch.cuda.get_device_capability()
        err, prog = nvrtc.nvrtcCreateProgram(BASELINE_SRC.encode(), b"baseline.cu", 0, [], [])
        opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        assert int(err) == 0, "baseline kernels failed to compile"
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = bytearray(size)  # NVRTC writes into it: never an immutable bytes object
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        cubin = bytes(cubin)
        torch.empty(1, device="cuda")
        err, self.module = driver.cuModuleLoadData(cubin)
        assert int(err) == 0
        _, self.empty = driver.cuModuleGetFunction(self.module, b"ec_empty_kernel")
        _, self.read = driver.cuModuleGetFunction(self.module, b"ec_sm_read")
        self._keep = []

    def launch_empty(self, stream: int) -> None:
        (err,) = self.driver.cuLaunchKernel(self.empty, 1, 1, 1, 32, 1, 1, 0, stream, 0, 0)
        assert int(err) == 0

    def launch_read(self, src: int, dst: int, nbytes: int, grid: int, stream: int) -> None:
        vals = [ctypes.c_void_p(src), ctypes.c_void_p(dst), ctypes.c_longlong(nbytes // 16)]
        arr = (ctypes.c_void_p * 3)(*[ctypes.addressof(v) for v in vals])
        self._keep.append((vals, arr))
        (err,) = self.driver.cuLaunchKernel(self.read, grid, 1, 1, 256, 1, 1, 0, stream,
                                            ctypes.addressof(arr), 0)
        assert int(err) == 0


    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Copy-engine copy (cudaMemcpyAsync through the driver; UVA picks the direction)."""
        (err,) = self.driver.cuMemcpyAsync(dst, src, nbytes, stream)
        assert int(err) == 0, f"cuMemcpyAsync failed: {err}"


def graph_time(torch, body, reps: int = 20) -> float:
    """Seconds per replay of a CUDA graph that captures ``body(stream_handle)``."""
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        body(side.cuda_stream)
    torch.cuda.current_stream().wait_stream(side)
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):  # best of three windows of `reps` back-to-back replays
        start.record()
        for _ in range(reps):
            g.replay()
        stop.record()
        stop.synchronize()
        best = min(best, start.elapsed_time(stop) / 1e3 / reps)
    del g
    return best


def header(torch, title: str) -> None:
    import datetime
    import subprocess

    props = torch.cuda.get_device_properties(0)
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        drv = "?"
    print(f"# {title}")
    print(f"# {props.name}, {props.multi_processor_count} SMs, driver {drv}, torch "
          f"{torch.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")


def add_thrash_arg(ap) -> None:
    """The cold rows' option, the same in every bench that has them."""
    ap.add_argument("--thrash-mib", type=int, default=None,
                    help="memory written before each layer in the cold rows "
                         "(default: probe-link's, twice the GPU's L2)")


def thrash_buffer(torch, mib: int | None):
    """The buffer the cold rows write before each layer to evict the cache's state from L2:
    ``mib`` MiB, else what probe-link's cold step writes (`evict_bytes`)."""
    from expertcache_cli.probe.measurements import evict_bytes

    n = mib << 20 if mib else evict_bytes(torch, torch.cuda.current_device())
    return torch.empty(n, dtype=torch.uint8, device="cuda")
