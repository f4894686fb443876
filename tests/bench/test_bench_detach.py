"""bench/detach.sh: a runner started in its own session keeps running after the shell that
started it returns, and --poll reports it running, then ended with its exit status."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "detach.sh"


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_detached_runner_outlives_its_caller_and_poll_reports_it(tmp_path):
    name = f"t{uuid.uuid4().hex[:8]}"
    results, out = tmp_path / "res", tmp_path / "out"
    results.mkdir()
    out.mkdir()
    try:
        r = _run(name, "bash", "-c", f"echo started; echo 1 > {results}/a.json; sleep 3; "
                 "echo finished; exit 7")
        assert r.returncode == 0 and f"detached {name}: pid" in r.stdout
        running = _run("--poll", name, "0")
        assert running.returncode == 3 and "still running" in running.stdout
        ended = _run("--poll", name, "30", env={"OUT": str(out), "RESULTS": str(results)})
        assert ended.returncode == 0, ended.stdout
        assert "finished" in ended.stdout and f"detached {name} ended: exit 7" in ended.stdout
        import tarfile

        with tarfile.open(out / "results.tgz") as tar:  # the results and the log, packed
            assert {"res/a.json", f"res/detached-{name}.log"} <= set(tar.getnames())
    finally:
        for suffix in ("log", "rc"):
            Path(f"/tmp/detached-{name}.{suffix}").unlink(missing_ok=True)


def test_poll_of_a_job_not_on_this_machine_says_so_at_once():
    name = f"t{uuid.uuid4().hex[:8]}"  # never started: as on a machine that came back bare
    r = _run("--poll", name, "540")
    assert r.returncode == 4, r.stdout
    assert f"no detached job '{name}' on this machine" in r.stdout
