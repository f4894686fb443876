"""Replay sweep speed: LRU + LFU + OPT x slots {8,16,24,32} on an OLMoE-shaped trace.

The goal: <= 10 s wall on the 2-core CI-class machine for a trace of 51,112
steps x 16 layers x top-8 of 64 experts. The sweep is timed the way a user meets it: a
fresh `python` process that imports the package and replays (compiled code loaded from
numba's on-disk cache), and once more with an empty cache (first use ever, compile
included). The baseline is the plain per-step reference (`policy.replay_layer_reference`)
on the same trace in the same run; it is slow, so by default it runs on the first
``--baseline-steps`` steps of every layer and is scaled linearly to the whole trace
(the rules cost the same per step throughout); ``--full-baseline`` runs it all.

    python bench/bench_replay.py [--steps 51112] [--baseline-steps 1500] [--full-baseline]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from expertcache_cli.rules import trace as trace_io  # noqa: E402
from expertcache_cli.rules.policy import Policy, replay_layer_reference  # noqa: E402
from expertcache_cli.rules.synth import SynthSpec, synthesize  # noqa: E402

POLICIES = ["lru", "lfu", "opt"]
SLOTS = [8, 16, 24, 32]

SWEEP = """
import sys, time
t0 = time.perf_counter()
from expertcache_cli.rules import engine, trace
from expertcache_cli.rules.policy import Policy
t = trace.load(sys.argv[1])
r = engine.sweep(t.topk_ids, t.num_experts, [Policy.LRU, Policy.LFU, Policy.OPT], [8, 16, 24, 32])
print(time.perf_counter() - t0, sum(c.installs for c in r))
"""


def timed_sweep(path: Path, cache_dir: str | None) -> tuple[float, float, int]:
    env = dict(os.environ)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", SWEEP, str(path)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return time.perf_counter() - start, float(out[0]), int(out[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=51112)
    ap.add_argument("--baseline-steps", type=int, default=1500)
    ap.add_argument("--full-baseline", action="store_true")
    args = ap.parse_args()

    spec = SynthSpec(steps=args.steps, layers=16, experts=64, top_k=8, seed=42)
    trace = synthesize(spec)
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_io.save(trace, Path(tmp) / "olmoe_shaped.npz")
        print(f"trace: {trace.steps} steps x {trace.num_layers} layers x top-8 of 64 (synthetic)")
        print(f"machine: {os.cpu_count()} cores")

        cold_wall, _, installs = timed_sweep(path, cache_dir=str(Path(tmp) / "numba-cold"))
        warm_wall, warm_inner, installs2 = timed_sweep(path, cache_dir=None)
        assert installs == installs2
        print(f"sweep, first use (compile included): {cold_wall:6.2f} s wall")
        print(f"sweep, cached (process start to result): {warm_wall:6.2f} s wall")

        n = trace.steps if args.full_baseline else min(args.baseline_steps, trace.steps)
        start = time.perf_counter()
        base_installs = 0
        for pol in POLICIES:
            for s in SLOTS:
                for layer in range(trace.num_layers):
                    seq = np.ascontiguousarray(trace.topk_ids[:n, layer, :])
                    res = replay_layer_reference(seq, 64, s, Policy.parse(pol))
                    base_installs += sum(r.miss_count for r in res)
        base = (time.perf_counter() - start) * trace.steps / n
        scale = trace.steps / n
        how = "measured" if n == trace.steps else f"measured on {n} steps, scaled x{scale:.1f}"
        print(f"plain per-step Python reference: {base:8.1f} s ({how})")
        if n == trace.steps:
            assert base_installs == installs, (base_installs, installs)
            print("installs identical between the two")
        print(f"speed-up (cached sweep vs reference): {base / warm_wall:6.0f}x")
        verdict = "PASS" if warm_wall <= 10 else "FAIL"
        print(f"goal <= 10 s wall: {verdict} ({warm_wall:.2f} s; first use {cold_wall:.2f} s)")


if __name__ == "__main__":
    main()
