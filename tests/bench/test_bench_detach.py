"""bench/detach.sh: a runner started in its own session keeps running after the shell that
started it returns, and --poll reports it running, then ended with its exit status."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "detach.sh"


def _run(*args: str, env: dict | None = None, cwd: Path | None = None
         ) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})},
                          cwd=cwd or Path(__file__).parent / "detach_tree")


def _forget(name: str) -> None:
    import shutil

    for suffix in ("log", "rc"):
        Path(f"/tmp/detached-{name}.{suffix}").unlink(missing_ok=True)
    shutil.rmtree(f"/tmp/detached-{name}.tree", ignore_errors=True)


def test_the_job_runs_from_its_own_copy_of_the_tree(tmp_path):
    """Every remote call re-copies the caller's tree over the one a detached job started in;
    a job reading its files from there could find one missing mid-copy. It reads its copy."""
    name = f"t{uuid.uuid4().hex[:8]}"
    tree = tmp_path / "tree"
    (tree / "bench").mkdir(parents=True)
    (tree / "bench" / "step.txt").write_text("from the copy\n")
    try:
        r = _run(name, "bash", "-c", "sleep 2; cat bench/step.txt; ls -A", cwd=tree)
        assert r.returncode == 0, r.stderr
        (tree / "bench" / "step.txt").unlink()  # the caller's tree changes under the job
        ended = _run("--poll", name, "30", cwd=tree)
        assert ended.returncode == 0 and "detached " + name + " ended: exit 0" in ended.stdout
        assert "from the copy" in ended.stdout
    finally:
        _forget(name)


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
        _forget(name)


def test_a_poll_into_a_sub_folder_not_made_yet_packs_the_results(tmp_path):
    """Two polls in a session write under $OUT/a and $OUT/b so that the second does not
    overwrite the first's results.tgz; the call's $OUT starts empty, so the poll makes it."""
    import tarfile

    name = f"t{uuid.uuid4().hex[:8]}"
    results = tmp_path / "res"
    results.mkdir()
    out = tmp_path / "out" / "a"
    try:
        assert _run(name, "bash", "-c", f"echo 1 > {results}/a.json").returncode == 0
        ended = _run("--poll", name, "30", env={"OUT": str(out), "RESULTS": str(results)})
        assert ended.returncode == 0, ended.stdout + ended.stderr
        with tarfile.open(out / "results.tgz") as tar:
            assert "res/a.json" in tar.getnames()
    finally:
        _forget(name)


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
            _forget(n)


def test_poll_all_of_jobs_not_on_this_machine_says_so_at_once():
    r = _run("--poll-all", "540", f"t{uuid.uuid4().hex[:8]}=/tmp/none")
    assert r.returncode == 4 and "on this machine" in r.stdout
    assert _run("--poll-all", "5").returncode == 2


def test_a_poll_longer_than_a_call_can_wait_is_cut_and_said(tmp_path):
    """A poll of 600 s inside a call limited to 600 s would be killed before it packed the
    results: the wait is cut to MAX_WAIT_S (560 by default) and the poll says so."""
    import time

    name = f"t{uuid.uuid4().hex[:8]}"
    results, out = tmp_path / "res", tmp_path / "out"
    results.mkdir()
    out.mkdir()
    try:
        assert _run(name, "bash", "-c", "sleep 30").returncode == 0
        t0 = time.monotonic()
        r = _run("--poll", name, "600", env={"MAX_WAIT_S": "2", "OUT": str(out),
                                              "RESULTS": str(results)})
        assert r.returncode == 3 and time.monotonic() - t0 < 20
        assert "waiting 2 s, not 600" in r.stderr
        assert (out / "results.tgz").exists()  # packed, in time
    finally:
        _forget(name)
