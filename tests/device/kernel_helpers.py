"""Assertions shared by the device tests of the kernels."""

from __future__ import annotations

import numpy as np


def assert_same_state(cache, ref, ctx: str, ids=None, out=None, result=None,
                      real_rows=None, pad_rows=None) -> None:
    """Every field of a SlotCache equals the reference LayerCache (and the step's output)."""
    st = cache.state()
    for key in ("table", "slot_expert", "prio"):
        got, want = np.asarray(st[key]), np.asarray(getattr(ref, key))
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)[:8]
            raise AssertionError(
                f"{ctx}: {key} diverged at {bad.tolist()}: got {got[bad].tolist()} "
                f"want {want[bad].tolist()}"
            )
    assert st["step"] == ref.step_count, f"{ctx}: step {st['step']} != {ref.step_count}"
    if result is not None:
        assert st["miss_count"] == result.miss_count, (
            f"{ctx}: miss count {st['miss_count']} != {result.miss_count}"
        )
        assert st["misses"] == result.misses, f"{ctx}: misses {st['misses']} != {result.misses}"
    if ids is not None and out is not None:
        want = ref.remap(np.asarray(ids), real_rows, pad_rows)
        got = out.cpu().numpy()
        assert np.array_equal(got, want), f"{ctx}: remapped ids {got.tolist()} != {want.tolist()}"
