#!/usr/bin/env python3
"""Write a config-only model directory of a real MoE architecture, cut to N layers (BENCH ONLY).

The formats and first-start benches serve Qwen3-30B-A3B's and gpt-oss's shapes. Two
architectures size their KV differently and are served here with the cache only through
this: Llama 4 Scout's text model (three of every four layers chunked local attention over
8,192 tokens, top-1 of 16 experts with a shared expert) and Qwen3-Next-80B-A3B (three of
every four layers gated-delta-rule linear attention with a fixed state a sequence, top-10
of 512 experts with a shared expert). The directory holds the model's config.json, cut to
``--layers`` (its per-layer lists cut with it), and the bench's word-level tokenizer; vLLM
serves it with ``--load-format dummy`` (random weights, random routers: a start's memory
and arming, not a throughput to compare).

    python bench/write_arch_config.py /tmp/llama4-scout-8 --arch llama4-scout --layers 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: the models' own config.json fields (meta-llama/Llama-4-Scout-17B-16E's text_config;
#: Qwen/Qwen3-Next-80B-A3B-Instruct), the bench tokenizer's bos/eos ids (1, 2) in place of
#: theirs
ARCHS: dict[str, dict[str, Any]] = {
    "llama4-scout": {
        "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
        "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
        "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
        "head_dim": 128, "num_local_experts": 16, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1, "vocab_size": 202048, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "attention_chunk_size": 8192, "use_qk_norm": True, "attn_temperature_tuning": True,
        "floor_scale": 8192, "attn_scale": 0.1, "attention_bias": False,
        "max_position_embeddings": 10485760, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    },
    "qwen3-next": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "vocab_size": 151936,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4, "partial_rotary_factor": 0.25,
        "rope_theta": 10000000.0, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    },
}


def config(arch: str, layers: int) -> dict[str, Any]:
    """``arch``'s config cut to ``layers`` layers. Llama 4 keeps its NoPE layer every
    fourth (transformers derives ``no_rope_layers`` from the count) and Qwen3-Next its
    full-attention layer every fourth, so a cut keeps the model's mix of layer kinds; a
    count not a multiple of 4 is refused, since it would not."""
    if arch not in ARCHS:
        raise SystemExit(f"--arch {arch!r}: choose from {', '.join(ARCHS)}")
    if layers < 4 or layers % 4:
        raise SystemExit(f"--layers {layers}: a multiple of 4 (the models' layer pattern)")
    if layers > ARCHS[arch]["num_hidden_layers"]:
        raise SystemExit(f"--layers {layers}: {arch} has {ARCHS[arch]['num_hidden_layers']}")
    return ARCHS[arch] | {"num_hidden_layers": layers}


def write(out: Path, arch: str, layers: int) -> dict[str, Any]:
    """config.json and the bench tokenizer in ``out``; the config written."""
    import e2e_vllm

    cfg = config(arch, layers)
    e2e_vllm.write_model(out, layers, vocab_size=cfg["vocab_size"],
                         context=cfg["max_position_embeddings"])  # the tokenizer
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", required=True, choices=sorted(ARCHS))
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args(argv)
    cfg = write(a.out, a.arch, a.layers)
    print(f"wrote {a.out}: {a.arch}, {cfg['num_hidden_layers']} layers, config only "
          "(serve it with --load-format dummy)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
