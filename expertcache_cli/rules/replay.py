"""Replay a routing trace under policies and budgets: the library behind `expertcache replay`.

Counting misses is the deterministic way to compare policies (docs/design.md, Measuring
without fooling ourselves): no server, no timing noise, and it measures exactly what the
cache controls. The numbers here are the ones a user sizes a deployment from, so each is
defined once:

- ``requests``: distinct valid ids over all layer-steps (what a layer needs resident).
- ``installs``: experts the cache gathered into slots (what the kernel counts live).
- ``read_through_ids``: distinct ids of layer-steps too wide for the slots
  (``tokens x top_k > slots``); the stock path reads them over the link in place.
- ``staged_ids``: with a staged wide-step mode (`policy.Wide`), the experts wide steps
  fetched into the scratch (their misses not installed); such steps are ``staged_steps``.
- ``misses = installs + read_through_ids + staged_ids``: experts fetched over the link.
- ``staged_hits``: the experts staged steps found in the slots, each copied from its slot
  into the scratch: no link traffic, but a device copy a step pays (`plan` prices it).

Each count is also kept per step group, in the same pass (`ReplayReport.by_group`): by
default the trace's step kinds (`Trace.step_kinds`: decode and prefill), so that `plan`
prices the decode steps' fetches in the cache state the prefills left, without a second
replay; a caller may label the steps otherwise (a window, or every step apart).

The shape gate is the plugin's own (`policy.gate_widths`: a recorded trace's tokens x
top_k as vLLM ran each step, padding rows included), so a trace recorded from a server
replays to its live counters: the server's ``installs`` equal ``installs`` here, and its
``requests`` (counted only on steps served from slots) equal ``requests -
read_through_ids`` (`live_requests`; the counter's hit rate, `live_hit_rate`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from numba import njit

from . import engine
from .policy import Policy, Wide
from .trace import DECODE, Trace

COUNT_FIELDS = [
    "installs",
    "dropped",
    "read_through_steps",
    "read_through_ids",
    "requests",
    "served_steps",
    "staged_steps",
    "staged_ids",
    "staged_hits",
]


@dataclass
class ReplayReport:
    """Everything one replay computed; tables are pandas frames for the CLI and tests."""

    results: pd.DataFrame  # one row per (policy, slots), all layers summed
    per_layer: pd.DataFrame  # one row per (policy, slots, layer)
    reuse: dict[str, float] = field(default_factory=dict)
    split: pd.DataFrame | None = None
    #: one row per (policy, slots, group): the counts, misses and miss rate of each step
    #: group (`replay`'s ``groups``; default the trace's step kinds, `trace.DECODE` and
    #: `trace.PREFILL`; a trace that cannot tell them apart is all `DECODE`)
    by_group: pd.DataFrame | None = None

    def group(self, label: int) -> pd.DataFrame:
        """``by_group``'s rows of one group, one per (policy, slots), in `results`' order
        (zero counts where no step of that group exists)."""
        if self.by_group is None:
            raise ValueError("this report was built without step groups")
        key = ["policy", "slots"]
        rows = self.by_group[self.by_group["group"] == label].drop(columns="group")
        out = self.results[key].merge(rows, on=key, how="left")
        out[COUNT_FIELDS + ["misses"]] = out[COUNT_FIELDS + ["misses"]].fillna(0).astype(int)
        out["miss_rate"] = out["misses"] / out["requests"].where(out["requests"] > 0, 1)
        return out


def live_requests(requests: int, read_through_ids: int) -> int:
    """The ``requests`` a server's live counter reports for a replay's counts: it counts
    ids only on the steps it served from slots, so a read-through step's are not in it."""
    return requests - read_through_ids


def live_hit_rate(installs: int, requests: int, read_through_ids: int) -> float:
    """The hit rate the cache's own counter reports for a replay's counts (installs over
    the ids it served). It differs from ``1 - miss_rate`` wherever steps were read through
    (which count as misses there, nowhere live) or where a prefill step fits the slots
    (which `plan`'s decode-only rate leaves out and the counter does not); NaN where the
    cache served nothing."""
    served = live_requests(requests, read_through_ids)
    return 1 - installs / served if served > 0 else float("nan")


def _derive(df: pd.DataFrame, tokens: int, expert_bytes: int | None, link_gbps: float | None):
    df = df.copy()
    df["misses"] = df["installs"] + df["read_through_ids"] + df["staged_ids"]
    df["miss_rate"] = df["misses"] / df["requests"].where(df["requests"] > 0, 1)
    if expert_bytes:
        df["bytes_moved"] = df["misses"] * expert_bytes
        df["bytes_per_token"] = df["bytes_moved"] / max(1, tokens)
        if link_gbps:
            df["transfer_ms_per_token"] = df["bytes_per_token"] / (link_gbps * 1e9) * 1e3
    return df


