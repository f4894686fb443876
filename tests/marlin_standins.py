"""CPU stand-ins for vLLM's Marlin MoE layers (0.26 and 0.33), for the plugin's tests.

The layer, quant method and `MarlinExperts` stand-ins carry the attribute layout of vLLM's
real classes after `process_weights_after_loading` (read in 0.26.0 and 0.33.0: the
``auto_gptq``/``auto_awq``/compressed-tensors WNA16 methods, ModelOpt NVFP4 and gpt-oss
MXFP4 on Marlin): the packed weights as parameters aliased ``w13_weight``/``w2_weight``
where vLLM aliases them, scales, zero points, biases, NVFP4's per-expert global scales,
act-order ``g_idx`` and sort indices (0.26 only, held by the kernel object too),
compressed-tensors' load-only ``weight_shape``. The kernel is a CPU reference of
`fused_marlin_moe`: vLLM's block-size heuristic, blocks built by the module-level
`moe_align_block_size` (which the plugin patches, as in vLLM's marlin_moe module), each
block's weights dequantised from its expert's tensors, and Marlin's stripe partition of
every GEMM's K reduction over a fixed grid of "thread blocks", each stripe's partial sum
rounded to bf16 before the stripes are added. That rounding makes the result depend on
where a block sits in the block list, as on the GPU (where it is fp32 partials, rarer
flips): a slot path that reorders the blocks shows up, one that keeps them does not.

The packed layouts are the stand-in's own (eight 4-bit codes an int32, row-major
``[K, N]``), not Marlin's tile permutation: what is tested is that every byte reaches the
kernel through the right expert, not how Marlin shuffles them.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

E, K, N, G, TOPK = 12, 64, 32, 16, 2  # experts, hidden, intermediate, group, top-k
#: the stand-in GPU: "thread blocks" the stripes are spread over
GRID = 5
TILE = 16
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
                         pad_sorted_ids=False, ignore_invalid_experts=False):
    """vLLM's ``moe_align_block_size`` on the host: (token, k) pairs sorted by expert id,
    each expert's run padded to whole blocks, blocks past the last filled with expert 0."""
    ids = topk_ids.reshape(-1).tolist()
    numel = len(ids)
    padded_max = numel + num_experts * (block_size - 1)
    if numel < num_experts:
        padded_max = min(numel * block_size, padded_max)
    sorted_ids = torch.full((padded_max,), numel, dtype=torch.int32)
    blocks = torch.zeros(math.ceil(padded_max / block_size), dtype=torch.int32)
    pos = 0
    for e in range(num_experts):
        rows = [i for i, x in enumerate(ids) if x == e]
        if not rows:
            continue
        sorted_ids[pos:pos + len(rows)] = torch.tensor(rows, dtype=torch.int32)
        n_blocks = math.ceil(len(rows) / block_size)
        blocks[pos // block_size:pos // block_size + n_blocks] = e
        pos += n_blocks * block_size
    return sorted_ids, blocks, torch.tensor([pos], dtype=torch.int32)


def fused_marlin_moe(hidden_states, w1, w2, quant, topk_weights, topk_ids,
                     global_num_experts=-1, g_idx=(None, None), sort_indices=(None, None)):
    """`fused_marlin_moe` in the stand-in: blocks from `moe_align_block_size`, then the
    two stripe-partitioned GEMMs on each block's expert (see the module docstring)."""
    m, _ = hidden_states.shape
    experts = w1.size(0)
    topk = topk_ids.size(1)
    if global_num_experts == -1:
        global_num_experts = experts
    else:
        m = math.ceil(m * experts / global_num_experts)
    for block_size in (8, 16, 32, 48, 64):
        if m * topk / experts / block_size < 0.9:
            break
    sorted_ids, blocks, padded = MODULE.moe_align_block_size(
        topk_ids, block_size, global_num_experts, None, ignore_invalid_experts=True)
    order = _block_rows(sorted_ids, blocks, int(padded), block_size, topk_ids.numel())
    x = hidden_states.float()
    h = _stripe_gemm(order, lambda r: x[r // topk], w1, quant, 1, g_idx[0], sort_indices[0],
                     topk_ids.numel())
    gate, up = h[:, :N], h[:, N:]
    act = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16).float()
    y = _stripe_gemm(order, lambda r: act[r], w2, quant, 2, g_idx[1], sort_indices[1],
                     topk_ids.numel())
    y = y * topk_weights.reshape(-1, 1)
    return y.view(-1, topk, K).sum(1).to(hidden_states.dtype)


def _block_rows(sorted_ids, blocks, padded, block_size, numel):
    """[(expert id of the block, its valid row indices)] in block-list order."""
    out = []
    for b in range(padded // block_size):
        rows = [int(r) for r in sorted_ids[b * block_size:(b + 1) * block_size] if r < numel]
        out.append((int(blocks[b]), rows))
    return out


def _stripe_gemm(order, rows_of, w, quant, which, g_idx, sort_indices, numel):
    """One GEMM over the blocks: every (block, n tile, k tile) in Marlin's linear order,
    split into stripes of ``iters`` tiles over `GRID` thread blocks; a stripe's partial
    sum over its k tiles is rounded to bf16 (see the module docstring)."""
    out = None
    weights = {}
    kt = nt = 0
    for e, _ in order:
        if e not in weights:  # [K_in, N_out] float32
            act_order = g_idx is not None and g_idx.size(-1) > 0
            weights[e] = quant.dequant(which, e, w, g_idx[e] if act_order else None)
        kt, nt = weights[e].shape[0] // TILE, weights[e].shape[1] // TILE
    iters = max(1, math.ceil(kt * nt * len(order) / GRID))
    for p, (e, rows) in enumerate(order):
        if not rows:
            continue
        a = torch.stack([rows_of(r) for r in rows])  # [R, K_in]
        if sort_indices is not None and sort_indices.size(-1):  # act order: permuted input
            a = a[:, sort_indices[e].long()]
        wt = weights[e]
        if out is None:
            out = torch.zeros(numel, wt.shape[1])
        for j in range(nt):
            start = (p * nt + j) * kt
            acc = torch.zeros(len(rows), TILE)
            part = torch.zeros(len(rows), TILE)
            for t in range(kt):
                if t and (start + t) % iters == 0:
                    acc += part.to(torch.bfloat16).float()
                    part = torch.zeros_like(part)
                ks = slice(t * TILE, (t + 1) * TILE)
                part += a[:, ks] @ wt[ks, j * TILE:(j + 1) * TILE]
            acc += part.to(torch.bfloat16).float()
            out[rows, j * TILE:(j + 1) * TILE] = acc
    bias = quant.bias(which)
    if bias is not None:
        for e, rows in order:
            if rows:
                out[rows] += bias[e].float()
    return out.to(torch.bfloat16).float()


def fused_marlin_moe_source_calls_align():  # pragma: no cover - inspected, never run
    """Stands for vLLM's function body in the check that it builds blocks this way."""
    return moe_align_block_size(None, 8, 1)


#: the stand-in of vLLM's ``marlin_moe`` module: what the plugin patches
MODULE = types.ModuleType("marlin_moe_standin")
MODULE.moe_align_block_size = moe_align_block_size
MODULE.fused_marlin_moe = fused_marlin_moe


# -- the quant config and the experts kernel -------------------------------------------

@dataclass
class FusedMoEQuantConfig:
    """The fields `MarlinExperts.apply` reads (vLLM's are properties over descriptors)."""

    w1_scale: Any
    w2_scale: Any
    w1_zp: Any = None
    w2_zp: Any = None
    w1_bias: Any = None
    w2_bias: Any = None
    g1_alphas: Any = None
    g2_alphas: Any = None
    fmt: str = "int4"

    def _pick(self, which, a, b):
        return a if which == 1 else b

    def bias(self, which):
        return self._pick(which, self.w1_bias, self.w2_bias)

    def dequant(self, which, e, w, g_idx=None):
        """Expert ``e``'s weights of GEMM ``which`` as float32 [K_in, N_out]; ``g_idx``
        (act order): the scale group of each input row, else rows in order by groups."""
        scale = self._pick(which, self.w1_scale, self.w2_scale)[e].float()
        k_in = scale.shape[0] * {"nvfp4": 16, "mxfp4": 32}.get(self.fmt, G)
        codes = _nibbles(w[e], k_in)
        if self.fmt == "nvfp4":
            vals = E2M1[codes.long()] * scale.repeat_interleave(16, 0)
            return vals * self._pick(which, self.g1_alphas, self.g2_alphas)[e].float()
        if self.fmt == "mxfp4":
            raw = self._pick(which, self.w1_scale, self.w2_scale)[e].view(torch.uint8)
            return E2M1[codes.long()] * torch.exp2(raw.float() - 127).repeat_interleave(32, 0)
        zp = self._pick(which, self.w1_zp, self.w2_zp)
        rows = g_idx.long() if g_idx is not None else torch.arange(k_in) // G
        zero = 8 if zp is None else _nibbles(zp[e], scale.shape[0]).float()[rows]
        return (codes.float() - zero) * scale[rows]


def _nibbles(packed, rows):
    """int32 words of eight 4-bit codes (low nibble first) as an int tensor [rows, -1]."""
    shifts = torch.arange(8, dtype=torch.int32) * 4
    return ((packed.reshape(-1, 1) >> shifts) & 0xF).reshape(rows, -1)


class MarlinExperts:
    """vLLM's `MarlinExperts` as the plugin sees it: ``quant_config`` (a plain attribute),
    and in 0.26's layout the act-order tensors bound at construction (the layer's own
    parameters) and ``is_k_full``; in 0.33's, ``activation_config`` instead."""

    def __init__(self, quant_config, layout="0.26", layer=None):
        self.quant_config = quant_config
        self.layout = layout
        if layout == "0.26":
            self.w13_g_idx = layer.w13_g_idx
            self.w2_g_idx = layer.w2_g_idx
            self.w13_g_idx_sort_indices = layer.w13_g_idx_sort_indices
            self.w2_g_idx_sort_indices = layer.w2_g_idx_sort_indices
            self.is_k_full = True
        else:
            self.activation_config = SimpleNamespace(clamp_limit=None)

    def apply(self, hidden_states, w1, w2, topk_weights, topk_ids, global_num_experts):
        if self.layout != "0.26":  # 0.33: no act order
            return fused_marlin_moe(hidden_states, w1, w2, self.quant_config, topk_weights,
                                    topk_ids, global_num_experts)
        return fused_marlin_moe(
            hidden_states, w1, w2, self.quant_config, topk_weights, topk_ids,
            global_num_experts, g_idx=(self.w13_g_idx, self.w2_g_idx),
            sort_indices=(self.w13_g_idx_sort_indices, self.w2_g_idx_sort_indices))


class FusedMoEKernel:
    def __init__(self, experts):
        self.fused_experts = experts

    def apply(self, hidden_states, w1, w2, topk_weights, topk_ids, global_num_experts=-1,
              **_):
        return self.fused_experts.apply(hidden_states, w1, w2, topk_weights, topk_ids,
                                        global_num_experts)


# -- the quant methods and the layer ------------------------------------------------------

def _p(t):
    p = torch.nn.Parameter(t, requires_grad=False)
    p._vllm_is_uva_offloaded = True  # host tensors standing for UVA views
    return p


def _packed(g, rows, cols):
    """Random 4-bit codes for a [rows, cols] matrix, eight to an int32."""
    codes = torch.randint(0, 16, (E, rows * cols // 8, 8), generator=g, dtype=torch.int32)
    words = torch.zeros(E, rows * cols // 8, dtype=torch.int32)
    for i in range(8):
        words |= codes[..., i] << (4 * i)
    return words.view(E, rows // TILE, cols * TILE // 8)


class MarlinMoEMethod:
    """The quant methods that run on Marlin, by format: ``gptq``/``awq``/``w4a16``
    (AutoGPTQ, AutoAWQ, compressed-tensors WNA16), ``nvfp4`` (ModelOpt), ``mxfp4``
    (gpt-oss); they build their quant config from the layer's own tensors, as vLLM's do."""

    is_monolithic = False

    def __init__(self, fmt):
        self.fmt = fmt
        self.moe_quant_config = None
        self.moe_kernel = None

    def get_fused_moe_quant_config(self, layer):
        f = self.fmt
        if f in ("gptq", "awq"):
            zp = f == "awq"
            return FusedMoEQuantConfig(layer.w13_scales, layer.w2_scales,
                                       layer.w13_qzeros if zp else None,
                                       layer.w2_qzeros if zp else None)
        if f == "w4a16":
            return FusedMoEQuantConfig(layer.w13_weight_scale, layer.w2_weight_scale)
        if f == "nvfp4":
            return FusedMoEQuantConfig(layer.w13_weight_scale, layer.w2_weight_scale,
                                       g1_alphas=layer.w13_weight_scale_2,
                                       g2_alphas=layer.w2_weight_scale_2, fmt="nvfp4")
        return FusedMoEQuantConfig(layer.w13_weight_scale, layer.w2_weight_scale,
                                   w1_bias=layer.w13_bias, w2_bias=layer.w2_bias,
                                   fmt="mxfp4")

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        return self.moe_kernel.apply(x, layer.w13_weight, layer.w2_weight, topk_weights,
                                     topk_ids, global_num_experts=layer.global_num_experts)


class RoutedExperts(torch.nn.Module):
    """A vLLM `RoutedExperts` holding one format's Marlin tensors (seeded), its quant
    method and kernel; ``layout`` "0.26" or "0.33"; ``act_order`` (GPTQ, 0.26): g_idx and
    sort indices filled, else empty ``[E, 0]`` as vLLM leaves them."""

    def __init__(self, fmt="gptq", layout="0.26", act_order=False, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layer_name = "model.layers.2.mlp.experts"
        self.local_num_experts = self.global_num_experts = E
        self.top_k = TOPK
        self.expert_map = None
        self.moe_config = SimpleNamespace(moe_parallel_config=SimpleNamespace(use_ep=False),
                                          is_lora_enabled=False)
        self.quant_method = MarlinMoEMethod(fmt)
        reg = self.register_parameter
        n2 = 2 * N

        def rand(*shape, dtype=torch.bfloat16, lo=0.5, hi=1.5):
            return (torch.rand(E, *shape, generator=g) * (hi - lo) + lo).to(dtype)

        if fmt in ("gptq", "awq", "w4a16"):
            w = "qweight" if fmt != "w4a16" else "weight_packed"
            s = "scales" if fmt != "w4a16" else "weight_scale"
            reg(f"w13_{w}", _p(_packed(g, K, n2)))
            reg(f"w2_{w}", _p(_packed(g, N, K)))
            reg(f"w13_{s}", _p(rand(K // G, n2) / 8))
            reg(f"w2_{s}", _p(rand(N // G, K) / 8))
            if fmt == "gptq":  # symmetric: 0.26 keeps the checkpoint's qzeros, unread
                reg("w13_qzeros", _p(torch.zeros(E, K // G, n2 // 8, dtype=torch.float16)))
                reg("w2_qzeros", _p(torch.zeros(E, N // G, K // 8, dtype=torch.float16)))
            if fmt == "awq":
                reg("w13_qzeros", _p(_packed(g, K // G * TILE, n2 // TILE).view(E, K // G, -1)))
                reg("w2_qzeros", _p(_packed(g, N // G * TILE, K // TILE).view(E, N // G, -1)))
            if fmt == "w4a16":  # compressed-tensors' shape record: read at load only
                reg("w13_weight_shape", _p(torch.tensor([n2, K], dtype=torch.float32)
                                           .repeat(E, 1)))
                reg("w2_weight_shape", _p(torch.tensor([K, N], dtype=torch.float32)
                                          .repeat(E, 1)))
            # every WNA16 method aliases the packed weights under the names the call reads
            self.w13_weight = getattr(self, f"w13_{w}")
            self.w2_weight = getattr(self, f"w2_{w}")
        else:
            reg("w13_weight", _p(_packed(g, K, n2)))
            reg("w2_weight", _p(_packed(g, N, K)))
        if fmt == "nvfp4":
            reg("w13_weight_scale", _p(rand(K // 16, n2).to(torch.float8_e4m3fn)))
            reg("w2_weight_scale", _p(rand(N // 16, K).to(torch.float8_e4m3fn)))
            reg("w13_weight_scale_2", _p(rand(dtype=torch.float32) / 16))  # 4 B an expert
            reg("w2_weight_scale_2", _p(rand(dtype=torch.float32) / 16))
            reg("w13_input_scale", _p(torch.ones(E)))  # vLLM's routing-state list
        if fmt == "mxfp4":
            exps = lambda *s: torch.randint(121, 127, (E, *s), generator=g,  # noqa: E731
                                            dtype=torch.uint8)
            reg("w13_weight_scale", _p(exps(K // 32, n2)))
            reg("w2_weight_scale", _p(exps(N // 32, K)))
            reg("w13_bias", _p(rand(n2, lo=-0.5, hi=0.5)))
            reg("w2_bias", _p(rand(K, lo=-0.5, hi=0.5)))
        if layout == "0.26":  # act-order tensors: filled for GPTQ desc_act, else [E, 0]
            for name, width in (("w13", K), ("w2", N)):
                if act_order:
                    perm = torch.stack([torch.randperm(width, generator=g) for _ in range(E)])
                    idx = torch.sort(torch.randint(0, width // G, (E, width), generator=g))[0]
                    reg(f"{name}_g_idx", _p(idx.to(torch.int32)))
                    reg(f"{name}_g_idx_sort_indices", _p(perm.to(torch.int32)))
                else:
                    reg(f"{name}_g_idx", _p(torch.empty(E, 0, dtype=torch.int32)))
                    reg(f"{name}_g_idx_sort_indices", _p(torch.empty(E, 0, dtype=torch.int32)))
        qm = self.quant_method
        qm.moe_quant_config = qm.get_fused_moe_quant_config(self)
        qm.moe_kernel = FusedMoEKernel(MarlinExperts(qm.moe_quant_config, layout, self))
        self.calls: list[dict] = []  # what each experts call saw

    def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None,
                        shared_experts_input=None):
        self.calls.append({"global_num_experts": self.global_num_experts,
                           "w13": self.w13_weight.data_ptr(),
                           "ids": topk_ids.clone()})
        return self.quant_method.apply(self, x, topk_weights, topk_ids, shared_experts,
                                       shared_experts_input)
