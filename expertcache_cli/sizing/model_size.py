"""What sizing needs to know about a model, read from a preset, a ``config.json``, a model
directory or a Hugging Face id.

`load_model` turns a preset name, a ``config.json`` path, a model directory or a Hub id
(`hub`: the local Hugging Face cache, else the Hub's config.json) into a
`ModelSize`: MoE layers, experts, top_k, the bytes of one expert in one layer (every
tensor the cache must mirror into a slot, as vLLM holds it), the non-expert weight bytes,
and KV bytes per token. A directory's safetensors headers, when present, replace the
arithmetic with the checkpoint's exact tensor sizes (only the headers are read, never a
tensor). Nothing here imports torch.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..vllm_facts import installed_vllm
from . import formats, hub, rotary
from .cards import GiB, MiB
from .formats import QUANTS, Tensor, ceil_div, linear_bytes, linear_tensors, quant_from_config
from .hybrid_pages import MAMBA_DTYPE_BYTES, LinearState
from .presets import DEFAULT_PRESET, PRESETS, find_preset

_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8,
}


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
    #: KV heads (GQA; 0 for MLA, whose latent every tensor-parallel rank keeps whole)
    kv_heads: int = 0
    #: attention (query) heads; 0 where unknown
    attention_heads: int = 0
    #: tensor-parallel ranks the figures are per (1: the whole model)
    tensor_parallel: int = 1
    #: config.json's ``architectures``: vLLM's per-model config may change how it serves
    #: (gpt-oss raises the CUDA-graph capture ceiling, `capture.for_model`)
    architectures: tuple[str, ...] = ()
    #: linear-attention layers (Qwen3-Next, Qwen3.5): a fixed state a sequence, whatever
    #: its length and the KV cache's dtype (vLLM's state dtypes: `with_state_dtypes`)
    state_bytes_per_seq: int = 0
    #: what that state is made of, so vLLM's ``--mamba-*-cache-dtype`` flags re-price it
    linear_state: LinearState | None = None
    #: sliding-window layers and their window (tokens): ``kv_window_bytes_per_seq`` is
    #: their window's KV; vLLM holds more (`sizing.window_reserve`)
    window_layers: int = 0
    sliding_window: int = 0
    #: chunked local-attention layers (Llama 4's RoPE layers) and their chunk (tokens):
    #: ``kv_chunk_bytes_per_seq`` is their chunk's KV; vLLM holds more
    #: (`sizing.chunk_reserve`)
    chunked_layers: int = 0
    attention_chunk: int = 0
    kv_chunk_bytes_per_seq: int = 0
    #: vLLM's rotary cos/sin caches (`rotary.rope_cache_bytes`): VRAM beside the weights
    #: that no checkpoint holds; every tensor-parallel rank keeps them whole
    rope_cache_bytes: int = 0

    def per_rank(self, tp: int) -> ModelSize:
        """The share one of ``tp`` tensor-parallel GPUs holds.

        vLLM shards every expert across the ranks (w13 along its output, w2 along its
        input), so a slot on one GPU holds 1/tp of an expert: bytes per slot and the
        offload divide by tp. Attention, embeddings and the LM head are sharded too
        (norms and the router are small and replicated: counted sharded, within a few
        MiB); the KV cache splits by KV head, down to one head a rank (MLA: not split).
        """
        import dataclasses

        if tp <= 1:
            return self
        why = self.tensor_parallel_refusal(tp)
        if why:
            raise UserError(why)
        kv_split = max(1, min(tp, self.kv_heads)) if self.kv_heads else 1
        tensors = [Tensor(t.name, t.shape, t.dtype, ceil_div(t.nbytes, tp))
                   for t in self.expert_tensors]
        linear = self.linear_state.per_rank(tp, kv_split) if self.linear_state else None
        return dataclasses.replace(
            self,
            bytes_per_expert=sum(t.nbytes for t in tensors),
            expert_tensors=tensors,
            non_expert_bytes=ceil_div(self.non_expert_bytes, tp),
            kv_bytes_per_token=ceil_div(self.kv_bytes_per_token, kv_split),
            kv_window_bytes_per_seq=ceil_div(self.kv_window_bytes_per_seq, kv_split),
            kv_chunk_bytes_per_seq=ceil_div(self.kv_chunk_bytes_per_seq, kv_split),
            state_bytes_per_seq=(linear.bytes_per_seq if linear
                                 else ceil_div(self.state_bytes_per_seq, tp)),
            linear_state=linear,
            tensor_parallel=tp,
            notes=[*self.notes, f"per GPU of {tp} (tensor parallel): experts, attention and "
                                f"embeddings sharded, KV split over {kv_split} rank(s)"],
        )

    def _splits(self, tp: int) -> list[str]:
        """What stops vLLM from splitting this model ``tp`` ways (empty: nothing).

        vLLM's rules, read in 0.26.0 and 0.33.0: the attention heads divide by tp
        (`ModelConfig.verify_with_parallel_config`); the KV heads divide by tp, or tp by
        them (`QKVParallelLinear` replicates a head over tp / heads ranks; MLA's latent is
        not split); the experts' intermediate size divides by tp (`FusedMoEConfig`), and
        with 128x128 FP8 blocks each rank's share divides by 128
        (`validate_fp8_block_shape_moe`).
        """
        out = []
        heads, kv, inter = self.attention_heads, self.kv_heads, self.moe_intermediate_size
        if heads and heads % tp:
            out.append(f"its {heads} attention heads do not divide by {tp}")
        if kv and kv % tp and tp % kv:
            out.append(f"its {kv} KV heads neither divide by {tp} nor divide it")
        if inter % tp:
            out.append(f"its experts' intermediate size {inter} does not divide by {tp}")
        elif self.quant == "fp8-block" and (inter // tp) % 128:
            out.append(f"its experts' intermediate size {inter} splits into {inter // tp} a "
                       "rank, not a multiple of the 128-wide FP8 blocks")
        return out

    def tensor_parallel_refusal(self, tp: int) -> str | None:
        """One line saying why vLLM cannot run this model at ``--tensor-parallel-size tp``
        and which sizes up to 16 it can, or None when it can."""
        why = self._splits(tp)
        if not why:
            return None
        ok = [str(n) for n in range(1, 17) if not self._splits(n)]
        return (f"--tensor-parallel-size {tp}: vLLM cannot split {self.name} {tp} ways: "
                + "; ".join(why) + f" (sizes it can: {', '.join(ok)})")

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def bytes_per_slot(self) -> int:
        """One slot = one expert id across every MoE layer (the cache's unit of VRAM): the
        expert as vLLM holds it, and the packed side row of its ragged tensors
        (`formats.slot_bytes`)."""
        side = formats.slot_bytes(self.expert_tensors) - sum(
            t.nbytes for t in self.expert_tensors)
        return (self.bytes_per_expert + side) * self.num_moe_layers

    @property
    def expert_bytes(self) -> int:
        """Every expert of every MoE layer as vLLM holds them: resident, or offloaded (what
        ``--cpu-offload-gb`` must cover)."""
        return self.bytes_per_expert * self.num_moe_layers * self.num_experts

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes + self.non_expert_bytes

    @property
    def aligned(self) -> bool:
        """Every per-expert tensor can be moved by the gather: a 16-byte slab, or within
        the packed side row (`formats.ragged_refusal`)."""
        return formats.ragged_refusal(self.expert_tensors) is None

    def with_state_dtypes(self, mamba_cache_dtype: str = "auto",
                          mamba_ssm_cache_dtype: str = "auto") -> ModelSize:
        """The model with its linear-attention state in the dtypes vLLM's
        ``--mamba-cache-dtype`` and ``--mamba-ssm-cache-dtype`` give it (`LinearState.priced`);
        itself where it has no such state or both are ``auto``."""
        import dataclasses

        if self.linear_state is None or (mamba_cache_dtype, mamba_ssm_cache_dtype) == (
                "auto", "auto"):
            return self
        state = self.linear_state.priced(mamba_cache_dtype, mamba_ssm_cache_dtype)
        return dataclasses.replace(self, linear_state=state,
                                   state_bytes_per_seq=state.bytes_per_seq)

    def all_full_attention(self) -> ModelSize:
        """The model as vLLM pages it with its hybrid KV cache manager off: every
        sliding-window and chunked layer keeps a sequence's every token, as a full-attention
        layer does (vLLM's ``unify_hybrid_kv_cache_specs``), so their KV is a token's."""
        import dataclasses

        local = []  # (the layers' KV for their span, the span in tokens)
        if self.window_layers and self.sliding_window:
            local.append((self.kv_window_bytes_per_seq, self.sliding_window))
        if self.chunked_layers and self.attention_chunk:
            local.append((self.kv_chunk_bytes_per_seq, self.attention_chunk))
        if not local:
            return self
        extra = sum(ceil_div(kv, span) for kv, span in local)
        return dataclasses.replace(
            self, kv_bytes_per_token=self.kv_bytes_per_token + extra,
            kv_window_bytes_per_seq=0, window_layers=0, sliding_window=0,
            kv_chunk_bytes_per_seq=0, chunked_layers=0, attention_chunk=0)

    @property
    def resident_bytes(self) -> int:
        """What stays in VRAM whatever is offloaded: the non-expert weights and the rotary
        caches vLLM builds beside them (its "Model loading took" counts both)."""
        return self.non_expert_bytes + self.rope_cache_bytes

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
            "rope_cache_bytes": self.rope_cache_bytes,
            "total_bytes": self.total_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_window_bytes_per_seq": self.kv_window_bytes_per_seq,
            "kv_chunk_bytes_per_seq": self.kv_chunk_bytes_per_seq,
            "state_bytes_per_seq": self.state_bytes_per_seq,
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


def _base_quant(cfg: dict[str, Any]) -> str:
    dt = str(_first(cfg, "torch_dtype", "dtype", default="bfloat16")).lower()
    return "fp16" if dt in ("float16", "fp16", "half") else "bf16"


#: config keys of Mamba-hybrid families (Jamba, Nemotron-H, Granite 4): their Mamba layers'
#: weights and state are not modelled, and a note says so
MAMBA_KEYS = ("mamba_d_state", "mamba_expand", "mamba_num_heads", "hybrid_override_pattern",
              "layers_block_type")


def _moe_layer_indices(cfg: dict[str, Any], num_layers: int) -> list[int]:
    """Which decoder layers carry routed experts, per each family's config convention."""
    if cfg.get("n_routed_experts"):  # DeepSeek V2/V3, Kimi, GLM-4.5 style
        first = int(cfg.get("first_k_dense_replace", 0) or 0)
        freq = cfg.get("moe_layer_freq", 1)
        if isinstance(freq, list):
            return [i for i in range(num_layers) if i < len(freq) and freq[i]]
        freq = int(freq or 1)
        return [i for i in range(first, num_layers) if i % freq == 0]
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str):  # Nemotron-H: one letter a layer, E the MoE ones
        return [i for i, kind in enumerate(pattern[:num_layers]) if kind == "E"]
    if cfg.get("expert_layer_period"):  # Jamba: every period-th layer from the offset
        period, offset = int(cfg["expert_layer_period"]), int(cfg.get("expert_layer_offset", 0))
        return [i for i in range(num_layers) if i >= offset and (i - offset) % period == 0]
    if isinstance(cfg.get("moe_layers"), list):  # Llama 4 lists them
        return sorted(int(i) for i in cfg["moe_layers"] if int(i) < num_layers)
    if cfg.get("interleave_moe_layer_step"):  # Llama 4: every step-th layer, the last of each
        step = int(cfg["interleave_moe_layer_step"])
        return [i for i in range(num_layers) if (i + 1) % step == 0]
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
    only the experts are 4-bit, as its ``modules_to_not_convert`` says. A field of the
    wrong type (a string where a count belongs, a list for a dict) is one clear error.
    """
    try:
        return _model_from_config(cfg, name, quant, source)
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
        if isinstance(exc, UserError):
            raise
        raise UserError(f"{name}: a config.json field has an unexpected value or type "
                        f"({exc.__class__.__name__}: {exc})") from None


def _model_from_config(
    cfg: dict[str, Any], name: str, quant: str | None, source: str
) -> ModelSize:
    notes: list[str] = []
    vision = 0
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers keep the LM inside
        cfg = {**cfg, **cfg["text_config"]}
        if isinstance(cfg.get("vision_config"), dict):
            vision = vision_encoder_bytes(cfg["vision_config"])
            notes.append(
                (f"{VISION_NOTE} estimated at {vision / GiB:.2f} GiB, as a plain ViT of "
                 "its depth and widths" if vision else f"{VISION_NOTE} not in the "
                 "arithmetic (its config names no depth and width)")
                + ": vLLM loads it beside the language model unless told to serve text only "
                "(a model directory's safetensors count it exactly)")
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

    missing = [k for k in ("hidden_size", "vocab_size") if cfg.get(k) is None]
    if _first(cfg, "num_hidden_layers", "n_layer", "num_layers") is None:
        missing.append("num_hidden_layers")
    if missing:
        raise UserError(f"{name}: config lacks {', '.join(missing)} (needs hidden_size, "
                        "num_hidden_layers, vocab_size)")
    hidden = int(cfg["hidden_size"])
    layers = int(_first(cfg, "num_hidden_layers", "n_layer", "num_layers"))
    vocab = int(cfg["vocab_size"])
    num_experts = int(
        _first(cfg, "n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts",
               default=0)
    )
    top_k = int(_first(cfg, "num_experts_per_tok", "experts_per_token", "moe_top_k", default=0))
    if num_experts <= 1 or top_k <= 0:
        raise UserError(f"{name}: not a mixture-of-experts model (no routed experts in its config)")
    inter = int(_first(cfg, "moe_intermediate_size", "intermediate_size"))
    # Llama 4 names its dense layers' width apart from the experts' (`intermediate_size`)
    dense_inter = int(_first(cfg, "intermediate_size_mlp", "intermediate_size", default=inter))
    heads = int(cfg.get("num_attention_heads", 0))
    kv_heads = int(_first(cfg, "num_key_value_heads", default=heads))
    head_dim = int(_first(cfg, "head_dim", default=hidden // max(heads, 1)))
    mla = cfg.get("kv_lora_rank") is not None
    hybrid = _linear_attention(cfg, layers)
    if any(k in cfg for k in MAMBA_KEYS):
        notes.append("Mamba layers are not in the arithmetic (counted as attention): the "
                     "non-expert bytes and the KV reserve are estimates; a model directory's "
                     "safetensors give the weights exactly")
    if mla:  # DeepSeek configs carry a head_dim that does not describe MLA's projections
        head_dim = 0
    moe_layers = _moe_layer_indices(cfg, layers)
    has_expert_bias = cfg.get("model_type") == "gpt_oss" or bool(cfg.get("mlp_bias"))
    # Linear layers outside the experts: quantised too, except under mxfp4 (gpt-oss keeps
    # attention in bf16) and for router/lm_head/embeddings (left in 16 bits by every scheme).
    lin_q = _base_quant(cfg) if quant == "mxfp4" else quant
    b16 = 2

    # -- experts: vLLM fuses gate and up into w13 [2I, H]; down is w2 [H, I]
    if quant in formats.MARLIN_QUANTS:
        tensors = _marlin_experts(cfg, quant, hidden, inter, has_expert_bias, notes)
    else:
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
        # a gated attention's query projection also emits the gate (Qwen3-Next, Qwen3.5)
        gate = 2 if cfg.get("attn_output_gate", hybrid is not None) else 1
        attn = linear_bytes(gate * q_out, hidden, lin_q) + 2 * linear_bytes(kv_out, hidden,
                                                                            lin_q)
        attn += linear_bytes(hidden, q_out, lin_q)
        mt = str(cfg.get("model_type", ""))
        if cfg.get("attention_bias") or cfg.get("qkv_bias"):
            out_bias = cfg.get("attention_bias") and mt not in QKV_BIAS_ONLY
            attn += (q_out + 2 * kv_out + (hidden if out_bias else 0)) * b16
        if mt.startswith("qwen3"):
            attn += 2 * head_dim * b16  # q_norm, k_norm over one head
        elif mt == "olmoe":
            attn += (q_out + kv_out) * b16  # q_norm, k_norm over the whole projection
        if mt == "gpt_oss":
            attn += heads * b16  # attention sinks
        kv_layer = 2 * kv_out * b16
        kv_kind = f"GQA {kv_heads} kv heads x {head_dim}"

    norms = 2 * hidden * b16
    router = _router_bytes(cfg, num_experts, hidden, has_expert_bias)
    shared = 0
    n_shared = int(cfg.get("n_shared_experts") or 0)
    if n_shared:
        shared = _mlp_bytes(hidden, n_shared * inter, lin_q)
    if str(cfg.get("model_type", "")).startswith("llama4"):
        shared = _mlp_bytes(hidden, inter, lin_q)  # one shared expert a MoE layer
    if cfg.get("shared_expert_intermediate_size"):
        shared = _mlp_bytes(hidden, int(cfg["shared_expert_intermediate_size"]), lin_q)
        shared += hidden * b16  # the shared expert's sigmoid gate
    moe_set = set(moe_layers)
    non_expert = vocab * hidden * b16 + vision  # embeddings, any vision encoder
    if not cfg.get("tie_word_embeddings", False):
        non_expert += vocab * hidden * b16  # lm_head
    non_expert += hidden * b16  # final norm
    linear = hybrid.layers if hybrid else frozenset()
    for i in range(layers):
        non_expert += (hybrid.weight_bytes(hidden, lin_q) if i in linear else attn) + norms
        non_expert += router + shared if i in moe_set else _mlp_bytes(hidden, dense_inter, lin_q)

    # -- KV cache: sliding-window layers hold only the window, linear-attention layers a
    # fixed state, per sequence
    types = cfg.get("layer_types") or []
    window = int(cfg.get("sliding_window") or 0)
    sliding = sum(1 for t in types if t == "sliding_attention") if window else 0
    chunk, chunked = _chunked_attention(cfg, layers)
    kv_tok = (layers - sliding - chunked - len(linear)) * kv_layer
    kv_win = sliding * window * kv_layer
    state, linear_state = 0, None
    if sliding:
        kv_kind += f", {sliding} of {layers} layers sliding ({window} tokens)"
    if chunked:
        kv_kind += f", {chunked} of {layers} layers chunked local attention ({chunk} tokens)"
    if hybrid:
        # vLLM pages a hybrid model's KV and state together (`hybrid_pages`): the plan
        # reserves the pages, this is the state itself
        linear_state = hybrid.state(cfg, layers - sliding - len(linear), kv_layer)
        state = linear_state.bytes_per_seq
        kv_kind += f", {len(linear)} of {layers} layers linear attention"
        notes.append(
            f"{len(linear)} of {layers} layers are linear attention (gated delta rule): no KV "
            f"a token, {state / MiB:.1f} MiB of state a sequence, reserved as vLLM pages it "
            f"with the KV (blocks of {linear_state.block_tokens(1.0)} tokens at this KV "
            "dtype; the pages vLLM allocated at start matched on a GPU, with Qwen3-Next's "
            "layout; no real hybrid checkpoint has been served with the cache)")
    max_position = int(_first(cfg, "max_position_embeddings", default=4096))
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
        max_position_embeddings=max_position,
        notes=notes,
        kv_heads=0 if mla else kv_heads,
        attention_heads=heads,
        architectures=config_architectures(cfg),
        state_bytes_per_seq=state,
        linear_state=linear_state,
        window_layers=sliding,
        sliding_window=window if sliding else 0,
        chunked_layers=chunked,
        attention_chunk=chunk if chunked else 0,
        kv_chunk_bytes_per_seq=chunked * chunk * kv_layer,
        rope_cache_bytes=rotary.rope_cache_bytes(
            cfg, int(cfg.get("qk_rope_head_dim", 64)) if mla else head_dim, max_position),
    )


def _chunked_attention(cfg: dict[str, Any], layers: int) -> tuple[int, int]:
    """(chunk, layers) of Llama 4's chunked local attention: every RoPE layer
    (``no_rope_layers[i]`` 1) attends within ``attention_chunk_size`` tokens, the NoPE
    layers to the whole sequence (vLLM's ``Llama4Attention``). transformers fills what a
    config leaves out: a chunk of 8,192 tokens and a NoPE layer every
    ``no_rope_layer_interval`` (4); a null chunk makes every layer full attention."""
    if not str(cfg.get("model_type", "")).startswith("llama4"):
        return 0, 0
    chunk = int(cfg.get("attention_chunk_size", 8192) or 0)
    if not chunk:
        return 0, 0
    interval = int(cfg.get("no_rope_layer_interval") or 4)
    rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    return chunk, sum(1 for i in range(min(layers, len(rope))) if rope[i])


#: model types whose `attention_bias` biases the q/k/v projection only, not the output's
QKV_BIAS_ONLY = frozenset({"glm4_moe"})
#: model types whose router vLLM builds in float32 (its `params_dtype`), not the model's dtype
FLOAT32_ROUTER = frozenset({"glm4_moe", "minimax_m2", "ernie4_5_moe"})


def _router_bytes(cfg: dict[str, Any], num_experts: int, hidden: int, bias: bool) -> int:
    """One MoE layer's router as vLLM holds it: its weight (in float32 for the
    `FLOAT32_ROUTER` models), gpt-oss's bias, and the float32 score-correction bias of the
    aux-loss-free routers (GLM-4.5, ERNIE 4.5, DeepSeek-V3's `noaux_tc`, MiniMax-M2's
    `use_routing_bias`): a few MB a model that a tight card's slot count can feel."""
    mt = str(cfg.get("model_type", ""))
    weight = num_experts * hidden * (4 if mt in FLOAT32_ROUTER else 2)
    correction = (mt in ("glm4_moe", "ernie4_5_moe")
                  or cfg.get("topk_method") == "noaux_tc"
                  or (mt == "minimax_m2" and cfg.get("use_routing_bias")))
    return weight + (num_experts * 2 if bias else 0) + (num_experts * 4 if correction else 0)


@dataclass(frozen=True)
class LinearAttention:
    """The gated-delta-rule linear attention of Qwen3-Next and Qwen3.5, as vLLM holds it:
    which layers have it, and what a layer's weights and a sequence's state take."""

    layers: frozenset[int]
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def weight_bytes(self, hidden: int, quant: str) -> int:
        """One layer: the fused q/k/v/z and b/a input projections, the short causal
        convolution, the per-head decay (float32 in vLLM, ``A_log``) and its bias, the gated
        norm, the output projection."""
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        b16, f32 = 2, 4
        return (linear_bytes(2 * keys + 2 * values, hidden, quant)
                + linear_bytes(2 * self.value_heads, hidden, quant)
                + self.conv_channels * self.conv_kernel * b16
                + self.value_heads * (f32 + b16) + self.value_dim * b16
                + linear_bytes(hidden, values, quant))

    def state(self, cfg: dict[str, Any], full_layers: int, kv_layer: int) -> LinearState:
        """A sequence's state over these layers, in the dtypes vLLM picks by default: the
        recurrent state (a key x value matrix a value head) and the convolution's last
        ``kernel - 1`` inputs in the model's dtype, the recurrent one in the config's
        ``mamba_ssm_dtype`` where vLLM reads it (`config_ssm_bytes`); beside the
        ``full_layers`` attention layers of ``kv_layer`` bytes a token it pages with."""
        return LinearState(
            layers=len(self.layers), full_layers=full_layers,
            ssm_elements=self.value_heads * self.key_dim * self.value_dim,
            conv_channels=self.conv_channels, conv_taps=self.conv_kernel - 1,
            kv_layer=kv_layer, config_ssm_bytes=config_ssm_bytes(cfg))


def config_ssm_bytes(cfg: dict[str, Any]) -> int | None:
    """The recurrent state's element size a config asks for, where vLLM honours it: its
    Qwen3.5 models (and their retrieval variant) take ``mamba_ssm_dtype`` as the default of
    ``--mamba-ssm-cache-dtype``; vLLM reads the field for no other linear-attention model."""
    archs = config_architectures(cfg)
    qwen3_5 = (str(cfg.get("model_type", "")).startswith("qwen3_5")
               or any(a.startswith(("Qwen3_5", "ColQwen3_5")) for a in archs))
    dtype = str(cfg.get("mamba_ssm_dtype") or "").lower()
    return MAMBA_DTYPE_BYTES.get({"fp32": "float32"}.get(dtype, dtype)) if qwen3_5 else None


def _linear_attention(cfg: dict[str, Any], layers: int) -> LinearAttention | None:
    """The config's linear-attention layers (``layer_types``, else every layer but each
    ``full_attention_interval``-th), or None for a model without them."""
    if cfg.get("linear_num_value_heads") is None:
        return None
    types = cfg.get("layer_types")
    if types:
        linear = frozenset(i for i, t in enumerate(types[:layers]) if t == "linear_attention")
    else:
        every = int(cfg.get("full_attention_interval") or 4)
        linear = frozenset(i for i in range(layers) if (i + 1) % every)
    return LinearAttention(
        layers=linear, key_heads=int(cfg["linear_num_key_heads"]),
        key_dim=int(cfg["linear_key_head_dim"]), value_heads=int(cfg["linear_num_value_heads"]),
        value_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4))


