"""The EXPERT_CACHE_* contract: parsing, writing back, the budget rules (no torch)."""

from __future__ import annotations

import pytest

from expertcache_cli.config import ENV_VARS, CacheConfig, ConfigError, from_env
from expertcache_cli.errors import UserError
from expertcache_cli.rules.policy import Policy, Wide


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
        ({"EXPERT_CACHE_WIDE": "sideways"},
         "EXPERT_CACHE_WIDE='sideways': unknown wide-step mode 'sideways': choose from in-place"),
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


def _env_table(doc: str, after: str) -> dict[str, tuple[str, str]]:
    """The variable table that follows the sentence ``after`` in ``doc``: name -> (meaning,
    default), backticks dropped."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / doc).read_text()
    lines = text[text.index(after):].splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| variable |"))
    rows: dict[str, tuple[str, str]] = {}
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        name, meaning, default = (c.strip().replace("`", "") for c in line.strip("|").split(" | "))
        rows[name] = (meaning, default)
    return rows


@pytest.mark.parametrize("doc, after", [
    ("README.md", "The plugin reads these in every vLLM process"),
    ("docs/plugin.md", "Read by the vLLM plugin once per process"),
])
def test_the_docs_env_tables_are_configs_contract(doc, after):
    """config.ENV_VARS is the contract; the README's and docs/plugin.md's tables name the
    same variables, each with config's default and every phrase config says it must carry
    (so that, say, one text cannot call STATS a device sync while the code never waits)."""
    table = _env_table(doc, after)
    assert sorted(table) == sorted(ENV_VARS), f"{doc} names other variables than config"
    for name, var in ENV_VARS.items():
        meaning, default = table[name]
        assert default.lower().startswith(var.default), (doc, name, default)
        for phrase in var.says:
            assert phrase in meaning, f"{doc}: {name} does not say {phrase!r}"
            assert phrase in var.meaning, f"config: {name} does not say {phrase!r}"


@pytest.mark.parametrize("cfg", [
    CacheConfig(), CacheConfig(disabled=True), CacheConfig(slots=89),
    CacheConfig(fraction=0.3), CacheConfig(slots=40, policy=Policy.LFU, decay=64),
    CacheConfig(fraction=0.125, stats_every=480, trace_path="run.npz"),
    CacheConfig(slots=81, wide=Wide.STAGED_INSTALL), CacheConfig(slots=8, wide=Wide.STAGED),
])
def test_to_env_is_what_from_env_reads_back(cfg, tmp_path, monkeypatch):
    """`serve` and `baseline` write the environment with to_env; the plugin reads it with
    from_env: one contract, both directions."""
    monkeypatch.chdir(tmp_path)
    env = cfg.to_env()
    assert set(env) <= set(ENV_VARS)
    assert from_env(env) == cfg


def test_integers_the_kernels_take_as_c_ints_are_range_checked():
    """4294967297 would reach the kernel as 1 through ctypes."""
    for name in ("EXPERT_CACHE_DECAY", "EXPERT_CACHE_SLOTS", "EXPERT_CACHE_STATS"):
        env = {name: "4294967297"}
        if name == "EXPERT_CACHE_DECAY":
            env["EXPERT_CACHE_POLICY"] = "lfu"
        with pytest.raises(ConfigError, match=f"{name}='4294967297': expected an integer"):
            from_env(env)
    assert from_env({"EXPERT_CACHE_POLICY": "lfu", "EXPERT_CACHE_DECAY": "2147483647"}).decay


def test_a_lib_that_is_not_a_shared_library_is_refused(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ConfigError, match="not a shared library"):
        from_env({"EXPERT_CACHE_LIB": str(text)})
    elf = tmp_path / "lib.so"
    elf.write_bytes(b"\x7fELF" + bytes(60))
    assert from_env({"EXPERT_CACHE_LIB": str(elf)}).lib == str(elf)


def test_per_layer_slots_are_parsed_and_looked_up_by_layer():
    cfg = from_env({"EXPERT_CACHE_SLOTS": "40, 52,61"})
    assert cfg.slots_per_layer == (40, 52, 61) and cfg.slots is None
    assert [cfg.slots_for(128, i) for i in range(3)] == [40, 52, 61]
    with pytest.raises(ValueError, match="MoE layer 3 has none"):
        cfg.slots_for(128, 3)
    with pytest.raises(ValueError, match="not below"):
        from_env({"EXPERT_CACHE_SLOTS": "40,128"}).slots_for(128, 1)
    for bad, words in (("40,,61", "empty entry"), ("40,x", "per-layer budgets"),
                       ("40,0", "expected an integer")):
        with pytest.raises(ConfigError, match=words):
            from_env({"EXPERT_CACHE_SLOTS": bad})
    with pytest.raises(ConfigError, match="both set"):
        from_env({"EXPERT_CACHE_SLOTS": "4,5", "EXPERT_CACHE_FRACTION": "0.5"})
    assert from_env(CacheConfig(slots_per_layer=(7, 8)).to_env()).slots_per_layer == (7, 8)


@pytest.mark.parametrize(("value", "want"), [
    (None, True), ("", True), ("1", True), ("on", True), ("0", False), ("no", False),
    ("OFF", False),
])
def test_pdl_switch_reads_as_the_other_booleans_and_defaults_on(value, want):
    from expertcache_cli.config import pdl_from_env

    env = {} if value is None else {"EXPERT_CACHE_PDL": value}
    assert pdl_from_env(env) is want
    assert from_env(env).pdl is want
    assert from_env(from_env(env).to_env()).pdl is want


def test_a_bad_pdl_value_is_one_clear_error():
    with pytest.raises(ConfigError, match="EXPERT_CACHE_PDL='maybe': expected 1 or 0"):
        from_env({"EXPERT_CACHE_PDL": "maybe"})


@pytest.mark.parametrize("env, want", [
    ({}, (None, True)),
    ({"EXPERT_CACHE_LIB": "/opt/libexpertcache.so", "EXPERT_CACHE_PDL": "0"},
     ("/opt/libexpertcache.so", False)),
    ({"EXPERT_CACHE_LIB": "", "EXPERT_CACHE_PDL": "1"}, (None, True)),
])
def test_kernel_source_is_what_the_environment_hands_the_binding(env, want):
    from expertcache_cli.config import kernel_source

    assert kernel_source(env) == want


@pytest.mark.parametrize(("value", "want"), [
    (None, True), ("", True), ("1", True), ("on", True), ("0", False), ("off", False),
])
def test_the_spread_switch_defaults_on_and_round_trips(value, want):
    env = {} if value is None else {"EXPERT_CACHE_SPREAD": value}
    assert from_env(env).spread is want
    assert from_env(from_env(env).to_env()).spread is want


def test_a_bad_spread_value_is_one_clear_error():
    with pytest.raises(ConfigError, match="EXPERT_CACHE_SPREAD='maybe': expected 1 or 0"):
        from_env({"EXPERT_CACHE_SPREAD": "maybe"})
