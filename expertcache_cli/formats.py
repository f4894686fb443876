"""Weight formats: the tensors one linear layer becomes in vLLM, and the format a model's
config declares.

Sizing must know, for every format users download, what a slot has to hold: the weight
and every tensor indexed by the expert id with it (scales, zero points, biases), at the
dtype vLLM holds them. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import UserError

#: Weight formats we can size. Each maps a [out, in] linear layer to its bytes.
QUANTS = ("bf16", "fp16", "w8a8", "fp8", "fp8-block", "w4a16", "mxfp4", "nvfp4")


@dataclass(frozen=True)
class Tensor:
    """One per-expert tensor as vLLM holds it: name, per-expert shape, dtype, bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    @property
    def aligned(self) -> bool:
        """The gather moves 16 bytes a lane: a per-expert slab must be a multiple of 16."""
        return self.nbytes % 16 == 0


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def linear_tensors(prefix: str, out: int, inp: int, quant: str, group: int = 128) -> list[Tensor]:
    """The tensors of one [out, in] linear layer in weight format ``quant`` (vLLM's layout)."""
    if quant in ("bf16", "fp16"):
        return [Tensor(f"{prefix}_weight", (out, inp), quant, out * inp * 2)]
    if quant in ("w8a8", "fp8"):
        dt = "int8" if quant == "w8a8" else "fp8_e4m3"
        return [
            Tensor(f"{prefix}_weight", (out, inp), dt, out * inp),
            Tensor(f"{prefix}_weight_scale", (out, 1), "fp32", out * 4),
        ]
    if quant == "fp8-block":
        bo, bi = ceil_div(out, 128), ceil_div(inp, 128)
        return [
            Tensor(f"{prefix}_weight", (out, inp), "fp8_e4m3", out * inp),
            Tensor(f"{prefix}_weight_scale_inv", (bo, bi), "fp32", bo * bi * 4),
        ]
    if quant == "w4a16":
        groups = ceil_div(inp, group)
        return [
            Tensor(f"{prefix}_weight_packed", (out, inp // 8), "int32", out * inp // 2),
            Tensor(f"{prefix}_weight_scale", (out, groups), "bf16", out * groups * 2),
        ]
    if quant == "mxfp4":
        return [
            Tensor(f"{prefix}_weight", (out, inp // 2), "uint8", out * inp // 2),
            Tensor(f"{prefix}_weight_scale", (out, inp // 32), "e8m0", out * (inp // 32)),
        ]
    if quant == "nvfp4":  # ModelOpt: e2m1 pairs, an e4m3 scale a 16-block, a global scale
        return [
            Tensor(f"{prefix}_weight", (out, inp // 2), "uint8", out * inp // 2),
            Tensor(f"{prefix}_weight_scale", (out, inp // 16), "fp8_e4m3", out * (inp // 16)),
            Tensor(f"{prefix}_weight_scale_2", (1,), "fp32", 4),
        ]
    raise UserError(f"unknown weight format {quant!r}: choose from {', '.join(QUANTS)}")


def linear_bytes(out: int, inp: int, quant: str) -> int:
    return sum(t.nbytes for t in linear_tensors("x", out, inp, quant))




def quant_from_config(cfg: dict[str, Any]) -> str | None:
    """The weight format a config declares, or None when it declares none (plain dtype).

    Raises UserError for a quantisation scheme we cannot size, naming it, so the user can
    pass ``--quant`` with the nearest format instead of getting a silent wrong answer.
    """
    qc = cfg.get("quantization_config") or cfg.get("compression_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "mxfp4":
        return "mxfp4"
    if method == "modelopt":
        algo = str(qc.get("quant_algo") or (qc.get("quantization") or {}).get("quant_algo")
                   or "").upper()
        if "FP4" in algo:
            return "nvfp4"
        if "FP8" in algo:
            return "fp8"
    if method == "fp8":
        return "fp8-block" if qc.get("weight_block_size") else "fp8"
    if method in ("gptq", "awq", "awq_marlin", "gptq_marlin"):
        if int(qc.get("bits", 4)) == 4:
            return "w4a16"
        if int(qc.get("bits", 4)) == 8:
            return "w8a8"
    if method == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            bits, typ = int(w.get("num_bits", 0)), str(w.get("type", "int"))
            if bits == 8 and typ == "float":
                return "fp8-block" if w.get("strategy") == "block" else "fp8"
            if bits == 8:
                return "w8a8"
            if bits == 4 and typ == "int":
                return "w4a16"
    raise UserError(
        f"cannot size quantization_config with quant_method={method or '?'}: "
        f"pass --quant with one of {', '.join(QUANTS)}"
    )
