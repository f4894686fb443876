"""The small-card ballast (bench/ballast.py) refuses a GPU that is not as free as asked,
leaves no report file behind, and `stop` ends the holder it recorded and nothing else."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import ballast  # noqa: E402


class FakeHolder:
    """Stands in for the holder process: writes its ready report at once."""

    killed = False

    def __init__(self, argv, **_):
        ready = Path(argv[argv.index("--ready") + 1])
        ready.write_text(json.dumps(FakeHolder.report))
        FakeHolder.ready = ready
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
    assert (fake / "ballast.pid").read_text().split()[0] == "4242"
    # the holder's report, written beside the PID file, is read and removed
    assert FakeHolder.ready.parent == fake and not FakeHolder.ready.exists()


def test_start_refuses_when_another_process_holds_the_gpu(fake, monkeypatch):
    # a server a killed run left behind holds 128 GiB: the ballast can hold nothing and
    # only 10 GiB is free, so a "24 GiB card" would really be a 10 GiB one
    FakeHolder.report = {"pid": 4242, "free_gib": 10.3, "total_gib": 139.8, "held_gib": 0.0}
    monkeypatch.setattr(ballast, "_smi_free_mib", lambda d: 10.3 * 1024)
    with pytest.raises(SystemExit) as exc:
        ballast.start(24, 0)
    assert re.match(r"ballast: cannot leave 24 GiB free: 10\.30 GiB is free", str(exc.value))
    assert FakeHolder.killed and not (fake / "ballast.pid").exists()
    assert not FakeHolder.ready.exists()


@pytest.fixture
def holder(monkeypatch, tmp_path):
    """A real process in a session of its own, as the holder runs, and the PID file."""
    monkeypatch.setattr(ballast, "PIDFILE", tmp_path / "ballast.pid")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    yield proc, tmp_path / "ballast.pid"
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_stop_ends_the_recorded_holder(holder):
    proc, pidfile = holder
    pidfile.write_text(f"{proc.pid} {ballast.groups.start_time(proc.pid)}")
    assert ballast.stop() == f"ballast: stopped pid {proc.pid}"
    assert proc.wait(timeout=10) is not None and not pidfile.exists()


def test_stop_leaves_a_process_that_took_the_recorded_pid_alone(holder):
    proc, pidfile = holder
    pidfile.write_text(f"{proc.pid} 1")  # the holder started at another time: not this one
    assert ballast.stop() == f"ballast: pid {proc.pid} has ended already, nothing to stop"
    assert proc.poll() is None and not pidfile.exists()
    pidfile.write_text(f"{proc.pid}")  # no start time: nothing to tell it by
    assert "nothing stopped" in ballast.stop()
    assert proc.poll() is None and pidfile.exists()


def test_nvidia_smi_is_asked_about_the_gpu_torch_holds():
    """Under CUDA_VISIBLE_DEVICES torch's device 0 is the first GPU listed, which
    nvidia-smi (blind to the variable) names by its own index or UUID."""
    assert ballast.smi_id(0, {}) == "0"
    assert ballast.smi_id(0, {"CUDA_VISIBLE_DEVICES": "1"}) == "1"
    assert ballast.smi_id(1, {"CUDA_VISIBLE_DEVICES": "1,0"}) == "0"
    assert ballast.smi_id(0, {"CUDA_VISIBLE_DEVICES": "GPU-3f2a"}) == "GPU-3f2a"