def _marlin_experts(cfg: dict[str, Any], quant: str, hidden: int, inter: int, bias: bool,
                    notes: list[str]) -> list[Tensor]:
    """One expert as vLLM's Marlin experts hold it (`formats.marlin_expert_tensors`), in
    the layout of the vLLM installed here (the newest read, without one), with a note
    where Marlin pads the widths."""
    scheme = formats.wna16_scheme(cfg) if quant == "w4a16" else None
    layout = formats.marlin_layout(installed_vllm.version())
    tensors = formats.marlin_expert_tensors(quant, hidden, inter, scheme=scheme, bias=bias,
                                            layout=layout)
    group, act = (scheme.group, scheme.act_order and layout == "0.26") if scheme else (128,
                                                                                       False)
    h_pad = formats.marlin_hidden(quant, hidden)
    i_pad = formats.marlin_intermediate(quant, hidden, inter, group, act)
    if (h_pad, i_pad) != (hidden, inter):
        plain = linear_tensors("w13", 2 * inter, hidden, quant) + linear_tensors(
            "w2", hidden, inter, quant)
        plain_bytes = sum(t.nbytes for t in plain) + ((2 * inter + hidden) * 2 if bias else 0)
        held = sum(t.nbytes for t in tensors)
        notes.append(
            f"4-bit experts run on vLLM's Marlin kernel, which pads them (hidden {hidden} -> "
            f"{h_pad}, intermediate {inter} -> {i_pad}): {held / 1e6:.2f} MB an expert in "
            f"host memory and in a slot, not {plain_bytes / 1e6:.2f}")
    return tensors


