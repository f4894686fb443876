"""Sliding-window layers: the KV vLLM holds for them, not their window.

vLLM frees a window's blocks only once the tokens scheduled past it are processed, so a
sequence holds its window less one token plus every token in flight (two batches of
``--max-num-batched-tokens`` with async scheduling), at most the context, in whole blocks
and one more (vLLM's ``SlidingWindowSpec``, 0.26-0.33). gpt-oss-120b's 18 layers of
128-token windows are worked by hand; the CPU build's own check holds the arithmetic to
vLLM in `test_vllm_architectures.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from expertcache_cli.sizing import model_size, sizing

GPT_OSS = Path(__file__).parent / "configs" / "gpt-oss-120b.json"
KV_LAYER = 2 * 8 * 64 * 2  # K and V, 8 KV heads of 64, bf16: 2,048 B a token


@pytest.fixture(scope="module")
def model():
    m = model_size.load_model(GPT_OSS, "mxfp4")
    assert (m.window_layers, m.sliding_window) == (18, 128)
    assert m.kv_window_bytes_per_seq == 18 * 128 * KV_LAYER  # the windows themselves
    return m


@pytest.mark.parametrize("context,batched,tokens", [
    # 127 + 2 x 2,048 = 4,223 tokens: 264 blocks of 16, and one more
    (131072, 2048, 16 * (264 + 1)),
    # 127 + 2 x 8,192 = 16,511: 1,032 blocks, and one more
    (131072, 8192, 16 * (1032 + 1)),
    # more than the context: the context, 256 blocks, and one more
    (4096, 2048, 16 * (256 + 1)),
])
def test_a_window_holds_the_tokens_in_flight(model, context, batched, tokens):
    assert sizing.window_reserve(model, kv_scale=1.0, max_model_len=context,
                                 max_num_batched_tokens=batched) == 18 * KV_LAYER * tokens
    assert sizing.window_reserve(model, kv_scale=0.5, max_model_len=context,
                                 max_num_batched_tokens=batched) == 18 * KV_LAYER * tokens // 2


def test_the_plan_reserves_it_beside_the_full_layers_kv():
    plan = sizing.plan(GPT_OSS, 24, max_model_len=8192, max_num_seqs=4,
                       max_num_batched_tokens=2048, quant="mxfp4")
    assert plan.kv_reserved_bytes == 18 * KV_LAYER * 8192 + 18 * KV_LAYER * 16 * 265


def test_a_model_without_windows_reserves_none():
    m = model_size.load_model(Path(__file__).parent / "configs" / "qwen3-30b-a3b.json")
    assert m.window_layers == 0
    assert sizing.window_reserve(m, kv_scale=1.0, max_model_len=8192,
                                 max_num_batched_tokens=2048) == 0