def replay(
    trace: Trace,
    policies: list[Policy],
    slots: list[int],
    *,
    decay: int = 0,
    max_inserts: int | None = None,
    expert_bytes: int | None = None,
    link_gbps: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    wide: Wide | str = Wide.IN_PLACE,
    groups: np.ndarray | None = None,
) -> ReplayReport:
    """Replay ``trace`` under every (policy, slots); LRU and OPT are added for the ratios.
    ``wide``: what a step wider than the slots does (the plugin's default: in place).
    ``groups[T]``: a label 0..G-1 a step, counted apart in ``by_group`` (default: the
    trace's step kinds, `Trace.step_kinds`)."""
    wanted = list(dict.fromkeys(policies))
    run = list(dict.fromkeys([*wanted, Policy.LRU, Policy.OPT]))
    if groups is None:
        kinds = trace.step_kinds()
        groups = kinds if kinds is not None else np.full(trace.steps, DECODE, np.int64)
    counts = engine.sweep(
        trace.topk_ids, trace.num_experts, run, slots, decay, max_inserts, progress=progress,
        widths=trace.gate_widths(), wide=wide, groups=groups,
    )
    layer_names = trace.layer_names()
    rows = [
        {
            "policy": c.policy.name.lower(),
            "slots": c.slots,
            "layer": layer_names[c.layer],
            **{f: getattr(c, f) for f in COUNT_FIELDS},
        }
        for c in counts
    ]
    per_layer = pd.DataFrame(rows)
    eb = expert_bytes if expert_bytes is not None else trace.expert_bytes
    tokens = trace.tokens
    totals = per_layer.groupby(["policy", "slots"], sort=False)[COUNT_FIELDS].sum().reset_index()
    totals = _derive(totals, tokens, eb, link_gbps)
    per_layer = _derive(per_layer, tokens, eb, link_gbps)
    base = totals.set_index(["policy", "slots"])["misses"]
    for ref in ("lru", "opt"):  # misses against LRU and against Belady at the same slots
        totals[f"vs_{ref}"] = [
            m / base[(ref, s)] if base[(ref, s)] else 1.0
            for m, s in zip(totals["misses"], totals["slots"])
        ]
    names = [p.name.lower() for p in wanted]
    totals = totals[totals["policy"].isin(names)].reset_index(drop=True)
    per_layer = per_layer[per_layer["policy"].isin(names)].reset_index(drop=True)
    return ReplayReport(results=totals, per_layer=per_layer, reuse=reuse_percentiles(trace),
                        by_group=_group_totals(counts, names))


def _group_totals(counts: list[engine.LayerCounts], names: list[str]) -> pd.DataFrame:
    """Per (policy, slots, group) sums over the layers of each step group's counters."""
    rows = [
        {"policy": c.policy.name.lower(), "slots": c.slots, "group": g,
         **{f: getattr(c.group(g), f) for f in COUNT_FIELDS}}
        for c in counts if c.policy.name.lower() in names
        for g in range(len(c.by_group))
    ]
    df = pd.DataFrame(rows, columns=["policy", "slots", "group", *COUNT_FIELDS])
    df = df.groupby(["policy", "slots", "group"], sort=False)[COUNT_FIELDS].sum().reset_index()
    df["misses"] = df["installs"] + df["read_through_ids"] + df["staged_ids"]
    df["miss_rate"] = df["misses"] / df["requests"].where(df["requests"] > 0, 1)
    return df


@njit(cache=True)
def _stack_distances(seq, num_experts, out):
    """Distinct other experts routed in the steps strictly between two uses of an expert.
    A use is one layer-step routing it (as ``requests`` counts it): the same expert routed
    by several tokens of one step is one use, whether the step lists it once or per token."""
    t_steps, width = seq.shape
    last = np.full(num_experts, -1, np.int64)
    seen = np.full(num_experts, -1, np.int64)
    n = 0
    for t in range(t_steps):
        for w in range(width):
            e = seq[t, w]
            if e < 0 or e >= num_experts or seen[e] == t:
                continue
            seen[e] = t
            if last[e] >= 0:
                d = 0
                for o in range(num_experts):
                    if o != e and last[o] > last[e] and last[o] < t:
                        d += 1
                out[n] = d
                n += 1
        for w in range(width):
            e = seq[t, w]
            if 0 <= e < num_experts:
                last[e] = t
    return n


def reuse_percentiles(trace: Trace, qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """Reuse (stack) distance percentiles over all layers, in distinct experts.

    An expert re-used after ``d`` other distinct experts hits an LRU cache of more than
    ``d`` slots (when the step fits), so these percentiles read as "slots needed for
    q% of re-uses to hit".
    """
    ids = np.ascontiguousarray(trace.topk_ids, dtype=np.int32)
    chunks = []
    for layer in range(ids.shape[1]):
        seq = np.ascontiguousarray(ids[:, layer, :])
        out = np.empty(seq.size, np.int64)
        n = _stack_distances(seq, trace.num_experts, out)
        chunks.append(out[:n])
    dist = np.concatenate(chunks) if chunks else np.empty(0)
    if dist.size == 0:
        return {f"p{q}": float("nan") for q in qs} | {"reuses": 0}
    return {f"p{q}": float(np.percentile(dist, q)) for q in qs} | {"reuses": int(dist.size)}
