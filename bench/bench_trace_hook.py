"""What the bench's trace hook adds to a captured decode step (BENCH ONLY).

    python bench/bench_trace_hook.py [--layers 24] [--top-k 6] [--experts 128]

Why: every trace-routed server runs `bench/trace_routing.py`'s substitution in each MoE
layer (a few small kernels in the captured step). A bench that gives `plan` a resident
rate measured without the hook, and compares served arms that ran it, charges the cache
with the hook's time. This measures that time, so a report can say how much of a gap it
is: a CUDA graph of ``layers`` layers, each a GEMV standing in for the layer's other work
(its own weight, read from HBM as a decode step reads its weights), replayed with and
without the hook's substitution of one token's ids behind each GEMV (both copying the ids
they end with, so that only the substitution differs). The difference over the layers is
the hook's cost; the graph without it is the same run's baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from _cudabench import graph_time, header


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048,
                    help="each layer's stand-in GEMV is hidden x hidden (bf16)")
    ap.add_argument("--steps", type=int, default=800, help="rows of the random trace")
    ap.add_argument("--reps", type=int, default=200, help="graph replays a timing window")
    ap.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("bench_trace_hook: no CUDA device; this measures GPU time", file=sys.stderr)
        return 2
    from trace_routing import TraceRouting

    header(torch, "bench_trace_hook: the trace hook's substitution in a captured decode step")
    L, k, h = args.layers, args.top_k, args.hidden
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(args.experts, k, replace=False) for _ in range(L)])
                    for _ in range(args.steps)])
    routing = TraceRouting(ids, k)
    routers = [object() for _ in range(L)]  # the hook tells layers apart by their router
    weights = [torch.randn(h, h, dtype=torch.bfloat16, device="cuda") for _ in range(L)]
    x = torch.randn(1, h, dtype=torch.bfloat16, device="cuda")
    router_ids = torch.zeros(1, k, dtype=torch.int32, device="cuda")
    sink = torch.zeros(L, 1, k, dtype=torch.int32, device="cuda")

    def step(mode: str) -> None:
        """A decode step's layers: the GEMV alone, with a copy of the router's ids into
        `sink` (what keeps the ids the hook returns alive), or with the hook's ids copied."""
        y = x
        for layer in range(L):
            y = y @ weights[layer]
            if mode == "copy":
                sink[layer].copy_(router_ids)
            elif mode == "hook":
                sink[layer].copy_(routing.substitute(routers[layer], router_ids))

    step("hook")  # the hook's per-layer rows and counters are made outside the capture
    torch.cuda.synchronize()
    t = {mode: graph_time(torch, lambda _s, m=mode: step(m), args.reps)
         for mode in ("plain", "copy", "hook")}
    per_layer_us = (t["hook"] - t["copy"]) / L * 1e6
    res = {"gpu": torch.cuda.get_device_name(0), "layers": L, "top_k": k, "hidden": h,
           **{f"step_ms_{m}": v * 1e3 for m, v in t.items()},
           "hook_us_per_layer": per_layer_us, "hook_ms_per_token": per_layer_us * L / 1e3,
           "hook_over_copy": t["hook"] / t["copy"]}
    print(f"layers {L}, top-{k}: a step of {L} GEMVs {t['plain'] * 1e3:.3f} ms; with a copy "
          f"of the router's ids a layer {t['copy'] * 1e3:.3f} ms; with the hook's ids "
          f"{t['hook'] * 1e3:.3f} ms ({t['hook'] / t['copy']:.3f}x the copy's step)")
    print(f"the hook: {per_layer_us:.2f} us a layer, {per_layer_us * L / 1e3:.3f} ms a token "
          f"over {L} layers")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
