"""The plugin's hooks on a real vLLM's classes: imported, not served (seconds, no model).

The plugin reaches into vLLM by module path and attribute name, and the tool reads some
facts of a release from its source text (`vllm_facts`). The CPU stand-ins test the logic;
this checks the names against the vLLM that ``EXPERTCACHE_VLLM_PYTHON`` has: asked for a
cache, `register()` wraps every `Worker` method it lists that the release has, the
engine loops, the loader's re-offload, the Triton tile lookups and Marlin's block
builder; the layout check passes on the real `RoutedExperts`; the release's facts read
from source agree with what importing it shows.

A GPU build of vLLM imports on a machine without a GPU, so this is also how a release that
has no CPU build is checked here (docs/development.md: a venv with ``pip install --no-deps
vllm==X`` and its requirements); CI runs it on the CPU build.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from real_vllm import vllm_python

from expertcache_cli.plugin import marlin
from expertcache_cli.vllm_facts.installed_vllm import parse_version

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import importlib, inspect, json, os, sys
sys.path.insert(0, sys.argv[1])
os.environ["EXPERT_CACHE_SLOTS"] = "32"
import expertcache_cli.plugin as plugin
from expertcache_cli.plugin import compat, marlin, memory, padding, session
from expertcache_cli.plugin.runtime import TRITON_EXPERTS_MODULE
from expertcache_cli.vllm_facts import installed_vllm, vllm_experts, vllm_runner

plugin.register()
import vllm
import vllm.v1.engine.core as core
import vllm.model_executor.model_loader.utils as loader_utils
worker_module = importlib.import_module(plugin.WORKER_MODULE)
W = worker_module.Worker

def ours(fn):
    return getattr(fn, "__module__", "") == plugin.__name__

def importable(name):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None

listed = ["load_model", "execute_model", "shutdown", "sleep", "extend_kv_cache", "wake_up",
          "compile_or_warm_up_model", "determine_available_memory"]
listed += [n for n, _ in plugin.WEIGHT_CHANGES] + list(plugin.WEIGHT_UPDATE_STEPS)
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
triton = importlib.import_module(TRITON_EXPERTS_MODULE)
humming = importable("vllm.model_executor.layers.quantization.utils.humming.priority")
backend = importable("vllm.device_allocator.sleep_mode_backend")
suspend = getattr(getattr(backend, "SleepModeBackend", None), "suspend", None)
fc = importlib.import_module("vllm.forward_context").ForwardContext
out = {
    "version": vllm.__version__,
    "source_version": installed_vllm.text(),
    "worker": {n: ours(getattr(W, n)) for n in dict.fromkeys(listed) if hasattr(W, n)},
    "loops": {c: ours(core.__dict__[c].__dict__.get("run_busy_loop"))
              for c in ("EngineCoreProc", "DPEngineCoreProc") if c in core.__dict__},
    "loader": bool(getattr(loader_utils.device_loading_context, compat.WRAPPED_MARK, False)),
    "layout_refusal": plugin.layout_refusal(RoutedExperts, FusedMoEKernel),
    "marlin_refusal": session._patch_marlin(),
    "mechanism": memory.plan_mechanism(),
    "v1_runner_file": vllm_runner.v1_runner_present(),
    "v1_runner_module": importable(padding.V1_RUNNER_MODULE) is not None,
    "humming_source": vllm_experts.humming_ranked_first(),
    "humming_import": (None if humming is None else
                       90 in getattr(humming, vllm_experts.HUMMING_PREFERRED)),
    "discardable": (None if suspend is None
                    else "discardable" in inspect.signature(suspend).parameters),
    "is_padding": "is_padding" in getattr(fc, "__dataclass_fields__", {}),
}
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
mm = importlib.import_module(marlin.MARLIN_MODULE)
fields = getattr(FusedMoEQuantConfig, "__dataclass_fields__", {})
out["quant_config_reads"] = [a for a in marlin.QUANT_CONFIG_READS
                             if not (hasattr(FusedMoEQuantConfig, a) or a in fields)]
text = inspect.getsource(mm.MarlinExperts)
out["marlin_layout_names"] = [a for a in (*marlin.ACT_ORDER_ATTRS, "is_k_full",
                                          "activation_config") if a in text]
session._patch_tiles()
out["tiles"] = [getattr(getattr(triton, n, None), compat.WRAPPED_MARK, None)
                for n in ("try_get_optimal_moe_config", "get_moe_configs")]
print("RESULT " + json.dumps(out))
"""


def test_the_plugins_hooks_land_on_the_installed_vllms_classes():
    py = vllm_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPERT_CACHE_")}
    r = subprocess.run([py, "-c", SCRIPT, str(ROOT)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    release = parse_version(res["version"])
    assert res["source_version"] == res["version"]
    # every Worker method the plugin lists and the release has is the plugin's wrapper
    assert {"load_model", "execute_model", "shutdown"} <= set(res["worker"])
    assert [n for n, wrapped in res["worker"].items() if not wrapped] == []
    assert res["loops"] and all(res["loops"].values())
    assert res["loader"], "device_loading_context not wrapped (re-offload)"
    assert res["layout_refusal"] is None and res["marlin_refusal"] is None
    tiles, configs = res["tiles"]
    assert tiles is True and configs in (True, None)  # get_moe_configs: 0.34's, wrapped
    assert res["mechanism"] is not None, "the slots' place in vLLM's memory plan unknown"
    # `marlin.layout` reads what MarlinExperts' quant config carries, and tells the two
    # layouts apart by act order's attributes (0.26) or an activation_config (0.32 on)
    assert res["quant_config_reads"] == []
    names = set(res["marlin_layout_names"])
    assert names in ({"activation_config"}, {*marlin.ACT_ORDER_ATTRS, "is_k_full"}), names
    # what the tool reads from the release's source is what importing it shows
    assert res["v1_runner_file"] == res["v1_runner_module"]
    assert bool(res["humming_source"]) == bool(res["humming_import"])
    if release >= (0, 34, 0):
        assert not res["v1_runner_module"] and res["is_padding"]
        assert "extend_kv_cache" in res["worker"] and res["discardable"] is True
        assert configs is True
    else:
        assert res["v1_runner_module"]
