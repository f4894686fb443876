"""Llama 4's chunked local attention: the KV vLLM holds for it, not the whole context.

Llama 4's RoPE layers (three of every four) attend within 8,192-token chunks, and vLLM's
hybrid KV cache manager keeps a sequence's current chunk and the tokens in flight there
(``ChunkedLocalAttentionSpec``, 0.26-0.33), whatever the context. With the manager off
(``--disable-hybrid-kv-cache-manager``, a KV connector, speculative decoding on a chunked
model, or ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0``) every layer keeps every
token. Scout's 48 layers are worked by hand; `test_vllm_architectures.py` holds the
arithmetic to the CPU build's own start check.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_sizing_architectures import SCOUT_TEXT

from expertcache_cli.sizing import hybrid_pages, model_size, sizing
from expertcache_cli.vllm_facts import vllm_flags

KV_LAYER = 2 * 8 * 128 * 2  # K and V, 8 KV heads of 128, bf16: 4,096 B a token
GiB = 2**30


@pytest.fixture(scope="module")
def scout():
    m = model_size.model_from_config({"model_type": "llama4", "text_config": SCOUT_TEXT},
                                     "scout")
    # transformers' defaults: a NoPE (full-attention) layer every 4th, 8,192-token chunks
    assert (m.chunked_layers, m.attention_chunk) == (36, 8192)
    assert m.kv_bytes_per_token == 12 * KV_LAYER
    assert m.kv_chunk_bytes_per_seq == 36 * 8192 * KV_LAYER
    return m


@pytest.mark.parametrize("context,batched,tokens", [
    # 8,192 + 2 x 2,048 = 12,288 tokens: 768 blocks of 16, no extra block
    (131072, 2048, 12288),
    # 8,192 + 2 x 8,192 = 24,576 tokens: 1,536 blocks
    (131072, 8192, 24576),
    # more than the context: the context, 10,001 tokens, in 626 blocks
    (10001, 2048, 16 * 626),
])
def test_a_chunked_layer_holds_its_chunk_and_the_tokens_in_flight(scout, context, batched,
                                                                 tokens):
    for scale in (1.0, 0.5):
        assert sizing.chunk_reserve(scout, kv_scale=scale, max_model_len=context,
                                    max_num_batched_tokens=batched) == int(
            36 * KV_LAYER * scale) * tokens


def test_the_plan_reserves_the_chunks_beside_the_nope_layers():
    """131,072 tokens of Scout: the 12 NoPE layers' KV and the chunks, 7.69 GiB, where the
    whole context in every layer would be 24 GiB."""
    m = model_size.model_from_config({"model_type": "llama4", "text_config": SCOUT_TEXT},
                                     "scout")
    plan = sizing.plan(m, 80, max_model_len=131072, max_num_seqs=4,
                       max_num_batched_tokens=2048)
    assert plan.kv_reserved_bytes == 12 * KV_LAYER * 131072 + 36 * KV_LAYER * 12288
    assert not any("reserved as full attention" in n for n in plan.notes)


@pytest.mark.parametrize("options,why", [
    ({"hybrid_kv_cache_manager": False}, "manager is off"),
    ({"speculative_tokens": 2}, "speculative decoding"),
])
def test_without_the_hybrid_manager_every_layer_keeps_every_token(scout, options, why):
    plan = sizing.plan(scout, 80, max_model_len=131072, max_num_seqs=4,
                       max_num_batched_tokens=2048, **options)
    assert plan.kv_reserved_bytes == 48 * KV_LAYER * 131072 == 24 * GiB
    assert any(why in n and "reserved as full attention" in n for n in plan.notes)


def test_vllms_switch_for_chunked_layers_is_read_from_the_environment():
    env = {hybrid_pages.CHUNKED_HYBRID_ENV: "0"}
    assert hybrid_pages.local_attention_paged(
        windows=False, chunks=True, manager=None, speculative_tokens=0, environ=env)
    # sliding windows do not depend on it, and a manager asked for explicitly stays on
    assert hybrid_pages.local_attention_paged(
        windows=True, chunks=False, manager=None, speculative_tokens=0, environ=env) is None
    assert hybrid_pages.local_attention_paged(
        windows=False, chunks=True, manager=True, speculative_tokens=0, environ=env) is None
    assert hybrid_pages.local_attention_paged(
        windows=False, chunks=True, manager=None, speculative_tokens=0, environ={}) is None


def test_gpt_oss_windows_keep_every_token_with_the_manager_off():
    gpt_oss = Path(__file__).parent / "configs" / "gpt-oss-120b.json"
    on = sizing.plan(gpt_oss, 80, max_model_len=8192, max_num_seqs=4,
                     max_num_batched_tokens=2048, quant="mxfp4")
    off = sizing.plan(gpt_oss, 80, max_model_len=8192, max_num_seqs=4,
                      max_num_batched_tokens=2048, quant="mxfp4",
                      hybrid_kv_cache_manager=False)
    kv_layer = 2 * 8 * 64 * 2
    assert on.kv_reserved_bytes == 18 * kv_layer * 8192 + 18 * kv_layer * 16 * 265
    assert off.kv_reserved_bytes == 36 * kv_layer * 8192


@pytest.mark.parametrize("args,manager", [
    ([], None),
    (["--disable-hybrid-kv-cache-manager"], False),
    (["--disable-hybrid-kv-cache-manager", "--no-disable-hybrid-kv-cache-manager"], True),
    (["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1"}'], False),
    (["--kv-transfer-config={}", "--no-disable-hybrid-kv-cache-manager"], True),
])
def test_the_flags_that_turn_the_manager_off(args, manager):
    assert vllm_flags.hybrid_kv_cache_manager(args) is manager
    kwargs = vllm_flags.plan_kwargs_from_vllm_args(args)
    assert kwargs.get("hybrid_kv_cache_manager") is manager


@pytest.mark.parametrize("text,chunked", [
    ({"no_rope_layers": [1, 1, 0] * 16}, 32),  # the config's own list
    ({"no_rope_layer_interval": 2}, 24),
    ({"attention_chunk_size": None}, 0),  # null: every layer full attention
])
def test_the_chunked_layers_follow_the_config(text, chunked):
    m = model_size.model_from_config(SCOUT_TEXT | text, "llama4")
    assert m.chunked_layers == chunked
    assert m.kv_bytes_per_token == (48 - chunked) * KV_LAYER
