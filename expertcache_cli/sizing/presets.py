"""Built-in model presets for `expertcache size` and `probe-link --model`.

Each preset is the part of the model's real Hugging Face ``config.json`` that sizing reads
(the full files the tests check these against live in ``tests/configs/``), plus the weight
format the preset stands for. Keeping the numbers here, rather than fetching configs,
means sizing works offline and on a laptop, which is where people ask "will it fit?".

The default preset is the model the AMD original (vllm-expert-cache) measured:
Qwen3-30B-A3B with W8A8 (int8 weights, one fp32 scale per output channel, as llm-
compressor's INT8 scheme writes it for vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_PRESET = "qwen3-30b-a3b-w8a8"

_QWEN3_30B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}

_QWEN3_235B: dict[str, Any] = {
    **_QWEN3_30B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
}

_MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}

_MIXTRAL_8X22B: dict[str, Any] = {
    **_MIXTRAL_8X7B,
    "hidden_size": 6144,
    "intermediate_size": 16384,
    "num_hidden_layers": 56,
    "num_attention_heads": 48,
    "max_position_embeddings": 65536,
}

_DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 163840,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 102400,
}

_OLMOE: dict[str, Any] = {
    "architectures": ["OlmoeForCausalLM"],
    "model_type": "olmoe",
    "hidden_size": 2048,
    "intermediate_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 50304,
}

_GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
    "quantization_config": {"quant_method": "mxfp4"},
}

_GPT_OSS_120B: dict[str, Any] = {
    **_GPT_OSS_20B,
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}


@dataclass(frozen=True)
class Preset:
    """A named model: its config fields, the weight format, and the HF repo it stands for."""

    name: str
    hf_id: str
    config: dict[str, Any]
    quant: str
    note: str = ""


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "qwen3-30b-a3b-w8a8",
            "Qwen/Qwen3-30B-A3B (W8A8)",
            _QWEN3_30B,
            "w8a8",
            "the AMD original's model: int8 weights, fp32 per-channel scales",
        ),
        Preset("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", _QWEN3_30B, "bf16"),
        Preset("qwen3-30b-a3b-fp8", "Qwen/Qwen3-30B-A3B-FP8", _QWEN3_30B, "fp8-block"),
        Preset("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", _QWEN3_235B, "bf16"),
        Preset("qwen3-235b-a22b-fp8", "Qwen/Qwen3-235B-A22B-FP8", _QWEN3_235B, "fp8-block"),
        Preset("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", _MIXTRAL_8X7B, "bf16"),
        Preset("mixtral-8x22b", "mistralai/Mixtral-8x22B-v0.1", _MIXTRAL_8X22B, "bf16"),
        Preset("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", _DEEPSEEK_V2_LITE, "bf16"),
        Preset("olmoe-1b-7b", "allenai/OLMoE-1B-7B-0125", _OLMOE, "bf16"),
        Preset("gpt-oss-20b", "openai/gpt-oss-20b", _GPT_OSS_20B, "mxfp4"),
        Preset("gpt-oss-120b", "openai/gpt-oss-120b", _GPT_OSS_120B, "mxfp4"),
    ]
}

#: Other spellings people type: the HF id (any case), with or without the org.
_ALIASES: dict[str, str] = {"qwen3-30b-a3b-int8": "qwen3-30b-a3b-w8a8"}
for _p in PRESETS.values():
    _hf = _p.hf_id.split(" ")[0].lower()
    if _p.quant in ("bf16", "fp8-block", "mxfp4"):
        _ALIASES.setdefault(_hf, _p.name)
        _ALIASES.setdefault(_hf.split("/")[-1], _p.name)


def find_preset(name: str) -> Preset | None:
    """The preset called ``name`` (preset name or HF id, case-insensitive), or None."""
    key = name.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    if key in _ALIASES:
        return PRESETS[_ALIASES[key]]
    return None
