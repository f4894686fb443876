"""Manager kernel: microseconds per call, in a CUDA graph of many calls, replayed.

    python bench/bench_manager.py [--calls 400]

Shapes (E, S, ids/step): (128, 64, 32) and (512, 257, 50); LRU and LFU (decay 16).
Two routings: "hit" (the same ids every call: the refresh + remap path, what a warm
cache does most of the time) and "zipf" (a different Zipf-drawn row every call: misses,
victim ranking and installs included). Baseline in the same run: a graph of the same
number of empty kernel nodes (the floor of any launch). Goal: <= 4 us at (128, 64, 32).
"""

from __future__ import annotations

import argparse

import numpy as np
from _cudabench import Baselines, graph_time, header


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=400, help="manager calls per graph")
    args = ap.parse_args()

    import torch

    from expertcache_cli.config import kernel_source
    from expertcache_cli.device import binding
    from expertcache_cli.device.slotcache import SlotCache

    binding.select(*kernel_source())  # EXPERT_CACHE_LIB and _PDL, as the commands read them

    header(torch, "bench_manager: manager kernel, us per call (CUDA graph replay)")
    base = Baselines(torch)
    n = args.calls
    empty = graph_time(torch, lambda s: [base.launch_empty(s) for _ in range(n)]) / n
    print(f"empty kernel node: {empty * 1e6:.2f} us")
    print("| E | S | ids | policy | routing | us/call | miss rate | vs empty node |")
    print("|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for E, S, W in ((128, 64, 32), (512, 257, 50)):
        p = 1.0 / np.arange(1, E + 1) ** 1.1
        p = p[rng.permutation(E)] / p.sum()
        rows = rng.choice(E, size=(n, W), p=p).astype(np.int32)
        dev_rows = torch.from_numpy(rows).cuda()
        out = torch.empty_like(dev_rows)
        for policy, decay in (("lru", 0), ("lfu", 16)):
            for routing in ("hit", "zipf"):
                cache = SlotCache(E, S, {}, policy=policy, decay=decay)
                launch: binding.ManageLauncher = cache._manage  # the raw launcher
                if routing == "hit":
                    cache.step(dev_rows[0], {})  # warm: afterwards every call hits

                def body(stream, launch=launch, routing=routing, rows=dev_rows, out=out, W=W):
                    for i in range(n):
                        r = 0 if routing == "hit" else i
                        launch(rows[r].data_ptr(), W, False, out[r].data_ptr(), stream)

                torch.cuda.synchronize()
                before = cache.stats.tolist()
                t = graph_time(torch, body, reps=10) / n
                after = cache.stats.tolist()
                miss = (after[1] - before[1]) / max(1, after[0] - before[0])
                print(f"| {E} | {S} | {W} | {policy} | {routing} | {t * 1e6:.2f} | "
                      f"{miss:.3f} | {t / empty:.1f}x |")


if __name__ == "__main__":
    main()
