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


def test_poll_all_waits_for_every_job_and_packs_each_ones_results(tmp_path):
    """Two jobs at once (one a GPU): one call waits for both, then brings back each one's
    results in its own folder; while one still runs, the call says so (exit 3)."""
    import tarfile

    names = [f"t{uuid.uuid4().hex[:8]}" for _ in range(2)]
    out = tmp_path / "out"
    out.mkdir()
    res = [tmp_path / f"res{i}" for i in range(len(names))]
    for r in res:
        r.mkdir()
    try:
        _run(names[0], "bash", "-c", f"echo 0 > {res[0]}/a.json; exit 0")
        _run(names[1], "bash", "-c", f"echo 1 > {res[1]}/b.json; sleep 4; exit 5")
        jobs = [f"{n}={r}" for n, r in zip(names, res)]
        running = _run("--poll-all", "0", *jobs, env={"OUT": str(out)})
        assert running.returncode == 3, running.stdout
        ended = _run("--poll-all", "30", *jobs, env={"OUT": str(out)})
        assert ended.returncode == 0, ended.stdout
        assert f"detached {names[0]} ended: exit 0" in ended.stdout
        assert f"detached {names[1]} ended: exit 5" in ended.stdout
        for n, r, f in zip(names, res, ("a.json", "b.json")):
            with tarfile.open(out / n / "results.tgz") as tar:
                assert f"{r.name}/{f}" in tar.getnames()
    finally:
        for n in names:
            for suffix in ("log", "rc"):
                Path(f"/tmp/detached-{n}.{suffix}").unlink(missing_ok=True)


def test_poll_all_of_jobs_not_on_this_machine_says_so_at_once():
    r = _run("--poll-all", "540", f"t{uuid.uuid4().hex[:8]}=/tmp/none")
    assert r.returncode == 4 and "on this machine" in r.stdout
    assert _run("--poll-all", "5").returncode == 2
