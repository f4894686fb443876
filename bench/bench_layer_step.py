"""The whole per-layer cache step as vLLM will run it, in a CUDA graph of many layers.

    python bench/bench_layer_step.py [--layers 48] [--experts 128] [--slots 64] [--ids 32]

Per layer: manager (with the fused remap) + gather that finds no misses (all experts of
the step resident: the steady state the cache is for). Qwen3-30B-A3B-shaped bf16 layers
(w13 [1536, 2048], w2 [2048, 768] per expert, sources in pinned host memory). The graph
holds every layer once and is replayed many times. Same-run baselines: a graph of one
empty kernel per layer, of the manager alone, and of the no-miss gather alone.
Goal: <= 5 us per layer.

Two ways of launching, timed in the same run where the GPU has PDL: with programmatic
dependent launch (the default on sm_90 and newer: the gather starts behind the manager,
the manager behind whatever ran before it) and without (``EXPERT_CACHE_PDL=0``). And two
states of memory: warm (every layer's cache state stays in L2 across the graph, as in a
bench) and cold (before each layer a kernel that writes other memory, twice the L2 as
probe-link's cold step does unless --thrash-mib says, as a served decode step's other
layers do; its own cost is measured with an empty kernel behind it and taken off), which
is what served all-hit layers see (H200, fp8-block, 24 layers: the manager took 3.56 us a
call in vLLM's profile against ~2.4 us warm here).
"""

from __future__ import annotations

import argparse

import numpy as np
from _cudabench import Baselines, add_thrash_arg, graph_time, header, thrash_buffer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--ids", type=int, default=32, help="routing ids per step (tokens x top_k)")
    add_thrash_arg(ap)
    args = ap.parse_args()

    import torch

    from expertcache_cli.config import kernel_source
    from expertcache_cli.device import binding
    from expertcache_cli.device.slotcache import SlotCache

    binding.select(*kernel_source())  # EXPERT_CACHE_LIB and _PDL, as the commands read them

    header(torch, "bench_layer_step: per-layer manager + no-miss gather + remap, CUDA graph")
    L, E, S, W = args.layers, args.experts, args.slots, args.ids
    specs = {"w13_weight": ((1536, 2048), torch.bfloat16),
             "w2_weight": ((2048, 768), torch.bfloat16)}
    sources = {k: torch.empty((E, *shape), dtype=dt, pin_memory=True)
               for k, (shape, dt) in specs.items()}
    caches = [SlotCache(E, S, specs, policy="lru", name=f"layer{i}") for i in range(L)]
    rng = np.random.default_rng(1)
    ids = torch.from_numpy(
        np.stack([rng.choice(E, 8, replace=False) for _ in range(W // 8)]).astype(np.int32)
    ).cuda()
    for c in caches:
        c.step(ids, sources)  # warm: installs this step's experts; later steps all hit
        c.check_sources(sources)
    torch.cuda.synchronize()
    base = Baselines(torch)
    outs: list = []

    def full(stream):
        outs.clear()
        for c in caches:
            outs.append(c.step(ids, sources))

    real = torch.tensor([ids.shape[0]], dtype=torch.int32, device="cuda")

    def full_count(stream):  # as served on vLLM's V1 runner: the manager reads the count
        outs.clear()
        for c in caches:
            outs.append(c.step(ids, sources, real_rows=real))

    scratch = torch.empty_like(ids)

    def manager_only(stream):
        for c in caches:
            c._manage(ids.data_ptr(), ids.numel(), False, scratch.data_ptr(), stream)

    def gather_only(stream):
        ptrs = [sources[k].data_ptr() for k in specs]
        for c in caches:
            c._gather(ptrs, stream)

    kernels = binding.get_kernels(torch.cuda.current_device())
    pdl_default = kernels.pdl
    thrash = thrash_buffer(torch, args.thrash_mib)

    def cold(body):  # before each layer, a kernel that evicts L2 (as other layers do)
        def run(stream):
            outs.clear()
            for c in caches:
                thrash.fill_(1)
                body(c, stream)
        return run

    def cold_step(c, stream):
        outs.append(c.step(ids, sources, real_rows=real))

    t_empty = graph_time(torch, lambda s: [base.launch_empty(s) for _ in range(L)], 200) / L
    t_cold_empty = graph_time(torch, cold(lambda c, s: base.launch_empty(s)), 50) / L
    installs = sum(c.stats[1].item() for c in caches)
    rows = []
    for pdl in ([True, False] if kernels.pdl_supported else [False]):
        kernels.set_pdl(pdl)
        tag = "PDL" if pdl else "no PDL"
        t_full = graph_time(torch, full, 200) / L
        t_count = graph_time(torch, full_count, 200) / L
        t_cold = graph_time(torch, cold(cold_step), 50) / L - t_cold_empty + t_empty
        rows += [(f"manager + remap + gather (full step), {tag}", t_full),
                 (f"full step, real-rows count read (V1, as served), {tag}", t_count),
                 (f"full step with the count, cold L2, {tag}", t_cold)]
        if pdl == pdl_default:
            t_goal = t_full
    kernels.set_pdl(pdl_default)
    t_mgr = graph_time(torch, manager_only, 200) / L
    t_gat = graph_time(torch, gather_only, 200) / L
    after = sum(c.stats[1].item() for c in caches)
    assert after == installs == L * len(set(ids.flatten().tolist())), "steady state had misses"
    print(f"layers={L} E={E} S={S} ids={W}; PDL on this GPU: "
          f"{'yes' if kernels.pdl_supported else 'no'}; cold rows: {thrash.numel() >> 20} MiB "
          f"written before each layer, its cost ({(t_cold_empty - t_empty) * 1e6:.2f} us "
          "a layer) taken off")
    print("| graph of one node kind per layer | us/layer | vs empty node |")
    print("|---|---|---|")
    for name, t in (("empty kernel", t_empty), ("manager + remap", t_mgr),
                    ("gather, no misses", t_gat), *rows):
        print(f"| {name} | {t * 1e6:.2f} | {t / t_empty:.1f}x |")
    by = dict(rows)
    if kernels.pdl_supported:
        for what in ("manager + remap + gather (full step)",
                     "full step with the count, cold L2"):
            on, off = by[f"{what}, PDL"], by[f"{what}, no PDL"]
            print(f"{what}: PDL {on * 1e6:.2f} us vs {off * 1e6:.2f} without = "
                  f"{on / off:.2f}x")
    t_full = t_goal
    print(f"full step: {t_full * 1e6:.2f} us/layer (goal <= 5 us): "
          f"{'MET' if t_full <= 5e-6 else 'NOT MET'}")


if __name__ == "__main__":
    main()
