"""One sequence's KV in whole blocks, as vLLM checks a start.

vLLM refuses to start unless its KV cache holds one ``--max-model-len`` sequence, counted in
whole blocks of its attention kernel (``FullAttentionSpec.max_memory_usage_bytes``): 16
tokens for GQA models, 64 (FlashMLA) or 128 (CUTLASS MLA) for latent attention, or the
user's ``--block-size``. A context that is not a whole number of blocks is reserved rounded
up, so the KV the plan hands vLLM passes that check.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from expertcache_cli.errors import UserError
from expertcache_cli.sizing import model_size, sizing
from expertcache_cli.vllm_facts import vllm_flags

CONFIGS = Path(__file__).parent / "configs"
QWEN3 = CONFIGS / "qwen3-30b-a3b.json"
DEEPSEEK = CONFIGS / "deepseek-v2-lite.json"


def reserve(spec: Path, context: int, **options) -> tuple[int, int]:
    plan = sizing.plan(spec, 80, max_model_len=context, max_num_seqs=4,
                       max_num_batched_tokens=2048, **options)
    return plan.kv_reserved_bytes, plan.kv_bytes_per_token


@pytest.mark.parametrize("context,options,tokens", [
    (1000, {}, 1008),  # 63 blocks of 16
    (1008, {}, 1008),
    (1000, {"block_size": 64}, 1024),  # the user's --block-size
])
def test_a_gqa_sequence_is_reserved_in_whole_blocks(context, options, tokens):
    kv, per_token = reserve(QWEN3, context, **options)
    assert kv == tokens * per_token


def test_latent_attention_is_reserved_in_the_largest_mla_block():
    m = model_size.load_model(DEEPSEEK)
    assert m.kv_kind.startswith("MLA")
    assert sizing.kv_block_tokens(m) == sizing.MLA_KV_BLOCK_TOKENS == 128
    kv, per_token = reserve(DEEPSEEK, 10001)
    assert kv == 79 * 128 * per_token  # 10,001 tokens: 79 blocks of 128


def test_the_block_size_flag_reaches_the_plan():
    assert vllm_flags.plan_kwargs_from_vllm_args(["--block-size", "32"])["block_size"] == 32
    with pytest.raises(UserError, match="--block-size must be positive"):
        reserve(QWEN3, 1000, block_size=0)


@pytest.mark.parametrize("dtype,scale", [("bfloat16", 1.0), ("float16", 1.0),
                                         ("fp8_e5m2", 0.5)])
def test_vllms_spelling_of_each_kv_dtype_is_sized(dtype, scale):
    """vLLM spells the 16-bit KV dtypes ``bfloat16`` and ``float16``; a value the plan
    cannot price is refused in one line naming those it can."""
    kv, per_token = reserve(QWEN3, 1008, kv_cache_dtype=dtype)
    full, full_token = reserve(QWEN3, 1008)
    assert per_token == int(full_token * scale) and kv == 1008 * per_token
    with pytest.raises(UserError, match="nvfp4.*not one the plan can size.*bfloat16"):
        reserve(QWEN3, 1008, kv_cache_dtype="nvfp4")
