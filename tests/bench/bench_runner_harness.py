"""Run a bench device runner (bench/run_*_on_device.sh) on the CPU with its GPU steps
stubbed: a copy of the named bench files, a `_device_vllm.sh` whose setup does nothing, and
a stub `python3` (the runner's ``PY``) that logs every call and fakes or forwards it. Device
minutes are few; a runner's flow is checked here before any are spent on it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def make_runner(tmp_path: Path, script: str, files: tuple[str, ...], stub_source: str,
                keep_bench_helpers: bool = False,
                **env: str) -> Callable[..., tuple[list[str], str]]:
    """``run(**extra_env)`` -> (the stub's logged calls, the runner's stdout).

    ``stub_source``: the python the stub runs (it logs to ``$STUB_LOG``; ``$REAL_PY`` is
    this interpreter, for what it forwards, with ``$ROOT`` the checkout whose package it
    should import: the runner's PYTHONPATH names the copy, which has none).
    ``keep_bench_helpers``: keep the real `_device_vllm.sh` helpers (bench_arm, bench_save,
    bench_mem_server and the process-group records they keep with bench/groups.py, in
    ``tmp_path/groups``) and stub only its setup."""
    bench = tmp_path / "tree" / "bench"
    bench.mkdir(parents=True)
    helpers = ("groups.py",) if keep_bench_helpers else ()
    for f in (script, *files, *helpers):
        shutil.copy(ROOT / "bench" / f, bench / f)
    real = (ROOT / "bench" / "_device_vllm.sh").read_text() if keep_bench_helpers else ""
    (bench / "_device_vllm.sh").write_text(real + "\ndevice_vllm_setup() { return 0; }\n")
    stub = tmp_path / "stubpy"
    stub.write_text(stub_source)
    stub.chmod(0o755)
    log = tmp_path / "calls.log"

    def run(expect_rc: int = 0, cwd: Path | None = None,
            **extra: str) -> tuple[list[str], str]:
        """The calls and the stdout (with the stderr after it where ``expect_rc`` is not
        0: a refusal's one line). ``cwd``: another copy of the tree to run from, as a
        second detached job does."""
        log.write_text("")
        full = {**os.environ, "PY": str(stub), "REAL_PY": sys.executable,
                "STUB_LOG": str(log), "OUT": str(tmp_path / "out"), "PYTHONPATH": str(ROOT),
                "ROOT": str(ROOT),
                "EXPERTCACHE_SERVER_GROUPS": str(tmp_path / "groups"), **env, **extra}
        r = subprocess.run(["bash", f"bench/{script}"], cwd=cwd or bench.parent, env=full,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == expect_rc, r.stdout + r.stderr
        return log.read_text().splitlines(), r.stdout if expect_rc == 0 else r.stdout + r.stderr

    return run


def trace_of_64_experts(path: Path) -> Path:
    """A trace of 64 experts (top-4), which no bench checkpoint of 128 can replay: what a
    runner must refuse before writing a checkpoint or starting a server."""
    import numpy as np

    from expertcache_cli.rules import trace as tracefile

    return tracefile.save(tracefile.Trace(np.zeros((3, 2, 4), dtype=np.int64), num_experts=64,
                                          top_k=4, source="recorded, 64 experts"), path)
