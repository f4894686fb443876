"""Does every slot hold what the table says it holds? A check of one layer's cache at rest.

The cache's correctness rests on two invariants nothing checks while serving (checking
would need a host sync every step): the table and ``slot_expert`` agree (expert e maps to
slot s exactly when slot s names expert e), and every occupied slot's bytes, in every
mirrored tensor (weights, scales, zero points, biases), equal its expert's bytes in the
source. A gather that raced its readers, or a slot written twice in one step, breaks the
second; a manager bug breaks the first. Either would change tokens quietly, from the step
it happened on, for as long as the slot stays. `audit_slots` checks both once, on demand:
the plugin runs it at shutdown under ``EXPERT_CACHE_AUDIT=1`` and says what it found, so a
token difference seen in a run can be told apart from the cache's state.

It compares bytes, not values (fp8 and packed ints have no useful float equality, and a
NaN in a weight must still compare equal to itself), one expert slab at a time, so its
extra device memory is one slab of the largest tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: problems listed in full; past it, only their count
MAX_LISTED = 8


@dataclass
class AuditResult:
    """What one audit found; ``problems`` empty means both invariants hold."""

    occupied: int = 0
    tensors: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _bytes(t: Any) -> Any:
    """A tensor's storage as flat uint8 (contiguous copy where it is not)."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def audit_slots(table: Any, slot_expert: Any, slots: Mapping[str, Any],
                sources: Mapping[str, Any]) -> AuditResult:
    """Check one layer: ``table[E]`` and ``slot_expert[S]`` (int tensors, any device),
    ``slots[name]`` ``[S, ...]`` and ``sources[name]`` ``[E, ...]`` (the source may live
    in host memory; each compared slab is copied to the slot's device)."""
    import torch

    tab = [int(x) for x in torch.as_tensor(table).cpu().tolist()]
    sexp = [int(x) for x in torch.as_tensor(slot_expert).cpu().tolist()]
    res = AuditResult(tensors=len(slots))
    for s, e in enumerate(sexp):
        if e < 0:
            continue
        res.occupied += 1
        if e >= len(tab):
            res.problems.append(f"slot {s} names expert {e}, past the {len(tab)} experts")
            continue
        if tab[e] != s:
            res.problems.append(f"slot {s} names expert {e}, whose table entry is {tab[e]}")
        for name, buf in slots.items():
            want = _bytes(sources[name][e].to(buf.device, non_blocking=False))
            if not torch.equal(_bytes(buf[s]), want):  # False on a size mismatch too
                res.problems.append(f"slot {s} (expert {e}): {name} differs from the "
                                    "expert's source")
    for e, s in enumerate(tab):
        if s < 0:
            continue
        if s >= len(sexp) or sexp[s] != e:
            held = sexp[s] if 0 <= s < len(sexp) else "nothing (no such slot)"
            res.problems.append(f"expert {e}'s table entry is slot {s}, which holds {held}")
    return res


def audit_line(layers: list[tuple[str, AuditResult]]) -> tuple[bool, str]:
    """The one line the plugin logs for a whole model: (all ok, text)."""
    bad = [(name, r) for name, r in layers if not r.ok]
    occupied = sum(r.occupied for _, r in layers)
    tensors = max((r.tensors for _, r in layers), default=0)
    if not bad:
        return True, (f"expertcache: slot audit at shutdown: {occupied} occupied slots in "
                      f"{len(layers)} layers hold their experts' bytes in all {tensors} "
                      "mirrored tensors, and every table entry matches its slot")
    listed = [f"{name}: {p}" for name, r in bad for p in r.problems]
    more = len(listed) - MAX_LISTED
    text = "; ".join(listed[:MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")
    return False, (f"expertcache: slot audit at shutdown FAILED in {len(bad)} of {len(layers)} "
                   f"layers ({occupied} occupied slots): {text}")
