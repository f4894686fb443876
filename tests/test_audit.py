"""`audit.audit_slots`: the table/slot invariant and the byte comparison, on CPU tensors."""

from __future__ import annotations

import pytest

from expertcache_cli.device.audit import MAX_LISTED, AuditResult, audit_line, audit_slots

torch = pytest.importorskip("torch", reason="no torch: the slot audit compares torch tensors")

E, S = 6, 3


def _layer(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    src = {"w": torch.randn(E, 4, 8, generator=g).to(dtype),
           "scale": torch.randn(E, 2, generator=g)}
    table = torch.full((E,), -1, dtype=torch.int32)
    sexp = torch.full((S,), -1, dtype=torch.int32)
    slots = {n: torch.zeros((S, *t.shape[1:]), dtype=t.dtype) for n, t in src.items()}
    for s, e in ((0, 4), (2, 1)):  # slot 1 stays empty
        table[e], sexp[s] = s, e
        for n in slots:
            slots[n][s] = src[n][e]
    return table, sexp, slots, src


def test_a_consistent_layer_passes_and_counts_its_occupied_slots():
    r = audit_slots(*_layer())
    assert r.ok and (r.occupied, r.tensors) == (2, 2)


def test_fp8_and_nan_weights_compare_by_bytes():
    table, sexp, slots, src = _layer(torch.float8_e4m3fn)
    src["scale"][4, 0] = float("nan")
    slots["scale"][0, 0] = float("nan")  # a NaN equals itself byte for byte
    assert audit_slots(table, sexp, slots, src).ok
    slots["w"][2].view(torch.uint8)[0, 0] ^= 1  # one bit of an fp8 weight
    r = audit_slots(table, sexp, slots, src)
    assert r.problems == ["slot 2 (expert 1): w differs from the expert's source"]


def test_table_and_slots_that_disagree_are_named_both_ways():
    table, sexp, slots, src = _layer()
    table[4] = 1  # expert 4 points at the empty slot; slot 0 still names expert 4
    r = audit_slots(table, sexp, slots, src)
    assert r.problems == ["slot 0 names expert 4, whose table entry is 1",
                          "expert 4's table entry is slot 1, which holds -1"]
    table, sexp, slots, src = _layer()
    sexp[1] = 9
    assert audit_slots(table, sexp, slots, src).problems == [
        "slot 1 names expert 9, past the 6 experts"]


def test_the_line_lists_a_bounded_number_of_problems():
    ok, line = audit_line([("l0", AuditResult(3, 2)), ("l1", AuditResult(2, 2))])
    assert ok and line.startswith("expertcache: slot audit at shutdown: 5 occupied slots in 2")
    bad = AuditResult(3, 2, [f"p{i}" for i in range(MAX_LISTED + 3)])
    ok, line = audit_line([("l0", AuditResult(3, 2)), ("l1", bad)])
    assert not ok and "FAILED in 1 of 2 layers (6 occupied slots): l1: p0; " in line
    assert line.endswith(f"l1: p{MAX_LISTED - 1}; and 3 more")
