"""Config fields of the hybrid linear-attention models the sizing tests work by hand."""

from __future__ import annotations

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
