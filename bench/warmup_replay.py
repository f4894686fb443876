"""What vLLM's warm-up would leave in the slots: replay a served workload after dummy steps.

vLLM's warm-up (compile sizes, CUDA-graph capture, the sampler's dummy run) runs steps
through every MoE layer before the first request. A cache that kept what those steps
installed starts serving from their state; under LFU without decay their experts keep the
counts the steps gave them. This replays the requests a bench server was handed (a trace
fitted by `bench/trace_fit.py ... --decode-only`, with its ``requests`` labels) at each
layer's slots from a `plan --save` record, from empty slots and after N warm-up steps that
take the first ``4 x tokens`` ids of the raw trace's first row (what the bench's routing
hook gives a capture-sized step), and prints the hit rate over the requests after the
first (the timed ones), per policy.

    python bench/warmup_replay.py ROUTE_TOP4.npz ROUTE_FIT.npz PLAN.json \
        --sizes 1,2,4,8,16,24 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from expertcache_cli.rules.engine import sweep  # noqa: E402
from expertcache_cli.rules.policy import Policy  # noqa: E402


def warmup_steps(first_row: np.ndarray, sizes: list[int], top_k: int, width: int) -> np.ndarray:
    """One step per size: ``top_k x size`` ids of the first row (the rest padding)."""
    out = np.full((len(sizes), first_row.shape[0], width), -1, np.int32)
    for i, n in enumerate(sizes):
        k = min(top_k * n, first_row.shape[1], width)
        out[i, :, :k] = first_row[:, :k]
    return out


def timed_hit_rate(fit: np.ndarray, requests: np.ndarray, pre: np.ndarray, slots: list[int],
                   num_experts: int, policy: Policy) -> float:
    """Hits over the fitted trace's requests after its first, each layer at its own slots,
    with ``pre`` steps replayed before them."""
    width = max(fit.shape[2], pre.shape[2] if len(pre) else 0)
    body = np.full((fit.shape[0], fit.shape[1], width), -1, np.int32)
    body[:, :, :fit.shape[2]] = fit
    seq = np.concatenate([pre, body]) if len(pre) else body
    labels = np.concatenate([np.zeros(len(pre), np.int64), 1 + requests.astype(np.int64)])
    first = int(requests.min())
    uses = misses = 0
    for s in sorted(set(slots)):  # each layer replayed once, at its own slots
        layers = [i for i, n in enumerate(slots) if n == s]
        for lc in sweep(seq[:, layers, :], num_experts, [policy], [s], groups=labels):
            for g in range(len(lc.by_group)):
                if g >= 2 + first:  # group 0: warm-up; group 1 + first: the untimed request
                    c = lc.group(g)
                    uses += c.requests
                    misses += c.installs
    return 1 - misses / uses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", help="the trace the servers replayed (its row 0: the prefill)")
    ap.add_argument("fit", help="the ids the servers were handed (trace_fit --decode-only)")
    ap.add_argument("plan", help="a `plan --save` record: its recommended per-layer slots")
    ap.add_argument("--sizes", default="1,2,4,8,16,24", help="the warm-up's step sizes, tokens")
    ap.add_argument("--repeat", type=int, default=2, help="times each size runs")
    a = ap.parse_args(argv)
    raw = np.load(a.raw, allow_pickle=True)
    fit = np.load(a.fit, allow_pickle=True)
    rec = json.loads(Path(a.plan).read_text())["recommended"]
    slots = rec.get("per_layer_slots") or [rec["slots"]] * fit["topk_ids"].shape[1]
    top_k, experts = int(fit["top_k"]), int(fit["num_experts"])
    sizes = [int(x) for x in a.sizes.split(",") if x] * a.repeat
    pre = warmup_steps(raw["topk_ids"][0], sizes, top_k, raw["topk_ids"].shape[2])
    none = np.zeros((0, *pre.shape[1:]), np.int32)
    for policy in (Policy.LFU, Policy.LRU):
        empty = timed_hit_rate(fit["topk_ids"], fit["requests"], none, slots, experts, policy)
        warm = timed_hit_rate(fit["topk_ids"], fit["requests"], pre, slots, experts, policy)
        print(f"{policy.name.lower()}: timed requests' hits from empty slots {empty:.1%}, "
              f"after {len(sizes)} warm-up steps {warm:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
