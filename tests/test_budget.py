"""The slot-budget rules every command and the plugin share (budget.py)."""

from __future__ import annotations

import math

import pytest

from expertcache_cli.errors import UserError
from expertcache_cli.planning.launch import make_plan
from expertcache_cli.rules import budget
from expertcache_cli.rules.policy import Policy
from expertcache_cli.sizing import sizing
from expertcache_cli.sizing.model_size import model_from_config


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5, math.nan])
def test_a_fraction_is_strictly_between_0_and_1_everywhere(bad):
    with pytest.raises(ValueError):
        budget.check_fraction(bad)
    with pytest.raises(UserError, match="--fraction"):
        sizing.plan(None, 24, max_model_len=4096, fraction=bad)
    with pytest.raises(UserError, match="--fraction"):
        make_plan("/models/w8a8", 24, size_from="qwen3-30b-a3b-w8a8", fraction=bad,
                  launcher=["vllm"], environ={},
                  vllm_args=["--max-num-seqs", "4", "--max-model-len", "4096"])


def test_online_policies_and_decay():
    assert budget.online_policy(None) == (Policy.LRU, 0)
    assert budget.online_policy("LFU", 8) == (Policy.LFU, 8)
    for name, decay, words in (("opt", 0, "choose lru or lfu"), ("fifo", 0, "choose lru"),
                               ("lru", 8, "lfu only"), ("lfu", -1, ">= 0")):
        with pytest.raises(ValueError, match=words):
            budget.online_policy(name, decay)


def test_the_planner_honours_the_kernels_slot_limit():
    """A layer of more experts than the kernel's slot limit: the plan stops at the limit and
    says why; a forced count beyond it is refused (the plugin would decline the layer)."""
    big = model_from_config({
        "model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts": 4096, "num_experts_per_tok": 8, "vocab_size": 1000}, "big")
    p = sizing.plan(big, 80, max_model_len=4096, max_num_seqs=8)
    assert p.verdict == "cache" and p.slots == budget.MAX_SLOTS
    assert any("at most 1024 slots" in n for n in p.notes)
    with pytest.raises(UserError, match="at most 1024 slots"):
        sizing.plan(big, 80, max_model_len=4096, slots=2000)
    from expertcache_cli.config import CacheConfig

    with pytest.raises(ValueError, match="kernel's limit"):
        CacheConfig(slots=2000).slots_for(4096)
    assert budget.slot_limit(128) == 127 and budget.slot_limit(4096) == 1024


def test_one_slot_check_and_one_list_of_online_policies():
    """The plugin's configuration, `size`/`serve`'s --slots and a plan's per-layer budgets
    share `check_slots` (below E, within the kernel); every list of the policies a live
    cache runs reads `ONLINE_POLICIES`, which the kernel's codes cover exactly."""
    from expertcache_cli.device import binding
    from expertcache_cli.rules.policy import Policy

    assert budget.check_slots(budget.slot_limit(128), 128) == 127
    with pytest.raises(ValueError, match="128 is not below the 128 experts"):
        budget.check_slots(128, 128)
    with pytest.raises(ValueError, match="kernel's limit: it holds at most 1024 slots"):
        budget.check_slots(1025, 4096)
    assert budget.ONLINE_POLICIES == (Policy.LRU, Policy.LFU)
    assert tuple(binding.POLICY_CODES) == budget.ONLINE_POLICIES
    assert budget.online_names() == "lru or lfu"


def test_a_budget_for_a_trace_must_be_below_its_experts():
    """`replay --slots` and `plan --slots`: E slots hold every expert, nothing to cache."""
    assert budget.budgets_below([16, 127], 128) == [16, 127]
    with pytest.raises(ValueError, match="^128 is not below the trace's 128 experts"):
        budget.budgets_below([16, 128, 200], 128, "the trace's ")
    assert budget.default_budgets(128, 8) == [16, 32, 64]


def test_the_trap_never_advises_a_batch_of_no_sequences():
    """Where even one sequence's verify step carries more ids than the slots (speculative
    decoding on one slot), no ``--max-num-seqs`` helps, and the line says so rather than
    advising ``--max-num-seqs 0``."""
    text = budget.trap_text(8, 32, 1, 1, 0, "vLLM's defaults", spec_tokens=3)
    assert "--max-num-seqs 0" not in text
    assert "no --max-num-seqs keeps decode steps on it (one sequence's step carries at least " \
           "4 ids)" in text
    assert "--max-num-seqs 2 keeps every decode step on it" in budget.trap_text(
        8, 8, 6, 12, 2, "vLLM's defaults")
