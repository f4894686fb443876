"""Trace files: round trip, and every malformed file gets one line and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from expertcache_cli.trace import Trace, TraceError, load, save


def good(tmp_path: Path) -> Path:
    ids = np.array([[[0, 3, -1]], [[2, 1, 1]]], dtype=np.int32)
    t = Trace(ids, num_experts=4, top_k=2, expert_bytes=4096, model="m", source="test")
    return save(t, tmp_path / "good.npz")


def test_round_trip(tmp_path):
    path = good(tmp_path)
    t = load(path)
    assert t.topk_ids.tolist() == [[[0, 3, -1]], [[2, 1, 1]]]
    assert (t.num_experts, t.top_k, t.expert_bytes, t.model, t.source) == (4, 2, 4096, "m", "test")
    assert t.tokens == 2  # 5 valid ids on layer 0 // top_k


def test_save_adds_suffix(tmp_path):
    t = Trace(np.zeros((1, 1, 1), np.int32), 2, 1)
    assert save(t, tmp_path / "x").name == "x.npz"


def write_npz(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


CASES = {
    "not_npz": lambda p: (p.write_text("hello"), p)[1],
    "missing_keys": lambda p: write_npz(p, topk_ids=np.zeros((1, 1, 1), np.int32)),
    "float_ids": lambda p: write_npz(
        p, topk_ids=np.zeros((2, 1, 2), np.float32), num_experts=4, top_k=2
    ),
    "ids_too_big": lambda p: write_npz(
        p, topk_ids=np.array([[[0, 9]]], np.int32), num_experts=4, top_k=2
    ),
    "empty": lambda p: write_npz(p, topk_ids=np.zeros((0, 1, 2), np.int32), num_experts=4, top_k=2),
    "only_padding": lambda p: write_npz(
        p, topk_ids=np.full((2, 1, 2), -1, np.int32), num_experts=4, top_k=2
    ),
    "wrong_rank": lambda p: write_npz(
        p, topk_ids=np.zeros((3, 2), np.int32), num_experts=4, top_k=2
    ),
    "missing_file": lambda p: p,
}

MESSAGES = {
    "not_npz": "not a readable",
    "missing_keys": "missing key(s) num_experts, top_k",
    "float_ids": "integer array",
    "ids_too_big": "expert id 9 at step 0, layer 0",
    "empty": "empty",
    "only_padding": "only padding",
    "wrong_rank": "[steps, layers, ids]",
    "missing_file": "no such file",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_trace_library_error(tmp_path, case):
    path = CASES[case](tmp_path / f"{case}.npz")
    with pytest.raises(TraceError) as info:
        load(path)
    assert MESSAGES[case] in str(info.value)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", ["replay", "trace info"])
def test_malformed_trace_cli_one_line_exit_2(tmp_path, case, command):
    path = CASES[case](tmp_path / f"{case}.npz")
    proc = subprocess.run(
        [sys.executable, "-m", "expertcache_cli", *command.split(), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("expertcache: error:"), proc.stderr
    assert MESSAGES[case] in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
