"""The reference cache: the one place the slot-cache rules are written in code.

The rules are stated in docs/design.md, The cache rules.

Everything else is checked against this module: the compiled replay engine
(`engine.py`) must agree with it step by step, and the CUDA manager kernel must agree
with it on every field after every step. It is deliberately written as plain,
per-step Python so that a reader can hold it against the design text line by line;
speed lives elsewhere.

Rules, per layer and per step (docs/design.md, The cache rules):

1. ``step += 1``.
2. ``R`` = distinct ids with ``0 <= id < E``. If ``|R| > max_distinct`` the step is a
   read-through: nothing else changes and no misses are emitted.
3. For each ``e`` in ``R`` ascending: resident -> refresh (LRU ``prio = step``, LFU
   ``prio += 1``); otherwise it is a miss. Only the first ``max_inserts`` misses are kept.
4. LFU with ``decay > 0`` and ``step % decay == 0``: every slot's priority ``>>= 1``.
5. Evictable slots are the empty ones and those whose expert is not in ``R``. They are
   ranked by ``(occupied, prio, slot)``: empty slots first, then the smallest priority,
   ties to the lowest slot index. The k-th ranked slot receives the k-th miss.
6. Install: the victim's old expert loses its table entry; ``prio = step`` (LRU) or 1 (LFU).

Wide steps (``tokens x top_k > S``; docs/design.md, Wide steps) follow one of three
modes (`Wide`): ``in-place`` (the plugin's default: the cache is untouched and every routed
expert is read over the link in place), ``staged`` (the step's hits are served from the
slots and refreshed as in rule 3, with rule 4; its misses are fetched once into a scratch
buffer; nothing is installed) or ``staged-install`` (a full manager step without the
``max_distinct`` gate; misses it cannot install are fetched into the scratch).

Belady's optimum (``opt``) uses the same steps, gates and order, with the priority of a
slot being the next step at which its expert is used again; the slot used furthest in
the future (or never) is evicted first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, IntEnum

import numpy as np

#: Priority given to an expert that is never used again (Belady): larger than any step.
NEVER = np.iinfo(np.int64).max // 4


class Policy(IntEnum):
    """Policy codes. LRU and LFU are also the kernel's policy codes (see the binding)."""

    LRU = 0
    LFU = 1
    OPT = 2

    @classmethod
    def parse(cls, name: str | int | Policy) -> Policy:
        """Accept 'lru' / 'LFU' / 2 / Policy.OPT; raise ValueError with the choices otherwise."""
        if isinstance(name, Policy):
            return name
        if isinstance(name, (int, np.integer)):
            return cls(int(name))
        try:
            return cls[str(name).strip().upper()]
        except KeyError:
            raise ValueError(f"unknown policy {name!r}: choose from lru, lfu, opt") from None


class Wide(str, Enum):
    """What a step too wide for the slots does (docs/design.md, Wide steps).

    Each member carries its engine code explicitly (`code`), not its position in the
    enum: the numba engine (`engine.WIDE_*`) branches on those integers, so reordering
    or inserting a member must not change them (tests/test_policy_rules.py pins them).
    """

    IN_PLACE = ("in-place", 0)
    STAGED = ("staged", 1)
    STAGED_INSTALL = ("staged-install", 2)

    def __new__(cls, value: str, code: int) -> Wide:
        member = str.__new__(cls, value)
        member._value_ = value
        member._code = code
        return member

    @classmethod
    def parse(cls, name: str | Wide) -> Wide:
        """Accept 'staged' / 'STAGED_INSTALL' / a Wide; ValueError naming the choices."""
        if isinstance(name, Wide):
            return name
        text = str(name).strip().lower().replace("_", "-")
        try:
            return cls(text)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown wide-step mode {name!r}: choose from {choices}") from None

    @property
    def code(self) -> int:
        """The engine's integer for the mode (0 in-place, 1 staged, 2 staged-install):
        written on each member, so that the numba engine never depends on the order."""
        return self._code

    def insert_cap(self, max_inserts: int) -> int:
        """How many misses a wide step may install, given the cache's own cap.

        The one definition the reference (`LayerCache._staged`), the numba engine and the
        plugin's wide manager all use: staged installs nothing (its misses go to the
        scratch only), staged-install keeps the cache's cap, and in place runs no manager
        on a wide step at all (so it installs nothing either). The kernel takes the result
        as its ``max_inserts`` argument, which allows 0..num_slots.
        """
        return max_inserts if self is Wide.STAGED_INSTALL else 0


