"""Device-test helpers: every test here needs torch with a CUDA GPU, else it is skipped
with the reason (CI has neither; the H200 box has both)."""

from __future__ import annotations

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
