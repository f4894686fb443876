"""Gather bandwidth from pinned host memory, beside the copy engine and an SM read.

    python bench/bench_gather.py [--repeat 0]

For k in {1, 8, 32} missed experts x per-expert slab {1.3, 4.5, 9} MiB (one tensor), in
the same run: (a) the gather kernel copying k slabs of scattered experts into slots,
(b) the copy engine doing the same k slab copies (cudaMemcpyAsync H2D, pinned), (c) the
SM read of one contiguous host buffer of the same k x slab bytes (same grid, same
16-byte lanes). Each is captured in a CUDA graph of many back-to-back repetitions and
replayed; GB/s = 1e9 bytes/s. Goals: gather >= 95% of (c) for k >= 8, and >= 42 GB/s for
one 1.3 MiB expert.
"""

from __future__ import annotations

import argparse

import numpy as np
from _cudabench import Baselines, graph_time, header

MIB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes-per-graph", type=float, default=1.0,
                    help="GiB moved per graph replay (sets the repetitions)")
    args = ap.parse_args()

    import torch

    from expertcache_cli.config import kernel_source
    from expertcache_cli.device import binding

    binding.select(*kernel_source())  # EXPERT_CACHE_LIB and _PDL, as the commands read them

    header(torch, "bench_gather: host->slot gather vs copy engine vs contiguous SM read")
    base = Baselines(torch)
    kernels = binding.get_kernels(torch.cuda.current_device())
    grid = binding.default_gather_grid(torch.cuda.current_device())
    n_src = 40
    max_slab = 9 * MIB
    host = torch.empty(n_src * max_slab, dtype=torch.uint8, pin_memory=True)
    host[:: 4096] = 7
    slots_dev = torch.empty(32 * max_slab, dtype=torch.uint8, device="cuda")
    read_dev = torch.empty(32 * max_slab, dtype=torch.uint8, device="cuda")  # SM-read target
    miss_e = torch.zeros(32, dtype=torch.int32, device="cuda")
    miss_s = torch.zeros(32, dtype=torch.int32, device="cuda")
    miss_c = torch.zeros(1, dtype=torch.int32, device="cuda")
    rng = np.random.default_rng(0)

    big = 256 * MIB
    t = graph_time(torch, lambda s: base.launch_read(host.data_ptr(), read_dev.data_ptr(),
                                                      big, grid, s), reps=10)
    print(f"SM read of one contiguous 256 MiB pinned buffer: {big / t / 1e9:.1f} GB/s "
          f"(grid {grid} x 256)")
    print("| k | slab MiB | gather GB/s | copy engine GB/s | SM contiguous GB/s | "
          "gather / SM contiguous |")
    print("|---|---|---|---|---|---|")
    for k in (1, 8, 32):
        for slab_mib in (1.3, 4.5, 9.0):
            slab = int(slab_mib * MIB) // 16 * 16
            total = k * slab
            reps = max(1, int(args.bytes_per_graph * (1 << 30) / total))
            src = host[: n_src * slab].view(n_src, slab)
            dst = slots_dev[: 32 * slab].view(32, slab)
            experts = rng.choice(n_src, size=k, replace=False)
            miss_e[:k] = torch.from_numpy(experts.astype(np.int32)).cuda()
            miss_s[:k] = torch.arange(k, dtype=torch.int32, device="cuda")
            miss_c.fill_(k)
            gl = binding.GatherLauncher(kernels, miss_expert=miss_e.data_ptr(),
                                        miss_slot=miss_s.data_ptr(), miss_count=miss_c.data_ptr(),
                                        dsts=[dst.data_ptr()], slab_bytes=[slab], grid=grid)
            t_g = graph_time(torch, lambda s, gl=gl, src=src, reps=reps: [
                gl([src.data_ptr()], s) for _ in range(reps)], reps=3) / reps

            def ce(stream, src=src, dst=dst, experts=experts, k=k, reps=reps, slab=slab):
                for _ in range(reps):
                    for j in range(k):
                        base.memcpy(dst[j].data_ptr(), src[int(experts[j])].data_ptr(), slab,
                                    stream)

            t_c = graph_time(torch, ce, reps=3) / reps
            t_s = graph_time(torch, lambda s, total=total, reps=reps: [
                base.launch_read(host.data_ptr(), read_dev.data_ptr(), total, grid, s)
                for _ in range(reps)], reps=3) / reps
            torch.cuda.synchronize()
            for j in range(k):  # the gather really moved the right bytes
                assert torch.equal(dst[j], src[int(experts[j])].to("cuda")), "gather wrong"
            g, c, s_ = total / t_g / 1e9, total / t_c / 1e9, total / t_s / 1e9
            print(f"| {k} | {slab_mib} | {g:.1f} | {c:.1f} | {s_:.1f} | {g / s_:.3f} |")
            base._keep.clear()

    # Grid sweep: bandwidth at two shapes, and the cost of a launch that finds no misses
    # (what every all-hit layer pays), for 1, 2 and 4 blocks per SM.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"\ngrid sweep (default grid = {grid} blocks)")
    print("| blocks | k=1 x 1.3 MiB GB/s | k=8 x 4.5 MiB GB/s | no-miss launch us (graph of 48) |")
    print("|---|---|---|---|")
    for per_sm in (1, 2, 4):
        g_blocks = per_sm * sms
        row = []
        for k, slab_mib in ((1, 1.3), (8, 4.5)):
            slab = int(slab_mib * MIB) // 16 * 16
            reps = max(1, int(args.bytes_per_graph * (1 << 30) / (k * slab)))
            src = host[: n_src * slab].view(n_src, slab)
            dst = slots_dev[: 32 * slab].view(32, slab)
            miss_e[:k] = torch.arange(3, 3 + k, dtype=torch.int32, device="cuda")
            miss_s[:k] = torch.arange(k, dtype=torch.int32, device="cuda")
            miss_c.fill_(k)
            gl = binding.GatherLauncher(kernels, miss_expert=miss_e.data_ptr(),
                                        miss_slot=miss_s.data_ptr(), miss_count=miss_c.data_ptr(),
                                        dsts=[dst.data_ptr()], slab_bytes=[slab], grid=g_blocks)
            t_g = graph_time(torch, lambda s, gl=gl, src=src, reps=reps: [
                gl([src.data_ptr()], s) for _ in range(reps)], reps=3) / reps
            row.append(k * slab / t_g / 1e9)
        miss_c.fill_(0)
        t0 = graph_time(torch, lambda s, gl=gl, src=src: [
            gl([src.data_ptr()], s) for _ in range(48)], reps=100) / 48
        print(f"| {g_blocks} ({per_sm}/SM) | {row[0]:.1f} | {row[1]:.1f} | {t0 * 1e6:.2f} |")


if __name__ == "__main__":
    main()