@dataclass
class StepResult:
    """What one manager step emits: the (expert, slot) installs in ascending expert order."""

    misses: list[tuple[int, int]]
    read_through: bool
    distinct: int
    #: misses dropped by the insert cap or for lack of evictable slots (not installed)
    dropped: int = 0
    #: a wide step served from slots plus a scratch (`Wide.STAGED*`)
    staged: bool = False
    #: experts that step fetched into the scratch (its misses not installed in slots)
    staged_ids: int = 0

    @property
    def miss_count(self) -> int:
        return len(self.misses)

    @property
    def staged_hits(self) -> int:
        """A staged step's experts found in the slots, each copied from its slot into the
        scratch (a device copy, not a fetch over the link); 0 for any other step."""
        return self.distinct - self.miss_count - self.staged_ids if self.staged else 0


def next_use_positions(seq: np.ndarray) -> np.ndarray:
    """For a layer's routing ``seq[T, W]``, the next step (> t) each entry's id is used.

    ``NEVER`` where it is not used again; padding entries get ``NEVER`` too. This is the
    knowledge Belady's optimum needs, computed once by a backward scan.
    """
    seq = np.asarray(seq)
    t_steps = seq.shape[0]
    out = np.full(seq.shape, NEVER, dtype=np.int64)
    last: dict[int, int] = {}
    for t in range(t_steps - 1, -1, -1):
        row = seq[t]
        for w, e in enumerate(row):
            e = int(e)
            if e >= 0:
                out[t, w] = last.get(e, NEVER)
        for e in row:
            if int(e) >= 0:
                last[int(e)] = t
    return out


