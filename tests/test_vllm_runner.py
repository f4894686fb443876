"""`vllm_runner`: a vLLM whose V2 model runner cannot offload never gets to load the experts
into VRAM unasked (serve and baseline pin V1; the plugin says why in the log)."""

from __future__ import annotations

import types

import pytest

from expertcache_cli.baseline.arms import parse_arms
from expertcache_cli.baseline.runner import BaselineConfig, _offload_env, run_baseline
from expertcache_cli.errors import UserError
from expertcache_cli.planning.launch import make_plan
from expertcache_cli.vllm_facts import installed_vllm, vllm_runner

ENV = vllm_runner.ENV
V026_LIKE = "from vllm.model_executor.offloader import get_offloader\nclass GPUModelRunner: ..."
V033_LIKE = "        set_offloader(create_offloader(self.vllm_config.offload_config))\n"


def installed_runner(tmp_path, monkeypatch, text: str):
    """A vLLM package in ``tmp_path`` whose V2 runner's source is ``text``, found as the
    installed one; returns its directory."""
    pkg = tmp_path / "vllm"
    (pkg / "v1" / "worker" / "gpu").mkdir(parents=True)
    (pkg / "v1" / "worker" / "gpu" / "model_runner.py").write_text(text)
    spec = types.SimpleNamespace(submodule_search_locations=[str(pkg)])
    monkeypatch.setattr(installed_vllm.importlib.util, "find_spec", lambda name: spec)
    return pkg


def test_the_runner_source_decides():
    assert vllm_runner.v2_runner_offloads(V033_LIKE) is True
    assert vllm_runner.v2_runner_offloads(V026_LIKE) is False


def test_no_vllm_here_decides_nothing(monkeypatch):
    monkeypatch.setattr(installed_vllm.importlib.util, "find_spec", lambda name: None)
    assert vllm_runner.v2_runner_offloads() is None


def test_the_installed_file_is_read_without_importing_vllm(tmp_path, monkeypatch):
    pkg = installed_runner(tmp_path, monkeypatch, V026_LIKE)
    assert vllm_runner.v2_runner_offloads() is False
    (pkg / "v1" / "worker" / "gpu" / "model_runner.py").write_text(V033_LIKE)
    assert vllm_runner.v2_runner_offloads() is True


@pytest.mark.parametrize("offloads", [True, None])
def test_a_runner_that_offloads_needs_nothing(offloads):
    assert vllm_runner.offload_runner_env({ENV: "1"}, offloads) == ({}, None)


def test_a_runner_that_cannot_offload_is_pinned_to_v1_with_a_note():
    env, note = vllm_runner.offload_runner_env({}, False, "0.26.0")
    assert env == {ENV: "0"}
    assert "vLLM 0.26.0's V2 model runner never installs the CPU offloader" in note
    # already V1 by the user's choice: the same env, nothing to say
    assert vllm_runner.offload_runner_env({ENV: "0"}, False) == ({ENV: "0"}, None)


def test_forcing_v2_on_such_a_vllm_is_refused():
    with pytest.raises(UserError, match=f"{ENV}=1 in your environment: .*unset it"):
        vllm_runner.offload_runner_env({ENV: "1"}, False, "0.26.0")


def _worker(module_name: str, gb: float):
    runner_cls = type("GPUModelRunner", (), {"__module__": module_name})
    cfg = types.SimpleNamespace(offload_config=types.SimpleNamespace(
        uva=types.SimpleNamespace(cpu_offload_gb=gb)))
    return types.SimpleNamespace(model_runner=runner_cls(), vllm_config=cfg)


def test_the_plugin_names_a_v2_runner_that_will_not_offload():
    v2 = "vllm.v1.worker.gpu.model_runner"
    old = types.ModuleType(v2)  # 0.26: never imports set_offloader
    new = types.ModuleType(v2)
    new.set_offloader = lambda inst: None
    why = vllm_runner.runner_ignores_offload(_worker(v2, 28), {v2: old}, "0.26.0")
    assert why and "(28 GB asked for)" in why and f"Set {ENV}=0" in why
    assert vllm_runner.runner_ignores_offload(_worker(v2, 28), {v2: new}) is None
    assert vllm_runner.runner_ignores_offload(_worker(v2, 0), {v2: old}) is None
    v1 = "vllm.v1.worker.gpu_model_runner"  # the V1 runner always offloads
    assert vllm_runner.runner_ignores_offload(_worker(v1, 28), {v1: old}) is None


def _serve(environ, offloads):
    return make_plan("Qwen/Qwen3-30B-A3B", 24, launcher=["vllm"], environ=environ,
                     v2_runner_offloads=lambda: offloads,
                     vllm_args=["--max-num-seqs", "4", "--max-model-len", "8192"])


