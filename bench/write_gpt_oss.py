"""Write a random-weight gpt-oss-20b-shaped MXFP4 checkpoint, as OpenAI ships gpt-oss.

Why: MXFP4 is how gpt-oss (20b and 120b, among the most downloaded MoE models) reaches
users, and it is a different model family from the Qwen3-MoE shape of
`bench/write_checkpoint.py`: biased attention with per-head sinks, alternating sliding and
full attention, a biased router, and experts stored as one 3-D tensor per projection in
the OCP MX layout. `bench/write_checkpoint.py --format mxfp4` calls this module.

The layout (the names vLLM's `GptOssForCausalLM` loader maps): per layer
``mlp.experts.gate_up_proj_blocks`` uint8 [E, 2 I, H / 32, 16] (32 e2m1 codes a block, two
a byte), ``gate_up_proj_scales`` uint8 [E, 2 I, H / 32] (e8m0: 2^(s - 127)),
``gate_up_proj_bias`` bf16 [E, 2 I], and the same for ``down_proj`` [E, H, I / 32, ...];
``mlp.router.weight`` / ``.bias`` and the attention (``q/k/v/o_proj`` with biases,
``sinks``) in bf16, as the checkpoint's ``modules_to_not_convert`` says. Codes are uniform
random nibbles at scale 2^-6 (|w| up to 0.09), routers per-layer seeded N(0, 1) rows with a
zero bias, so each layer routes differently; ``hot`` zeroes all but the first ``hot`` rows.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

OCP_MX_BLOCK = 32  # values a scale covers
E8M0_BIAS = 127
SCALE_EXP = -6  # every block's scale: 2^-6


@dataclass(frozen=True)
class Shape:
    hidden: int = 2880
    inter: int = 2880
    experts: int = 32
    top_k: int = 4
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 64
    sliding_window: int = 128


GPT_OSS_20B = Shape()
TINY = Shape(hidden=256, inter=256, experts=16, top_k=2, heads=4, kv_heads=2, head_dim=64)


def shape() -> Shape:
    """The real gpt-oss-20b shape, or the CPU smoke shape with ``EC_E2E_TINY=1``."""
    return TINY if os.environ.get("EC_E2E_TINY") == "1" else GPT_OSS_20B


def config(s: Shape, layers: int, vocab: int, context: int) -> dict:
    """config.json as gpt-oss-20b's, at ``layers`` layers and the bench tokenizer's ids."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": s.hidden,
        "intermediate_size": s.inter,
        "num_hidden_layers": layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "num_local_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "experts_per_token": s.top_k,
        "layer_types": [("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        "sliding_window": s.sliding_window,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "swiglu_limit": 7.0,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                         "truncate": False},
        "initial_context_length": 4096,
        "max_position_embeddings": context,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
        "router_aux_loss_coef": 0.9,
        "output_router_logits": False,
        "use_cache": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
        },
    }


def normal(gen, *dims: int, std: float = 0.02):
    """N(0, std) bf16 weights drawn from ``gen`` on its device, returned on the CPU (both
    bench checkpoint writers draw every random tensor this way)."""
    import torch

    t = torch.randn(dims, generator=gen, device=gen.device, dtype=torch.float32)
    return (t * std).to(torch.bfloat16).cpu()


def tensors(layers: int, device: str, vocab: int, hot: int = 0, s: Shape | None = None):
    """(name, tensor) pairs in gpt-oss's HF naming, generated on ``device``, on the CPU."""
    import torch

    s = s or shape()
    h, inter, e = s.hidden, s.inter, s.experts
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    g = torch.Generator(device=device).manual_seed(0)

    def bf16(*dims: int, value: float = 0.0) -> torch.Tensor:
        return torch.full(dims, value, dtype=torch.bfloat16)

    def mx(prefix: str, out: int, inp: int):
        """One expert projection [E, out, inp] in MXFP4: blocks, scales, bias."""
        blocks = inp // OCP_MX_BLOCK
        codes = torch.randint(0, 256, (e, out, blocks, OCP_MX_BLOCK // 2), generator=g,
                              device=device, dtype=torch.int32)
        yield f"{prefix}_blocks", codes.to(torch.uint8).cpu()
        yield f"{prefix}_scales", torch.full((e, out, blocks), E8M0_BIAS + SCALE_EXP,
                                             dtype=torch.uint8)
        yield f"{prefix}_bias", bf16(e, out)

    yield "model.embed_tokens.weight", normal(g, vocab, h, std=1.0)
    for i in range(layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", bf16(h, value=1.0)
        yield f"{p}.post_attention_layernorm.weight", bf16(h, value=1.0)
        for name, out, inp in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h),
                               ("o_proj", h, q)):
            yield f"{p}.self_attn.{name}.weight", normal(g, out, inp)
            yield f"{p}.self_attn.{name}.bias", bf16(out)
        yield f"{p}.self_attn.sinks", bf16(s.heads)
        router = torch.Generator(device=device).manual_seed(1000 + i)
        gate = normal(router, e, h, std=1.0)
        if hot:
            gate[hot:] = 0  # as write_checkpoint's --hot: the top-k stay in the first ``hot``
        yield f"{p}.mlp.router.weight", gate
        yield f"{p}.mlp.router.bias", bf16(e)
        yield from mx(f"{p}.mlp.experts.gate_up_proj", 2 * inter, h)
        yield from mx(f"{p}.mlp.experts.down_proj", h, inter)
    yield "model.norm.weight", bf16(h, value=1.0)
    yield "lm_head.weight", normal(g, vocab, h)


def write_config(out: Path, layers: int, vocab: int, context: int,
                 s: Shape | None = None) -> None:
    """config.json (``s``: the shape, default `shape`) and the bench's word-level tokenizer
    (ids 0-2: unk, bos, eos)."""
    import e2e_vllm

    e2e_vllm.write_model(out, layers, vocab_size=vocab, context=context)  # the tokenizer
    (out / "config.json").write_text(json.dumps(config(s or shape(), layers, vocab, context),
                                                indent=1))
