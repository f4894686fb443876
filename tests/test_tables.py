"""Tables never cut a value (tables.py): at 80 columns, in pipes, on narrow terminals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from expertcache_cli.tables import Table


def _render(table: Table, width: int) -> str:
    console = Console(width=width, record=True, force_terminal=False)
    console.print(table)
    return console.export_text()


def _table() -> Table:
    t = Table(title="t")
    t.add_column("policy", keep=9)
    t.add_column("misses", justify="right", keep=9)
    t.add_column("requests", justify="right", keep=1)
    t.add_column("read-through layer-steps", justify="right", keep=0)
    t.add_column("verdict", text=True, keep=5)
    t.add_row("lru", "473,601", "1,152,000", "12,345,678", "cache at 84 of 128 slots")
    return t


def test_values_stay_whole_and_lines_fit_at_every_width():
    for width in (40, 50, 60, 80, 120):
        out = _render(_table(), width)
        assert "…" not in out
        assert all(len(line) <= width for line in out.splitlines()), width
        assert "473,601" in out  # the most important value is always there, whole
    wide = _render(_table(), 120)
    assert "1,152,000" in wide and "12,345,678" in wide and "left out" not in wide
    narrow = _render(_table(), 40)
    assert ("left out to fit 40 columns: requests, read-through layer-steps"
            in " ".join(narrow.split()))


def test_replay_at_80_columns_in_a_pipe_prints_every_number_whole():
    env = {**os.environ, "COLUMNS": "80"}
    tasks = Path(__file__).resolve().parent.parent / "traces" / "demo-qwen3-30b-a3b-tasks.npz"
    out = subprocess.run([sys.executable, "-m", "expertcache_cli", "replay", str(tasks)], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "…" not in out and "473,601" in out and "1,152,000" in out
    assert all(len(line) <= 80 for line in out.splitlines())
