"""The host-link sharing bench's arithmetic and refusals (its copies need two GPUs)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("link_sharing", ROOT / "bench" / "link_sharing.py")
link_sharing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(link_sharing)


def test_each_gpu_at_once_is_set_against_itself_alone():
    result = {"alone": {0: 55.0, 1: 54.0}, "together": {0: 44.0, 1: 54.0}}
    table = link_sharing.rows(result)
    assert [r["gpu"] for r in table] == [0, 1]
    assert table[0]["ratio"] == 44.0 / 55.0 and table[1]["ratio"] == 1.0
    text = link_sharing.render(table)
    assert "| 0 | 55.0 | 44.0 | 0.800 |" in text and "| 1 | 54.0 | 54.0 | 1.000 |" in text


def test_a_gpu_missing_from_the_shared_phase_gets_no_ratio():
    table = link_sharing.rows({"alone": {0: 55.0}, "together": {}})
    assert table[0]["ratio"] is None and "| 0 | 55.0 | - | - |" in link_sharing.render(table)


def test_bad_input_and_a_box_without_two_gpus_are_one_line_and_exit_2(capsys):
    assert link_sharing.main(["--seconds", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err
    if _gpus() >= 2:  # a 2-GPU box runs the bench itself: nothing to refuse
        return
    rc = link_sharing.main(["--seconds", "1"])  # CI: no torch, or no GPU
    err = capsys.readouterr().err
    assert rc == 2 and ("needs torch" in err or "needs two GPUs" in err)


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()
