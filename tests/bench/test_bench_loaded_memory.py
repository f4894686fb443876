"""bench/loaded_memory.py: the bytes vLLM counts as the loaded model split into expert and
other parameters, buffers, tensors modules hold as attributes, and tensors held elsewhere;
a storage is counted once however many views reach it; the wrap logs after the runner's
load and never stops a start."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import loaded_memory  # noqa: E402


class Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(4, 8, 16), requires_grad=False)
        self.workspace = torch.zeros(64, dtype=torch.int32)  # held, not registered


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48, bias=False)
        self.experts = Experts()
        self.register_buffer("cos_sin", torch.zeros(32, 8))


def test_every_byte_lands_in_one_part_and_views_count_once():
    model = torch.nn.Sequential(Layer(), Layer())
    model[1].qkv.weight = model[0].qkv.weight  # tied: one storage
    alias = model[0].experts.w13_weight[1:]  # a view of a parameter: nothing new
    held = torch.zeros(10, 3, dtype=torch.float64)  # held by no module
    b = loaded_memory.breakdown(model, device_type="cpu")
    assert b.expert_params == 2 * 4 * 8 * 16 * 4
    assert b.other_params == 48 * 16 * 4  # the tied weight once
    assert b.buffers == 2 * 32 * 8 * 4
    assert b.attributes == {"0.experts.workspace": 256, "1.experts.workspace": 256}
    assert b.elsewhere.get("(10, 3) float64") == (1, 240)
    assert alias.untyped_storage().data_ptr() == \
        model[0].experts.w13_weight.untyped_storage().data_ptr()
    assert not any(k.startswith("(3, 8, 16)") for k in b.elsewhere)  # the view: not again
    del held


def test_parameters_offloaded_to_host_are_in_no_device_part():
    """vLLM's UVA offloader leaves a device-typed view of host memory in the parameter: it
    is not VRAM, and a view of it met by the scan is not counted either."""
    model = torch.nn.Sequential(Layer())
    w = model[0].experts.w13_weight
    w._vllm_is_uva_offloaded = True
    view = w[:2]  # as a kernel's argument would hold it
    b = loaded_memory.breakdown(model, device_type="cpu")
    assert b.offloaded == 4 * 8 * 16 * 4 and b.expert_params == 0
    assert not any(k.startswith("(2, 8, 16)") for k in b.elsewhere)
    assert b.other_params == 48 * 16 * 4
    del view


def test_other_devices_are_not_counted():
    b = loaded_memory.breakdown(torch.nn.Sequential(Layer()), device_type="cuda", scan=False)
    assert (b.expert_params, b.other_params, b.buffers, b.attributes) == (0, 0, 0, {})


def test_the_lines_add_up_to_what_was_allocated():
    b = loaded_memory.Breakdown(expert_params=1 << 30, other_params=2 << 30, buffers=0,
                                attributes={"0.mlp.experts.workspace": 1 << 20,
                                            "1.mlp.experts.workspace": 1 << 20},
                                elsewhere={"(128, 8960) float32": (36, 36 << 20)})
    lines = loaded_memory.lines(b, allocated=(3 << 30) + (40 << 20))
    assert lines[0].startswith("EC_BENCH_LOADED: allocated 3.039 GiB = expert parameters "
                               "1.000 + other parameters 2.000")
    assert lines[0].endswith("held elsewhere 0.035 + not found 0.002 (offloaded to host, "
                             "not counted: 0.000)")
    assert "EC_BENCH_LOADED attribute workspace: 2 module(s), 2.00 MiB" in lines
    assert "EC_BENCH_LOADED elsewhere (128, 8960) float32: 36 tensor(s), 36.00 MiB" in lines


def test_the_wrap_logs_after_the_load_and_never_stops_it(caplog, monkeypatch):
    order: list[str] = []

    class Runner:
        def load_model(self):
            order.append("load")
            self.model = torch.nn.Sequential(Layer())
            return "loaded"

    assert loaded_memory.patch_runner_class(Runner)
    assert loaded_memory.patch_runner_class(Runner)  # once: not wrapped twice
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(loaded_memory, "breakdown",
                        lambda model, **kw: order.append("breakdown") or
                        loaded_memory.Breakdown())
    with caplog.at_level(logging.WARNING, logger="vllm.expertcache.bench"):
        assert Runner().load_model() == "loaded"
    assert order == ["load", "breakdown"]

    class Wrapped(Runner):  # vLLM's runner: the model behind a CUDA-graph wrapper
        def get_model(self):
            order.append("get_model")
            return self.model

    loaded_memory.patch_runner_class(Wrapped)
    order.clear()
    assert Wrapped().load_model() == "loaded"
    assert order == ["load", "get_model", "breakdown"]
    assert any(r.getMessage().startswith("EC_BENCH_LOADED: allocated") for r in caplog.records)

    def broken(model, **kw):
        raise RuntimeError("no device")

    monkeypatch.setattr(loaded_memory, "breakdown", broken)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.expertcache.bench"):
        assert Runner().load_model() == "loaded"
    assert any("no breakdown (RuntimeError: no device)" in r.getMessage()
               for r in caplog.records)
    assert not loaded_memory.patch_runner_class(type("NoLoad", (), {}))


def test_the_hook_folder_installs_it_only_when_asked():
    code = ("import sys; print('loaded_memory' in sys.modules)")
    env_path = f"{ROOT / 'bench' / 'trace_hook'}:{ROOT}"
    for value, want in (("1", "True"), ("0", "False")):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONPATH": env_path, "EC_BENCH_LOADED": value,
                                "PATH": "/usr/bin:/bin"}, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == want
