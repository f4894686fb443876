"""On the GPU: the sweep of every expert (`plugin.runtime.ArmedLayer.sweep`) on a real armed
layer, the real `SlotCache` (manager and gather kernels, experts in pinned host memory)
behind the real `ArmedLayer`, in front of a layer whose stock call is a plain MoE in torch
(vLLM is not needed: what is proven is the plugin's part, on the device).

- fed vLLM's warm-up routing (every row the same top_k experts), the first eager call
  still computes all 128 experts from their slots and on the stock path, and leaves the
  cache as a fresh one;
- a slot the gather gets wrong for one expert the warm-up never routes is caught at that
  first call, named, and the layer serves the stock path;
- once a CUDA graph captured the layer's slot path (and replays it right), a failure
  stops the server with one line (`CacheFault`) instead of leaving the graph serving it.

Run with ``-s`` to see the sweep's line and its wall time on this GPU.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

E, S, K, H, INTER = 128, 32, 8, 256, 128


def _layer_class(torch):
    class TritonExperts:  # the name the planner knows
        quant_config = None

    class Method:
        is_monolithic = False
        moe_quant_config = None

        def __init__(self) -> None:
            self.moe_kernel = SimpleNamespace(fused_experts=TritonExperts())

        def get_fused_moe_quant_config(self, layer):
            return None

    class Layer(torch.nn.Module):
        """A RoutedExperts as the planner sees it; experts in pinned host memory, flagged
        as vLLM's UVA offloader flags them."""

        def __init__(self, seed: int) -> None:
            super().__init__()
            self.layer_name = f"model.layers.{seed}.mlp.experts"
            self.local_num_experts = self.global_num_experts = E
            self.top_k, self.expert_map = K, None
            self.moe_config = SimpleNamespace(
                moe_parallel_config=SimpleNamespace(use_ep=False), is_lora_enabled=False)
            self.quant_method = Method()
            g = torch.Generator().manual_seed(seed)
            for name, shape in (("w13_weight", (2 * INTER, H)), ("w2_weight", (H, INTER))):
                w = (torch.randn((E, *shape), generator=g) / 16).to(torch.bfloat16)
                p = torch.nn.Parameter(w.pin_memory(), requires_grad=False)
                p._vllm_is_uva_offloaded = True
                self.register_parameter(name, p)

        def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None,
                            shared_experts_input=None):
            """The MoE on whichever tensors the layer holds: on the host copies (the stock
            path) the routed experts are fetched; on slot buffers (device) they are indexed
            in place, with no host sync, so a CUDA graph can capture it."""
            n, k = topk_ids.shape
            flat = topk_ids.reshape(-1).long()
            w13, w2 = self.w13_weight, self.w2_weight
            if w13.device.type == "cpu":
                rows = flat.cpu()
                w13 = w13.index_select(0, rows).to(x.device)
                w2 = w2.index_select(0, rows).to(x.device)
            else:
                w13, w2 = w13[flat], w2[flat]
            xs = x.float().unsqueeze(1).expand(n, k, x.shape[1]).reshape(n * k, -1)
            h = torch.einsum("nih,nh->ni", w13.float(), xs)
            a = torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]
            y = torch.einsum("nhi,ni->nh", w2.float(), a).view(n, k, -1)
            return (y * topk_weights.unsqueeze(-1).float()).sum(dim=1).to(x.dtype)

    return Layer


def _armed(torch, seed):
    from expertcache_cli.config import CacheConfig
    from expertcache_cli.device.slotcache import SlotCache
    from expertcache_cli.plugin.arming import ARM, plan_layer
    from expertcache_cli.plugin.runtime import ArmedLayer

    layer = _layer_class(torch)(seed)
    d = plan_layer(layer, CacheConfig(slots=S))
    assert d.action == ARM, d.reason
    cache = SlotCache(E, S, {s.name: (s.shape, s.dtype) for s in d.specs}, device="cuda",
                      name=d.layer_name)
    armed = ArmedLayer(layer, d, cache, index=0, padding=lambda n: None)
    armed.install()
    return layer, armed


def _warm_up_call(torch, rows=4):
    """What vLLM's dummy runs route: every row to the same top_k experts (0..7)."""
    ids = torch.arange(K, dtype=torch.int32, device="cuda").repeat(rows, 1)
    w = torch.full((rows, K), 1.0 / K, device="cuda")
    x = torch.randn(rows, H, device="cuda").to(torch.bfloat16)
    return x, w, ids


