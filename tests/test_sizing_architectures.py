"""Architectures whose layers are not all alike, and multimodal ones: what sizing counts.

Hybrid linear-attention models (Qwen3-Next, Qwen3.5): three of every four layers are
gated-delta-rule linear attention, which holds no KV a token but a fixed state a
sequence; the others are gated full attention. Counting every layer as full attention
would reserve four times the KV a token, and size the attention weights wrong.

Llama 4: a shared expert beside the routed ones in every MoE layer, and (Maverick) dense
layers of another width interleaved with the MoE ones.

Mamba hybrids (Jamba, Nemotron-H): which layers are MoE, and a note that their Mamba
layers are estimated.

The expected figures are worked by hand from the configs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from expertcache_cli.errors import UserError
from expertcache_cli.sizing import model_size, sizing
from expertcache_cli.vllm_facts import vllm_flags

CONFIGS = Path(__file__).parent / "configs"

#: Qwen/Qwen3-Coder-Next's config.json fields (the Qwen3-Next-80B-A3B architecture), as a
#: public parameter-count test quotes them; that test pins the checkpoint at
#: 79,674,391,296 parameters.
CODER_NEXT = {
    "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
    "hidden_size": 2048, "num_hidden_layers": 48, "vocab_size": 151936, "head_dim": 256,
    "num_attention_heads": 16, "num_key_value_heads": 2, "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "intermediate_size": 5120,
    "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
    "max_position_embeddings": 262144, "torch_dtype": "bfloat16",
}
PARAMETERS = 79_674_391_296
KV_LAYER = 2 * 2 * 256 * 2  # K and V, 2 KV heads of 256, bf16
LAYER_STATE = 32 * 128 * 128 * 2 + (2 * 16 * 128 + 32 * 128) * 3 * 2  # recurrent + conv


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
    page_tokens = -(-LAYER_STATE // KV_LAYER)
    assert m.state_bytes_per_seq == 36 * LAYER_STATE + page_tokens * 12 * KV_LAYER
    assert "36 of 48 layers linear attention" in m.kv_kind
    assert any("linear attention" in n and "no hybrid model has been served" in n
               for n in m.notes)


#: a Qwen3.5-style wrapper of the Qwen3-Next layers: the language model in text_config, its
#: layer types listed, the recurrent state asked for in float32
QWEN3_5 = {
    "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "vision_config": {"depth": 27},
    "text_config": {k: v for k, v in CODER_NEXT.items()
                    if k not in ("full_attention_interval", "architectures")}
    | {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 8, "mamba_ssm_dtype": "float32",
       "layer_types": ["linear_attention", "full_attention"] * 4},
}


def test_layer_types_and_a_float32_state_are_read_qwen3_5_style():
    """Qwen3.5 wraps the language model in text_config and lists its layer types; its
    configs ask for the recurrent state in float32."""
    m = model_size.model_from_config(QWEN3_5, "q35")
    state = 32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2
    assert m.kv_bytes_per_token == 4 * KV_LAYER
    assert m.state_bytes_per_seq == 4 * state + -(-state // KV_LAYER) * 4 * KV_LAYER
    assert any("vision encoder" in n for n in m.notes)


def test_a_model_without_linear_attention_is_unchanged():
    plain = {k: v for k, v in CODER_NEXT.items() if not k.startswith(("linear_", "full_"))}
    m = model_size.model_from_config(plain, "plain")
    assert m.state_bytes_per_seq == 0 and m.kv_bytes_per_token == 48 * KV_LAYER
    assert not any("linear attention" in n for n in m.notes)


def test_the_state_is_reserved_whatever_the_kv_dtype(tmp_path):
    """An fp8 KV cache halves the KV a token, not the state (its dtype is the model's)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CODER_NEXT))
    m = model_size.load_model(path)
    auto = sizing.plan(path, 80, max_model_len=8192, max_num_seqs=1)
    fp8 = sizing.plan(path, 80, max_model_len=8192, max_num_seqs=1, kv_cache_dtype="fp8")
    assert auto.kv_reserved_bytes - fp8.kv_reserved_bytes == 8192 * m.kv_bytes_per_token // 2
    assert fp8.kv_reserved_bytes >= m.state_bytes_per_seq


RECURRENT = 36 * 32 * 128 * 128  # Coder-Next's recurrent state, elements a sequence
CONV = 36 * (2 * 16 * 128 + 32 * 128) * 3  # its convolution inputs


def _state(path, *vllm_args: str) -> int:
    """The state a sequence `plan` reserves under these vLLM flags: its reserve for one
    token, less that token's KV."""
    kwargs = vllm_flags.plan_kwargs_from_vllm_args(list(vllm_args))
    plan = sizing.plan(path, 80, max_model_len=8192, max_num_seqs=1, kv_tokens=1, **kwargs)
    return plan.kv_reserved_bytes - 12 * KV_LAYER


@pytest.mark.parametrize("args,ssm,conv", [
    ((), 2, 2),
    (("--mamba-ssm-cache-dtype", "float32"), 4, 2),
    (("--mamba-cache-dtype", "float32"), 4, 4),
    (("--mamba-cache-dtype=float32", "--mamba-ssm-cache-dtype", "bfloat16"), 2, 4),
])
def test_vllms_state_dtype_flags_price_the_state(tmp_path, args, ssm, conv):
    """vLLM's ``--mamba-cache-dtype`` sets the whole state's dtype and
    ``--mamba-ssm-cache-dtype`` the recurrent part's; the page rounding follows the
    state's width (one full-attention layer's KV is 2,048 B a token)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CODER_NEXT))
    layer = (RECURRENT * ssm + CONV * conv) // 36
    assert _state(path, *args) == 36 * layer + -(-layer // KV_LAYER) * 12 * KV_LAYER


def test_qwen3_5s_float32_state_is_its_default_and_a_flag_overrides_it(tmp_path):
    """vLLM takes Qwen3.5's ``mamba_ssm_dtype`` as the default of ``--mamba-ssm-cache-dtype``,
    so ``--mamba-cache-dtype`` alone leaves the recurrent part in float32; it reads the field
    for no other model."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_5))
    m = model_size.load_model(path)
    recurrent, conv = 32 * 128 * 128, (2 * 16 * 128 + 32 * 128) * 3  # a layer, elements
    assert m.linear_state is not None and m.linear_state.layer_bytes == recurrent * 4 + conv * 2
    wide = m.with_state_dtypes("float32", "auto").linear_state
    assert wide is not None and wide.layer_bytes == (recurrent + conv) * 4
    narrow = m.with_state_dtypes("auto", "bfloat16").linear_state
    assert narrow is not None and narrow.layer_bytes == (recurrent + conv) * 2
    asked = CODER_NEXT | {"mamba_ssm_dtype": "float32"}
    assert (model_size.model_from_config(asked, "next").state_bytes_per_seq
            == model_size.model_from_config(CODER_NEXT, "next").state_bytes_per_seq)


def test_an_unknown_state_dtype_is_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CODER_NEXT))
    with pytest.raises(UserError, match=r"unknown --mamba-ssm-cache-dtype 'fp8': auto, float32"):
        _state(path, "--mamba-ssm-cache-dtype", "fp8")


