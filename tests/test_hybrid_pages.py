"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5): their weights, their state, and
the KV pages vLLM reserves for both.

Three of every four layers are gated-delta-rule linear attention, which holds no KV a
token but a fixed state a sequence; the others are gated full attention. vLLM pages both
in blocks of one byte size (`hybrid_pages`), so a start needs more than the state and the
KV added up: the reserves below are worked by hand from Qwen3-Coder-Next's config, the
way vLLM 0.26-0.33 work them, and the CPU build's own check holds them to vLLM in
`test_vllm_architectures.py`.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hybrid_configs import CODER_NEXT, QWEN3_5

from expertcache_cli.errors import UserError
from expertcache_cli.sizing import hybrid_pages, model_size, sizing
from expertcache_cli.vllm_facts import installed_vllm, vllm_flags

PARAMETERS = 79_674_391_296
KV_LAYER = 2 * 2 * 256 * 2  # K and V, 2 KV heads of 256, bf16: 2,048 B a token
RECURRENT = 32 * 128 * 128  # a layer's recurrent state, elements (32 value heads, 128 x 128)
CONV = (2 * 16 * 128 + 32 * 128) * 3  # its convolution's channels x the 3 inputs it keeps
LAYER_STATE = RECURRENT * 2 + CONV * 2  # 1,097,728 B in bf16


@pytest.fixture(autouse=True)
def vllm_0_32(monkeypatch):
    """The rules of vLLM 0.32 unless a test says otherwise (no vLLM is installed here:
    the sizing would take the newest read)."""
    monkeypatch.setattr(installed_vllm, "version", lambda: (0, 32))


@pytest.fixture
def coder_next(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CODER_NEXT))
    return path


def test_qwen3_next_weights_are_its_parameter_count():
    m = model_size.model_from_config(CODER_NEXT, "coder-next")
    # every parameter in bf16 but the 36 linear-attention layers' A_log (32 heads each),
    # which vLLM holds in float32
    assert m.total_bytes == 2 * PARAMETERS + 36 * 32 * 2
    assert m.moe_layers == list(range(48)) and (m.num_experts, m.top_k) == (512, 10)
    assert m.bytes_per_expert == 3 * 2048 * 512 * 2


def test_qwen3_next_kv_is_its_full_attention_layers_and_state_its_linear_ones():
    m = model_size.model_from_config(CODER_NEXT, "coder-next")
    assert m.kv_bytes_per_token == 12 * KV_LAYER  # layers 3, 7, ..., 47
    assert m.state_bytes_per_seq == 36 * LAYER_STATE
    assert "36 of 48 layers linear attention" in m.kv_kind
    assert any("linear attention" in n and "blocks of 544 tokens" in n
               and "no real hybrid checkpoint has been served" in n for n in m.notes)


def test_layer_types_and_a_float32_state_are_read_qwen3_5_style():
    """Qwen3.5 wraps the language model in text_config and lists its layer types; its
    configs ask for the recurrent state in float32."""
    m = model_size.model_from_config(QWEN3_5, "q35")
    assert m.kv_bytes_per_token == 4 * KV_LAYER
    assert m.state_bytes_per_seq == 4 * (RECURRENT * 4 + CONV * 2)
    assert any("vision encoder" in n for n in m.notes)


def test_a_model_without_linear_attention_is_unchanged():
    plain = {k: v for k, v in CODER_NEXT.items() if not k.startswith(("linear_", "full_"))}
    m = model_size.model_from_config(plain, "plain")
    assert m.state_bytes_per_seq == 0 and m.kv_bytes_per_token == 48 * KV_LAYER
    assert m.linear_state is None
    assert m.with_state_dtypes("float32", "float32") is m
    assert not any("linear attention" in n for n in m.notes)


def _reserve(path, *vllm_args: str, caching: bool = False) -> int:
    """The KV `plan` reserves for one 8,192-token sequence under these vLLM flags."""
    kwargs = {"prefix_caching": caching} | vllm_flags.plan_kwargs_from_vllm_args(
        list(vllm_args))
    return sizing.plan(path, 80, max_model_len=8192, max_num_seqs=1,
                       **kwargs).kv_reserved_bytes


