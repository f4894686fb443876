"""The bench runners' setup cleanup (bench/_device_vllm.sh `bench_end_leftovers`, through
bench/groups.py and bench/ballast.py): it ends the server a killed call left behind, by
the process group it recorded, and leaves a user's own vLLM alive, whatever its command
line says (setup used to end every process whose command line matched OLD_PATTERN)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from expertcache_cli.baseline import groups

ROOT = Path(__file__).resolve().parents[2]
OLD_PATTERN = r"vllm.entrypoints|EngineCore|ballast.py hold"

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc (not Linux)")


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_setup_cleanup_ends_what_a_killed_run_left_and_not_a_users_vllm(tmp_path):
    sleep = "import time; time.sleep(60)"
    # the user's own server beside the bench: its command line matches the old pattern
    users = subprocess.Popen([sys.executable, "-c", sleep, "-m", "vllm.entrypoints.cli.main",
                              "serve", "EngineCore", "ballast.py hold"],
                             start_new_session=True)
    # a server a bench runner started and recorded, the runner since killed
    left = subprocess.Popen([sys.executable, "-c", sleep], start_new_session=True)
    runner = subprocess.Popen([sys.executable, "-c", sleep])
    try:
        assert re.search(OLD_PATTERN, _cmdline(users.pid))
        directory = tmp_path / "groups"
        assert groups.record(directory, left.pid, ["vllm", "serve", "m"], owner=runner.pid)
        runner.kill()
        runner.wait()
        env = {**os.environ, "PY": sys.executable, groups.ENV: str(directory),
               "EC_BALLAST_PIDFILE": str(tmp_path / "ballast.pid")}
        r = subprocess.run(["bash", "-c", "source bench/_device_vllm.sh && bench_end_leftovers"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"groups: ended process group {left.pid} (vllm serve m)" in r.stdout
        assert "ballast: no pid file, nothing to stop" in r.stdout
        assert left.wait(timeout=10) == -signal.SIGTERM
        assert users.poll() is None  # the user's vLLM still runs
    finally:
        for p in (users, left):
            if p.returncode is None:
                p.kill()
                p.wait()


def test_no_script_ends_processes_by_their_names():
    """Every process a script ends is one it started (a PID, a process group, a PID file):
    no tool that picks processes by name appears in the scripts, tests or CI."""
    # the two tools' names, spelt in parts so that this file passes the same search
    by_name = re.compile(r"\b(?:" + "p" + "kill|kill" + "all" + r")\b[^\n]*")
    found = []
    for path in [*ROOT.glob("bench/**/*"), *ROOT.glob("tests/**/*"), *ROOT.glob(".ci/*")]:
        if path.is_file() and path.suffix in (".sh", ".py", ""):
            text = path.read_text(errors="replace")
            found += [f"{path.relative_to(ROOT)}: {m}" for m in by_name.findall(text)]
    assert found == []
