"""Does one GPU's host link slow down while another GPU of the same box reads host memory?

Why: device time counts the machine's held time, not its GPUs, so a 2-GPU box runs two
benches at once for the price of one, but only where the link-bound phases of one (an
offloaded server's timed runs, `probe-link`) do not slow the other's: both GPUs' reads of
pinned host memory meet in the host's memory and PCIe root. Each visible GPU copies a pinned
host buffer into device memory in a loop for a fixed time, alone, then every GPU at once
behind one barrier; each GPU's rate together over its rate alone (the baseline, measured
in the same run) is what sharing the host costs it.

    CUDA_VISIBLE_DEVICES=0,1 python bench/link_sharing.py [--gib 1] [--seconds 8] [--out F]

The copy engine is the probe's `pinned H2D` path; the cache's gather reads the same host
memory from the SMs over the same link.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

GiB = 1024**3


def copy_rate(device: int, gib: float, seconds: float, barrier=None) -> float:
    """GB/s of pinned host -> device copies on ``device`` for ``seconds`` (after a warm-up;
    after ``barrier`` when given, so that every GPU's timed copies overlap)."""
    import torch

    torch.cuda.set_device(device)
    n = int(gib * GiB)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    if barrier is not None:
        barrier.wait()
    copies, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        copies += 1
    return copies * n / (time.perf_counter() - t0) / 1e9


def _worker(device: int, gib: float, seconds: float, barrier, results) -> None:
    results.put((device, copy_rate(device, gib, seconds, barrier)))


def measure(devices: list[int], gib: float, seconds: float) -> dict[str, dict[int, float]]:
    """Each device alone, one after another, then all of them at once (one process a GPU,
    so that no Python lock serialises the copies)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out: dict[str, dict[int, float]] = {"alone": {}, "together": {}}
    for d in devices:
        q = ctx.Queue()
        p = ctx.Process(target=_worker, args=(d, gib, seconds, None, q))
        p.start()
        dev, rate = q.get()
        p.join()
        out["alone"][dev] = rate
    q, barrier = ctx.Queue(), ctx.Barrier(len(devices))
    procs = [ctx.Process(target=_worker, args=(d, gib, seconds, barrier, q)) for d in devices]
    for p in procs:
        p.start()
    for _ in procs:
        dev, rate = q.get()
        out["together"][dev] = rate
    for p in procs:
        p.join()
    return out


def rows(result: dict[str, dict[int, float]]) -> list[dict]:
    """Per GPU: alone, together, and together / alone (1.0: sharing the host costs nothing)."""
    return [{"gpu": d, "alone_gbps": a, "together_gbps": result["together"].get(d),
             "ratio": (result["together"][d] / a) if d in result["together"] and a else None}
            for d, a in sorted(result["alone"].items())]


def render(table: list[dict]) -> str:
    lines = ["| GPU (torch index) | alone GB/s | all GPUs at once GB/s | at once / alone |",
             "| --- | --- | --- | --- |"]
    for r in table:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        together = "-" if r["together_gbps"] is None else f"{r['together_gbps']:.1f}"
        lines.append(f"| {r['gpu']} | {r['alone_gbps']:.1f} | {together} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="pinned buffer a GPU (GiB)")
    ap.add_argument("--seconds", type=float, default=8.0, help="timed copies a phase")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    a = ap.parse_args(argv)
    if a.gib <= 0 or a.seconds <= 0:
        print("link_sharing: --gib and --seconds must be positive", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print("link_sharing: needs torch", file=sys.stderr)
        return 2
    n = torch.cuda.device_count()
    if n < 2:
        print(f"link_sharing: needs two GPUs or more; {n} visible", file=sys.stderr)
        return 2
    table = rows(measure(list(range(n)), a.gib, a.seconds))
    print(render(table))
    if a.out:
        a.out.write_text(json.dumps({"gib": a.gib, "seconds": a.seconds, "rows": table},
                                    indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