VISION_NOTE = "the vision encoder (vision_config)"


def vision_encoder_bytes(vcfg: dict[str, Any]) -> int:
    """A multimodal config's vision encoder in bf16, estimated as a plain ViT: each block's
    attention (4 h^2) and MLP (2 h i), and, where the config names them, the patch merger
    to the language model's width (Qwen's ``spatial_merge_size``, ``out_hidden_size``) or
    a projector (``projector_input_dim`` -> ``projector_output_dim``). Norms, biases and
    position tables are left out: a few percent of it."""
    h = int(_first(vcfg, "hidden_size", "embed_dim", "width", default=0) or 0)
    depth = int(_first(vcfg, "depth", "num_hidden_layers", "num_layers", default=0) or 0)
    if not h or not depth:
        return 0
    inter = int(_first(vcfg, "intermediate_size", "mlp_dim", default=4 * h) or 4 * h)
    params = depth * (4 * h * h + 2 * h * inter)
    merge, out = vcfg.get("spatial_merge_size"), vcfg.get("out_hidden_size")
    if merge and out:
        wide = h * int(merge) ** 2
        params += wide * wide + wide * int(out)
    if vcfg.get("projector_input_dim") and vcfg.get("projector_output_dim"):
        params += int(vcfg["projector_input_dim"]) * int(vcfg["projector_output_dim"])
    return 2 * params


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


