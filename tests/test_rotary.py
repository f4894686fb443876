"""vLLM's rotary cos/sin caches: VRAM beside the weights that no checkpoint holds.

The cache is one row a position, ``rotary_dim`` wide, in the model's dtype, built once a
distinct rotary embedding. Llama 4 Scout's 10,485,760 positions make it 2.5 GiB: on an
emulated 24 GiB card vLLM reported "Model loading took 9.17 GiB" for Scout's config cut
to 8 layers, where the weights alone are 6.67 GiB, and a plan without the cache ran out of
memory at its first start (docs/results.md, "First start"). Held to vLLM's own buffers in
`tests/test_vllm_architectures.py`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_sizing_architectures import SCOUT_TEXT

from expertcache_cli.sizing import model_size, rotary, sizing
from expertcache_cli.vllm_facts import capture

GiB = 2**30
ROOT = Path(__file__).resolve().parents[1]


def test_scouts_ten_million_positions_take_two_and_a_half_gib():
    m = model_size.model_from_config({"model_type": "llama4", "text_config": SCOUT_TEXT},
                                     "scout")
    assert m.rope_cache_bytes == 10485760 * 128 * 2 == int(2.5 * GiB)
    assert m.resident_bytes == m.non_expert_bytes + m.rope_cache_bytes


def test_scout_cut_to_eight_layers_loads_what_vllm_reported():
    """vLLM's "Model loading took 9.17 GiB" (experts offloaded) for the bench's 8-layer
    Scout: the weights and the rotary cache, to the hundredth of a GiB it prints."""
    cut = SCOUT_TEXT | {"num_hidden_layers": 8}
    m = model_size.model_from_config(cut, "scout-8")
    assert round(m.non_expert_bytes / GiB, 2) == 6.67
    assert round(m.resident_bytes / GiB, 2) == 9.17


@pytest.mark.parametrize("cfg,head,rows,width", [
    # yarn: the pre-scaling length times the factor (gpt-oss)
    ({"rope_scaling": {"rope_type": "yarn", "factor": 32.0,
                       "original_max_position_embeddings": 4096}}, 64, 131072, 64),
    # a partial rotation narrows the rows (Qwen3-Next, GLM-4.5)
    ({"partial_rotary_factor": 0.25}, 256, 4096, 64),
    ({"rotary_pct": 0.5}, 128, 4096, 64),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, 128,
     4096, 64),
    # linear scaling: one cache a factor, each the length times its factor
    ({"rope_scaling": {"type": "linear", "factor": [1.0, 2.0]}}, 128, 4096 * 3, 128),
    # Phi-3.5's long rope: a short cache and a long one
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0],
                       "long_factor": [1.0], "original_max_position_embeddings": 1024}},
     96, 1024 + 4096, 96),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [1.0],
                       "original_max_position_embeddings": 1024}}, 96, 1024 + 4096, 96),
])
def test_each_rope_type_is_sized_as_vllm_builds_it(cfg, head, rows, width):
    assert rotary.rope_cache_bytes(cfg, head, 4096) == rows * width * 2


def test_gpt_oss_holds_its_rotary_cache_in_float32():
    """vLLM builds gpt-oss's yarn cache in float32 whatever the model's dtype."""
    cfg = {"model_type": "gpt_oss", "rope_scaling": {
        "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}}
    assert rotary.rope_cache_bytes(cfg, 64, 131072) == 131072 * 64 * 4


def test_a_parameter_set_a_layer_type_builds_a_cache_each():
    """Gemma-style configs give full and sliding layers their own rotary parameters."""
    cfg = {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    assert rotary.rope_cache_bytes(cfg, 128, 8192) == 2 * 8192 * 128 * 2


def test_latent_attention_rotates_its_rope_head_only():
    cfg = json.loads((ROOT / "tests/configs/deepseek-v2-lite.json").read_text())
    m = model_size.model_from_config(cfg, "dsv2-lite")
    scaling = cfg["rope_parameters"]
    rows = int(scaling["original_max_position_embeddings"] * scaling["factor"])
    assert m.rope_cache_bytes == rows * cfg["qk_rope_head_dim"] * 2


def test_the_plan_holds_the_cache_and_room_for_the_compiles_copy():
    """The cache is held with the weights, and a first start's compile copies it before
    vLLM allocates the KV cache: the KV and runtime reserves together cover the copy."""
    cut = SCOUT_TEXT | {"num_hidden_layers": 8}
    m = model_size.model_from_config(cut, "scout-8")
    for context in (8192, 131072):
        p = sizing.plan(m, 24, max_model_len=context, max_num_seqs=4,
                        max_num_batched_tokens=2048)
        assert p.rope_cache_bytes == m.rope_cache_bytes
        assert p.slot_budget_bytes == (p.budget_bytes - m.non_expert_bytes
                                       - m.rope_cache_bytes - p.kv_reserved_bytes
                                       - p.overhead_bytes)
        assert p.kv_reserved_bytes + p.overhead_bytes >= m.rope_cache_bytes
        assert any("second copy" in n for n in p.notes)
        # what the device ran out of: the cache was not counted, 6 and 7 slots planned
        assert p.slots == 5


def test_an_eager_server_compiles_nothing_and_needs_no_room_for_the_copy():
    cut = SCOUT_TEXT | {"num_hidden_layers": 8}
    m = model_size.model_from_config(cut, "scout-8")
    eager = sizing.plan(m, 24, max_model_len=8192, max_num_seqs=4, max_num_batched_tokens=2048,
                        graphs=capture.settings_from_vllm_args(["--enforce-eager"]))
    assert not any("second copy" in n for n in eager.notes)
    assert eager.kv_reserved_bytes + eager.overhead_bytes < m.rope_cache_bytes
    assert eager.slot_budget_bytes == (eager.budget_bytes - m.resident_bytes
                                       - eager.kv_reserved_bytes - eager.overhead_bytes)


def test_a_small_cache_leaves_the_runtime_reserve_alone():
    """Qwen3-30B-A3B's 40,960 positions: 10 MiB, taken from the slots' room and nothing else."""
    cfg = json.loads((ROOT / "tests/configs/qwen3-30b-a3b.json").read_text())
    m = model_size.model_from_config(cfg, "qwen3-30b-a3b")
    assert m.rope_cache_bytes == 40960 * 128 * 2
    without = dataclasses.replace(m, rope_cache_bytes=0)
    p, q = (sizing.plan(x, 24, max_model_len=8192, max_num_seqs=4,
                        max_num_batched_tokens=2048) for x in (m, without))
    assert p.overhead_bytes == q.overhead_bytes
    assert q.slot_budget_bytes - p.slot_budget_bytes == m.rope_cache_bytes
    assert not any("second copy" in n for n in p.notes)