@pytest.mark.device
def test_the_first_call_sweeps_every_expert_and_leaves_a_fresh_cache(cuda, caplog):
    torch = cuda
    from expertcache_cli.config import CacheConfig
    from expertcache_cli.plugin.session import Session

    caplog.set_level(logging.DEBUG, logger="vllm.expertcache")
    layer, armed = _armed(torch, 1)
    Session(CacheConfig(slots=S), [armed.decision], [armed], None)  # its one summary line
    x, w, ids = _warm_up_call(torch)
    out = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    torch.cuda.synchronize()
    (sweep,) = armed.sweep_result.paths
    assert (sweep.path, sweep.covered, sweep.steps) == ("slots", E, E // S)
    assert sweep.worst <= 1e-3 and not armed.sweep_result.failed, sweep
    # the sweep's installs are gone: only the call's 8 experts are resident, counted once
    table = armed.cache.table.cpu().tolist()
    assert sorted(e for e in range(E) if table[e] >= 0) == list(range(K))
    assert armed.cache.stats.cpu().tolist() == [K, K]
    want = _layer_class(torch)(1).forward_modular(x, w, ids)
    torch.testing.assert_close(out, want)
    line = next(r.getMessage() for r in caplog.records
                if "check of every expert" in r.getMessage())
    print(f"\n{line}\nper layer: {armed.sweep_result.seconds:.4f} s")


@pytest.mark.device
def test_a_slot_wrong_for_one_unrouted_expert_is_caught_at_the_first_call(cuda, caplog):
    """Expert 100's slot is corrupted on the device after every install of it (no sync):
    the warm-up routing never reaches it, the sweep does."""
    torch = cuda
    layer, armed = _armed(torch, 2)
    step = armed.cache.step

    def corrupting(ids, sources, **kw):
        out = step(ids, sources, **kw)
        s = armed.cache.table[100].long()
        slot = armed.cache.slots["w2_weight"][s.clamp_min(0)]
        slot.add_((s >= 0).to(slot.dtype))  # +1 on every value, only while resident
        return out

    armed.cache.step = corrupting
    x, w, ids = _warm_up_call(torch)
    with caplog.at_level(logging.ERROR, logger="vllm.expertcache"):
        out = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    (sweep,) = armed.sweep_result.paths
    assert armed.sweep_result.failed and 100 in sweep.bad_experts, sweep
    assert "differs from the stock path's on experts" in caplog.text
    assert "forward_modular" not in layer.__dict__  # back on the stock path
    torch.testing.assert_close(out, _layer_class(torch)(2).forward_modular(x, w, ids))
    print(f"\n{caplog.records[-1].getMessage()}")


def _captured(torch, layer, x, w, ids):
    """The layer's call captured in a CUDA graph on static copies of its inputs, as vLLM
    captures it: (graph, the static inputs a replay reads, the output it writes)."""
    static = (x.clone(), w.clone(), ids.clone())
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        graph_out = layer.forward_modular(x=static[0], topk_weights=static[1],
                                          topk_ids=static[2])
    torch.cuda.current_stream().wait_stream(side)
    return g, static, graph_out


@pytest.mark.device
def test_a_failure_once_captured_stops_the_server(cuda, caplog):
    torch = cuda
    from expertcache_cli.plugin.runtime import CacheFault

    layer, armed = _armed(torch, 3)
    x, w, ids = _warm_up_call(torch, rows=1)
    layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)  # eager: swept, checked
    assert armed.sweep_result is not None and not armed.sweep_result.failed
    g, static, graph_out = _captured(torch, layer, x, w, ids)
    assert armed.captured and not armed._failed
    stock = _layer_class(torch)(3)
    for e in (40, 90, 127):  # replays install and serve experts the warm-up never routed
        static[2].copy_(torch.arange(e - K + 1, e + 1, dtype=torch.int32, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(graph_out, stock.forward_modular(*static))

    def broken(*a, **k):
        raise RuntimeError("source moved")

    armed.cache.step = broken
    with caplog.at_level(logging.CRITICAL, logger="vllm.expertcache"), \
            pytest.raises(CacheFault, match="the server stops rather than serve it"):
        layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    print(f"\n{caplog.records[-1].getMessage()}")


@pytest.mark.device
def test_the_slots_emptied_after_warm_up_refill_through_the_captured_graph(cuda):
    """`Session.serving_starts` after capture, as vLLM's warm-up ends: every slot empty,
    the counters zero, and the graph captured before keeps serving, installing again from
    empty (device state only changed, no pointer)."""
    torch = cuda
    from expertcache_cli.config import CacheConfig
    from expertcache_cli.plugin.session import Session

    layer, armed = _armed(torch, 4)
    x, w, ids = _warm_up_call(torch, rows=1)
    layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)  # eager: swept, checked
    g, static, graph_out = _captured(torch, layer, x, w, ids)
    for _ in range(5):  # the warm-up's dummy steps, through the graph
        g.replay()
    torch.cuda.synchronize()
    assert int(armed.cache.stats[0]) > 0 and (armed.cache.slot_expert >= 0).any()
    Session(CacheConfig(slots=S), [armed.decision], [armed], None).serving_starts()
    assert (armed.cache.table == -1).all() and (armed.cache.slot_expert == -1).all()
    assert all(int(t.sum()) == 0 for t in armed._counters())
    stock = _layer_class(torch)(4)
    static[2].copy_(torch.arange(40, 40 + K, dtype=torch.int32, device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(graph_out, stock.forward_modular(*static))
    assert armed.cache.stats.tolist() == [K, K]  # the first request: K uses, K installs
    assert sorted(armed.cache.slot_expert[armed.cache.slot_expert >= 0].tolist()) == list(
        range(40, 40 + K))