# One 8,192-token sequence of Qwen3-Coder-Next, bf16, as vLLM pages it: a layer's state is
# 1,097,728 B, so a block is the fewest multiple of 16 tokens whose KV (2,048 B a token a
# layer) holds it, 16 x ceil(1,097,728 / 32,768) = 544 tokens, a page 1,114,112 B. The
# layers group by the fewer kind, 12: one group of full attention, three of linear, a
# block of the pool 12 pages. The sequence takes ceil(8,192 / 544) = 16 blocks of the
# full group and one a linear group, two with prefix caching (vLLM's "align" mode).
PAGE = 544 * KV_LAYER


def test_a_sequences_pages_are_vllms(coder_next):
    assert _reserve(coder_next) == 12 * PAGE * (16 + 3) == 254_017_536
    assert _reserve(coder_next, caching=True) == 12 * PAGE * (16 + 3 * 2) == 294_125_568


def test_an_fp8_kv_cache_halves_the_kv_not_the_state(coder_next):
    # 1,024 B a token a layer: blocks of 16 x ceil(1,097,728 / 16,384) = 1,072 tokens, whose
    # page (1,097,728 B) is exactly the state; ceil(8,192 / 1,072) = 8 blocks
    assert _reserve(coder_next, "--kv-cache-dtype", "fp8") == 12 * 1072 * 1024 * (8 + 3)


def test_draft_tokens_widen_the_state_and_take_a_page_each(coder_next):
    # 2 draft tokens: the convolution keeps 2 more inputs (1,130,496 B a layer), blocks of
    # 16 x 35 = 560 tokens, 15 for the sequence, and 1 + 2 state pages a linear group
    spec = '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}'
    assert (_reserve(coder_next, "--speculative-config", spec)
            == 12 * 560 * KV_LAYER * (15 + 3 * 3) == 330_301_440)


def test_a_float32_recurrent_state_is_priced_and_paged(coder_next):
    # 2,146,304 B a layer: blocks of 16 x 66 = 1,056 tokens, 8 for the sequence
    assert (_reserve(coder_next, "--mamba-ssm-cache-dtype", "float32")
            == 12 * 1056 * KV_LAYER * (8 + 3) == 285_474_816)


@pytest.mark.parametrize("args,ssm,conv", [
    ((), 2, 2),
    (("--mamba-ssm-cache-dtype", "float32"), 4, 2),
    (("--mamba-cache-dtype", "float32"), 4, 4),
    (("--mamba-cache-dtype=float32", "--mamba-ssm-cache-dtype", "bfloat16"), 2, 4),
])
def test_vllms_state_dtype_flags_price_the_state(args, ssm, conv):
    """vLLM's ``--mamba-cache-dtype`` sets the whole state's dtype and
    ``--mamba-ssm-cache-dtype`` the recurrent part's."""
    kwargs = vllm_flags.plan_kwargs_from_vllm_args(list(args))
    m = model_size.model_from_config(CODER_NEXT, "next").with_state_dtypes(
        kwargs.get("mamba_cache_dtype", "auto"), kwargs.get("mamba_ssm_cache_dtype", "auto"))
    assert m.state_bytes_per_seq == 36 * (RECURRENT * ssm + CONV * conv)


def test_qwen3_5s_float32_state_is_its_default_and_a_flag_overrides_it():
    """vLLM takes Qwen3.5's ``mamba_ssm_dtype`` as the default of ``--mamba-ssm-cache-dtype``,
    so ``--mamba-cache-dtype`` alone leaves the recurrent part in float32; it reads the field
    for no other model."""
    m = model_size.model_from_config(QWEN3_5, "q35")
    assert m.state_bytes_per_seq == 4 * (RECURRENT * 4 + CONV * 2)
    assert m.with_state_dtypes("float32", "auto").state_bytes_per_seq == 4 * (
        RECURRENT + CONV) * 4
    assert m.with_state_dtypes("auto", "bfloat16").state_bytes_per_seq == 4 * (
        RECURRENT + CONV) * 2
    asked = CODER_NEXT | {"mamba_ssm_dtype": "float32"}
    assert (model_size.model_from_config(asked, "next").state_bytes_per_seq
            == model_size.model_from_config(CODER_NEXT, "next").state_bytes_per_seq)


def test_an_unknown_state_dtype_is_one_line(coder_next):
    with pytest.raises(UserError, match=r"unknown --mamba-ssm-cache-dtype 'fp8': auto, float32"):
        _reserve(coder_next, "--mamba-ssm-cache-dtype", "fp8")


