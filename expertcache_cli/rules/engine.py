"""Compiled replay: the rules of `policy.py`, counted over whole traces at sweep speed.

Why numba: a sweep is tens of millions of layer-steps, each a handful of dependent,
data-driven branches (hit or miss, which slot, which victim). That does not vectorise
over steps, and a per-step Python loop is ~1000x too slow. numba compiles the same
loop to machine code, caches it on disk (``cache=True``) and runs independent
(policy, slots, layer) jobs on all cores. It is a pure pip wheel with no toolchain.

This module only counts; it holds no rule of its own that `policy.py` does not state.
The test suite replays random traces through both and compares every step's installs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from numba import njit

from .policy import NEVER, Policy, Wide, gate_widths

# Counter layout of one (policy, slots, layer) job.
(INSTALLS, DROPPED, RT_STEPS, RT_IDS, REQUESTS, SERVED_STEPS, STAGED_STEPS, STAGED_IDS,
 STAGED_HITS) = range(9)
N_COUNTERS = 9

#: The wide-step codes the compiled loop branches on: `Wide.code` of each member
#: (tests/test_policy_rules.py pins the two together).
WIDE_IN_PLACE = Wide.IN_PLACE.code
WIDE_STAGED = Wide.STAGED.code
WIDE_STAGED_INSTALL = Wide.STAGED_INSTALL.code

_SLOT_BITS = 16  # victim key = occupied << 62 | priority << 16 | slot
_MAX_SLOTS = 1 << _SLOT_BITS


@njit(cache=True, nogil=True)
def _replay_layer(seq, nxt, widths, num_experts, num_slots, policy, decay, max_inserts, out,
                  per_step, wide, wide_cap, groups):
    """Replay one layer's ``seq[T, W]``; counters into ``out[G, N_COUNTERS]``, step t's into
    its group's row ``out[groups[t]]``, installs per step into ``per_step`` (length T, or
    length 0 to skip). ``widths[t]`` is what the shape gate compares at step t
    (`policy.gate_widths`); ``wide`` is `Wide.code` (what a step wider than the slots
    does), ``wide_cap`` the installs such a step may make (`Wide.insert_cap`, computed once
    outside the compiled loop)."""
    t_steps, width = seq.shape
    table = np.full(num_experts, -1, np.int32)
    slot_expert = np.full(num_slots, -1, np.int32)
    prio = np.zeros(num_slots, np.int64)
    seen = np.zeros(num_experts, np.int64)  # stamp t+1 marks "in this step's R"
    nextuse = np.full(num_experts, NEVER, np.int64)
    distinct = np.empty(width, np.int32)
    missing = np.empty(width, np.int32)
    best_key = np.empty(num_slots, np.int64)
    horizon = t_steps + 1
    step = 0
    for t in range(t_steps):
        o = out[groups[t]]  # this step's counters (a view: its group's row)
        stamp = t + 1
        n = 0
        valid = 0
        for w in range(width):
            e = seq[t, w]
            if e < 0 or e >= num_experts:
                continue
            valid += 1
            if seen[e] != stamp:
                seen[e] = stamp
                distinct[n] = e
                n += 1
                if policy == 2:
                    nextuse[e] = nxt[t, w]
        o[REQUESTS] += n
        if policy == 2:
            # Belady's knowledge stays true on every step, read-through ones included.
            for i in range(n):
                s = table[distinct[i]]
                if s >= 0:
                    prio[s] = nextuse[distinct[i]]
        is_wide = widths[t] > num_slots  # the shape gate: tokens x top_k > slots
        if is_wide and wide == WIDE_IN_PLACE:  # in place: read through, the cache untouched
            o[RT_STEPS] += 1
            o[RT_IDS] += n
            continue
        if is_wide:
            o[STAGED_STEPS] += 1
        else:
            o[SERVED_STEPS] += 1
        step += 1
        # a wide step is the manager step at the wide cap (`policy._staged`)
        cap = wide_cap if is_wide else max_inserts
        # ascending order of the distinct ids (n is small: insertion sort)
        for i in range(1, n):
            v = distinct[i]
            j = i - 1
            while j >= 0 and distinct[j] > v:
                distinct[j + 1] = distinct[j]
                j -= 1
            distinct[j + 1] = v
        m = 0
        for i in range(n):
            e = distinct[i]
            s = table[e]
            if s >= 0:
                if policy == 0:
                    prio[s] = step
                elif policy == 1:
                    prio[s] += 1
            else:
                missing[m] = e
                m += 1
        if is_wide:  # the step's resident experts, copied slots -> scratch
            o[STAGED_HITS] += n - m
        if m > cap:  # past the cap: dropped, or on a wide step fetched to scratch
            o[STAGED_IDS if is_wide else DROPPED] += m - cap
            m = cap
        if policy == 1 and decay > 0 and step % decay == 0:
            for s in range(num_slots):
                prio[s] >>= 1
        if m == 0:
            continue
        # the m smallest victim keys among evictable slots, kept sorted
        k = 0
        for s in range(num_slots):
            old = slot_expert[s]
            if old >= 0 and seen[old] == stamp:
                continue
            if old < 0:
                key = np.int64(s)
            else:
                p = prio[s]
                if policy == 2:
                    p = 0 if p >= NEVER else horizon - p
                key = (np.int64(1) << 62) | (p << _SLOT_BITS) | s
            if k < m:
                j = k
                k += 1
            elif key < best_key[m - 1]:
                j = m - 1
            else:
                continue
            while j > 0 and best_key[j - 1] > key:
                best_key[j] = best_key[j - 1]
                j -= 1
            best_key[j] = key
        if k < m:
            o[STAGED_IDS if is_wide else DROPPED] += m - k
            m = k
        for i in range(m):
            s = np.int32(best_key[i] & (_MAX_SLOTS - 1))
            e = missing[i]
            old = slot_expert[s]
            if old >= 0:
                table[old] = -1
            slot_expert[s] = e
            table[e] = s
            if policy == 0:
                prio[s] = step
            elif policy == 1:
                prio[s] = 1
            else:
                prio[s] = nextuse[e]
        o[INSTALLS] += m
        if per_step.shape[0] > 0:
            per_step[t] = m


@njit(cache=True, nogil=True)
def _next_use_layer(seq, num_experts):
    """Backward scan: for each entry, the next step its id is routed again (or NEVER)."""
    t_steps, width = seq.shape
    out = np.full((t_steps, width), NEVER, np.int64)
    last = np.full(num_experts, NEVER, np.int64)
    for t in range(t_steps - 1, -1, -1):
        for w in range(width):
            e = seq[t, w]
            if 0 <= e < num_experts:
                out[t, w] = last[e]
        for w in range(width):
            e = seq[t, w]
            if 0 <= e < num_experts:
                last[e] = t
    return out


@njit(cache=True, nogil=True)
def union_layer(seq, offsets, num_experts, used, out):
    """``out[s]`` = the distinct ids of rows ``(s + o) % T`` of ``seq[T, W]``, ``o`` in
    ``offsets``. A step stops reading once it holds all ``used`` experts of the layer (many
    streams: every step soon routes all of them)."""
    t_steps, width = seq.shape
    stamp = np.full(num_experts, -1, np.int64)
    for s in range(t_steps):
        k = 0
        for o in offsets:
            if k == used:
                break
            r = s + o
            if r >= t_steps:
                r -= t_steps
            for w in range(width):
                e = seq[r, w]
                if e >= 0 and stamp[e] != s:
                    stamp[e] = s
                    out[s, k] = e
                    k += 1


@dataclass(frozen=True)
class LayerCounts:
    """Counters of one (policy, slots, layer) replay: over every step, and in ``by_group``
    the same counters (engine layout) of each step group `sweep` was given."""

    policy: Policy
    slots: int
    layer: int
    installs: int
    dropped: int
    read_through_steps: int
    read_through_ids: int
    requests: int
    served_steps: int
    staged_steps: int = 0
    staged_ids: int = 0
    staged_hits: int = 0
    by_group: tuple[tuple[int, ...], ...] = ()

    def group(self, g: int) -> LayerCounts:
        """The counters of step group ``g`` alone (its steps replayed in the whole trace's
        cache state, so a group's misses are what those steps fetched in the run)."""
        return LayerCounts(self.policy, self.slots, self.layer, *self.by_group[g])


def step_groups(groups: np.ndarray | None, t_steps: int) -> np.ndarray:
    """``groups`` checked as `sweep` reads it: one label ``0..G-1`` a step (None: one group)."""
    if groups is None:
        return np.zeros(t_steps, np.int64)
    out = np.ascontiguousarray(groups, dtype=np.int64)
    if out.shape != (t_steps,):
        raise ValueError(f"groups must label each of the {t_steps} steps, got shape "
                         f"{out.shape}")
    if t_steps and int(out.min()) < 0:
        raise ValueError("groups must be labels >= 0")
    return out


def sweep(
    ids: np.ndarray,
    num_experts: int,
    policies: list[Policy],
    slots: list[int],
    decay: int = 0,
    max_inserts: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    widths: np.ndarray | None = None,
    wide: Wide | str = Wide.IN_PLACE,
    groups: np.ndarray | None = None,
) -> list[LayerCounts]:
    """Replay every layer of ``ids[T, L, W]`` under every (policy, slots) pair.

    ``max_inserts`` None means uncapped (the slot count). ``widths[T, L]``: what the
    shape gate sees (`policy.gate_widths`; default: the valid ids). ``wide``: what a step
    wider than the slots does (`policy.Wide`). ``groups[T]``: a label ``0..G-1`` for each
    step; every counter is also kept per group (`LayerCounts.by_group`), in the same pass,
    so a caller can count some steps (decode) in the state others (prefills) left without
    replaying twice: the trace's step kinds (`Trace.step_kinds`), a window of steps, or
    ``arange(T)`` for every step apart (``G x 8`` counters a job). Jobs run in parallel
    threads; ``progress(done, total)`` is called as each (policy, slots, layer) job ends.
    """
    wide_mode = Wide.parse(wide)
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    t_steps, n_layers, _ = ids.shape
    labels = step_groups(groups, t_steps)
    n_groups = int(labels.max()) + 1 if t_steps else 1
    if widths is None:
        widths = gate_widths(ids, num_experts)
    widths = np.ascontiguousarray(widths, dtype=np.int64)
    for s in slots:
        if not 0 < s < _MAX_SLOTS:
            raise ValueError(f"slots must be in 1..{_MAX_SLOTS - 1}, got {s}")
    jobs = [(p, s, layer) for p in policies for s in slots for layer in range(n_layers)]
    nxt_all: dict[int, np.ndarray] = {}
    empty_steps = np.empty(0, np.int64)
    no_next = np.empty((0, 0), np.int64)
    out = np.zeros((len(jobs), n_groups, N_COUNTERS), np.int64)

    def next_use(layer: int) -> None:
        nxt_all[layer] = _next_use_layer(np.ascontiguousarray(ids[:, layer, :]), num_experts)

    def run(j: int) -> None:
        p, s, layer = jobs[j]
        seq = np.ascontiguousarray(ids[:, layer, :])
        nxt = nxt_all[layer] if p is Policy.OPT else no_next
        cap = s if max_inserts is None else max_inserts
        _replay_layer(seq, nxt, np.ascontiguousarray(widths[:, layer]), num_experts, s, int(p),
                      decay, cap, out[j], empty_steps, wide_mode.code,
                      wide_mode.insert_cap(cap), labels)

    # The compiled loops release the GIL, so plain threads use every core.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        if Policy.OPT in policies:
            list(pool.map(next_use, range(n_layers)))
        for done, _ in enumerate(pool.map(run, range(len(jobs))), start=1):
            if progress is not None:
                progress(done, len(jobs))
    return [
        LayerCounts(p, s, layer, *(int(v) for v in parts.sum(axis=0)),
                    by_group=tuple(tuple(int(v) for v in g) for g in parts) if groups is not None
                    else ())
        for (p, s, layer), parts in zip(jobs, out)
    ]


def installs_per_step(
    seq: np.ndarray,
    num_experts: int,
    policy: Policy,
    slots: int,
    decay: int = 0,
    max_inserts: int | None = None,
    widths: np.ndarray | None = None,
    wide: Wide | str = Wide.IN_PLACE,
) -> np.ndarray:
    """Installs at every step of one layer (for step-by-step checks against the reference)."""
    seq = np.ascontiguousarray(seq, dtype=np.int32)
    if widths is None:
        widths = gate_widths(seq[:, None, :], num_experts)[:, 0]
    widths = np.ascontiguousarray(widths, dtype=np.int64)
    nxt = _next_use_layer(seq, num_experts) if policy is Policy.OPT else np.empty((0, 0), np.int64)
    out = np.zeros((1, N_COUNTERS), np.int64)
    per_step = np.zeros(seq.shape[0], np.int64)
    cap = slots if max_inserts is None else max_inserts
    wide_mode = Wide.parse(wide)
    _replay_layer(seq, nxt, widths, num_experts, slots, int(policy), decay, cap, out, per_step,
                  wide_mode.code, wide_mode.insert_cap(cap), step_groups(None, seq.shape[0]))
    return per_step
