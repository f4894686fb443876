"""How many expert slots fit on a card, and what to tell vLLM (docs/design.md, The sizing model).

Two layers:

* :func:`load_model` turns a preset name, a ``config.json`` path or a model directory into
  a :class:`ModelSize`: MoE layers, experts, top_k, the bytes of one expert in one layer
  (gate+up+down at the weight format, plus scales and biases: everything the cache must
  mirror into a slot), the non-expert weight bytes, and KV bytes per token. A directory's
  safetensors headers, when present, replace the arithmetic with the checkpoint's exact
  tensor sizes.
* :func:`plan` puts a model on a card: ``slots = (VRAM x utilisation - non-expert - KV -
  runtime overhead) / bytes per slot``, the ``--cpu-offload-gb`` that moves every MoE
  layer's experts to the host, the verdict, and the sizing trap
  (``max_num_seqs x top_k > slots`` makes batched decode bypass the cache silently).

Units: VRAM is given in GiB (a "24 GB" card reports 24 GiB), and vLLM's
``--cpu-offload-gb`` is GiB too (vLLM multiplies it by 1024**3). Byte counts are exact.

Nothing here imports torch: sizing must answer on a machine without a GPU.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import budget as rules
from . import capture
from .errors import UserError
from .presets import DEFAULT_PRESET, PRESETS, find_preset

GiB = 1024**3

#: Weight formats we can size. Each maps a [out, in] linear layer to its bytes.
QUANTS = ("bf16", "fp16", "w8a8", "fp8", "fp8-block", "w4a16", "mxfp4")

#: vLLM's `vllm serve` defaults (V1 engine): on cards with >= 70 GiB it raises both.
VLLM_DEFAULT_UTILIZATION = 0.9
_BIG_CARD_GIB = 70

#: Fixed part of the runtime overhead estimate: cuBLAS/NCCL workspaces, the CUDA-graph
#: memory pool and allocator slack. An estimate, not a measurement: --overhead-gb replaces
#: the whole runtime figure with what vLLM's startup log reports on the user's machine.
FIXED_OVERHEAD_BYTES = GiB // 2

_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8,
}


# --------------------------------------------------------------------------- weight formats


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


def _ceil_div(a: int, b: int) -> int:
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
        bo, bi = _ceil_div(out, 128), _ceil_div(inp, 128)
        return [
            Tensor(f"{prefix}_weight", (out, inp), "fp8_e4m3", out * inp),
            Tensor(f"{prefix}_weight_scale_inv", (bo, bi), "fp32", bo * bi * 4),
        ]
    if quant == "w4a16":
        groups = _ceil_div(inp, group)
        return [
            Tensor(f"{prefix}_weight_packed", (out, inp // 8), "int32", out * inp // 2),
            Tensor(f"{prefix}_weight_scale", (out, groups), "bf16", out * groups * 2),
        ]
    if quant == "mxfp4":
        return [
            Tensor(f"{prefix}_weight", (out, inp // 2), "uint8", out * inp // 2),
            Tensor(f"{prefix}_weight_scale", (out, inp // 32), "e8m0", out * (inp // 32)),
        ]
    raise UserError(f"unknown weight format {quant!r}: choose from {', '.join(QUANTS)}")


def linear_bytes(out: int, inp: int, quant: str) -> int:
    return sum(t.nbytes for t in linear_tensors("x", out, inp, quant))


# --------------------------------------------------------------------------- model description


@dataclass
class ModelSize:
    """What sizing needs to know about a model, all in bytes."""

    name: str
    source: str  # "preset", "config" or "checkpoint"
    quant: str
    num_layers: int
    moe_layers: list[int]
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    bytes_per_expert: int  # one expert, one MoE layer: every per-expert tensor
    expert_tensors: list[Tensor]
    non_expert_bytes: int
    kv_bytes_per_token: int  # full-attention layers, every token of a sequence
    kv_window_bytes_per_seq: int  # sliding-window layers: a fixed amount per sequence
    kv_kind: str
    vocab_size: int
    max_position_embeddings: int
    notes: list[str] = field(default_factory=list)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def bytes_per_slot(self) -> int:
        """One slot = one expert id across every MoE layer (the cache's unit of VRAM)."""
        return self.bytes_per_expert * self.num_moe_layers

    @property
    def expert_bytes(self) -> int:
        return self.bytes_per_slot * self.num_experts

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes + self.non_expert_bytes

    @property
    def aligned(self) -> bool:
        return all(t.aligned for t in self.expert_tensors)

    def active_bytes_per_token(self) -> int:
        """Weight bytes one decode token reads: non-expert + top_k experts in each MoE layer."""
        return self.non_expert_bytes + self.top_k * self.bytes_per_slot

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "source": self.source,
            "quant": self.quant,
            "num_layers": self.num_layers,
            "num_moe_layers": self.num_moe_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "bytes_per_expert": self.bytes_per_expert,
            "bytes_per_slot": self.bytes_per_slot,
            "expert_bytes": self.expert_bytes,
            "non_expert_bytes": self.non_expert_bytes,
            "total_bytes": self.total_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_window_bytes_per_seq": self.kv_window_bytes_per_seq,
            "kv_kind": self.kv_kind,
            "expert_tensors": [asdict(t) | {"aligned": t.aligned} for t in self.expert_tensors],
            "aligned": self.aligned,
            "max_position_embeddings": self.max_position_embeddings,
            "notes": list(self.notes),
        }


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


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


