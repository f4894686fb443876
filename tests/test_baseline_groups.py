"""Records of the servers' process groups (expertcache_cli/baseline/groups.py): a server
records its group while it runs, and `end_orphans` ends only recorded groups whose
starting process is gone: never a live run's, never a process that took a recorded PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from expertcache_cli.baseline import groups
from expertcache_cli.baseline.server import Server

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc (not Linux)")

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
# a leader with a child in its group, as vLLM's API server with its engine core
LEADER = [sys.executable, "-c", "import subprocess, sys, time; "
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
          "time.sleep(60)"]


@pytest.fixture
def procs():
    """Processes a test starts, each ended by its own PID (and group) at the end."""
    started: list[subprocess.Popen] = []

    def start(argv, **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv, **kw)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.returncode is None:  # not reaped yet: its PID, and the group it leads, are ours
            for pid in {p.pid, *groups.members(p.pid)}:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()


def _wait_members(pgid: int, n: int) -> None:
    end = time.monotonic() + 20
    while len(groups.members(pgid)) < n and time.monotonic() < end:
        time.sleep(0.05)
    assert len(groups.members(pgid)) == n


def test_an_orphaned_group_is_ended_whole_and_its_record_dropped(tmp_path, procs):
    server = procs(LEADER, start_new_session=True)
    _wait_members(server.pid, 2)
    runner = procs(SLEEP)  # the process that started the server: killed, as a call is
    path = groups.record(tmp_path, server.pid, ["vllm", "serve", "m"], owner=runner.pid)
    assert json.loads(path.read_text())["pgid"] == server.pid
    runner.kill()
    runner.wait()
    lines = groups.end_orphans(tmp_path, grace_s=5)
    assert lines == [f"groups: ended process group {server.pid} (vllm serve m), left behind "
                     "by a run that is gone"]
    assert groups.members(server.pid) == [] and not path.exists()


def test_a_group_whose_run_still_goes_is_kept(tmp_path, procs):
    server = procs(SLEEP, start_new_session=True)
    path = groups.record(tmp_path, server.pid, ["vllm", "serve", "m"])  # owner: this test
    lines = groups.end_orphans(tmp_path, grace_s=5)
    assert lines == [f"groups: kept process group {server.pid} (vllm serve m): its run "
                     f"(pid {os.getpid()}) is still going"]
    assert server.poll() is None and path.exists()


def test_a_process_that_took_a_recorded_pid_is_left_alone(tmp_path, procs):
    other = procs(SLEEP, start_new_session=True)
    runner = procs(SLEEP)
    path = groups.record(tmp_path, other.pid, ["vllm", "serve", "m"], owner=runner.pid)
    rec = json.loads(path.read_text())
    rec["leader_start"] = str(int(rec["leader_start"]) - 1)  # the recorded one started earlier
    path.write_text(json.dumps(rec))
    runner.kill()
    runner.wait()
    assert groups.end_orphans(tmp_path, grace_s=5) == []
    assert other.poll() is None and not path.exists()


def test_a_group_that_ended_by_itself_only_loses_its_record(tmp_path, procs):
    server = procs(SLEEP, start_new_session=True)
    path = groups.record(tmp_path, server.pid, ["x"], owner=server.pid)
    server.kill()
    server.wait()
    assert groups.end_orphans(tmp_path) == [] and not path.exists()
    assert groups.record(tmp_path, server.pid, ["x"]) is None  # gone: nothing to record


def test_a_server_records_its_group_while_it_runs(tmp_path, monkeypatch):
    def server() -> Server:
        return Server(argv=SLEEP, env=dict(os.environ), log_path=tmp_path / "s.log",
                      host="127.0.0.1", port=0)

    monkeypatch.delenv(groups.ENV, raising=False)
    plain = server()
    plain.start()
    plain.stop(grace_s=0.5)
    assert plain.group_record is None

    monkeypatch.setenv(groups.ENV, str(tmp_path / "groups"))
    srv = server()
    srv.start()
    try:
        rec = json.loads((tmp_path / "groups" / f"{srv.proc.pid}.json").read_text())
        assert rec["pgid"] == srv.proc.pid and rec["owner"] == os.getpid()
        assert rec["argv"] == SLEEP
    finally:
        srv.stop(grace_s=0.5)
    assert not srv.alive() and list((tmp_path / "groups").iterdir()) == []
