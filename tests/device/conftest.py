"""Device-test helpers: every test here needs torch with a CUDA GPU, else it is skipped
with the reason (CI has neither; the H200 box has both)."""

from __future__ import annotations

import numpy as np
import pytest


def _cuda_reason() -> str | None:
    try:
        import torch
    except ImportError as exc:
        return f"no torch ({exc})"
    if not torch.cuda.is_available():
        return "no CUDA device: torch.cuda.is_available() is False"
    return None


@pytest.fixture(scope="session")
def cuda():
    """torch, after checking a CUDA device is there (skip with the reason otherwise)."""
    reason = _cuda_reason()
    if reason:
        pytest.skip(reason)
    import torch

    return torch


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/device" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.device)


def assert_same_state(cache, ref, ctx: str, ids=None, out=None, result=None) -> None:
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
        want = ref.remap(np.asarray(ids))
        got = out.cpu().numpy()
        assert np.array_equal(got, want), f"{ctx}: remapped ids {got.tolist()} != {want.tolist()}"
