"""Weight formats: the tensors one linear layer becomes in vLLM, and the format a model's
config declares.

Sizing must know, for every format users download, what a slot has to hold: the weight
and every tensor indexed by the expert id with it (scales, zero points, biases), at the
dtype vLLM holds them. The 4-bit formats run on vLLM's Marlin experts on NVIDIA GPUs,
which repack and pad them when the model loads: `marlin_expert_tensors` is what vLLM holds
then (read in vLLM 0.26.0 and 0.33.0), and what the cache mirrors. Nothing here imports
torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import UserError

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
        return self.nbytes % SLAB_ALIGN == 0


#: the gather's unit: a per-expert slab it moves must be a multiple of these bytes
SLAB_ALIGN = 16
#: most bytes an expert's ragged tensors (slabs not a multiple of 16: NVFP4's per-expert
#: global scales) may take together: the plugin packs them into one side row of the layer
#: (`plugin.small`), gathered with the weights; more is declined (the path is for scales)
SIDE_ROW_LIMIT = 256

#: the packed side row's name among a layer's slot buffers (no vLLM parameter is named so)
SIDE_ROW = "_expertcache_small_row"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def side_row_bytes(sizes: list[int]) -> int:
    """Bytes of the packed side row that carries ragged tensors of ``sizes`` bytes."""
    return round_up(sum(int(s) for s in sizes), SLAB_ALIGN) if sizes else 0


def gather_slabs(tensors: list[Tensor]) -> list[tuple[str, int]]:
    """(name, bytes an expert) of each slab the gather moves for these tensors, as the plugin
    lays them out: every aligned tensor its own slab, the ragged ones packed into one side
    row (`SIDE_ROW`), so that a probe times the step the plugin runs, not one the gather
    refuses."""
    slabs = [(t.name, t.nbytes) for t in tensors if t.aligned]
    ragged = [t.nbytes for t in tensors if not t.aligned]
    if ragged:
        slabs.append((SIDE_ROW, side_row_bytes(ragged)))
    return slabs


def slot_bytes(tensors: list[Tensor]) -> int:
    """VRAM one expert's slot takes for these tensors, as the plugin lays it out: every
    aligned slab, and the ragged ones twice (their packed side row and the compact copy
    the kernel reads)."""
    ragged = sum(t.nbytes for t in tensors if not t.aligned)
    return sum(n for _, n in gather_slabs(tensors)) + ragged


def ragged_refusal(tensors: list[Tensor]) -> str | None:
    """Why the gather cannot move these tensors (ragged ones past `SIDE_ROW_LIMIT`), or
    None when every one travels: as a slab, or in the packed side row."""
    ragged = [t for t in tensors if not t.aligned]
    total = sum(t.nbytes for t in ragged)
    if total <= SIDE_ROW_LIMIT:
        return None
    names = ", ".join(t.name for t in ragged)
    return (f"per-expert tensors ({names}) are not multiples of 16 bytes and take {total} "
            f"bytes an expert, more than the {SIDE_ROW_LIMIT} the cache packs into its side "
            "row")


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


# --------------------------------------------------------------------------- Marlin

#: formats vLLM 0.26-0.33 runs on its Marlin experts on NVIDIA GPUs up to Hopper: 4-bit
#: integer (GPTQ, AWQ, compressed-tensors W4A16), MXFP4 (gpt-oss, offloaded with
#: ``--moe-backend marlin``), NVFP4 (weight-only); held repacked and padded
MARLIN_QUANTS = ("w4a16", "mxfp4", "nvfp4")
#: vLLM releases whose Marlin layout differs for GPTQ: 0.26 keeps the checkpoint's zero
#: points unprocessed in the model's dtype and act order's g_idx; 0.33 repacks the zero
#: points as int32 and refuses act order
MARLIN_LAYOUTS = ("0.26", "0.33")


@dataclass(frozen=True)
class Wna16Scheme:
    """How a 4-bit integer checkpoint quantised its experts, as far as what vLLM holds of
    them depends on it."""

    method: str = "compressed-tensors"  # "gptq", "awq" or "compressed-tensors"
    group: int = 128  # inputs per scale; -1: one scale per output channel
    zero_points: bool = False  # asymmetric
    act_order: bool = False  # GPTQ desc_act / compressed-tensors actorder "group"


def wna16_scheme(cfg: dict[str, Any]) -> Wna16Scheme:
    """The scheme a config's quantization_config declares (RedHat's compressed-tensors
    W4A16 defaults, group 128 symmetric, where it declares none)."""
    qc = cfg.get("quantization_config") or cfg.get("compression_config") or {}
    method = str(qc.get("quant_method", "")).lower()
    if method in ("gptq", "gptq_marlin"):
        return Wna16Scheme("gptq", int(qc.get("group_size", 128) or 128),
                           not bool(qc.get("sym", True)), bool(qc.get("desc_act", False)))
    if method in ("awq", "awq_marlin"):
        return Wna16Scheme("awq", int(qc.get("group_size", 128) or 128),
                           bool(qc.get("zero_point", True)))
    if method == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            if int(w.get("num_bits", 0)) == 4:
                size = w.get("group_size")
                return Wna16Scheme("compressed-tensors",
                                   int(size) if size else -1,
                                   not bool(w.get("symmetric", True)),
                                   str(w.get("actorder") or "") == "group")
    return Wna16Scheme()


def marlin_layout(version: tuple[int, int] | None) -> str:
    """Which of `MARLIN_LAYOUTS` a vLLM release holds GPTQ experts in (None, no vLLM
    here: the newest)."""
    return MARLIN_LAYOUTS[0] if version is not None and version <= (0, 26) else \
        MARLIN_LAYOUTS[-1]


def marlin_intermediate(quant: str, hidden: int, inter: int, group: int = 128,
                        act_order: bool = False) -> int:
    """The expert intermediate size vLLM's Marlin path pads to: its thread tiles need 64
    (and a whole number of scale groups) for the integer formats
    (``marlin_moe_padded_intermediate``; act order is never padded), 64 or 128 for NVFP4
    (128 where the hidden size is not a multiple of 128), 128 for MXFP4."""
    if quant == "w4a16":
        if act_order:
            return inter
        return round_up(inter, math.lcm(64, group if group > 0 else 1))
    if quant == "nvfp4":
        return round_up(inter, 64 if hidden % 128 == 0 else 128)
    if quant == "mxfp4":
        return round_up(inter, 128)
    raise UserError(f"{quant} does not run on vLLM's Marlin experts")


def marlin_hidden(quant: str, hidden: int) -> int:
    """The expert hidden size vLLM pads to on Marlin: MXFP4 only, to 256 (gpt-oss's
    2,880 becomes 3,072)."""
    return round_up(hidden, 256) if quant == "mxfp4" else hidden


def marlin_expert_tensors(quant: str, hidden: int, inter: int, *,
                          scheme: Wna16Scheme | None = None, bias: bool = False,
                          layout: str = MARLIN_LAYOUTS[-1]) -> list[Tensor]:
    """One expert's tensors as vLLM holds them after its Marlin weight processing (0.26
    and 0.33: ``oracle/int_wna16.py``, ``utils/marlin_utils_fp4.py``): 4-bit weights
    repacked into Marlin's int32 tiles (K/16 rows of 2N int32, the same bytes), the widths
    padded (`marlin_intermediate`, `marlin_hidden`), scales in the model's 16-bit dtype
    (int4) or fp8 (NVFP4: e4m3 a 16-block, MXFP4: e8m0 a 32-block), zero points, act
    order's indices, NVFP4's float32 per-expert global scales, biases (gpt-oss)."""
    h, w16 = marlin_hidden(quant, hidden), 2
    t: list[Tensor] = []
    if quant == "w4a16":
        sc = scheme or Wna16Scheme()
        act = sc.act_order and layout == "0.26"
        i = marlin_intermediate(quant, hidden, inter, sc.group, act)
        g13 = h // sc.group if sc.group > 0 else 1
        g2 = i // sc.group if sc.group > 0 else 1
        ct = sc.method == "compressed-tensors"
        q, s = ("weight_packed", "weight_scale") if ct else ("qweight", "scales")
        t += [Tensor(f"w13_{q}", (h // 16, 4 * i), "int32", h * i),
              Tensor(f"w2_{q}", (i // 16, 2 * h), "int32", i * h // 2),
              Tensor(f"w13_{s}", (g13, 2 * i), "bf16", g13 * 2 * i * w16),
              Tensor(f"w2_{s}", (g2, h), "bf16", g2 * h * w16)]
        if sc.method == "gptq" and layout == "0.26":
            # kept as loaded, in the model's dtype and unpadded: 0.26 never repacks them
            g2_raw = inter // sc.group if sc.group > 0 else 1
            t += [Tensor("w13_qzeros", (g13, 2 * inter // 8), "bf16", g13 * 2 * inter // 8 * w16),
                  Tensor("w2_qzeros", (g2_raw, h // 8), "bf16", g2_raw * h // 8 * w16)]
        elif sc.method in ("gptq", "awq") or sc.zero_points:
            z = "qzeros" if not ct else "weight_zero_point"
            t += [Tensor(f"w13_{z}", (g13, 2 * i // 8), "int32", g13 * 2 * i // 8 * 4),
                  Tensor(f"w2_{z}", (g2, h // 8), "int32", g2 * h // 8 * 4)]
        if act:
            gi = "weight_g_idx" if ct else "g_idx"
            t += [Tensor(f"w13_{gi}", (h,), "int32", 4 * h),
                  Tensor("w13_g_idx_sort_indices", (h,), "int32", 4 * h),
                  Tensor(f"w2_{gi}", (i,), "int32", 4 * i),
                  Tensor("w2_g_idx_sort_indices", (i,), "int32", 4 * i)]
    elif quant == "nvfp4":
        i = marlin_intermediate(quant, hidden, inter)
        t += [Tensor("w13_weight", (h // 16, 4 * i), "int32", h * i),
              Tensor("w13_weight_scale", (h // 16, 2 * i), "fp8_e4m3", h * 2 * i // 16),
              Tensor("w13_weight_scale_2", (), "fp32", 4),
              Tensor("w2_weight", (i // 16, 2 * h), "int32", i * h // 2),
              Tensor("w2_weight_scale", (i // 16, h), "fp8_e4m3", i * h // 16),
              Tensor("w2_weight_scale_2", (), "fp32", 4)]
    elif quant == "mxfp4":
        i = marlin_intermediate(quant, hidden, inter)
        t += [Tensor("w13_weight", (h // 16, 4 * i), "int32", h * i),
              Tensor("w13_weight_scale", (h // 32, 2 * i), "e8m0", h * 2 * i // 32),
              Tensor("w2_weight", (i // 16, 2 * h), "int32", i * h // 2),
              Tensor("w2_weight_scale", (i // 32, h), "e8m0", i * h // 32)]
    else:
        raise UserError(f"{quant} does not run on vLLM's Marlin experts")
    if bias:
        t += [Tensor("w13_bias", (2 * i,), "bf16", 2 * i * w16),
              Tensor("w2_bias", (h,), "bf16", h * w16)]
    return t



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
