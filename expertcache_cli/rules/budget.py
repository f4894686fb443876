"""The slot budget's rules, in one place: what `size`, `serve`, `baseline` and the plugin
all obey, so they cannot disagree.

- a fraction of the experts becomes slots rounded half up, at least 1, and must lie in
  (0, 1): a budget of every expert is what not offloading does, without the cache's work;
- slots must be below the layer's expert count and within the kernel's limit
  (`MAX_SLOTS`, here because the budget obeys it; the manager keeps its state in one
  block's shared memory, and `binding` checks its launches against the same numbers);
- the online policies are LRU and LFU; a decay applies to LFU only (Belady's optimum needs
  the future and exists only in replay);
- the sizing trap is worded once (`trap_text`); how a batch is padded is `capture`;
- a replay of a trace with no budgets given replays `default_budgets`, and a budget given
  for a trace must be below its experts (`budgets_below`).

Functions raise ``ValueError`` with the rule in words and without naming the input; each
caller puts its own option or variable in front (``--policy`` on the command line,
``EXPERT_CACHE_POLICY`` in vLLM).
"""

from __future__ import annotations

import math

from .policy import Policy

__all__ = ["DEFAULT_EIGHTHS", "MAX_EXPERTS", "MAX_SLOTS", "ONLINE_POLICIES", "budgets_below",
           "check_fraction", "check_slots", "default_budgets", "online_names", "online_policy",
           "slot_limit", "slots_from_fraction", "trap_text"]

#: the cache kernel's limits, = EC_MAX_EXPERTS and EC_MAX_SLOTS in kernels/expert_cache.cu
#: (tests/test_kernel_build.py reads them from the source)
MAX_EXPERTS = 16384
MAX_SLOTS = 1024


def check_fraction(fraction: float) -> float:
    """The fraction itself, or ValueError when it is not strictly between 0 and 1."""
    if math.isnan(fraction) or not 0.0 < fraction < 1.0:
        raise ValueError(f"{fraction:g} is not a fraction between 0 and 1 (exclusive)")
    return fraction


def slots_from_fraction(fraction: float, num_experts: int) -> int:
    """Slots for ``fraction`` of ``num_experts``, rounded half up, at least 1."""
    return max(1, int(math.floor(fraction * num_experts + 0.5)))


def slot_limit(num_experts: int) -> int:
    """The most slots a layer of ``num_experts`` may have: below E, within the kernel."""
    return max(0, min(num_experts - 1, MAX_SLOTS))


def check_slots(slots: int, num_experts: int, whose: str = "") -> int:
    """``slots`` itself when a layer of ``num_experts`` may have them (`slot_limit`), else
    ValueError saying which rule it breaks: the one check the plugin's configuration,
    `size`/`serve`'s ``--slots`` and a plan file's per-layer budgets share. ``whose``
    qualifies the experts in the message ("the layer's ")."""
    if slots <= slot_limit(num_experts):
        return slots
    if slots >= num_experts:
        raise ValueError(f"{slots} is not below {whose or 'the '}{num_experts} experts "
                         "(nothing to cache: do not offload the experts instead)")
    raise ValueError(f"{slots} is above the cache kernel's limit: it holds at most {MAX_SLOTS} "
                     "slots a layer")


#: `replay`'s budgets when none are given: three of E/8, E/4, E/2, 3E/4 (as E x n/8)
DEFAULT_EIGHTHS = (1, 2, 4, 6)


def default_budgets(num_experts: int, top_k: int = 0) -> list[int]:
    """The first three of E/8, E/4, E/2 and 3E/4 slots that are above ``top_k`` (at top_k
    slots or fewer a one-token step leaves no choice: every policy counts alike), each a
    budget the plugin serves (`slot_limit`: below E, within the kernel). 16, 32, 64 of 128
    experts top-8; 16, 32, 48 of 64 top-8. When none is above top_k: the largest."""
    top = slot_limit(num_experts)
    cands = list(dict.fromkeys(min(top, max(1, num_experts * n // 8)) for n in DEFAULT_EIGHTHS))
    above = [s for s in cands if s > top_k]
    return above[:3] if above else [max(1, top)]


def budgets_below(budgets: list[int], num_experts: int, whose: str = "") -> list[int]:
    """``budgets`` themselves when each is below ``num_experts``, else ValueError naming the
    first that is not: that many slots hold every expert, so there is nothing to cache (a
    replay or a prediction at E slots answers a question no server asks). ``whose``
    qualifies the experts in the message ("the trace's ")."""
    bad = [s for s in budgets if s >= num_experts]
    if bad:
        raise ValueError(f"{bad[0]} is not below {whose or 'the '}{num_experts} experts "
                         "(that many slots hold every expert: nothing to cache)")
    return budgets


#: The policies a live cache runs (the plugin and the kernel); Belady's optimum (`Policy.OPT`)
#: needs the future and exists only in replay. Every list of them reads this one.
ONLINE_POLICIES: tuple[Policy, ...] = (Policy.LRU, Policy.LFU)


def online_names(sep: str = " or ") -> str:
    """The online policies' names as the user types them ("lru or lfu")."""
    return sep.join(p.name.lower() for p in ONLINE_POLICIES)


def online_policy(name: str | Policy | None, decay: int = 0) -> tuple[Policy, int]:
    """(policy, decay) for a cache that runs live: LRU or LFU, decay >= 0 and LFU only."""
    try:
        policy = Policy.parse(name) if name not in (None, "") else Policy.LRU
    except ValueError:
        policy = None  # type: ignore[assignment]
    if policy not in ONLINE_POLICIES:
        raise ValueError(
            f"choose {online_names()} (opt needs the future: it exists only in `expertcache "
            "replay`)"
        )
    if decay < 0:
        raise ValueError(f"decay {decay} must be >= 0")
    if decay and policy is not Policy.LFU:
        raise ValueError(f"a decay applies to lfu only (the policy is {policy.name.lower()})")
    return policy, decay


def trap_text(max_num_seqs: int, padded: int, top_k: int, slots: int, safe: int,
              graphs: str, spec_tokens: int = 0) -> str:
    """The one wording of the sizing trap (size, serve and the plugin's startup line).
    ``spec_tokens``: draft tokens a sequence carries into each verify step (speculative
    decoding: a decode step is ``max_num_seqs x (1 + k)`` tokens)."""
    tokens = max_num_seqs * (1 + spec_tokens)
    seqs = (f"{max_num_seqs} seqs x (1 + {spec_tokens} draft tokens, speculative decoding)"
            if spec_tokens else f"{max_num_seqs} seqs")
    batch = (f"a full batch of {seqs} runs as {padded} (CUDA-graph padding, "
             f"{graphs})" if padded != tokens else f"a full batch of {seqs}")
    keep = (f"--max-num-seqs {safe} keeps every decode step on it" if safe >= 1 else
            f"no --max-num-seqs keeps decode steps on it (one sequence's step carries at "
            f"least {(1 + spec_tokens) * top_k} ids)")
    return (
        f"sizing trap: {batch} x top_k {top_k} = {padded * top_k} ids > {slots} slots: "
        f"batched decode steps bypass the cache silently; {keep}; "
        "--wide staged-install (EXPERT_CACHE_WIDE=staged-install) "
        "stages them through a VRAM scratch instead (measured at 16 streams: 1.71x the "
        "offload floor, where in place runs at it)"
    )
