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


def test_the_no_check_and_memory_hooks_act_only_when_asked():
    probe = ("from expertcache_cli.plugin import runtime as r; "
             "print(r.CHECK_ATTEMPTS, r.ArmedLayer.forward_modular.__name__)")

    def run(extra):
        env = {k: v for k, v in os.environ.items() if not k.startswith("EC_BENCH_")}
        env.update(extra)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench" / "kernel_trial"), str(ROOT)])
        return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              text=True, timeout=60, check=True).stdout.strip()

    from expertcache_cli.plugin import runtime

    assert run({}) == f"{runtime.CHECK_ATTEMPTS} forward_modular" and runtime.CHECK_ATTEMPTS > 0
    assert run({"EC_BENCH_NO_CHECK": "1", "EC_BENCH_MEM": "1"}) == "0 _forward"
