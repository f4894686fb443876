"""The small-card ballast (bench/ballast.py) refuses a GPU that is not as free as asked."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import ballast  # noqa: E402


class FakeHolder:
    """Stands in for the holder process: writes its ready report at once."""

    killed = False

    def __init__(self, argv, **_):
        ready = Path(argv[argv.index("--ready") + 1])
        ready.write_text(json.dumps(FakeHolder.report))
        self.pid = 4242
        self.returncode = None

    def poll(self):
        return None

    def kill(self):
        FakeHolder.killed = True


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setattr(ballast, "PIDFILE", tmp_path / "ballast.pid")
    monkeypatch.setattr(ballast.subprocess, "Popen", FakeHolder)
    monkeypatch.setattr(ballast.time, "sleep", lambda _s: None)
    monkeypatch.setattr(ballast, "flags", lambda card, total: ["--gpu-memory-utilization", "x"])
    FakeHolder.killed = False
    return tmp_path


def test_start_reports_a_card_that_is_as_free_as_asked(fake, monkeypatch):
    FakeHolder.report = {"pid": 4242, "free_gib": 24.0, "total_gib": 139.8, "held_gib": 115.2}
    monkeypatch.setattr(ballast, "_smi_free_mib", lambda d: 24.0 * 1024)
    info = ballast.start(24, 0)
    assert info["verified"] and not FakeHolder.killed
    assert (fake / "ballast.pid").read_text() == "4242"


def test_start_refuses_when_another_process_holds_the_gpu(fake, monkeypatch):
    # a server a killed run left behind holds 128 GiB: the ballast can hold nothing and
    # only 10 GiB is free, so a "24 GiB card" would really be a 10 GiB one
    FakeHolder.report = {"pid": 4242, "free_gib": 10.3, "total_gib": 139.8, "held_gib": 0.0}
    monkeypatch.setattr(ballast, "_smi_free_mib", lambda d: 10.3 * 1024)
    with pytest.raises(SystemExit) as exc:
        ballast.start(24, 0)
    assert re.match(r"ballast: cannot leave 24 GiB free: 10\.30 GiB is free", str(exc.value))
    assert FakeHolder.killed and not (fake / "ballast.pid").exists()
