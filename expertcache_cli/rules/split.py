"""Recommend how to split a total slot budget across layers.

Layers differ a lot: deep layers are often far more cacheable than shallow ones, so a
uniform split wastes slots where they buy little. Given each layer's miss curve (misses
at a grid of slot counts, from the replay engine), an exact dynamic program over the
grid finds the per-layer counts with the fewest total misses within the same total.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import engine
from .budget import ONLINE_POLICIES
from .policy import Policy, Wide
from .trace import DECODE, Trace


@dataclass
class Split:
    """A per-layer allocation and what it costs against the uniform one."""

    budget: int
    uniform_slots: int
    slots: list[int]  # per layer
    misses: int
    uniform_misses: int

    @property
    def saved(self) -> int:
        return self.uniform_misses - self.misses

    @property
    def saved_fraction(self) -> float:
        return self.saved / self.uniform_misses if self.uniform_misses else 0.0


def slot_grid(num_experts: int, extra: list[int], floor: int = 0) -> list[int]:
    """Candidate per-layer slot counts: an even grid of ~32 points plus the asked sizes,
    each one a budget the plugin accepts (`budget.slot_limit`: below E, within the
    kernel), so a recommended split can be served as it is. ``floor``: no layer below
    it (the widest decode step's ids, which `serve` requires of every layer)."""
    from .budget import slot_limit

    top = slot_limit(num_experts)
    step = max(1, num_experts // 32)
    grid = set(range(step, top + 1, step)) | {s for s in extra if 0 < s <= top}
    if floor > 0:
        grid = {s for s in grid if s >= floor} | ({floor} if floor <= top else set())
    return sorted(grid)


def miss_curves(trace: Trace, policy: Policy, grid: list[int], decay: int = 0,
                wide: Wide | str = Wide.IN_PLACE, decode_only: bool = False) -> np.ndarray:
    """``curves[layer, i]`` = host fetches of that layer at ``grid[i]`` slots.
    ``decode_only``: the decode steps' fetches (`Trace.step_kinds`), every step replayed
    for the cache state, as `plan` prices them; every step where the trace cannot tell."""
    kinds = trace.step_kinds() if decode_only else None
    counts = engine.sweep(trace.topk_ids, trace.num_experts, [policy], grid, decay,
                          widths=trace.gate_widths(), wide=wide, groups=kinds)
    curves = np.zeros((trace.num_layers, len(grid)), np.int64)
    col = {s: i for i, s in enumerate(grid)}
    for c in counts:
        if kinds is not None:
            c = c.group(DECODE)
        curves[c.layer, col[c.slots]] = c.installs + c.read_through_ids + c.staged_ids
    return curves


def best_split(curves: np.ndarray, grid: list[int], budget: int, uniform: int) -> Split:
    """Exact minimum of total misses with per-layer slots from ``grid`` summing to <= budget."""
    n_layers = curves.shape[0]
    inf = np.iinfo(np.int64).max // 4
    # cost[b] = fewest misses of the layers so far using exactly b slots
    cost = np.full(budget + 1, inf, np.int64)
    cost[0] = 0
    choice = np.zeros((n_layers, budget + 1), np.int64)
    for layer in range(n_layers):
        new = np.full(budget + 1, inf, np.int64)
        for i, s in enumerate(grid):
            if s > budget:
                break
            cand = np.full(budget + 1, inf, np.int64)
            cand[s:] = cost[: budget + 1 - s] + curves[layer, i]
            better = cand < new
            new[better] = cand[better]
            choice[layer, better] = i
        cost = new
    b = int(np.argmin(cost))
    if cost[b] >= inf:
        raise ValueError(f"budget {budget} is below one grid step per layer")
    slots = [0] * n_layers
    for layer in range(n_layers - 1, -1, -1):
        i = int(choice[layer, b])
        slots[layer] = grid[i]
        b -= grid[i]
    misses = int(sum(curves[layer, grid.index(s)] for layer, s in enumerate(slots)))
    uniform_misses = int(curves[:, grid.index(uniform)].sum())
    return Split(uniform * n_layers, uniform, slots, misses, uniform_misses)


def split_policy(policies: list[Policy]) -> Policy:
    """The policy a per-layer split is recommended for: the first of ``policies`` a live
    cache runs (`budget.ONLINE_POLICIES`), else LRU. A split is something to serve, and
    Belady's optimum, which needs the future, serves nothing: a split priced with it
    would promise misses no server gets."""
    return next((p for p in policies if p in ONLINE_POLICIES), Policy.LRU)


def recommend(
    trace: Trace, policy: Policy, uniform_slots: list[int], decay: int = 0,
    wide: Wide | str = Wide.IN_PLACE, floor: int = 0, decode_only: bool = False,
) -> list[Split]:
    """For each uniform size, the best split of the same total (``size x layers``), with
    no layer below ``floor`` slots (each uniform size must be at least that).
    ``decode_only``: minimise the decode steps' misses (`miss_curves`), as `plan` prices."""
    if floor and min(uniform_slots) < floor:
        raise ValueError(f"a uniform budget below the floor of {floor} slots")
    grid = slot_grid(trace.num_experts, uniform_slots, floor)
    curves = miss_curves(trace, policy, grid, decay, wide, decode_only)
    return [best_split(curves, grid, s * trace.num_layers, s) for s in uniform_slots]
