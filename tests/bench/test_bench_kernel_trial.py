"""The bench-only kernel trial hook (bench/kernel_trial): it widens the known kernels only
when asked, in a fresh interpreter as vLLM's processes would load it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("from expertcache_cli.plugin import arming; "
         "print('BatchedMarlinExperts' in arming.KNOWN_EXPERTS)")


def _run(extra_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "EC_BENCH_TRY_KERNELS"}
    env.update(extra_env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench" / "kernel_trial"), str(ROOT)])
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=60, check=True).stdout.strip()


def test_the_hook_adds_the_named_kernels_only_when_asked():
    assert _run({}) == "False"
    assert _run({"EC_BENCH_TRY_KERNELS": "BatchedMarlinExperts"}) == "True"


def test_the_no_check_and_memory_hooks_act_only_when_asked():
    probe = ("from expertcache_cli.plugin import runtime as r; "
             "print(r.CHECK_ATTEMPTS, r.SWEEP, r.ArmedLayer.forward_modular.__name__)")

    def run(extra):
        env = {k: v for k, v in os.environ.items() if not k.startswith("EC_BENCH_")}
        env.update(extra)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench" / "kernel_trial"), str(ROOT)])
        return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              text=True, timeout=60, check=True).stdout.strip()

    from expertcache_cli.plugin import runtime

    assert run({}) == f"{runtime.CHECK_ATTEMPTS} True forward_modular"
    assert runtime.CHECK_ATTEMPTS > 0 and runtime.SWEEP
    assert run({"EC_BENCH_NO_CHECK": "1", "EC_BENCH_MEM": "1"}) == "0 False _forward"


MEM_PROBE = r'''
import logging, sys, types
import torch

state = {"alloc": 10 * 2**30, "peak": 10 * 2**30}
torch.cuda.synchronize = lambda: None
torch.cuda.memory_allocated = lambda: state["alloc"]
torch.cuda.max_memory_allocated = lambda: state["peak"]
torch.cuda.is_current_stream_capturing = lambda: False
logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")

from expertcache_cli.plugin import runtime as r

def stock(ids, x=None):  # the check's reference call (the second) raises the peak
    stock.calls += 1
    if stock.calls == 2:
        state["peak"] += 2**29
    return torch.ones(2, 4)
stock.calls = 0

layer = types.SimpleNamespace(index=7, checked={"scratch": None},
                              _check_attempts={"scratch": 4}, _failed=False,
                              decision=types.SimpleNamespace(layer_name="L7"))
out = r.ArmedLayer._checked_call(layer, "scratch", stock, torch.ones(2, 4),
                                 torch.zeros(2, 8, dtype=torch.int64), None,
                                 lambda: stock(None))
print("checked", layer.checked["scratch"])
'''


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="no torch: the probe runs the memory hook on torch tensors")
def test_the_memory_hook_pins_a_peak_rise_on_the_checks_reference_call():
    env = {k: v for k, v in os.environ.items() if not k.startswith("EC_BENCH_")}
    env.update(EC_BENCH_MEM="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "bench" / "kernel_trial"), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", MEM_PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    lines = [line for line in out.splitlines() if "EC_BENCH_MEM" in line]
    assert len(lines) == 1, out
    assert ("layer 7 scratch path, the check's reference call: 16 ids" in lines[0]
            and "peak 10.000 -> 10.500 GiB (+0.500 above allocated)" in lines[0]), lines
    assert "checked 0.0" in out


def test_the_memory_history_names_the_big_allocations_and_whether_they_were_freed():
    """EC_BENCH_MEM's allocator history: only allocations past the size, freed or held, with
    the innermost frames outside torch (the profile step's 0.52 GiB in place,
    bench/results/memory.md)."""
    import importlib.util

    # by path, under its own name: the interpreter may have a sitecustomize of its own
    spec = importlib.util.spec_from_file_location(
        "ec_kernel_trial_hook", ROOT / "bench" / "kernel_trial" / "sitecustomize.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    mib = 2**20
    frames = [{"filename": "/x/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"},
              {"filename": "/x/vllm/model_executor/layers/fused_moe/layer.py", "line": 42,
               "name": "forward_impl"},
              {"filename": "/x/vllm/v1/worker/gpu_model_runner.py", "line": 7,
               "name": "_dummy_run"}]
    snap = {"device_traces": [[
        {"action": "alloc", "addr": 1, "size": 555 * mib, "frames": frames},
        {"action": "alloc", "addr": 2, "size": 8 * mib, "frames": frames},
        {"action": "alloc", "addr": 3, "size": 100 * mib, "frames": []},
        {"action": "free_requested", "addr": 1, "size": 555 * mib},
    ]]}
    lines = hook.big_allocations(snap, 64 * mib)
    assert lines == [
        "555 MiB freed at layer.py:42 forward_impl <- gpu_model_runner.py:7 _dummy_run",
        "100 MiB held at (no frames)",
    ]
    assert hook.big_allocations({}, 1) == []
