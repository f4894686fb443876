"""`plugin.reoffload`: offloaded weights that vLLM's weight processing rebinds to VRAM in
place (0.33+ `replace_parameter`) go back to host memory at the layer's exit; what vLLM's
own exit already handles (0.26's new Parameter) or what stayed in its storage (0.34's copy
into a fitting host storage) is left alone. CPU torch: the "device" tensors are CPU ones
and vLLM's host-view function a recorder."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest

torch = pytest.importorskip("torch", reason="the re-offload moves torch tensors")

import expertcache_cli.plugin as plugin  # noqa: E402
from expertcache_cli.plugin import reoffload  # noqa: E402
from expertcache_cli.plugin.compat import WRAPPED_MARK  # noqa: E402

CUDA = torch.device("cuda")  # only its type is read; nothing is allocated on it


class Views:
    """vLLM's `get_accelerator_view_from_cpu_tensor`, recording what it was handed."""

    def __init__(self) -> None:
        self.handed: list[torch.Tensor] = []

    def __call__(self, cpu: torch.Tensor) -> torch.Tensor:
        self.handed.append(cpu)
        return cpu


def loader_utils(views: Views) -> types.ModuleType:
    """A stand-in of vLLM's loader utilities: its `device_loading_context` exit re-offloads
    a parameter that was marked before and is unmarked after (0.26.0 to 0.34.0)."""
    mod = types.ModuleType(reoffload.LOADER_UTILS_MODULE)

    @contextlib.contextmanager
    def device_loading_context(module, target_device):
        if target_device is None or target_device.type == "cpu":
            yield module
            return
        marked = [n for n, p in module.named_parameters()
                  if getattr(p, reoffload.UVA_MARK, False)]
        try:
            yield module
        finally:
            for name, p in module.named_parameters():
                if name in marked and not getattr(p, reoffload.UVA_MARK, False):
                    p.data = views(torch.empty_like(p.data, device="cpu").copy_(p.data))
                    setattr(p, reoffload.UVA_MARK, True)

    mod.device_loading_context = device_loading_context
    mod.get_accelerator_view_from_cpu_tensor = views
    mod.is_pin_memory_available = lambda: False
    mod.envs = types.SimpleNamespace(VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY=False)
    return mod


def layer() -> torch.nn.Module:
    m = torch.nn.Module()
    m.w13_weight = torch.nn.Parameter(torch.arange(24, dtype=torch.int32).view(2, 3, 4),
                                      requires_grad=False)
    m.w13_scale = torch.nn.Parameter(torch.ones(2, 4), requires_grad=False)
    m.gate = torch.nn.Parameter(torch.zeros(4), requires_grad=False)  # resident: no mark
    for p in (m.w13_weight, m.w13_scale):
        setattr(p, reoffload.UVA_MARK, True)
    return m


@pytest.fixture()
def patched():
    views, tally = Views(), reoffload.Tally()
    mod = loader_utils(views)
    assert reoffload.patch_loader_utils(mod, tally) is None
    return mod, views, tally


def test_a_marked_parameter_rebound_in_place_goes_back_to_host(patched):
    mod, views, tally = patched
    m = layer()
    obj = m.w13_weight
    repacked = torch.arange(24, dtype=torch.int32).view(2, 2, 6) * 7
    with mod.device_loading_context(m, CUDA):
        m.w13_weight.data = repacked.clone()  # 0.33's replace_parameter: same object
    assert m.w13_weight is obj and getattr(obj, reoffload.UVA_MARK)
    assert len(views.handed) == 1 and obj.data_ptr() == views.handed[0].data_ptr()
    assert obj.data.data_ptr() != repacked.data_ptr() and torch.equal(obj.data, repacked)
    assert (tally.params, tally.bytes) == (1, 24 * 4)
    assert "1 offloaded parameters (0.00 GiB)" in tally.line()


def test_what_vllm_already_reoffloads_or_kept_in_place_is_left_alone(patched):
    mod, views, tally = patched
    m = layer()
    scale_ptr = m.w13_scale.data_ptr()
    with mod.device_loading_context(m, CUDA):
        # 0.26: a new Parameter, unmarked: vLLM's exit re-offloads it (one view)
        m.w13_weight = torch.nn.Parameter(torch.zeros(2, 2, 6, dtype=torch.int32),
                                          requires_grad=False)
        # 0.34: a result that fits is copied into the host storage (same address)
        m.w13_scale.data.copy_(torch.full((2, 4), 3.0))
        m.gate.data = torch.ones(8)  # never offloaded: not ours to move
    assert len(views.handed) == 1  # vLLM's own, for the new Parameter
    assert m.w13_scale.data_ptr() == scale_ptr
    assert tally.params == 0 and tally.line() is None


def test_a_cpu_target_or_no_marked_parameter_does_nothing(patched):
    mod, views, tally = patched
    m = layer()
    with mod.device_loading_context(m, torch.device("cpu")):
        m.w13_weight.data = torch.zeros(5, dtype=torch.int32)
    assert views.handed == [] and tally.params == 0


def test_the_patch_is_once_and_a_module_without_the_names_is_said():
    views, tally = Views(), reoffload.Tally()
    mod = loader_utils(views)
    reoffload.patch_loader_utils(mod, tally)
    first = mod.device_loading_context
    assert reoffload.patch_loader_utils(mod, tally) is None
    assert mod.device_loading_context is first
    bare = types.ModuleType("x")
    why = reoffload.patch_loader_utils(bare, tally)
    assert why is not None and "device_loading_context" in why


@pytest.mark.parametrize("env, version, wrapped", [
    ({"EXPERT_CACHE_SLOTS": "4"}, "0.33.0", True),
    ({"EXPERT_CACHE_DISABLE": "1"}, "0.33.0", True),  # the control run offloads alike
    ({}, "0.33.0", False),  # installed, not asked: vLLM untouched
    ({"EXPERT_CACHE_SLOTS": "4"}, "0.40.0", False),  # a release not read: untouched
])
def test_register_wraps_the_loaders_exit_where_the_cache_or_its_control_runs(
        monkeypatch, env, version, wrapped):
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_config", None)
    for name in list(__import__("os").environ):
        if name.startswith("EXPERT_CACHE_"):
            monkeypatch.delenv(name)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    mod = loader_utils(Views())
    monkeypatch.setitem(sys.modules, reoffload.LOADER_UTILS_MODULE, mod)
    before = list(sys.meta_path)
    try:
        plugin.register()
    finally:
        sys.meta_path[:] = before
    assert getattr(mod.device_loading_context, WRAPPED_MARK, False) == wrapped