@pytest.mark.parametrize("tp,reserve", [
    # 2 GPUs: half the state and one KV head each, the same blocks: half the pool
    (2, 254_017_536 // 2),
    # 4 GPUs: a quarter of the state (274,432 B) but still one KV head (1,024 B a token):
    # blocks of 16 x 17 = 272 tokens, 31 for the sequence
    (4, 12 * 272 * 1024 * (31 + 3)),
])
def test_the_state_is_sharded_with_the_heads(coder_next, tp, reserve):
    m = model_size.model_from_config(CODER_NEXT, "coder-next")
    assert m.per_rank(tp).state_bytes_per_seq == m.state_bytes_per_seq // tp
    assert dataclasses.asdict(m.per_rank(1)) == dataclasses.asdict(m)
    plan = sizing.plan(coder_next, 80, max_model_len=8192, max_num_seqs=1,
                       tensor_parallel_size=tp, prefix_caching=False)
    assert plan.kv_reserved_bytes == reserve


def test_padding_layers_fill_the_groups():
    """vLLM groups by the fewer kind of layer unless the other has under 1.5 times as many:
    5 full and 6 linear layers make groups of 6, the full group padded with one layer."""
    state = hybrid_pages.LinearState(layers=6, full_layers=5, ssm_elements=RECURRENT,
                                     conv_channels=CONV // 3, conv_taps=3, kv_layer=KV_LAYER)
    assert state.reserve(8192, 1) == 6 * PAGE * (16 + 1)
    three = dataclasses.replace(state, layers=9, full_layers=3)  # groups of 3
    assert three.reserve(8192, 1) == 3 * PAGE * (16 + 3)
    # two sequences: their 16,384 tokens in ceil(16,384 / 544) = 31 blocks, and one more
    # for where the first one ends; a state page each in each linear group
    assert three.reserve(2 * 8192, 2) == 3 * PAGE * (31 + 1 + 3 * 2)


def test_a_kv_cache_too_small_for_a_sequences_pages_is_refused(coder_next):
    with pytest.raises(UserError, match="cannot hold one --max-model-len 8192 sequence"):
        sizing.plan(coder_next, 80, max_model_len=8192, max_num_seqs=1, prefix_caching=False,
                    kv_cache_memory_bytes=254_017_535)
    plan = sizing.plan(coder_next, 80, max_model_len=8192, max_num_seqs=1,
                       prefix_caching=False, kv_cache_memory_bytes=254_017_536)
    assert plan.kv_cache_bytes == 254_017_536


@pytest.mark.parametrize("args,expected", [
    ([], None),
    (["--enable-prefix-caching"], True),
    (["--no-enable-prefix-caching"], False),
    (["--no-enable-prefix-caching", "--enable-prefix-caching"], True),
])
def test_the_prefix_caching_switch_is_read(args, expected):
    assert vllm_flags.plan_kwargs_from_vllm_args(args).get("prefix_caching") == expected


# vLLM 0.33 on Hopper and Blackwell: with prefix caching, FlashInfer's gated-delta-rule
# prefill saves states every 64 tokens, so blocks are multiples of 64 (16 x 9 = 576 tokens,
# 15 for the sequence) and each state keeps a third page
CHECKPOINTED = 12 * 576 * KV_LAYER * (15 + 3 * 3)


@pytest.mark.parametrize("version,reserve", [
    ((0, 26), 12 * PAGE * (16 + 3)),  # prefix caching off for hybrid models
    ((0, 32), 12 * PAGE * (16 + 3 * 2)),  # on: a second state page
    ((0, 33), CHECKPOINTED),
    (None, CHECKPOINTED),  # no vLLM here: the newest read
])
def test_the_installed_vllms_defaults_decide_the_pages(coder_next, monkeypatch, version,
                                                       reserve):
    monkeypatch.setattr(installed_vllm, "version", lambda: version)
    assert hybrid_pages.prefix_caching_default(version) is (version != (0, 26))
    plan = sizing.plan(coder_next, 80, max_model_len=8192, max_num_seqs=1)
    assert plan.kv_reserved_bytes == reserve
    off = sizing.plan(coder_next, 80, max_model_len=8192, max_num_seqs=1,
                      prefix_caching=False)
    assert off.kv_reserved_bytes == 12 * PAGE * (16 + 3)  # no checkpoints without caching
