"""The bench hook that replays a trace's routing in a served model (bench/trace_routing.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="no torch: the routing hook needs torch")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import trace_routing  # noqa: E402


class Router:
    """A router whose own choice is always experts 0..k-1."""

    def select_experts(self, hidden_states, router_logits, topk_indices_dtype=None, **kw):
        t = hidden_states.shape[0]
        return torch.ones(t, 2), torch.arange(2, dtype=torch.int32).repeat(t, 1)


def test_decode_steps_follow_the_trace_per_layer_and_prefill_keeps_the_router():
    ids = np.array([[[5, 6], [7, 8]], [[9, 10], [11, 12]], [[13, -1], [14, 15]]])  # T3 L2 W2
    routing = trace_routing.TraceRouting(ids, top_k=2)
    cls = type("FusedMoERouter", (Router,), {"select_experts": Router.select_experts})
    trace_routing.patch_router_class(cls, routing)
    trace_routing.patch_router_class(cls, routing)  # once only
    layers = [cls(), cls()]
    x1, x5 = torch.zeros(1, 4), torch.zeros(5, 4)
    seen = []
    for _ in range(4):  # steps cycle through the 3 trace rows
        seen.append([r.select_experts(x1, None)[1].tolist() for r in layers])
    assert seen[0] == [[[5, 6]], [[7, 8]]] and seen[1] == [[[9, 10]], [[11, 12]]]
    assert seen[2] == [[[13, 1]], [[14, 15]]]  # padding -1: the router's id stays
    assert seen[3] == seen[0]
    w, prefill = layers[0].select_experts(x5, None)  # 10 ids > the trace's 2: router's
    assert prefill.tolist() == [[0, 1]] * 5 and w.shape == (5, 2)
    assert prefill.dtype == torch.int32


def test_every_request_starts_the_trace_again_at_its_prefill():
    """Greedy tokens of two servers (or two requests) compare only where both replay the
    same rows: a prefill (more tokens than the streams) restarts each layer at row 0."""
    ids = np.array([[[1, 2, 3, 4]], [[5, 6, -1, -1]], [[7, 8, -1, -1]]])  # T3 L1, top-2
    routing = trace_routing.TraceRouting(ids, top_k=2)
    cls = type("FusedMoERouter", (Router,), {"select_experts": Router.select_experts})
    trace_routing.patch_router_class(cls, routing)
    r = cls()

    def request(decode_steps: int) -> list:
        got = [r.select_experts(torch.zeros(2, 4), None)[1].tolist()]  # prefill of 2
        got += [r.select_experts(torch.zeros(1, 4), None)[1].tolist()
                for _ in range(decode_steps)]
        return got

    first = request(4)
    assert first == [[[1, 2], [3, 4]], [[5, 6]], [[7, 8]], [[1, 2]], [[5, 6]]]
    for _ in range(5):  # whatever ran before (warm-up calls of one token)
        r.select_experts(torch.zeros(1, 4), None)
    assert request(4) == first
    # a prefill wider than the rows keeps the router's ids and still takes row 0's place
    wide = [r.select_experts(torch.zeros(3, 4), None)[1].tolist()]
    assert wide == [[[0, 1]] * 3]
    assert r.select_experts(torch.zeros(1, 4), None)[1].tolist() == [[5, 6]]
    # two streams decode steps of 2 tokens without restarting
    two = trace_routing.TraceRouting(ids, top_k=2, streams=2)
    cls2 = type("FusedMoERouter", (Router,), {"select_experts": Router.select_experts})
    trace_routing.patch_router_class(cls2, two)
    r2 = cls2()
    steps = [r2.select_experts(torch.zeros(2, 4), None)[1].tolist() for _ in range(3)]
    assert steps == [[[1, 2], [3, 4]], [[5, 6], [0, 1]], [[7, 8], [0, 1]]]


def test_the_first_routed_step_says_the_trace_is_in_force_once(caplog):
    routing = trace_routing.TraceRouting(np.array([[[5, 6], [7, 8]]]), top_k=2)
    cls = type("FusedMoERouter", (Router,), {"select_experts": Router.select_experts})
    trace_routing.patch_router_class(cls, routing)
    layers = [cls(), cls()]
    with caplog.at_level("WARNING", logger="vllm.expertcache.bench"):
        layers[0].select_experts(torch.zeros(5, 4), None)  # prefill: the router's, no line
        assert trace_routing.IN_FORCE_LINE not in caplog.text
        for r in layers * 2:
            r.select_experts(torch.zeros(1, 4), None)
    assert caplog.text.count(trace_routing.IN_FORCE_LINE) == 1


def test_install_needs_the_variable(monkeypatch):
    monkeypatch.delenv(trace_routing.ENV, raising=False)
    assert trace_routing.install() is None


def test_install_patches_vllms_router_class_when_its_module_is_imported(monkeypatch):
    import types

    from expertcache_cli.rules.trace import Trace, save

    path = save(Trace(topk_ids=np.array([[[3, 4]], [[5, 6]]]), num_experts=8, top_k=2),
                Path(pytest.importorskip("tempfile").mkdtemp()) / "t.npz")
    mod = types.ModuleType(trace_routing.ROUTER_MODULE)
    mod.FusedMoERouter = type("FusedMoERouter", (Router,),
                              {"select_experts": Router.select_experts})
    monkeypatch.setitem(sys.modules, trace_routing.ROUTER_MODULE, mod)
    monkeypatch.setenv(trace_routing.ENV, str(path))
    assert trace_routing.install() is not None
    r = mod.FusedMoERouter()
    assert r.select_experts(torch.zeros(1, 4), None)[1].tolist() == [[3, 4]]
    assert r.select_experts(torch.zeros(1, 4), None)[1].tolist() == [[5, 6]]


def test_without_restart_one_counter_runs_across_requests():
    """EC_BENCH_TRACE_RESTART=0: a long synthetic trace that plan replays whole."""
    ids = np.array([[[5, 6]], [[7, 8]], [[9, 10]]])
    routing = trace_routing.TraceRouting(ids, top_k=2, restart=False)
    cls = type("FusedMoERouter", (Router,), {"select_experts": Router.select_experts})
    trace_routing.patch_router_class(cls, routing)
    r = cls()
    one = torch.zeros(1, 4)
    assert r.select_experts(one, None)[1].tolist() == [[5, 6]]
    r.select_experts(torch.zeros(3, 4), None)  # a prefill: the router's, no restart
    assert r.select_experts(one, None)[1].tolist() == [[7, 8]]


def test_a_decode_step_wider_than_the_rows_keeps_the_router_and_the_counter():
    """Only a prefill takes a row's place when it keeps the router's ids: a decode step of
    more streams than the rows hold moves no layer along the trace."""
    ids = np.array([[[1, 2, 3, 4]], [[5, 6, -1, -1]]])  # W4, top-2
    routing = trace_routing.TraceRouting(ids, top_k=2, streams=3)
    cls = type("FusedMoERouter", (Router,), {"select_experts": Router.select_experts})
    trace_routing.patch_router_class(cls, routing)
    r = cls()
    assert r.select_experts(torch.zeros(1, 4), None)[1].tolist() == [[1, 2]]
    assert r.select_experts(torch.zeros(3, 4), None)[1].tolist() == [[0, 1]] * 3
    assert r.select_experts(torch.zeros(1, 4), None)[1].tolist() == [[5, 6]]
