"""What an armed layer adds to a captured decode step, besides the cache's own step.

    python bench/bench_armed_layer.py [--layers 24] [--slots 32] [--tokens 1]

Why: served with every expert a hit, fp8-block at 24 layers kept 0.874 of resident (~12 us
a MoE layer) while the probed cache step (manager + no-miss gather) is ~4.1 us. The
difference is either the plugin's own Python path at capture (`ArmedLayer.forward_modular`:
the padding mask of vLLM's V1 runner, the two ``torch.where`` around the step, the bound
stock call) or the experts kernel itself on slots. Since ABI 2 the manager reads V1's count
of real rows itself; the bench times both ways. This bench times the first part alone,
in CUDA graphs of ``--layers`` layers as vLLM captures them, with the real `ArmedLayer`
around a stock call that only copies its input (the experts' GEMMs left out on purpose):

    stock        the stock call alone (the baseline)
    step         the cache's step + the stock call (what `probe-link` measures, plus it)
    armed        `ArmedLayer.forward_modular`, no padding rows known
    armed+mask   the same, V1's padding rows masked in torch (a compare, two torch.where
                 and their two scalar fills: five kernels)
    armed+count  the same, V1's count of real rows read by the manager (what serves now)
    ... PDL      armed+count launched with programmatic dependent launch where the GPU
                 has it (the default; the gather starts behind the manager and the
                 manager behind the stock call before it); the row is labelled "no PDL"
                 instead when the run's default is on (EXPERT_CACHE_PDL unset or 1)
    ... cold     before each layer a kernel writes other memory (twice the L2 unless
                 --thrash-mib says: what probe-link's cold step writes), as a served step's
                 other layers do: the cache state is cold, as served; over "stock, cold"
    marlin       armed+count on NVFP4-shaped Marlin layers (`plugin.marlin`): what vLLM's
                 Marlin experts add, the block list rewritten to slots (by the manager's
                 own launch, on the list of a stand-in ``moe_align_block_size`` that
                 launches nothing) and the packed side row of the two 4-byte global
                 scales, spread into their compact copies by the gather's installs
    ... torch    the same with the list rewritten in torch ops after the step
                 (`binding.block_slots`: the table's slots, the block ids clamped, one
                 gather), what a cache without the fused rule runs: the ratio of the two
                 is the fusion's gain
    ... unpacked the side row copied into the compact copies after every step instead
                 (EXPERT_CACHE_SPREAD=0): the ratio is the spread's gain

Each printed with its cost over ``stock`` per layer and the ratio of the armed path to the
step alone. The layers are fp8-block-shaped (Qwen3-30B-A3B-FP8: fp8 w13/w2 and fp32 block
scales), sources in pinned host memory; every step hits after a warm-up.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np
from _cudabench import Baselines, add_thrash_arg, graph_time, header, thrash_buffer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1, help="decode rows a step (padded: 2x)")
    ap.add_argument("--top-k", type=int, default=8)
    add_thrash_arg(ap)
    args = ap.parse_args()

    import torch

    from expertcache_cli.config import CacheConfig, kernel_source
    from expertcache_cli.device import binding
    from expertcache_cli.device.slotcache import SlotCache
    from expertcache_cli.plugin.arming import ARM, plan_layer
    from expertcache_cli.plugin.padding import mask_reader
    from expertcache_cli.plugin.runtime import ArmedLayer

    binding.select(*kernel_source())  # EXPERT_CACHE_LIB and _PDL, as the commands read them

    header(torch, "bench_armed_layer: the plugin's per-layer path around the cache step")
    L, E, S, K = args.layers, args.experts, args.slots, args.top_k
    rows = 2 * args.tokens  # a padded graph: half the rows real
    if rows * K > S:
        ap.error(f"{rows} rows x top-{K} = {rows * K} ids > {S} slots: a wide step, which "
                 "reads through (not what this bench times); fewer --tokens or more --slots")
    specs = {"w13_weight": ((1536, 2048), torch.float8_e4m3fn),
             "w2_weight": ((2048, 768), torch.float8_e4m3fn),
             "w13_weight_scale_inv": ((12, 16), torch.float32),
             "w2_weight_scale_inv": ((16, 6), torch.float32)}

    class TritonExperts:  # the name the planner knows; the stock call never uses it
        quant_config = None

    class Method:
        is_monolithic = False
        moe_quant_config = None

        def __init__(self) -> None:
            self.moe_kernel = SimpleNamespace(fused_experts=TritonExperts())

        def get_fused_moe_quant_config(self, layer):
            return None

    class Layer(torch.nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.layer_name = f"model.layers.{i}.mlp.experts"
            self.local_num_experts = self.global_num_experts = E
            self.top_k, self.expert_map = K, None
            self.moe_config = SimpleNamespace(
                moe_parallel_config=SimpleNamespace(use_ep=False), is_lora_enabled=False)
            self.quant_method = Method()
            for name, (shape, dt) in specs.items():
                p = torch.nn.Parameter(torch.empty((E, *shape), dtype=dt, pin_memory=True),
                                       requires_grad=False)
                p._vllm_is_uva_offloaded = True  # as vLLM's UVA offloader flags them
                self.register_parameter(name, p)

        def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None,
                            shared_experts_input=None):
            return x.clone()

    token_count = torch.tensor([args.tokens], dtype=torch.int32, device="cuda")

    def build(padding: str) -> tuple[list, list]:
        layers, armed = [], []
        for i in range(L):
            layer = Layer(i)
            d = plan_layer(layer, CacheConfig(slots=S))
            assert d.action == ARM, d.reason
            cache = SlotCache(E, S, {s.name: (s.shape, s.dtype) for s in d.specs},
                              policy="lru", device="cuda", name=d.layer_name)
            reader = mask_reader(token_count, 64)
            pad = {"none": lambda n: None, "mask": reader.__call__,  # no .count: masked
                   "count": reader}[padding]
            a = ArmedLayer(layer, d, cache, index=i, padding=pad)
            a.install()
            layers.append(layer)
            armed.append(a)
        return layers, armed

    rng = np.random.default_rng(1)
    ids = torch.from_numpy(np.stack([rng.choice(E, K, replace=False) for _ in range(rows)])
                           .astype(np.int32)).cuda()
    x = torch.randn(rows, 2048, dtype=torch.bfloat16, device="cuda")
    w = torch.rand(rows, K, device="cuda")
    plain, armed_plain = build("none")
    masked, armed_masked = build("mask")
    counted, armed_counted = build("count")
    for layers in (plain, masked, counted):
        for layer in layers:  # eager: the first-call check, and the installs
            layer.forward_modular(x, w, ids)
    for a in armed_plain + armed_masked + armed_counted:
        a.cache.check_sources({n: a.layer._parameters[n] for n in a.names})
        assert a.checked["slots"] == 0.0, "the first-call check did not pass"
    torch.cuda.synchronize()
    every = armed_plain + armed_masked + armed_counted

    def installs() -> int:
        return sum(int(a.cache.stats[1].item()) for a in every)

    warm = installs()
    base = Baselines(torch)
    stock = [type(layer).forward_modular.__get__(layer) for layer in plain]

    def run(body):
        return graph_time(torch, lambda s: body(), 200) / L * 1e6

    kernels = binding.get_kernels(torch.cuda.current_device())
    pdl_default = kernels.pdl
    thrash = thrash_buffer(torch, args.thrash_mib)

    def cold(fns):
        def body():
            for f in fns:
                thrash.fill_(1)
                f(x, w, ids)
        return body

    t = {
        "empty kernel": graph_time(torch, lambda s: [base.launch_empty(s) for _ in range(L)],
                                   200) / L * 1e6,
        "stock": run(lambda: [f(x, w, ids) for f in stock]),
        "step": run(lambda: [(a.cache.step(ids, {n: a.layer._parameters[n] for n in a.names}),
                              f(x, w, ids)) for a, f in zip(armed_plain, stock, strict=True)]),
        "armed": run(lambda: [layer.forward_modular(x, w, ids) for layer in plain]),
        "armed+mask": run(lambda: [layer.forward_modular(x, w, ids) for layer in masked]),
        "armed+count": run(lambda: [layer.forward_modular(x, w, ids) for layer in counted]),
    }
    cold_stock = graph_time(torch, lambda s: cold(stock)(), 50) / L * 1e6
    counted_fns = [layer.forward_modular for layer in counted]
    t["armed+count, cold"] = (graph_time(torch, lambda s: cold(counted_fns)(), 50) / L * 1e6
                              - cold_stock + t["stock"])
    if kernels.pdl_supported:
        kernels.set_pdl(not pdl_default)
        other = "no PDL" if pdl_default else "PDL"
        t[f"armed+count, {other}"] = run(lambda: [f(x, w, ids) for f in counted_fns])
        t[f"armed+count, cold, {other}"] = (
            graph_time(torch, lambda s: cold(counted_fns)(), 50) / L * 1e6
            - cold_stock + t["stock"])
        kernels.set_pdl(pdl_default)
    for label, kernel_remap, spread in (("marlin (armed+count on Marlin)", True, True),
                                        ("marlin, block list in torch ops", False, True),
                                        ("marlin, side row unpacked after the step", True,
                                         False)):
        marlin_fns, marlin_armed = marlin_layers(torch, args, token_count, x, w, ids,
                                                 kernel_remap, spread)
        t[label] = run(lambda fns=marlin_fns: [f(x, w, ids) for f in fns])
        assert (sum(int(a.cache.stats[1].item()) for a in marlin_armed)
                == marlin_armed[0].warm), "a timed Marlin step missed"
    assert installs() == warm, "a timed step missed: not the all-hit steady state"
    print(f"layers={L} E={E} S={S} rows={rows} ({args.tokens} real, the rest padding); "
          f"PDL {'on' if pdl_default else 'off'} by default here; cold rows: "
          f"{thrash.numel() >> 20} MiB written before each layer, taken off with 'stock, cold' "
          f"({cold_stock:.2f} us a layer)")
    print("| graph per layer | us/layer | over stock |")
    print("|---|---|---|")
    for name, us in t.items():
        print(f"| {name} | {us:.2f} | {us - t['stock']:+.2f} |")
    step = t["step"] - t["stock"]
    for name in [n for n in t if n.startswith("armed")]:
        print(f"{name}: {t[name] - t['stock']:.2f} us/layer over stock = "
              f"{(t[name] - t['stock']) / step:.2f}x the step alone ({step:.2f} us)")
    m, unpacked = t["marlin (armed+count on Marlin)"], t["marlin, side row unpacked after the step"]
    print(f"marlin, side row spread by the gather / unpacked after the step, over stock: "
          f"{(m - t['stock']) / (unpacked - t['stock']):.3f} ({m - unpacked:+.2f} us/layer)")


def marlin_layers(torch, args, token_count, x, w, ids, kernel_remap=True, spread=True):
    """``args.layers`` NVFP4-shaped layers on a stand-in of vLLM's Marlin experts (0.33
    layout), armed as the plugin arms them: expert-order blocks through the patched
    ``moe_align_block_size`` of a stand-in module (whose own work is none: preallocated
    outputs), rewritten by the manager's launch or (``kernel_remap=False``) by torch ops
    after it,
    the packed side row of the global scales, spread into their compact copies by the
    gather (``spread``, as the plugin arms it) or unpacked after each step; warmed to the
    all-hit steady state.
    Returns the layers' forward calls and their `ArmedLayer` objects."""
    import os
    import types

    from expertcache_cli.config import MARLIN

    # this bench arms Marlin layers on purpose: the opt-in switch the plugin reads
    os.environ[MARLIN] = "1"

    from expertcache_cli.config import CacheConfig
    from expertcache_cli.device.binding import block_slots
    from expertcache_cli.device.slotcache import SlotCache
    from expertcache_cli.plugin import session
    from expertcache_cli.plugin.arming import ARM, plan_layer
    from expertcache_cli.plugin.marlin import BlockOrder
    from expertcache_cli.plugin.padding import mask_reader
    from expertcache_cli.plugin.runtime import ArmedLayer
    from expertcache_cli.plugin.small import SMALL_ROW

    class TorchBlocksCache(SlotCache):
        """The step without the block list, then the list rewritten in torch ops."""

        def step(self, *a, blocks=None, **k):
            out = super().step(*a, **k)
            if blocks is not None:
                blocks.copy_(block_slots(blocks, self.table))
            return out

    L, E, S, K = args.layers, args.experts, args.slots, args.top_k
    blocks = ids.numel()
    fixed = (torch.zeros(blocks * 8, dtype=torch.int32, device="cuda"),
             torch.zeros(blocks, dtype=torch.int32, device="cuda"),
             torch.zeros(1, dtype=torch.int32, device="cuda"))
    module = types.ModuleType("marlin_moe_bench")
    module.moe_align_block_size = lambda *a, **k: fixed

    def fused_marlin_moe(topk_ids, global_num_experts):  # what _patch_marlin inspects
        return module.moe_align_block_size(topk_ids, 8, global_num_experts, None,
                                           ignore_invalid_experts=True)

    module.fused_marlin_moe = fused_marlin_moe
    assert session._patch_marlin(module) is None
    specs = {"w13_weight": ((128, 3072), torch.int32), "w2_weight": ((48, 4096), torch.int32),
             "w13_weight_scale": ((128, 1536), torch.float8_e4m3fn),
             "w2_weight_scale": ((48, 2048), torch.float8_e4m3fn),
             "w13_weight_scale_2": ((), torch.float32), "w2_weight_scale_2": ((), torch.float32)}

    def quant_config(layer):
        return SimpleNamespace(
            w1_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale, w1_zp=None,
            w2_zp=None, w1_bias=None, w2_bias=None, g1_alphas=layer.w13_weight_scale_2,
            g2_alphas=layer.w2_weight_scale_2)

    class MarlinExperts:  # 0.33's layout, by name and attributes
        activation_config = None

    class Method:
        is_monolithic = False
        moe_quant_config = None

        def __init__(self) -> None:
            self.moe_kernel = SimpleNamespace(fused_experts=MarlinExperts())

        def get_fused_moe_quant_config(self, layer):
            return quant_config(layer)

    class Layer(torch.nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.layer_name = f"model.layers.{i}.mlp.experts"
            self.local_num_experts = self.global_num_experts = E
            self.top_k, self.expert_map = K, None
            self.moe_config = SimpleNamespace(
                moe_parallel_config=SimpleNamespace(use_ep=False), is_lora_enabled=False)
            self.quant_method = Method()
            for name, (shape, dt) in specs.items():
                p = torch.nn.Parameter(torch.zeros((E, *shape), dtype=dt).pin_memory(),
                                       requires_grad=False)
                p._vllm_is_uva_offloaded = True
                self.register_parameter(name, p)
            self.quant_method.moe_kernel.fused_experts.quant_config = quant_config(self)

        def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None,
                            shared_experts_input=None):
            fused_marlin_moe(topk_ids, self.global_num_experts)  # the remap, when bound
            return x.clone()

    fns, armed = [], []
    for i in range(L):
        layer = Layer(i)
        d = plan_layer(layer, CacheConfig(slots=S))
        assert d.action == ARM and d.marlin and d.small, d.reason
        device = torch.device("cuda", torch.cuda.current_device())
        small = session._small_for(layer, d, device)
        cache = (SlotCache if kernel_remap else TorchBlocksCache)(
            E, S, {**{s.name: (s.shape, s.dtype) for s in d.specs},
                   SMALL_ROW: ((small.row_bytes,), torch.uint8)},
            policy="lru", device="cuda", name=d.layer_name,
            spread={SMALL_ROW: small.spread_targets()} if spread else None)
        a = ArmedLayer(layer, d, cache, index=i, padding=mask_reader(token_count, 64),
                       small=small, block_order=BlockOrder(E))
        a.install()
        layer.forward_modular(x, w, ids)  # eager: the first-call check, and the installs
        assert a.checked["slots"] == 0.0, "the Marlin first-call check did not pass"
        a.cache.check_sources(a._sources())
        fns.append(layer.forward_modular)
        armed.append(a)
    torch.cuda.synchronize()
    armed[0].warm = sum(int(a.cache.stats[1].item()) for a in armed)
    return fns, armed


if __name__ == "__main__":
    main()
