"""A hybrid linear-attention model's state, and the KV pages vLLM reserves for it.

Qwen3-Next and Qwen3.5 hold a fixed state a sequence in each gated-delta-rule layer and KV
a token in the others. vLLM pages both in blocks of one byte size, so the numbers a plan
needs are not the state's and the KV's bytes added up: vLLM widens the attention block
until one attention page holds a layer's state (in multiples of the attention kernel's
block alignment), pads every state to that page, and sizes a pool whose block holds one
page for each layer of a group, the groups formed from the layer counts. `reserve` is that
arithmetic, read in vLLM 0.26, 0.32 and 0.33 (`_align_hybrid_block_size`,
`_get_kv_cache_groups_uniform_page_size`, `_max_memory_usage_bytes_from_groups`,
`MambaSpec.max_memory_usage_bytes` and 0.33's prefill checkpoints of the gated delta rule):
what vLLM checks a start against, to the byte, for one sequence of ``--max-model-len``
tokens. It is held to vLLM's own check in
`tests/test_vllm_architectures.py`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import UserError
from .formats import ceil_div

#: vLLM's ``--mamba-cache-dtype`` / ``--mamba-ssm-cache-dtype`` values and their bytes
MAMBA_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

#: the attention kernels' block alignment on NVIDIA GPUs (FlashAttention, Triton and
#: FlashInfer all take multiples of 16 tokens), which a hybrid model's block size is a
#: multiple of
GPU_BLOCK_ALIGN = 16
#: the token alignment of the states FlashInfer's gated-delta-rule prefill saves inside a
#: prefill (vLLM 0.33's ``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT``): with prefix caching,
#: blocks are multiples of it and each state keeps one more page for such a checkpoint
CHECKPOINT_ALIGN = 64


@dataclass(frozen=True)
class LinearState:
    """A sequence's linear-attention state on one GPU, as element counts and sizes (so
    vLLM's state dtype flags re-price it), beside the full-attention layers whose KV
    pages it shares."""

    layers: int  # linear-attention layers
    full_layers: int  # full-attention layers
    ssm_elements: int  # one layer's recurrent state, one sequence
    conv_channels: int  # the short convolution's channels
    conv_taps: int  # the inputs it keeps: its kernel less one
    kv_layer: int  # one full-attention layer's KV bytes a token, in the model's dtype
    model_bytes: int = 2
    config_ssm_bytes: int | None = None  # Qwen3.5's ``mamba_ssm_dtype``, where vLLM reads it
    conv_bytes: int | None = None  # set by `priced`; None: the model's dtype
    ssm_bytes: int | None = None  # set by `priced`; None: vLLM's default

    def layer_bytes(self, speculative_tokens: int = 0) -> int:
        """One layer's state for one sequence; with speculative decoding vLLM keeps one
        more convolution input a draft token."""
        conv = self.conv_bytes or self.model_bytes
        ssm = self.ssm_bytes or self.config_ssm_bytes or conv
        return (self.ssm_elements * ssm
                + self.conv_channels * (self.conv_taps + speculative_tokens) * conv)

    @property
    def bytes_per_seq(self) -> int:
        """The state itself, every linear layer, one sequence (before vLLM's paging)."""
        return self.layers * self.layer_bytes()

    def priced(self, mamba_cache_dtype: str, mamba_ssm_cache_dtype: str) -> LinearState:
        """The state in vLLM's dtypes for these flags: ``--mamba-cache-dtype`` sets both
        parts (``auto``: the model's dtype); ``--mamba-ssm-cache-dtype`` the recurrent part
        alone (``auto``: the config's, for Qwen3.5, else the first flag's)."""
        def size(flag: str, value: str) -> int | None:
            if value == "auto":
                return None
            if value not in MAMBA_DTYPE_BYTES:
                raise UserError(f"unknown {flag} {value!r}: auto, "
                                f"{', '.join(MAMBA_DTYPE_BYTES)}")
            return MAMBA_DTYPE_BYTES[value]

        conv = size("--mamba-cache-dtype", mamba_cache_dtype)
        ssm = size("--mamba-ssm-cache-dtype", mamba_ssm_cache_dtype)
        if ssm is None and self.config_ssm_bytes is None:
            ssm = conv
        return dataclasses.replace(self, conv_bytes=conv, ssm_bytes=ssm)

    def per_rank(self, tp: int, kv_split: int) -> LinearState:
        """One of ``tp`` tensor-parallel GPUs: vLLM splits the state's heads and channels
        over the ranks, and the KV by KV head (``kv_split`` ranks' worth)."""
        return dataclasses.replace(
            self, ssm_elements=ceil_div(self.ssm_elements, tp),
            conv_channels=ceil_div(self.conv_channels, tp),
            kv_layer=ceil_div(self.kv_layer, kv_split))

    def block_tokens(self, kv_scale: float, speculative_tokens: int = 0,
                     align: int = GPU_BLOCK_ALIGN) -> int:
        """vLLM's block size for this model: the fewest tokens, a multiple of ``align``,
        whose one layer's KV holds one layer's state."""
        kv1 = int(self.kv_layer * kv_scale)
        return align * ceil_div(self.layer_bytes(speculative_tokens), align * kv1)

    def reserve(self, kv_tokens: int, seqs: int, *, kv_scale: float = 1.0,
                speculative_tokens: int = 0, prefix_caching: bool = False,
                checkpoints: bool = False, align: int = GPU_BLOCK_ALIGN) -> int:
        """The KV pool vLLM needs for ``seqs`` sequences of ``kv_tokens`` tokens in all:
        pages of ``block_tokens`` tokens of one layer's KV (each state padded to one),
        blocks of one page for each layer of a group. Each full-attention group takes its
        sequences' tokens in whole blocks; each linear group a block a sequence, one more
        a draft token, one more with prefix caching (vLLM's ``align`` mode) and, with it,
        one more for ``checkpoints`` (FlashInfer's prefill states, `CHECKPOINT_ALIGN`)."""
        if not self.full_layers or not self.kv_layer:
            return seqs * self.layers * self.layer_bytes(speculative_tokens)
        checkpoints = checkpoints and prefix_caching
        if checkpoints:
            align = math.lcm(align, CHECKPOINT_ALIGN)
        block = self.block_tokens(kv_scale, speculative_tokens, align)
        page = block * int(self.kv_layer * kv_scale)
        fewest, most = sorted((self.full_layers, self.layers))
        group = most if most < fewest * 1.5 else fewest
        state_blocks = (2 if prefix_caching else 1) + speculative_tokens + checkpoints
        blocks = (ceil_div(self.full_layers, group) * (ceil_div(kv_tokens, block) + seqs - 1)
                  + ceil_div(self.layers, group) * state_blocks * seqs)
        return group * page * blocks


#: vLLM releases read whose hybrid models serve without prefix caching by default (0.26
#: leaves it off for them; 0.32 and 0.33 turn it on, with a second state page a sequence)
PREFIX_CACHING_OFF_BY_DEFAULT = frozenset({(0, 26)})
#: vLLM releases read whose gated-delta-rule layers save no states inside a prefill (0.33
#: does with FlashInfer's prefill kernel, its pick on Hopper and Blackwell)
NO_PREFILL_CHECKPOINTS = frozenset({(0, 26), (0, 32)})


def prefix_caching_default(version: tuple[int, int] | None) -> bool:
    """Whether vLLM ``version`` serves a hybrid model with prefix caching unless told:
    on wherever it was not read off (the larger reserve, so that vLLM's check passes)."""
    return version not in PREFIX_CACHING_OFF_BY_DEFAULT


def prefill_checkpoints(version: tuple[int, int] | None) -> bool:
    """Whether vLLM ``version`` may keep a prefill checkpoint page a state (with prefix
    caching): counted wherever it was not read absent, on GPUs before Hopper too, where
    vLLM 0.33 takes none and the reserve is one page a linear group larger than needed."""
    return version not in NO_PREFILL_CHECKPOINTS


#: vLLM's switch for Llama 4's chunked layers under the hybrid KV cache manager (default
#: on in 0.26-0.33; ``0`` turns the manager off for a chunked model)
CHUNKED_HYBRID_ENV = "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"


def local_attention_paged(*, windows: bool, chunks: bool, manager: bool | None,
                          speculative_tokens: int,
                          environ: Mapping[str, str] | None = None) -> str | None:
    """Why vLLM keeps every token of a sliding-window or chunked layer, as if it were full
    attention, or None where it keeps only the window or chunk: vLLM 0.26-0.33 turn the
    hybrid KV cache manager off (and a local layer then pages as a full one,
    ``unify_hybrid_kv_cache_specs``) when told to (``manager`` False:
    ``--disable-hybrid-kv-cache-manager``, or a ``--kv-transfer-config`` whose connector
    may not support it), and for a chunked model with speculative decoding (EAGLE, MTP:
    counted for every method, the larger reserve) or ``CHUNKED_HYBRID_ENV=0``."""
    if not (windows or chunks):
        return None
    if manager is False:
        return "the hybrid KV cache manager is off (--disable-hybrid-kv-cache-manager or " \
               "a --kv-transfer-config)"
    if manager is None and chunks:
        if speculative_tokens > 0:
            return "vLLM turns the hybrid KV cache manager off for chunked local " \
                   "attention with speculative decoding"
        env = os.environ if environ is None else environ
        if env.get(CHUNKED_HYBRID_ENV, "1").strip() == "0":
            return f"{CHUNKED_HYBRID_ENV}=0 turns the hybrid KV cache manager off"
    return None