def model_from_checkpoint(directory: Path, quant: str | None = None,
                          config: dict[str, Any] | None = None) -> ModelSize:
    """Size a local model directory: config.json for the shape, safetensors for exact bytes.

    Expert bytes are the sum of every tensor under ``layers.N.…experts.`` (routed experts;
    shared experts stay with the non-expert weights) divided by the expert count. Tensors
    of layers past ``num_hidden_layers`` (e.g. DeepSeek's multi-token-prediction layer) are
    not loaded by vLLM for plain serving and are left out, with a note.
    """
    cfg_path = directory / "config.json"
    if config is None and not cfg_path.is_file():
        raise UserError(f"{directory}: no config.json in this directory")
    cfg = config if config is not None else _read_config(cfg_path)
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
    on_disk = ceil_div(biggest, model.num_experts)
    if model.quant in formats.MARLIN_QUANTS:
        # vLLM repacks (and may pad) these experts for Marlin at load: a slot and the host
        # copy hold what vLLM holds, not the file's layout
        if on_disk != model.bytes_per_expert:
            model.notes.append(
                f"one expert is {on_disk:,} B on disk and {model.bytes_per_expert:,} B as "
                "vLLM's Marlin kernel holds it: slots and offload sized at vLLM's")
    elif model.bytes_per_expert > on_disk and model.quant in ("w8a8", "fp8", "fp8-block"):
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
    model.non_expert_bytes = non_expert  # a vision encoder's tensors among them, exactly
    model.notes = [n for n in model.notes if not n.startswith(VISION_NOTE)]
    model.source = "checkpoint"
    if skipped:
        model.notes.append(f"{skipped} bytes of layers past num_hidden_layers not counted")
    return model