@dataclass
class LayerCache:
    """One layer's cache state and the manager step, exactly as the kernel must do it.

    ``future`` (Belady only) is the layer's whole routing ``[T, W]``: step ``t`` (0-based
    call count) must be fed ``future[t]``.
    """

    num_experts: int
    num_slots: int
    policy: Policy = Policy.LRU
    decay: int = 0
    max_distinct: int | None = None
    max_inserts: int | None = None
    future: np.ndarray | None = None
    wide: Wide = Wide.IN_PLACE
    table: np.ndarray = field(init=False)
    slot_expert: np.ndarray = field(init=False)
    prio: np.ndarray = field(init=False)
    step_count: int = field(init=False, default=0)
    #: forwards seen so far (the index into ``future``); equals step_count unless the
    #: shape gate of `forward` skipped the manager on wide steps
    forwards: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.policy = Policy.parse(self.policy)
        self.wide = Wide.parse(self.wide)
        if self.num_experts <= 0 or self.num_slots <= 0:
            raise ValueError("num_experts and num_slots must be positive")
        if self.decay < 0:
            raise ValueError("decay must be >= 0")
        if self.max_distinct is None:
            self.max_distinct = self.num_slots
        if self.max_inserts is None:
            self.max_inserts = self.num_slots
        self.table = np.full(self.num_experts, -1, dtype=np.int32)
        self.slot_expert = np.full(self.num_slots, -1, dtype=np.int32)
        self.prio = np.zeros(self.num_slots, dtype=np.int64)
        self._next: np.ndarray | None = None
        if self.policy is Policy.OPT:
            if self.future is None:
                raise ValueError("Belady's optimum needs the layer's future routing")
            self.future = np.asarray(self.future)
            self._next = next_use_positions(self.future)

    def _next_use(self, t: int, e: int) -> int:
        """Next step after ``t`` at which expert ``e`` is routed (``NEVER`` if none)."""
        assert self._next is not None and self.future is not None
        row = self.future[t]
        hits = np.nonzero(row == e)[0]
        if not hits.size:
            raise ValueError(f"Belady step {t} was not fed future[{t}] (expert {e} absent)")
        return int(self._next[t, hits[0]])

    def _distinct(self, ids: Sequence[int] | np.ndarray) -> tuple[list[int], int]:
        flat = np.asarray(ids).reshape(-1)
        valid = [int(e) for e in flat if 0 <= int(e) < self.num_experts]
        return sorted(set(valid)), len(valid)

    def _refresh_belady(self, t: int, distinct: list[int]) -> None:
        # Belady's knowledge is not cache state: keep it true even on read-through steps.
        for e in distinct:
            s = int(self.table[e])
            if s >= 0:
                self.prio[s] = self._next_use(t, e)

    def forward(self, ids: Sequence[int] | np.ndarray, width: int | None = None) -> StepResult:
        """One layer forward as the plugin runs it: the shape gate, then the manager.

        A forward carrying more routing ids than there are slots (``tokens x top_k >
        S``) cannot be served from slots alone whatever the hit rate; the plugin decides
        that from shapes alone. In-place, the cache is left untouched (not even ``step``
        moves); the staged modes are `_staged`. ``width`` is what the gate compares
        (`gate_widths`); default: the valid ids.
        """
        distinct, valid = self._distinct(ids)
        if (valid if width is None else width) > self.num_slots:
            if self.wide is not Wide.IN_PLACE:
                return self._staged(ids)
            if self.policy is Policy.OPT:
                self._refresh_belady(self.forwards, distinct)
            self.forwards += 1
            return StepResult([], True, len(distinct))
        return self.step(ids)

    def _staged(self, ids: Sequence[int] | np.ndarray) -> StepResult:
        """A wide step served from slots plus the scratch (docs/design.md, Wide steps): the
        manager step with no max_distinct gate, installing nothing (staged) or up to the
        cap (staged-install), as the kernel runs it. What it does not install (every miss,
        or those past the cap or the evictable slots) is fetched into the scratch."""
        r = self.step(ids, max_distinct=self.num_experts,
                      max_inserts=self.wide.insert_cap(self.max_inserts))
        return StepResult(r.misses, False, r.distinct, 0, True, r.dropped)

    def step(self, ids: Sequence[int] | np.ndarray, *, max_distinct: int | None = None,
             max_inserts: int | None = None, real_rows: int | None = None,
             pad_rows: Sequence[bool] | np.ndarray | None = None) -> StepResult:
        """Apply one manager step (docs/design.md, The cache rules) to one forward's ids.

        ``max_distinct`` / ``max_inserts`` replace the cache's own gate and cap for this
        step only (a wide step's manager call: `_staged`). ``real_rows`` / ``pad_rows``:
        the rows of ``ids`` that are CUDA-graph padding, not requested (`padding_rows`)."""
        pad = padding_rows(ids, real_rows, pad_rows)
        if pad is not None:
            ids = np.where(pad, -1, np.asarray(ids))
        gate = self.max_distinct if max_distinct is None else max_distinct
        cap = self.max_inserts if max_inserts is None else max_inserts
        t = self.forwards  # index of this forward in `future`
        self.forwards += 1
        self.step_count += 1
        step = self.step_count
        distinct, _ = self._distinct(ids)
        if self.policy is Policy.OPT:
            self._refresh_belady(t, distinct)
        if len(distinct) > gate:
            return StepResult([], True, len(distinct))

        wanted: list[int] = []
        for e in distinct:
            s = int(self.table[e])
            if s >= 0:
                if self.policy is Policy.LRU:
                    self.prio[s] = step
                elif self.policy is Policy.LFU:
                    self.prio[s] += 1
            else:
                wanted.append(e)
        dropped = max(0, len(wanted) - cap)
        wanted = wanted[:cap]

        if self.policy is Policy.LFU and self.decay > 0 and step % self.decay == 0:
            self.prio >>= 1

        in_step = set(distinct)
        evictable = [s for s in range(self.num_slots) if int(self.slot_expert[s]) not in in_step]
        evictable.sort(key=self._victim_key)
        if len(wanted) > len(evictable):
            dropped += len(wanted) - len(evictable)
            wanted = wanted[: len(evictable)]

        misses: list[tuple[int, int]] = []
        for e, s in zip(wanted, evictable):
            old = int(self.slot_expert[s])
            if old >= 0:
                self.table[old] = -1
            self.slot_expert[s] = e
            self.table[e] = s
            if self.policy is Policy.LRU:
                self.prio[s] = step
            elif self.policy is Policy.LFU:
                self.prio[s] = 1
            else:
                self.prio[s] = self._next_use(t, e)
            misses.append((e, s))
        return StepResult(misses, False, len(distinct), dropped)

    def _victim_key(self, s: int) -> tuple[int, int, int]:
        occupied = int(self.slot_expert[s] >= 0)
        p = int(self.prio[s])
        # Belady evicts the furthest next use first: invert so that smaller ranks first.
        return (occupied, -p if self.policy is Policy.OPT else p, s)

    def remap(self, ids: Sequence[int] | np.ndarray, real_rows: int | None = None,
              pad_rows: Sequence[bool] | np.ndarray | None = None) -> np.ndarray:
        """Routing ids in slot space (what the fused-MoE kernel sees after the gather);
        padding ids pass through, the ids of padding rows (`padding_rows`) become slot 0."""
        flat = np.asarray(ids)
        out = flat.copy()
        valid = (flat >= 0) & (flat < self.num_experts)
        out[valid] = self.table[flat[valid]]
        pad = padding_rows(flat, real_rows, pad_rows)
        if pad is not None:
            out[pad] = 0
        return out

    def state(self) -> dict[str, np.ndarray | int]:
        """A copy of the full state, field names as the kernel tests compare them."""
        return {
            "table": self.table.copy(),
            "slot_expert": self.slot_expert.copy(),
            "prio": self.prio.copy(),
            "step": self.step_count,
        }


