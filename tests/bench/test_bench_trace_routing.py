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


def _patched(routing):
    cls = type("FusedMoERouter", (Router,), {"select_experts": Router.select_experts})
    trace_routing.patch_router_class(cls, routing)
    return cls()


def _four_requests() -> np.ndarray:
    """T12 L1 top-2, one stream: recorded requests start at rows 0, 3, 6, 9."""
    return np.array([[[2 * t, 2 * t + 1]] for t in range(12)])


def test_a_prompt_replays_the_recorded_request_its_length_picks():
    """Prompts 8 tokens apart replay different recorded requests, one prompt always the
    same one (so that two servers given it still compare)."""
    routing = trace_routing.TraceRouting(_four_requests(), top_k=2, starts=[0, 3, 6, 9])
    r = _patched(routing)

    def request(prompt: int, decode_steps: int = 2) -> list:
        r.select_experts(torch.zeros(prompt, 4), None)  # the prefill: the router's ids
        return [r.select_experts(torch.zeros(1, 4), None)[1].tolist()[0]
                for _ in range(decode_steps)]

    # 16 tokens: request (16 // 8) % 4 = 2, from row 6 (the prefill took row 6's place)
    assert request(16) == [[14, 15], [16, 17]]
    assert request(24) == [[20, 21], [22, 23]]  # request 3, row 9 on
    assert request(32) == [[2, 3], [4, 5]]  # request 0
    assert request(16) == [[14, 15], [16, 17]]  # the same prompt again: the same rows
    assert request(17) == request(23) == [[14, 15], [16, 17]]  # one 8-token band
    # a trace of one request: row 0 whatever the prompt, as before
    one = _patched(trace_routing.TraceRouting(_four_requests(), top_k=2))
    one.select_experts(torch.zeros(24, 4), None)
    assert one.select_experts(torch.zeros(1, 4), None)[1].tolist() == [[2, 3]]


def test_streams_of_a_one_stream_recording_each_take_their_own_row():
    routing = trace_routing.TraceRouting(_four_requests(), top_k=2, streams=4,
                                         one_stream=True)
    r = _patched(routing)
    # streams 12 / 4 = 3 rows apart: in the four recorded requests at once
    assert r.select_experts(torch.zeros(4, 4), None)[1].tolist() == [
        [0, 1], [6, 7], [12, 13], [18, 19]]
    assert r.select_experts(torch.zeros(2, 4), None)[1].tolist() == [[2, 3], [8, 9]]
    # without one_stream, a row's first ids as far as they go (a batch trace's rule)
    batch = _patched(trace_routing.TraceRouting(_four_requests(), top_k=2, streams=4))
    assert batch.select_experts(torch.zeros(2, 4), None)[1].tolist() == [[0, 1], [0, 1]]


def test_one_stream_is_what_the_recording_ran():
    from expertcache_cli.rules.trace import Trace

    ids = _four_requests()
    assert trace_routing.one_stream(Trace(ids, 24, 2, step_tokens=np.ones(12, np.int64)))
    assert trace_routing.one_stream(Trace(ids, 24, 2))  # no step_tokens: no row wider
    wide = np.concatenate([ids, ids], axis=2)  # two streams a step
    assert not trace_routing.one_stream(Trace(wide, 24, 2, step_tokens=np.full(12, 2)))


@pytest.mark.parametrize("streams,prompts,hook", [
    (1, [16, 24, 40], None), (1, None, None), (3, [16, 32], None),
    (2, None, 4), (3, [16, 32], 5)])
def test_as_served_hands_plan_the_ids_the_hook_served(streams, prompts, hook):
    """trace_fit.as_served is the hook's rule written for `plan`: driven request by request,
    the hook hands every decode step the ids as_served wrote for it, also where the hook
    was set for more streams than a step decodes (``hook``: its streams spacing them)."""
    import trace_fit

    from expertcache_cli.rules.trace import Trace

    rng = np.random.default_rng(1)
    ids = np.stack([[rng.choice(32, 2, replace=False) for _ in range(2)]
                    for _ in range(20)])  # T20 L2 top-2, one stream
    tr = Trace(ids, 32, 2, step_tokens=np.ones(20, np.int64),
               requests=np.repeat(np.arange(4), 5)).validate()
    # without prompts as_served starts every request at row 0: a hook on one request
    routing = trace_routing.TraceRouting(ids, top_k=2, streams=hook or streams,
                                         starts=tr.request_starts() if prompts else None,
                                         one_stream=trace_routing.one_stream(tr))
    cls = type("FusedMoERouter", (Router,), {"select_experts": Router.select_experts})
    trace_routing.patch_router_class(cls, routing)
    layers = [cls(), cls()]
    steps_per_request, n_requests = 7, 3
    served = []
    for q in range(n_requests):
        prompt = prompts[q % len(prompts)] if prompts else 16
        for r in layers:  # the prefill (left out: decode only)
            r.select_experts(torch.zeros(prompt, 4), None)
        for _ in range(steps_per_request - 1):
            served.append([r.select_experts(torch.zeros(streams, 4), None)[1].reshape(-1)
                           .tolist() for r in layers])
    want = trace_fit.as_served(tr, streams, steps_per_request * n_requests, steps_per_request,
                               16, decode_only=True, prompt_tokens=prompts,
                               hook_streams=hook)
    assert (want.topk_ids[:, :, streams * 2:] == -1).all()  # a prefill's width, unused
    assert want.topk_ids[:, :, : streams * 2].tolist() == served
    assert want.request_ids().tolist() == [q for q in range(n_requests)
                                           for _ in range(steps_per_request - 1)]
