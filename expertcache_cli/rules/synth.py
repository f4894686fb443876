"""Synthetic routing traces, for tests, demos and the speed benchmark.

Real decode routing has three properties that decide a cache's hit rate, and the
generator has a knob for each: skewed expert popularity per layer (``alpha``, a Zipf
exponent over a per-layer random ranking, steeper in deeper layers with
``layer_skew``), temporal locality (``stickiness``: the chance a pick repeats one of the
previous token's experts), and workload shifts (several tasks with their own rankings,
interleaved in segments). None of this is a model of any particular network; traces
made here are labelled ``source="synthetic:..."`` so nobody mistakes them for recorded ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from .trace import Trace


@njit(cache=True)
def _stream(task_of_step, perm, cdf, top_k, stickiness, seed, out, col):
    """Fill ``out[:, :, col:col+top_k]`` with one sequence's distinct picks per step."""
    np.random.seed(seed)
    t_steps = task_of_step.shape[0]
    n_layers = perm.shape[1]
    n_experts = perm.shape[2]
    prev = np.full((n_layers, top_k), -1, np.int32)
    pick = np.empty(top_k, np.int32)
    for t in range(t_steps):
        task = task_of_step[t]
        for layer in range(n_layers):
            n = 0
            tries = 0
            while n < top_k:
                tries += 1
                if tries > 64 * top_k:  # pathological knobs: fill with the lowest unused ids
                    e = 0
                    while True:
                        dup = False
                        for j in range(n):
                            if pick[j] == e:
                                dup = True
                        if not dup:
                            break
                        e += 1
                elif t > 0 and np.random.random() < stickiness:
                    e = prev[layer, np.random.randint(top_k)]
                else:
                    r = np.random.random()
                    rank = np.searchsorted(cdf[layer], r)
                    if rank >= n_experts:
                        rank = n_experts - 1
                    e = perm[task, layer, rank]
                dup = False
                for j in range(n):
                    if pick[j] == e:
                        dup = True
                if not dup:
                    pick[n] = e
                    n += 1
            for j in range(top_k):
                out[t, layer, col + j] = pick[j]
                prev[layer, j] = pick[j]


@dataclass(frozen=True)
class SynthSpec:
    """Knobs of a synthetic trace; the defaults are shaped like an OLMoE-1B-7B decode."""

    steps: int = 2000
    layers: int = 16
    experts: int = 64
    top_k: int = 8
    alpha: float = 1.0
    layer_skew: float = 0.5
    stickiness: float = 0.35
    tasks: int = 1
    segment: int = 250
    batch: int = 1
    seed: int = 0
    expert_bytes: int | None = None
    model: str | None = None

    def check(self) -> None:
        if min(self.steps, self.layers, self.experts, self.top_k, self.tasks, self.batch) < 1:
            raise ValueError("steps, layers, experts, top_k, tasks and batch must be >= 1")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}")
        if not 0.0 <= self.stickiness < 1.0:
            raise ValueError("stickiness must be in [0, 1)")
        if self.alpha < 0 or self.segment < 1:
            raise ValueError("alpha must be >= 0 and segment >= 1")


def _layer_cdfs(spec: SynthSpec) -> np.ndarray:
    ranks = np.arange(1, spec.experts + 1, dtype=np.float64)
    cdfs = np.empty((spec.layers, spec.experts))
    for layer in range(spec.layers):
        depth = layer / max(1, spec.layers - 1)
        a = spec.alpha * (1.0 - spec.layer_skew / 2 + spec.layer_skew * depth)
        w = ranks**-a
        cdfs[layer] = np.cumsum(w) / w.sum()
    return cdfs


def synthesize(spec: SynthSpec) -> Trace:
    """Make a trace: ``batch`` independent sequences per step, each of ``top_k`` ids."""
    spec.check()
    rng = np.random.default_rng(spec.seed)
    perm = np.stack(
        [
            np.stack([rng.permutation(spec.experts) for _ in range(spec.layers)])
            for _ in range(spec.tasks)
        ]
    ).astype(np.int32)
    cdf = _layer_cdfs(spec)
    out = np.empty((spec.steps, spec.layers, spec.batch * spec.top_k), np.int32)
    for b in range(spec.batch):
        # each sequence walks through the tasks in its own random order of segments
        n_seg = -(-spec.steps // spec.segment)
        seg_tasks = rng.integers(0, spec.tasks, size=n_seg) if spec.tasks > 1 else np.zeros(n_seg)
        task_of_step = np.repeat(seg_tasks.astype(np.int64), spec.segment)[: spec.steps]
        seed = int(rng.integers(0, 2**31 - 1))
        _stream(task_of_step, perm, cdf, spec.top_k, spec.stickiness, seed, out, b * spec.top_k)
    kind = "batched" if spec.batch > 1 else ("tasks" if spec.tasks > 1 else "zipf")
    source = (
        f"synthetic:{kind} alpha={spec.alpha} layer_skew={spec.layer_skew} "
        f"stickiness={spec.stickiness} tasks={spec.tasks} segment={spec.segment} "
        f"batch={spec.batch} seed={spec.seed}"
    )
    return Trace(
        topk_ids=out,
        num_experts=spec.experts,
        top_k=spec.top_k,
        expert_bytes=spec.expert_bytes,
        model=spec.model,
        step_tokens=np.full(spec.steps, spec.batch, dtype=np.int64),
        source=source,
    ).validate()