def padding_rows(ids: Sequence[int] | np.ndarray, real_rows: int | None,
                 pad_rows: Sequence[bool] | np.ndarray | None = None) -> np.ndarray | None:
    """Where ``ids`` lie in padding rows (leading index): at or past ``real_rows`` (vLLM's
    V1 runner keeps that count), or marked in ``pad_rows`` (its V2 runner marks each row).
    vLLM pads a decode batch up to its captured graph size; the manager keeps those rows
    out of the step and remaps them to slot 0 (any valid slot: vLLM drops their output).
    None: every row is real."""
    if real_rows is None and pad_rows is None:
        return None
    arr = np.atleast_1d(np.asarray(ids))
    rows = np.arange(arr.shape[0])
    pad = np.zeros(arr.shape[0], dtype=bool)
    if real_rows is not None:
        pad |= rows >= max(real_rows, 0)
    if pad_rows is not None:
        pad |= np.asarray(pad_rows, dtype=bool).reshape(-1)[: arr.shape[0]]
    mask = np.broadcast_to(pad.reshape((-1,) + (1,) * (arr.ndim - 1)), arr.shape)
    return mask.reshape(np.asarray(ids).shape)


def replay_layer_reference(
    seq: np.ndarray,
    num_experts: int,
    num_slots: int,
    policy: Policy | str = Policy.LRU,
    decay: int = 0,
    max_inserts: int | None = None,
    widths: Sequence[int] | np.ndarray | None = None,
    wide: Wide | str = Wide.IN_PLACE,
) -> list[StepResult]:
    """Replay one layer's routing ``seq[T, W]`` forward by forward, the slow plain way
    (``widths[t]``: what the shape gate sees at step t, `gate_widths`)."""
    policy = Policy.parse(policy)
    cache = LayerCache(
        num_experts,
        num_slots,
        policy,
        decay,
        max_inserts=max_inserts,
        future=seq if policy is Policy.OPT else None,
        wide=Wide.parse(wide),
    )
    if widths is None:
        return [cache.forward(row) for row in seq]
    return [cache.forward(row, int(w)) for row, w in zip(seq, widths)]


def gate_widths(ids: np.ndarray, num_experts: int, step_tokens: np.ndarray | None = None,
                top_k: int | None = None) -> np.ndarray:
    """``[T, L]``: the routing ids each layer-step presents to the shape gate.

    The one definition the live plugin, the replay engine and the kernel replay share:
    the gate compares ``tokens x top_k`` of the step as vLLM ran it, padding rows of a
    CUDA graph included (the plugin sees the padded ``topk_ids``). A recorded trace knows
    that count (``step_tokens``, padded rows included, even where their ids were masked);
    a trace without it (synthetic) counts its valid ids, which is the same thing there.
    """
    ids = np.asarray(ids)
    if step_tokens is not None and top_k:
        widths = np.asarray(step_tokens, dtype=np.int64) * int(top_k)
        return np.repeat(widths[:, None], ids.shape[1], axis=1)
    return ((ids >= 0) & (ids < num_experts)).sum(axis=2).astype(np.int64)
