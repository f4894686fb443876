"""What the bench's trace hook adds to a captured decode step (BENCH ONLY).

    python bench/bench_trace_hook.py [--layers 24] [--top-k 6] [--experts 128]

Why: every trace-routed server runs `bench/trace_routing.py`'s substitution in each MoE
layer (a few small kernels in the captured step). A bench that gives `plan` a resident
rate measured without the hook, and compares served arms that ran it, charges the cache
with the hook's time. This measures that time, so a report can say how much of a gap it
is: a CUDA graph of ``layers`` layers, each a GEMV standing in for the layer's other work
(its own weight, read from HBM as a decode step reads its weights), replayed with and
without the hook's substitution of one token's ids behind each GEMV. The difference over
the layers is the hook's cost; the graph without it is the same run's baseline.
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

    def step(hook: bool) -> None:
        y = x
        for layer in range(L):
            y = y @ weights[layer]
            if hook:
                sink[layer].copy_(routing.substitute(routers[layer], router_ids))

    step(True)  # the hook's per-layer rows and counters are made outside the capture
    torch.cuda.synchronize()
    plain = graph_time(torch, lambda _s: step(False), args.reps)
    hooked = graph_time(torch, lambda _s: step(True), args.reps)
    # the copy into `sink` keeps the substituted ids alive; time it alone to take it off
    copies = graph_time(torch, lambda _s: [sink[i].copy_(router_ids) for i in range(L)],
                        args.reps)
    empty = graph_time(torch, lambda _s: None, args.reps)
    per_layer_us = ((hooked - plain) - (copies - empty)) / L * 1e6
    res = {"layers": L, "top_k": k, "hidden": h,
           "step_ms_without_hook": plain * 1e3, "step_ms_with_hook": hooked * 1e3,
           "sink_copies_ms": (copies - empty) * 1e3,
           "hook_us_per_layer": per_layer_us, "hook_ms_per_token": per_layer_us * L / 1e3,
           "with / without": hooked / plain}
    print(f"layers {L}, top-{k}: a step of {L} GEMVs {plain * 1e3:.3f} ms, with the hook "
          f"{hooked * 1e3:.3f} ms ({hooked / plain:.3f}x)")
    print(f"the hook: {per_layer_us:.2f} us a layer, {per_layer_us * L / 1e3:.3f} ms a token "
          f"over {L} layers (the {L} copies that keep its ids, "
          f"{(copies - empty) * 1e3:.3f} ms, taken off)")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