def _base_quant(cfg: dict[str, Any]) -> str:
    dt = str(_first(cfg, "torch_dtype", "dtype", default="bfloat16")).lower()
    return "fp16" if dt in ("float16", "fp16", "half") else "bf16"


def _moe_layer_indices(cfg: dict[str, Any], num_layers: int) -> list[int]:
    """Which decoder layers carry routed experts, per each family's config convention."""
    if cfg.get("n_routed_experts"):  # DeepSeek V2/V3, Kimi, GLM-4.5 style
        first = int(cfg.get("first_k_dense_replace", 0) or 0)
        freq = cfg.get("moe_layer_freq", 1)
        if isinstance(freq, list):
            return [i for i in range(num_layers) if i < len(freq) and freq[i]]
        freq = int(freq or 1)
        return [i for i in range(first, num_layers) if i % freq == 0]
    if "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:  # Qwen2/3-MoE
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
    return list(range(num_layers))


def model_from_config(
    cfg: dict[str, Any], name: str, quant: str | None = None, source: str = "config"
) -> ModelSize:
    """Size a model from its config.json contents by arithmetic over the architecture.

    ``quant`` overrides the format; otherwise the config's quantization_config decides, and
    failing that its dtype (bf16/fp16). Embeddings, lm_head, norms and the router always
    stay at 16 bits (every scheme vLLM loads leaves them unquantised); with mxfp4 (gpt-oss)
    only the experts are 4-bit, as its ``modules_to_not_convert`` says.
    """
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers keep the LM inside
        cfg = {**cfg, **cfg["text_config"]}
    notes: list[str] = []
    if quant is None:
        quant = quant_from_config(cfg) or _base_quant(cfg)
    else:
        try:
            declared = quant_from_config(cfg)
        except UserError:  # a scheme we cannot size: the user's --quant stands in for it
            declared = "an unsized scheme"
        quant = quant.lower()
        if quant not in QUANTS:
            raise UserError(f"unknown --quant {quant!r}: choose from {', '.join(QUANTS)}")
        if declared and declared != quant:
            notes.append(f"config declares {declared}; sized as {quant} (--quant)")

    try:
        hidden = int(cfg["hidden_size"])
        layers = int(_first(cfg, "num_hidden_layers", "n_layer", "num_layers"))
        vocab = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(
            f"{name}: config lacks {exc} (needs hidden_size, num_hidden_layers, vocab_size)"
        ) from None
    num_experts = int(
        _first(cfg, "n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts",
               default=0)
    )
    top_k = int(_first(cfg, "num_experts_per_tok", "experts_per_token", "moe_top_k", default=0))
    if num_experts <= 1 or top_k <= 0:
        raise UserError(f"{name}: not a mixture-of-experts model (no routed experts in its config)")
    inter = int(_first(cfg, "moe_intermediate_size", "intermediate_size"))
    dense_inter = int(_first(cfg, "intermediate_size", default=inter))
    heads = int(cfg.get("num_attention_heads", 0))
    kv_heads = int(_first(cfg, "num_key_value_heads", default=heads))
    head_dim = int(_first(cfg, "head_dim", default=hidden // max(heads, 1)))
    mla = cfg.get("kv_lora_rank") is not None
    if mla:  # DeepSeek configs carry a head_dim that does not describe MLA's projections
        head_dim = 0
    moe_layers = _moe_layer_indices(cfg, layers)
    has_expert_bias = cfg.get("model_type") == "gpt_oss" or bool(cfg.get("mlp_bias"))
    # Linear layers outside the experts: quantised too, except under mxfp4 (gpt-oss keeps
    # attention in bf16) and for router/lm_head/embeddings (left in 16 bits by every scheme).
    lin_q = _base_quant(cfg) if quant == "mxfp4" else quant
    b16 = 2

    # -- experts: vLLM fuses gate and up into w13 [2I, H]; down is w2 [H, I]
    tensors = linear_tensors("w13", 2 * inter, hidden, quant) + linear_tensors(
        "w2", hidden, inter, quant
    )
    if has_expert_bias:
        tensors += [
            Tensor("w13_bias", (2 * inter,), "bf16", 2 * inter * b16),
            Tensor("w2_bias", (hidden,), "bf16", hidden * b16),
        ]
    per_expert = sum(t.nbytes for t in tensors)

    # -- attention, per layer
    if mla:
        nope = int(cfg.get("qk_nope_head_dim", 128))
        rope = int(cfg.get("qk_rope_head_dim", 64))
        v_dim = int(cfg.get("v_head_dim", 128))
        kv_rank = int(cfg["kv_lora_rank"])
        q_rank = cfg.get("q_lora_rank")
        attn = 0
        if q_rank:
            attn += linear_bytes(int(q_rank), hidden, lin_q) + int(q_rank) * b16
            attn += linear_bytes(heads * (nope + rope), int(q_rank), lin_q)
        else:
            attn += linear_bytes(heads * (nope + rope), hidden, lin_q)
        attn += linear_bytes(kv_rank + rope, hidden, lin_q) + kv_rank * b16
        attn += linear_bytes(heads * (nope + v_dim), kv_rank, lin_q)
        attn += linear_bytes(hidden, heads * v_dim, lin_q)
        kv_layer = (kv_rank + rope) * b16  # the latent + rope key, one copy (vLLM MLA)
        kv_kind = f"MLA latent {kv_rank}+{rope}"
    else:
        q_out, kv_out = heads * head_dim, kv_heads * head_dim
        attn = linear_bytes(q_out, hidden, lin_q) + 2 * linear_bytes(kv_out, hidden, lin_q)
        attn += linear_bytes(hidden, q_out, lin_q)
        if cfg.get("attention_bias") or cfg.get("qkv_bias"):
            attn += (q_out + 2 * kv_out + (hidden if cfg.get("attention_bias") else 0)) * b16
        mt = str(cfg.get("model_type", ""))
        if mt.startswith("qwen3"):
            attn += 2 * head_dim * b16  # q_norm, k_norm over one head
        elif mt == "olmoe":
            attn += (q_out + kv_out) * b16  # q_norm, k_norm over the whole projection
        if mt == "gpt_oss":
            attn += heads * b16  # attention sinks
        kv_layer = 2 * kv_out * b16
        kv_kind = f"GQA {kv_heads} kv heads x {head_dim}"

    norms = 2 * hidden * b16
    router = num_experts * hidden * b16 + (num_experts * b16 if has_expert_bias else 0)
    shared = 0
    n_shared = int(cfg.get("n_shared_experts") or 0)
    if n_shared:
        shared = _mlp_bytes(hidden, n_shared * inter, lin_q)
    if cfg.get("shared_expert_intermediate_size"):
        shared = _mlp_bytes(hidden, int(cfg["shared_expert_intermediate_size"]), lin_q)
        shared += hidden * b16  # the shared expert's sigmoid gate
    moe_set = set(moe_layers)
    non_expert = vocab * hidden * b16  # embeddings
    if not cfg.get("tie_word_embeddings", False):
        non_expert += vocab * hidden * b16  # lm_head
    non_expert += hidden * b16  # final norm
    for i in range(layers):
        non_expert += attn + norms
        non_expert += router + shared if i in moe_set else _mlp_bytes(hidden, dense_inter, lin_q)

    # -- KV cache: sliding-window layers hold only the window, per sequence
    types = cfg.get("layer_types") or []
    window = int(cfg.get("sliding_window") or 0)
    sliding = sum(1 for t in types if t == "sliding_attention") if window else 0
    kv_tok = (layers - sliding) * kv_layer
    kv_win = sliding * window * kv_layer
    if sliding:
        kv_kind += f", {sliding} of {layers} layers sliding ({window} tokens)"
    if quant == "mxfp4" and inter % 128:
        notes.append("vLLM pads mxfp4 expert widths for its kernels; the real slab may be larger")

    return ModelSize(
        name=name,
        source=source,
        quant=quant,
        num_layers=layers,
        moe_layers=moe_layers,
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=hidden,
        moe_intermediate_size=inter,
        bytes_per_expert=per_expert,
        expert_tensors=tensors,
        non_expert_bytes=non_expert,
        kv_bytes_per_token=kv_tok,
        kv_window_bytes_per_seq=kv_win,
        kv_kind=kv_kind,
        vocab_size=vocab,
        max_position_embeddings=int(_first(cfg, "max_position_embeddings", default=4096)),
        notes=notes,
    )


def _mlp_bytes(hidden: int, inter: int, quant: str) -> int:
    """A gated MLP (gate, up, down) of width ``inter``."""
    return 2 * linear_bytes(inter, hidden, quant) + linear_bytes(hidden, inter, quant)


# --------------------------------------------------------------------------- checkpoints


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file: a little-endian u64 length, then that JSON.

    Only the header is read (a few KiB to MiB), never the tensors, so sizing a 200 GB
    checkpoint on a laptop is instant.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise UserError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 1024 * 1024:
                raise UserError(f"{path}: safetensors header claims {n} bytes; file is damaged")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot read safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: safetensors header is not a JSON object")
    return header


_EXPERT_RE = re.compile(r"layers\.(\d+)\.(?:.*\.)?experts\.")
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


def _tensor_bytes(meta: dict[str, Any]) -> int:
    if "data_offsets" in meta:
        a, b = meta["data_offsets"]
        return int(b) - int(a)
    n = _DTYPE_BYTES.get(str(meta.get("dtype")), 2)
    for d in meta.get("shape", []):
        n *= int(d)
    return n


def model_from_checkpoint(directory: Path, quant: str | None = None) -> ModelSize:
    """Size a local model directory: config.json for the shape, safetensors for exact bytes.

    Expert bytes are the sum of every tensor under ``layers.N.…experts.`` (routed experts;
    shared experts stay with the non-expert weights) divided by the expert count. Tensors
    of layers past ``num_hidden_layers`` (e.g. DeepSeek's multi-token-prediction layer) are
    not loaded by vLLM for plain serving and are left out, with a note.
    """
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise UserError(f"{directory}: no config.json in this directory")
    cfg = _read_config(cfg_path)
    model = model_from_config(cfg, directory.name, quant, source="config")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        model.notes.append("no safetensors in the directory: sizes computed from config.json")
        return model
    if quant is not None and quant_from_config(cfg) != quant:
        model.notes.append("--quant overrides the checkpoint: sizes computed from config.json")
        return model
    per_layer: dict[int, int] = {}
    non_expert = 0
    skipped = 0
    for f in files:
        for tname, meta in read_safetensors_header(f).items():
            if tname == "__metadata__" or not isinstance(meta, dict):
                continue
            nbytes = _tensor_bytes(meta)
            lm = _LAYER_RE.search(tname)
            if lm and int(lm.group(1)) >= model.num_layers:
                skipped += nbytes
                continue
            em = _EXPERT_RE.search(tname)
            if em and "shared_expert" not in tname:
                layer = int(em.group(1))
                per_layer[layer] = per_layer.get(layer, 0) + nbytes
            else:
                non_expert += nbytes
    if not per_layer:
        model.notes.append("no routed-expert tensors found in safetensors: sizes from config.json")
        return model
    sizes = sorted(set(per_layer.values()))
    biggest = sizes[-1]
    if len(sizes) > 1:
        model.notes.append(
            f"expert bytes differ across layers ({len(sizes)} sizes): using the largest"
        )
    on_disk = _ceil_div(biggest, model.num_experts)
    if model.bytes_per_expert > on_disk and model.quant in ("w8a8", "fp8", "fp8-block"):
        # vLLM holds these scales as fp32 whatever the file stores (often bf16): a slot
        # holds what vLLM holds, so the arithmetic over vLLM's layout is the slot's size
        model.notes.append(
            f"one expert is {on_disk:,} B on disk and {model.bytes_per_expert:,} B as vLLM "
            "holds it (fp32 scales): slots sized at vLLM's"
        )
    else:
        model.bytes_per_expert = on_disk
    if biggest % model.num_experts:
        model.notes.append("expert tensors do not divide evenly by the expert count")
    model.moe_layers = sorted(per_layer)
    model.non_expert_bytes = non_expert
    model.source = "checkpoint"
    if skipped:
        model.notes.append(f"{skipped} bytes of layers past num_hidden_layers not counted")
    return model


# --------------------------------------------------------------------------- resolving --model


def _read_config(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: a config.json must hold a JSON object")
    return cfg


def load_model(spec: str | Path | None = None, quant: str | None = None) -> ModelSize:
    """A preset name / HF id, a config.json path, or a model directory -> :class:`ModelSize`."""
    if spec is None or str(spec) == "":
        spec = DEFAULT_PRESET
    path = Path(str(spec)).expanduser()
    if path.is_dir():
        return model_from_checkpoint(path, quant)
    if path.is_file():
        name = path.parent.name if path.name == "config.json" else path.stem
        return model_from_config(_read_config(path), name, quant)
    preset = find_preset(str(spec))
    if preset is None:
        if str(spec).endswith(".json") or str(spec).startswith(("/", ".", "~")):
            raise UserError(f"{spec}: no such file or directory")
        raise UserError(
            f"unknown model {spec!r}: give a config.json, a model directory or one of "
            f"{', '.join(PRESETS)}"
        )
    m = model_from_config(preset.config, preset.name, quant or preset.quant, source="preset")
    return m


# --------------------------------------------------------------------------- vLLM flags

#: vLLM flags that change a plan, and the `plan` keyword (and type) each one feeds. Every
#: caller that passes a user's vLLM arguments through (`serve`, `baseline`) reads them here.
VLLM_PLAN_FLAGS: dict[str, tuple[str, type]] = {
    "--max-model-len": ("max_model_len", int),
    "--max-num-seqs": ("max_num_seqs", int),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int),
    "--kv-cache-dtype": ("kv_cache_dtype", str),
}


def vllm_flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``--flag V`` or ``--flag=V`` in ``args`` (last one wins), else None."""
    value = None
    for i, a in enumerate(args):
        if a == flag:
            if i + 1 >= len(args):
                raise UserError(f"vLLM argument {flag} has no value")
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def plan_kwargs_from_vllm_args(args: Sequence[str]) -> dict[str, Any]:
    """The keyword arguments for `plan` found among a user's vLLM flags (the CUDA-graph
    settings always: they decide how a decode batch is padded)."""
    out: dict[str, Any] = {"graphs": capture.settings_from_vllm_args(args)}
    for flag, (key, kind) in VLLM_PLAN_FLAGS.items():
        raw = vllm_flag_value(args, flag)
        if raw is None:
            continue
        try:
            out[key] = kind(raw)
        except ValueError:
            raise UserError(
                f"vLLM argument {flag} {raw!r} is not a valid {kind.__name__}"
            ) from None
    return out


# --------------------------------------------------------------------------- the plan


def vllm_defaults(vram_gib: float) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) that `vllm serve` picks on a card this big."""
    return (1024, 8192) if vram_gib >= _BIG_CARD_GIB else (256, 2048)


def runtime_overhead_bytes(model: ModelSize, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """What vLLM holds besides weights and KV: an estimate, overridable with --overhead-gb.

    Fixed workspaces and graph pool, the sampler's fp32 logits and probabilities for
    ``max_num_seqs`` rows of the vocabulary, and the peak activations of one prefill chunk
    of ``max_num_batched_tokens`` (residual stream copies plus the fused-MoE scratch of
    top_k gate/up/down rows per token), all at 16 bits.
    """
    logits = max_num_seqs * model.vocab_size * 4 * 2
    per_tok = 2 * (8 * model.hidden_size
                   + model.top_k * (3 * model.moe_intermediate_size + model.hidden_size))
    return FIXED_OVERHEAD_BYTES + logits + max_num_batched_tokens * per_tok


def _card_budget(
    vram_gb: float, device_total_gib: float | None, utilization: float | None
) -> tuple[float, float, float, int, list[str]]:
    """(card GiB, GPU GiB, vLLM's utilization, budget bytes, notes) for `plan`.

    vLLM's utilization is a fraction of the GPU it runs on. On the card itself that is
    the card; on a bigger GPU the card is a share of it, so the card's 0.9 becomes
    ``0.9 x card / GPU`` (floored to 4 places), and a utilization the user gave is
    vLLM's, of the GPU, and may not ask for more than the card.
    """
    notes: list[str] = []
    device = float(device_total_gib) if device_total_gib else vram_gb
    if device < vram_gb:
        notes.append(f"this GPU has {device:.2f} GiB, less than --vram {vram_gb:g}: "
                     f"sized for {device:.2f} GiB")
        vram_gb = device
    if utilization is None and device == vram_gb:
        utilization = VLLM_DEFAULT_UTILIZATION
    if utilization is None:
        budget = int(vram_gb * GiB * VLLM_DEFAULT_UTILIZATION)
        utilization = math.floor(budget / (device * GiB) * 1e4) / 1e4
    else:
        budget = int(device * GiB * utilization)
        if budget > vram_gb * GiB * (1 + 1e-9):
            raise UserError(
                f"--gpu-memory-utilization {utilization:g} of this {device:.2f} GiB GPU is "
                f"{budget / GiB:.2f} GiB, more than --vram {vram_gb:g}: leave the "
                "utilization out and it is planned for the card"
            )
    if device > vram_gb:
        notes.append(f"a {vram_gb:g} GiB share of a {device:.2f} GiB GPU: vLLM gets "
                     f"--gpu-memory-utilization {utilization:g} ({budget / GiB:.2f} GiB)")
    return vram_gb, device, utilization, budget, notes


@dataclass
class SizePlan:
    """A model on a card: the slot budget, the vLLM flags, the verdict, the trap."""

    model: str
    quant: str
    num_experts: int
    top_k: int
    num_moe_layers: int
    bytes_per_expert: int
    bytes_per_slot: int
    expert_bytes: int
    non_expert_bytes: int
    kv_bytes_per_token: int
    vram_gib: float
    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_reserved_bytes: int
    overhead_bytes: int
    budget_bytes: int  # VRAM x utilisation
    slot_budget_bytes: int  # what is left for expert slots
    max_slots: int  # slots that fit (capped at num_experts)
    slots: int  # slots planned (max_slots unless forced)
    fits_outright: bool
    verdict: str  # fits_outright | cache | offload_no_cache | does_not_fit
    verdict_text: str
    cpu_offload_gb: int
    trap: bool
    trap_ids: int  # padded_batch x top_k: routing ids of the widest batched decode step
    safe_max_num_seqs: int  # the largest max_num_seqs that keeps decode on the cache
    padded_batch: int  # tokens of a full decode batch once vLLM pads it to a CUDA graph
    graphs: str  # where the capture sizes came from (flags, defaults, eager)
    device_total_gib: float  # the GPU vLLM runs on (= vram_gib unless told otherwise)
    utilization_to_fit_outright: float | None
    aligned: bool
    notes: list[str] = field(default_factory=list)

    @property
    def shares_device(self) -> bool:
        """The card is a share of a bigger GPU (another tenant, or an emulated small card)."""
        return self.device_total_gib > self.vram_gib

    def vllm_args(self) -> list[str]:
        """The flags to pass to `vllm serve` for this plan.

        On a share of a bigger GPU, vLLM would pick its batch defaults for that GPU
        (8192 batched tokens on >= 70 GiB) and profile a wider step than planned, so the
        card's default is passed too.
        """
        args = [
            "--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}",
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
        ]
        if self.shares_device:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if not self.fits_outright and self.verdict in ("cache", "offload_no_cache"):
            args += ["--cpu-offload-gb", str(self.cpu_offload_gb)]
            args += ["--cpu-offload-params", "experts"]
        return args

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["vllm_args"] = self.vllm_args()
        return d


def plan(
    model_spec: str | Path | ModelSize | None = None,
    vram_gb: float = 24.0,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    gpu_memory_utilization: float | None = None,
    slots: int | None = None,
    fraction: float | None = None,
    *,
    quant: str | None = None,
    max_num_batched_tokens: int | None = None,
    kv_cache_dtype: str = "auto",
    kv_tokens: int | None = None,
    overhead_gb: float | None = None,
    graphs: capture.GraphSettings | None = None,
    device_total_gib: float | None = None,
) -> SizePlan:
    """Size the cache for ``model_spec`` on a ``vram_gb`` GiB card (docs/design.md, sizing).

    Defaults are vLLM's: ``max_model_len`` = the model's context, ``max_num_seqs`` and
    ``max_num_batched_tokens`` as `vllm serve` chooses for the card, utilisation 0.9.
    The KV reservation is ``kv_tokens`` (default ``max_model_len``: the one full-length
    sequence vLLM insists on before it starts) at the model's KV bytes per token.
    ``slots`` or ``fraction`` (of the experts) force the slot count instead of the largest
    that fits; the verdict then says whether that forced count fits.

    ``device_total_gib`` is the GPU vLLM will run on, when it is known and is not the
    card itself (``serve`` and ``baseline`` read it from the GPU): vLLM's
    ``--gpu-memory-utilization`` is a fraction of that GPU, so on a bigger one the card
    is a share of it. Then the planned utilisation (0.9 of the card by default) becomes
    ``0.9 x vram / device`` for vLLM, and a utilisation the user gave is taken as vLLM
    takes it, of the device. A GPU smaller than ``vram_gb`` is sized as what it is.
    ``graphs`` are the CUDA-graph settings (default: vLLM's, for the installed release):
    a decode batch is padded to the next capture size, and the trap counts padded ids.
    """
    model = model_spec if isinstance(model_spec, ModelSize) else load_model(model_spec, quant)
    if not vram_gb or vram_gb <= 0:
        raise UserError(f"--vram must be positive GiB, got {vram_gb}")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise UserError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    vram_gb, device, gpu_memory_utilization, budget, notes_device = _card_budget(
        float(vram_gb), device_total_gib, gpu_memory_utilization)
    graphs = graphs if graphs is not None else capture.settings_from_vllm_args([])
    if slots is not None and fraction is not None:
        raise UserError("give --slots or --fraction, not both")
    if fraction is not None:
        try:
            rules.check_fraction(fraction)
        except ValueError as exc:
            raise UserError(f"--fraction: {exc}") from None
    if slots is not None and not 0 <= slots <= model.num_experts:
        raise UserError(f"--slots must be between 0 and {model.num_experts} (the expert count)")
    if slots is not None and rules.MAX_SLOTS < slots < model.num_experts:
        raise UserError(f"--slots {slots}: the cache kernel holds at most {rules.MAX_SLOTS} "
                        "slots a layer")
    d_seqs, d_batched = vllm_defaults(vram_gb)
    max_model_len = int(max_model_len or model.max_position_embeddings)
    max_num_seqs = int(max_num_seqs or d_seqs)
    max_num_batched_tokens = int(max_num_batched_tokens or max(d_batched, 1))
    if max_model_len <= 0 or max_num_seqs <= 0:
        raise UserError("--max-model-len and --max-num-seqs must be positive")
    kv_scale = {"auto": 1.0, "bf16": 1.0, "fp16": 1.0, "fp8": 0.5, "fp8_e4m3": 0.5,
                "fp8_e5m2": 0.5}.get(kv_cache_dtype.lower())
    if kv_scale is None:
        raise UserError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}: auto, fp8")
    kv_tokens = int(kv_tokens or max_model_len)
    kv_per_tok = int(model.kv_bytes_per_token * kv_scale)
    seqs_for_window = max(1, min(max_num_seqs, kv_tokens // max(1, max_model_len)))
    kv_reserved = kv_tokens * kv_per_tok + int(
        model.kv_window_bytes_per_seq * kv_scale * seqs_for_window
    )
    overhead = (
        int(overhead_gb * GiB)
        if overhead_gb is not None
        else runtime_overhead_bytes(model, max_num_seqs, max_num_batched_tokens)
    )
    resident_need = model.non_expert_bytes + kv_reserved + overhead
    slot_budget = budget - resident_need
    per_slot = model.bytes_per_slot
    max_slots = max(0, min(model.num_experts, slot_budget // per_slot)) if slot_budget > 0 else 0
    fits_outright = slot_budget >= model.expert_bytes
    # fitting outright is a question about the card (at most 0.99 of it), answered in
    # vLLM's terms: a fraction of the GPU it runs on
    need_card = (resident_need + model.expert_bytes) / (vram_gb * GiB)
    util_fit = None
    if need_card <= 0.99:
        util_fit = (math.ceil(need_card * vram_gb / device * 1e4) / 1e4 if device > vram_gb
                    else round(math.ceil(need_card * 100) / 100, 2))

    forced = slots is not None or fraction is not None
    if fraction is not None:
        slots = rules.slots_from_fraction(fraction, model.num_experts)
    planned = int(slots) if forced else max_slots
    notes = list(model.notes) + notes_device
    E, k = model.num_experts, model.top_k
    if forced and planned == E:
        fits_outright = slot_budget >= model.expert_bytes
    gib = lambda b: b / GiB  # noqa: E731

    if slot_budget < 0:
        verdict = "does_not_fit"
        text = (
            f"does not fit even with offload: non-expert weights {gib(model.non_expert_bytes):.2f}"
            f" + KV {gib(kv_reserved):.2f} + runtime {gib(overhead):.2f} GiB exceed the "
            f"{gib(budget):.2f} GiB budget"
        )
        planned = 0
        fits_outright = False
    elif fits_outright and (not forced or planned == E):
        verdict, planned = "fits_outright", E
        text = (
            f"fits outright: all {E} experts ({gib(model.expert_bytes):.2f} GiB) stay in VRAM "
            f"with {gib(slot_budget - model.expert_bytes):.2f} GiB to spare; no offload, no cache"
        )
    elif forced and planned * per_slot > slot_budget:
        verdict = "does_not_fit"
        text = (
            f"{planned} slots need {gib(planned * per_slot):.2f} GiB but only "
            f"{gib(slot_budget):.2f} GiB is left after non-expert weights, KV and runtime "
            f"(at most {max_slots} slots)"
        )
        fits_outright = False
    elif planned < k:
        verdict = "offload_no_cache"
        text = (
            f"runs only fully offloaded: room for {planned} slots, fewer than top_k={k}, so "
            "not even one token's experts fit; no cache"
        )
        planned = 0
    else:
        verdict = "cache"
        if planned > rules.slot_limit(E):
            planned = rules.slot_limit(E)
            notes.append(f"the cache kernel holds at most {rules.MAX_SLOTS} slots a layer: "
                         f"planned {planned}, though more fit")
        text = f"cache at {planned} of {E} slots ({100 * planned / E:.0f}% of the experts)"
        if util_fit is not None and util_fit > gpu_memory_utilization and not forced:
            text += f"; fits outright with --gpu-memory-utilization {util_fit:g}"

    widest = capture.padded_batch(max_num_seqs, max_num_batched_tokens, graphs)
    trap_ids = widest * k
    trap = verdict == "cache" and trap_ids > planned
    safe = (capture.safe_max_num_seqs(planned, k, max_num_batched_tokens, graphs)
            if verdict == "cache" else 0)
    if trap:
        notes.append(rules.trap_text(max_num_seqs, widest, k, planned, safe, graphs.source))
    if not model.aligned:
        bad = [t.name for t in model.expert_tensors if not t.aligned]
        notes.append(f"per-expert tensors not a multiple of 16 bytes ({', '.join(bad)}): "
                     "the cache refuses this layer")
    if (verdict in ("cache", "offload_no_cache") and not forced and max_model_len > 8192
            and kv_tokens == max_model_len and kv_reserved > budget // 10):
        short = plan(model, vram_gb, 8192, max_num_seqs, gpu_memory_utilization,
                     max_num_batched_tokens=max_num_batched_tokens,
                     kv_cache_dtype=kv_cache_dtype, overhead_gb=overhead_gb, graphs=graphs,
                     device_total_gib=device)
        notes.append(
            f"KV for one {max_model_len}-token sequence takes {gib(kv_reserved):.2f} GiB; "
            f"--max-model-len 8192 leaves room for {short.slots} slots ({short.verdict})"
        )
    offload = math.ceil(model.expert_bytes / GiB + 0.5) if verdict in (
        "cache", "offload_no_cache") else 0

    return SizePlan(
        model=model.name,
        quant=model.quant,
        num_experts=E,
        top_k=k,
        num_moe_layers=model.num_moe_layers,
        bytes_per_expert=model.bytes_per_expert,
        bytes_per_slot=per_slot,
        expert_bytes=model.expert_bytes,
        non_expert_bytes=model.non_expert_bytes,
        kv_bytes_per_token=kv_per_tok,
        vram_gib=float(vram_gb),
        gpu_memory_utilization=float(gpu_memory_utilization),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_reserved_bytes=kv_reserved,
        overhead_bytes=overhead,
        budget_bytes=budget,
        slot_budget_bytes=slot_budget,
        max_slots=max_slots,
        slots=planned,
        fits_outright=verdict == "fits_outright",
        verdict=verdict,
        verdict_text=text,
        cpu_offload_gb=offload,
        trap=trap,
        trap_ids=trap_ids,
        safe_max_num_seqs=safe,
        padded_batch=widest,
        graphs=graphs.source,
        device_total_gib=device,
        utilization_to_fit_outright=util_fit,
        aligned=model.aligned,
        notes=notes,
    )


#: Cards the no-``--vram`` table shows: common VRAM sizes in GiB.
COMMON_CARDS: list[tuple[str, float]] = [
    ("16 GiB", 16),
    ("24 GiB", 24),
    ("32 GiB", 32),
    ("40 GiB", 40),
    ("48 GiB", 48),
    ("80 GiB", 80),
    ("141 GiB", 141),
]
