"""A trace that starts with a prefill step of many tokens, and what the reference cache
(`policy.LayerCache`, step by step, no engine) fetches at a chosen set of its steps: the
independent side of the step-group and decode-pricing tests."""

from __future__ import annotations

import numpy as np

from expertcache_cli.rules.policy import LayerCache, Policy
from expertcache_cli.rules.trace import Trace

E, K, LAYERS = 64, 4, 3
PREFILL_TOKENS, DECODE_STEPS = 12, 40
BYTES = 9_437_184


def prefill_trace(seed: int = 7) -> Trace:
    """One prefill of 12 tokens (48 ids a layer) then 40 one-token decode steps routed among
    a layer's 24 hot experts: the prompt's tokens route over every expert, half of them to
    the hot ones, so the prefill fetches many experts decode never needs and installs
    (where it fits the slots) some that decode then hits."""
    rng = np.random.default_rng(seed)
    width = PREFILL_TOKENS * K
    ids = np.full((1 + DECODE_STEPS, LAYERS, width), -1, np.int64)
    for layer in range(LAYERS):
        hot = rng.permutation(E)[:24]
        for pos in range(PREFILL_TOKENS):
            pool = hot if pos % 2 else np.arange(E)
            ids[0, layer, pos * K:(pos + 1) * K] = rng.choice(pool, K, replace=False)
        for t in range(1, 1 + DECODE_STEPS):
            ids[t, layer, :K] = rng.choice(hot, K, replace=False)
    tokens = np.array([PREFILL_TOKENS] + [1] * DECODE_STEPS, np.int64)
    return Trace(ids, E, K, expert_bytes=BYTES, step_tokens=tokens).validate()


def reference_misses(trace: Trace, policy: Policy, slots: int, steps: range) -> int:
    """Experts fetched over the link at ``steps``, every step replayed in order through the
    reference cache: installs, plus a read-through step's distinct ids (in place)."""
    total = 0
    widths = (np.asarray(trace.step_tokens) * trace.top_k if trace.step_tokens is not None
              else (trace.topk_ids[:, 0] >= 0).sum(axis=1))
    for layer in range(trace.num_layers):
        cache = LayerCache(trace.num_experts, slots, policy)
        for t in range(trace.steps):
            r = cache.forward(trace.topk_ids[t, layer], width=int(widths[t]))
            if t in steps:
                total += r.miss_count + (r.distinct if r.read_through else 0) + r.staged_ids
    return total
