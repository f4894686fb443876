"""The bench-only kernel trial hook (bench/kernel_trial): it widens the known kernels only
when asked, in a fresh interpreter as vLLM's processes would load it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("from expertcache_cli.plugin import arming; "
         "print('MarlinExperts' in arming.KNOWN_EXPERTS)")


def _run(extra_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "EC_BENCH_TRY_KERNELS"}
    env.update(extra_env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench" / "kernel_trial"), str(ROOT)])
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=60, check=True).stdout.strip()


def test_the_hook_adds_the_named_kernels_only_when_asked():
    assert _run({}) == "False"
    assert _run({"EC_BENCH_TRY_KERNELS": "MarlinExperts"}) == "True"