def test_serve_pins_v1_where_v2_cannot_offload():
    p = _serve({}, False)
    assert p.env[ENV] == "0" and "--cpu-offload-gb" in p.argv
    assert any("never installs the CPU offloader" in n for n in p.notes)
    assert ENV not in _serve({}, True).env
    with pytest.raises(UserError, match="unset it"):
        _serve({ENV: "true"}, False)


def test_serve_without_offload_leaves_the_runner_alone():
    p = make_plan("Qwen/Qwen3-30B-A3B", 141, launcher=["vllm"], environ={ENV: "1"},
                  v2_runner_offloads=lambda: False)
    assert p.size.verdict == "fits_outright" and ENV not in p.env


def test_baseline_pins_v1_for_offloaded_arms_only(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_runner, "v2_runner_offloads", lambda: False)
    monkeypatch.delenv(ENV, raising=False)
    said: list[str] = []
    cfg = BaselineConfig(model="m", arms=parse_arms("resident,offload"), out=tmp_path / "r.jsonl",
                         cpu_offload_gb=1.0)
    assert _offload_env(cfg, said.append) == {ENV: "0"} and "V1 runner" in said[0]
    cfg.arms = parse_arms("resident")
    assert _offload_env(cfg, said.append) == {}
    cfg.arms, cfg.server_cmd = parse_arms("offload"), "/opt/other/bin/vllm serve {model}"
    assert _offload_env(cfg, said.append) == {}  # another program: not ours to read


def test_baseline_forced_v2_is_refused_before_anything_is_written(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_runner, "v2_runner_offloads", lambda: False)
    monkeypatch.setenv(ENV, "1")
    cfg = BaselineConfig(model="m", arms=parse_arms("offload"), out=tmp_path / "r.jsonl",
                         cpu_offload_gb=1.0, server_cmd="{python} -c pass")
    with pytest.raises(UserError, match="unset it"):
        run_baseline(cfg)
    assert not cfg.out.exists()


# -- vLLM 0.34: one model runner (the V2 one, which offloads); the V1 pin is an error -----

V034_LIKE = V033_LIKE  # gpu/model_runner.py:379 of 0.34.0, in GPUModelRunner.__init__


def test_034_has_no_v1_runner_to_pin(tmp_path, monkeypatch):
    pkg = installed_runner(tmp_path, monkeypatch, V034_LIKE)
    assert vllm_runner.v1_runner_present() is False and vllm_runner.v2_runner_offloads()
    (pkg / "v1" / "worker" / "gpu_model_runner.py").write_text("class GPUModelRunner: ...")
    assert vllm_runner.v1_runner_present() is True  # 0.26-0.33
    monkeypatch.setattr(installed_vllm.importlib.util, "find_spec", lambda name: None)
    assert vllm_runner.v1_runner_present() is None


@pytest.mark.parametrize("value", ["0", "true", "", "false"])
def test_034_refuses_any_runner_env_but_1(value):
    with pytest.raises(UserError, match=f"{ENV}={value} in your environment: vLLM 0.34.0 "
                                        "has no V1 model runner.*unset it"):
        vllm_runner.offload_runner_env({ENV: value}, True, "0.34.0", v1_present=False)
    assert vllm_runner.offload_runner_env({ENV: "1"}, True, "0.34.0", False) == ({}, None)
    assert vllm_runner.offload_runner_env({}, True, "0.34.0", False) == ({}, None)
    # 0.33 with V1 still there: a 0 is the user's V1, nothing to refuse
    assert vllm_runner.offload_runner_env({ENV: "0"}, True, "0.33.0", True) == ({}, None)


def test_034_never_gets_the_v1_pin():
    with pytest.raises(UserError, match="no V1 model runner to serve the offload on"):
        vllm_runner.offload_runner_env({}, False, "0.34.0", v1_present=False)


def test_serve_on_034_refuses_a_stale_v1_pin_before_launch():
    def plan(environ, vram=24):
        return make_plan("Qwen/Qwen3-30B-A3B", vram, launcher=["vllm"], environ=environ,
                         v2_runner_offloads=lambda: True, v1_runner_present=lambda: False,
                         vllm_args=["--max-num-seqs", "4", "--max-model-len", "8192"])
    assert ENV not in plan({}).env
    with pytest.raises(UserError, match="has no V1 model runner"):
        plan({ENV: "0"})
    with pytest.raises(UserError, match="has no V1 model runner"):
        plan({ENV: "0"}, vram=141)  # nothing offloaded: vLLM would still stop at start
