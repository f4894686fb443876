"""The sweep: every expert of an armed layer through each path against the stock path, at
its first eager call and after new weights. It catches a slot wrong for an expert the
warm-up never routed, leaves a fresh cache and its counters as they were, sums itself up in
one line, and a layer failing once captured stops the server.
Stand-ins: tests/armed_standins.py. Skipped (with the reason) without torch.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="no torch: the plugin runtime tests need torch")

from armed_standins import (  # noqa: E402
    TOPK,
    E,
    Experts,
    H,
    arm,
    mark_swept,
    routing,
)

from expertcache_cli.config import CacheConfig  # noqa: E402
from expertcache_cli.rules.policy import LayerCache, Policy  # noqa: E402


def _corrupting(armed, expert):
    """Wrap the layer's cache step: every install of ``expert`` leaves its slot's bytes
    wrong (a slot the gather got wrong), every other expert's right."""
    step = armed.cache.step

    def corrupt(ids, sources, **kw):
        out = step(ids, sources, **kw)
        s = int(armed.cache.table[expert])
        if s >= 0:
            armed.cache.slots["w2_weight"][s] *= -1.0
        return out

    armed.cache.step = corrupt


def test_the_sweep_catches_a_wrong_expert_the_warm_up_never_routes(caplog):
    """vLLM's dummy warm-up routes every row to the same top_k experts: a check on it alone
    compares those few. The sweep routes every expert through the slots, so a slot that
    is wrong only for expert 13 is caught at the first call, named, and the layer serves
    the stock path; the check of the call alone (the sweep done) sees nothing."""
    ids = torch.tensor([[0, 1]] * 3, dtype=torch.int32)  # the warm-up's routing
    w, x = torch.rand(3, TOPK), torch.randn(3, H)
    want = Experts(seed=21).forward_modular(x=x, topk_weights=w, topk_ids=ids)

    blind = Experts(seed=21)
    armed = mark_swept(arm(blind))
    _corrupting(armed, 13)
    blind.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    assert armed.checked["slots"] == 0.0 and not armed._failed  # blind to expert 13

    layer = Experts(seed=21)
    armed = arm(layer)
    _corrupting(armed, 13)
    with caplog.at_level("ERROR", logger="vllm.expertcache"):
        got = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    torch.testing.assert_close(got, want)
    (sweep,) = armed.sweep_result.paths
    assert armed.sweep_result.failed and 13 in sweep.bad_experts and sweep.worst > 0.02
    assert "differs from the stock path's on experts [12, 13] of a synthetic step" in (
        caplog.text)
    assert "forward_modular" not in layer.__dict__


def test_the_sweep_leaves_a_fresh_cache_and_its_counters_as_they_were():
    """After the sweep the cache is what a fresh one is: the first real step installs what
    a fresh reference cache installs, the counters count only served steps; each sweep
    step computed at most S // top_k rows and never more than the call (its scratch:
    the rows' outputs)."""
    layer = Experts(seed=22)
    armed = arm(layer, slots=6)
    rows = []
    stock_forward = armed._stock

    def counting(**kw):
        rows.append(kw["x"].shape[0])
        return stock_forward(**kw)

    armed._stock = counting
    ids, w = routing(np.random.default_rng(22), 2)
    layer.forward_modular(x=torch.randn(2, H), topk_weights=w, topk_ids=ids)
    ref = LayerCache(E, 6, Policy.LRU)
    ref.step(ids.numpy())
    assert np.array_equal(armed.cache.ref.table, ref.table)
    assert np.array_equal(armed.cache.ref.slot_expert, ref.slot_expert)
    assert armed.cache.stats.tolist() == [len(set(ids.flatten().tolist()))] * 2
    assert int(armed.read_through) == int(armed.staged) == 0
    # sweep steps as wide as the call (2 rows of the 3 the slots take): 4 on slots and on
    # the stock path, then the call and its check
    assert [p.steps for p in armed.sweep_result.paths] == [4]
    assert rows == [2] * 8 + [2, 2]


def test_a_layer_failing_after_capture_stops_the_server_with_one_line(monkeypatch, caplog):
    """A captured graph replays the layer's cache path whatever the plugin does later: a
    failure once the path is captured stops the server (a SystemExit, which vLLM lets end
    the engine) with one critical line, rather than leave the graphs serving it. A
    failure while capturing, before any capture held the path, puts the layer back on the
    stock path as before (that graph captures the stock call)."""
    from expertcache_cli.plugin import runtime

    rng = np.random.default_rng(23)
    layer = Experts(seed=23)
    armed = arm(layer)
    ids, w = routing(rng, 1)
    layer.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)  # eager, swept
    assert armed.sweep_result is not None and not armed.captured
    monkeypatch.setattr(runtime, "_capturing", lambda: True)
    layer.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)  # captured
    monkeypatch.setattr(runtime, "_capturing", lambda: False)
    assert armed.captured

    def broken(*a, **k):
        raise RuntimeError("source moved")

    armed.cache.step = broken
    caplog.set_level("ERROR", logger="vllm.expertcache")
    with pytest.raises(SystemExit) as stop:
        layer.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
    assert isinstance(stop.value, runtime.CacheFault)
    lines = [r for r in caplog.records if r.levelname == "CRITICAL"]
    assert len(lines) == 1 and lines[0].getMessage() == str(stop.value)
    assert "\n" not in str(stop.value)
    assert str(stop.value).startswith(
        "expertcache: model.layers.5.mlp.experts: cache step failed (RuntimeError: source "
        "moved); its cache path is in vLLM's captured CUDA graphs")
    assert "the server stops rather than serve it" in str(stop.value)

    fresh = Experts(seed=24)
    armed = arm(fresh)
    fresh.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
    armed.cache.step = broken
    monkeypatch.setattr(runtime, "_capturing", lambda: True)
    x = torch.randn(1, H)
    out = fresh.forward_modular(x=x, topk_weights=w, topk_ids=ids)  # fails while capturing
    torch.testing.assert_close(out, Experts(seed=24).forward_modular(x, w, ids))
    assert armed._failed and not armed.captured


def test_one_line_sums_up_the_sweeps_and_their_time(caplog):
    """Once every armed layer has swept, one line says how many agreed, over how many
    experts and paths, and what it cost (steps and seconds); a layer that differed is
    counted as such and the line is a warning."""
    from expertcache_cli.plugin.session import Session

    caplog.set_level("INFO", logger="vllm.expertcache")
    layers = [Experts(seed=25), Experts(seed=26)]
    armed = [arm(layer) for layer in layers]
    sess = Session(CacheConfig(slots=6), [a.decision for a in armed], armed, None)
    _corrupting(armed[1], 15)
    ids, w = routing(np.random.default_rng(25), 1)
    layers[0].forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
    assert "check of every expert" not in caplog.text  # one layer of two swept
    layers[1].forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
    lines = [r for r in caplog.records if "check of every expert" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "WARNING"
    text = lines[0].getMessage()
    import re

    assert re.fullmatch(
        r"expertcache: startup check of every expert \(16 a layer, each through the slots and "
        r"the stock path\): 1 of 2 layers agreed \(largest row difference 0\), 1 differed and "
        r"went back to the stock path; 16 synthetic steps in \d+\.\d\d s", text), text
    assert sess.sweep_line() == text