# --------------------------------------------------------------------------- resolving --model


def model_from_hub(repo_id: str, quant: str | None = None, client: Any = None) -> ModelSize:
    """A Hub id as vLLM would load it: its complete local snapshot (exact bytes from the
    safetensors headers), else its config.json from the cache or the Hub (arithmetic)."""
    found = hub.resolve(repo_id, client=client)
    name = repo_id.rsplit("/", 1)[-1]
    if found.snapshot is not None:
        model = model_from_checkpoint(found.snapshot, quant, config=found.config)
        model.name = name
    else:
        model = model_from_config(found.config, name, quant, source="config")
    model.notes.append(f"{repo_id}: config.json from {found.origin}")
    return model


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


def config_architectures(cfg: dict[str, Any]) -> tuple[str, ...]:
    """config.json's ``architectures``, the names vLLM picks its model classes by."""
    return tuple(str(a) for a in cfg.get("architectures") or ())


def load_model(spec: str | Path | None = None, quant: str | None = None) -> ModelSize:
    """A preset (by name, or the Hub id it stands for), a config.json path, a model directory
    or any other Hub id (`model_from_hub`) -> :class:`ModelSize`."""
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
        if hub.is_hub_id(str(spec)):
            return model_from_hub(str(spec), quant)
        raise UserError(
            f"unknown model {spec!r}: give a Hugging Face id (org/name), a config.json, a "
            f"model directory or one of {', '.join(PRESETS)}"
        )
    m = model_from_config(preset.config, preset.name, quant or preset.quant, source="preset")
    return m