def test_a_model_without_linear_attention_takes_the_flags_unchanged():
    plain = {k: v for k, v in CODER_NEXT.items() if not k.startswith(("linear_", "full_"))}
    m = model_size.model_from_config(plain, "plain")
    assert m.with_state_dtypes("float32", "float32") is m


@pytest.mark.parametrize("tp", [2, 4])
def test_a_priced_state_is_sharded_with_the_heads(tp):
    m = model_size.model_from_config(CODER_NEXT, "coder-next").with_state_dtypes(
        "auto", "float32")
    sharded = m.per_rank(tp)
    assert sharded.state_bytes_per_seq == -(-m.state_bytes_per_seq // tp)
    assert sharded.linear_state is not None
    assert sharded.linear_state.bytes_per_seq == sharded.state_bytes_per_seq


@pytest.mark.parametrize("tp", [2, 4])
def test_the_state_is_sharded_with_the_heads(tp):
    m = model_size.model_from_config(CODER_NEXT, "coder-next")
    assert m.per_rank(tp).state_bytes_per_seq == -(-m.state_bytes_per_seq // tp)
    assert dataclasses.asdict(m.per_rank(1)) == dataclasses.asdict(m)


#: Llama 4 Scout's text_config fields (meta-llama/Llama-4-Scout-17B-16E), as public config
#: parsers' tests quote them
SCOUT_TEXT = {
    "model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
    "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
    "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 16,
    "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "vocab_size": 202048,
    "attention_bias": False, "tie_word_embeddings": False, "use_qk_norm": True,
}


def test_llama4_counts_its_shared_expert_and_its_interleaved_dense_layers():
    """Every Llama 4 MoE layer has a shared expert of the experts' width beside the routed
    ones, and Maverick-style configs interleave dense layers of ``intermediate_size_mlp``."""
    h, inter = 5120, 8192
    attn = 2 * (h * 40 * 128 + 2 * h * 8 * 128 + 40 * 128 * h)
    expert = 3 * h * inter * 2
    layer = attn + 2 * h * 2 + 16 * h * 2 + expert  # norms, router, the shared expert
    scout = model_size.model_from_config(
        {"model_type": "llama4", "text_config": SCOUT_TEXT}, "scout")
    assert scout.moe_layers == list(range(48)) and scout.bytes_per_expert == expert
    assert scout.non_expert_bytes == 2 * 202048 * h * 2 + h * 2 + 48 * layer
    maverick = model_size.model_from_config(
        SCOUT_TEXT | {"num_local_experts": 128, "interleave_moe_layer_step": 2}, "maverick")
    assert maverick.moe_layers == list(range(1, 48, 2))
    dense = attn + 2 * h * 2 + 3 * h * 16384 * 2
    assert maverick.non_expert_bytes == (2 * 202048 * h * 2 + h * 2 + 24 * (layer - 16 * h * 2
                                         + 128 * h * 2) + 24 * dense)
    listed = model_size.model_from_config(SCOUT_TEXT | {"moe_layers": [1, 3, 99]}, "listed")
    assert listed.moe_layers == [1, 3]


@pytest.mark.parametrize("extra,moe", [
    ({"hybrid_override_pattern": "MEM*EMEM"}, [1, 4, 6]),  # Nemotron-H: E marks MoE layers
    ({"expert_layer_period": 2, "expert_layer_offset": 1, "mamba_d_state": 16},
     [1, 3, 5, 7]),  # Jamba
])
def test_mamba_hybrids_say_their_mamba_layers_are_estimated(extra, moe):
    cfg = {"hidden_size": 64, "num_hidden_layers": 8, "vocab_size": 100,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "intermediate_size": 32} | extra
    m = model_size.model_from_config(cfg, "hybrid")
    assert m.moe_layers == moe
    assert any("Mamba layers are not in the arithmetic" in n for n in m.notes)


def test_a_vision_encoder_is_estimated_as_a_vit():
    """Qwen3.5's vision tower: 27 blocks of width 1152 (MLP 4304) and a 2x2 patch merger
    to the language model's 2048; Llama 4's: 34 blocks of 1408 (MLP 5632) and a projector."""
    qwen = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
            "spatial_merge_size": 2, "out_hidden_size": 2048}
    blocks = 27 * (4 * 1152**2 + 2 * 1152 * 4304)
    assert model_size.vision_encoder_bytes(qwen) == 2 * (blocks + 4608**2 + 4608 * 2048)
    llama = {"hidden_size": 1408, "intermediate_size": 5632, "num_hidden_layers": 34,
             "projector_input_dim": 4096, "projector_output_dim": 4096}
    assert model_size.vision_encoder_bytes(llama) == 2 * (
        34 * (4 * 1408**2 + 2 * 1408 * 5632) + 4096 * 4096)
    text = {k: v for k, v in CODER_NEXT.items() if k != "full_attention_interval"}
    with_vision = model_size.model_from_config(
        {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": qwen}, "q35")
    alone = model_size.model_from_config(text, "q35")
    assert with_vision.non_expert_bytes - alone.non_expert_bytes == \
        model_size.vision_encoder_bytes(qwen)
    assert any("vision encoder (vision_config) estimated at" in n for n in with_vision.notes)


def test_a_checkpoints_safetensors_replace_the_vision_estimate(tmp_path):
    from test_sizing import _write_safetensors

    text = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 100, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": []}
    (tmp_path / "config.json").write_text(json.dumps(
        {"text_config": text, "vision_config": {"depth": 2, "hidden_size": 32}}))
    t = {f"model.layers.0.mlp.experts.{e}.{p}.weight": ("BF16", [32, 64])
         for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    t["visual.blocks.0.attn.qkv.weight"] = ("BF16", [96, 32])
    _write_safetensors(tmp_path / "model.safetensors", t)
    m = model_size.load_model(tmp_path)
    assert m.source == "checkpoint" and m.non_expert_bytes == 96 * 32 * 2
    assert not any("vision encoder" in n for n in m.notes)


def test_an_aux_loss_free_router_carries_its_float32_correction_bias():
    """DeepSeek-V3's `noaux_tc` routing adds a float32 score-correction bias a MoE layer
    (vLLM's `e_score_correction_bias`); GLM-4.5's router is float32 as well (checked
    against vLLM's own modules in test_vllm_architectures.py)."""
    with open(CONFIGS / "deepseek-v2-lite.json") as f:
        lite = json.load(f)
    greedy = model_size.model_from_config(lite, "lite")
    noaux = model_size.model_from_config(lite | {"topk_method": "noaux_tc"}, "lite")
    moe = len(greedy.moe_layers)
    assert noaux.non_expert_bytes - greedy.non_expert_bytes == moe * 64 * 4
    glm = model_size.model_from_config(lite | {"model_type": "glm4_moe"}, "glm")
    assert glm.non_expert_bytes - greedy.non_expert_bytes == moe * (64 * 2048 * 2 + 64 * 4)
