"""The tiny MoE models of the tests: config factories, and the writer the real-vLLM tests
run (no GPU, no weights).

`qwen3_moe_config` is the one place a test builds a Qwen3-MoE ``config.json`` by hand;
`MAKE_MODEL` writes it, with a tokenizer, for every test that starts vLLM's CPU build,
run by that vLLM's python. The other factories are the architectures whose sizing is
checked against vLLM's own modules (`test_vllm_architectures.py`); `make_model_script`
writes any of them.
"""

from __future__ import annotations

import json
from typing import Any


def qwen3_moe_config(**overrides: Any) -> dict[str, Any]:
    """A Qwen3-MoE config small enough to start in seconds (8 experts, top-2, 2 layers).

    head_dim 64: vLLM's CPU attention backend has no kernels for very small heads.
    ``None`` in ``overrides`` removes a key.
    """
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True, "max_position_embeddings": 512,
        "vocab_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu",
    }
    cfg.update(overrides)
    return {k: v for k, v in cfg.items() if v is not None}


def llama4_text_config() -> dict[str, Any]:
    """A Llama 4 text model as small: 4 layers, MoE every second (layers 1 and 3, each with
    its shared expert), 8 experts top-1, dense layers of their own width."""
    return _small(
        architectures=["Llama4ForCausalLM"], model_type="llama4_text", intermediate_size=32,
        intermediate_size_mlp=128, num_hidden_layers=4, num_local_experts=8,
        num_experts_per_tok=1, interleave_moe_layer_step=2, rope_theta=500000.0,
        no_rope_layers=[1, 1, 1, 0], use_qk_norm=True, attention_chunk_size=256,
        attn_temperature_tuning=False, floor_scale=8192, attn_scale=0.1, rope_scaling=None,
        max_position_embeddings=4096)


def qwen3_next_config() -> dict[str, Any]:
    """A Qwen3-Next as small: 4 layers, the first three gated-delta-rule linear attention
    and the fourth full (gated) attention, every layer MoE with a shared expert. Linear
    heads of 64: vLLM's CPU kernels have none smaller."""
    return qwen3_moe_config(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", num_hidden_layers=4,
        full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        shared_expert_intermediate_size=32, partial_rotary_factor=0.25)


def _small(**fields: Any) -> dict[str, Any]:
    """The fields every tiny model shares (3 layers of width 64, one KV head of 64), and
    its own."""
    return {
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 512,
        "vocab_size": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu",
    } | fields


def glm4_moe_config() -> dict[str, Any]:
    """A GLM-4.5 (Air) as small: a first dense layer then two MoE layers with a shared
    expert, a float32 router with its score-correction bias, biased q/k/v."""
    return _small(
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", intermediate_size=128,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
        routed_scaling_factor=1.0, n_group=1, topk_group=1, partial_rotary_factor=0.5,
        use_qk_norm=False, attention_bias=True, num_nextn_predict_layers=1)


def mixtral_config() -> dict[str, Any]:
    """A Mixtral as small: 8 experts top-2 in every layer."""
    return _small(architectures=["MixtralForCausalLM"], model_type="mixtral",
                  intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)


def deepseek_v2_config() -> dict[str, Any]:
    """A DeepSeek-V2 as small: multi-head latent attention (its latent of 512 and rope key
    of 64: vLLM's CPU MLA has no other head size), a first dense layer, then MoE layers
    with a shared expert."""
    return _small(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, moe_layer_freq=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, n_group=1, topk_group=1,
        topk_method="greedy", scoring_func="softmax", kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, num_key_value_heads=2)


def gpt_oss_config() -> dict[str, Any]:
    """A gpt-oss as small, in bf16 (vLLM's CPU build has no MXFP4): biased experts, router
    and attention, sinks, alternating sliding windows."""
    return _small(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", intermediate_size=64,
        num_local_experts=8, num_experts_per_tok=2, experts_per_token=2, sliding_window=128,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attention_bias=True, swiglu_limit=7.0, rope_scaling={
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096})


def make_model_script(config: dict[str, Any]) -> str:
    """The script the vLLM python runs (it has `tokenizers`) to write a model directory
    for ``config``: a character-level tokenizer and the config, no weights."""
    return _MAKE.replace("CONFIG_JSON", repr(json.dumps(config)))


_MAKE = r"""
import json, sys
from pathlib import Path
from tokenizers import Tokenizer, models, pre_tokenizers
d = Path(sys.argv[1])
d.mkdir(parents=True, exist_ok=True)
config = json.loads(CONFIG_JSON)
vocab_size = config["vocab_size"]
words = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(32, 127)]
words += [f"<extra_{i}>" for i in range(vocab_size - len(words))]
tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
tok.save(str(d / "tokenizer.json"))
(d / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
    "unk_token": "<unk>", "model_max_length": 512}))
(d / "config.json").write_text(json.dumps(config, indent=1))
"""

#: the tiny Qwen3-MoE model's writer, for every test that starts vLLM's CPU build
MAKE_MODEL = make_model_script(qwen3_moe_config())
