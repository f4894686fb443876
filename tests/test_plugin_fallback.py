"""The slot path can never take a server down: a call that raises or computes something
else on the slot buffers is caught at its first call (first rows of a wide step, never an
all-zero step, never fooled by a reused workspace) and served stock, and bookkeeping that
fails never stops serving. Stand-ins: tests/armed_standins.py. Skipped without torch.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="no torch: the plugin runtime tests need torch")

from armed_standins import (  # noqa: E402
    E,
    Experts,
    H,
    arm,
    mark_swept,
    routing,
)

from expertcache_cli.config import CacheConfig  # noqa: E402


def _one_call_with_a_slot_variant(caplog, seed, variant, swept=False):
    """Arm a layer whose experts call is ``variant(out, on_slots)`` of the stock one, serve
    one decode step (``swept``: with the sweep of every expert marked done); returns the
    armed layer, what it served and what the stock path gives."""
    layer = Experts(seed=seed)
    armed = arm(layer)
    if swept:
        mark_swept(armed)
    assert "forward_modular" in layer.__dict__  # the instance hook is installed
    stock_forward = Experts.forward_modular

    def changed(self, x, topk_weights, topk_ids, **kw):
        return variant(lambda: stock_forward(self, x, topk_weights, topk_ids, **kw),
                       self.w13_weight.shape[0] != E)

    armed._stock = changed.__get__(layer)
    x = torch.randn(1, H)
    ids, w = routing(np.random.default_rng(seed), 1)
    with caplog.at_level("ERROR", logger="vllm.expertcache"):
        out = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    want = Experts(seed=seed).forward_modular(x=x, topk_weights=w, topk_ids=ids)
    assert layer.w13_weight.shape[0] == E  # the full tensors are back
    return layer, armed, out, want


def test_an_experts_call_that_raises_on_slot_buffers_falls_back_and_disarms(caplog):
    """The stock kernel refusing the slot buffers (any exception, at serve time) sends the
    layer back to the stock path; the call is served from there."""
    def picky(call, on_slots):
        if on_slots:
            raise RuntimeError("illegal memory access (stand-in)")
        return call()

    layer, _, out, want = _one_call_with_a_slot_variant(caplog, 4, picky)
    torch.testing.assert_close(out, want)
    assert "experts call on slots failed (RuntimeError: illegal memory access" in caplog.text
    assert "forward_modular" not in layer.__dict__


@pytest.mark.parametrize("swept", [False, True])
def test_a_slot_path_that_computes_something_else_is_caught_at_its_first_call(caplog, swept):
    """A quant method whose kernel reads something the rebinding does not follow (here: a
    stand-in that scales its output when it sees slot-shaped weights) gives a different output;
    the sweep of every expert at the first call catches it before the call is served (and,
    were the sweep done, the check of the call itself would), and the stock output is
    served."""
    def off_by_one(call, on_slots):
        return call() * 1.5 if on_slots else call()

    layer, armed, out, want = _one_call_with_a_slot_variant(caplog, 5, off_by_one, swept)
    torch.testing.assert_close(out, want)
    if swept:
        assert armed.checked["slots"] > 0.02
        assert "the slots path's output differs from the stock path's on the same step" in (
            caplog.text)
    else:
        assert armed.sweep_result.failed and armed.checked["slots"] is None
        assert ("the slots path's output differs from the stock path's on experts [0, 1] of "
                "a synthetic step (relative difference of a row 0.5 > 0.02); layer back on "
                "the stock path") in caplog.text
    assert "forward_modular" not in layer.__dict__


def test_all_zero_steps_do_not_count_as_checked():
    """vLLM's dummy runs feed zeros: equal outputs that prove nothing; the check waits for
    a real step, and gives up after CHECK_ATTEMPTS such steps."""
    from expertcache_cli.plugin import runtime

    layer = Experts(seed=6)
    for bias in ("w13_bias", "w2_bias"):
        getattr(layer, bias).data.zero_()
    armed = arm(layer)
    ids, w = routing(np.random.default_rng(6), 1)
    layer.forward_modular(x=torch.zeros(1, H), topk_weights=w, topk_ids=ids)
    assert armed.checked["slots"] is None
    assert armed._check_attempts["slots"] == runtime.CHECK_ATTEMPTS - 1
    layer.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
    assert armed.checked["slots"] == 0.0


def test_the_staged_path_is_checked_at_its_first_wide_step():
    layer = Experts(seed=7)
    armed = arm(layer, slots=6, wide_inserts=6)
    ids, w = routing(np.random.default_rng(7), 5)  # 10 ids > 6 slots: staged
    out = layer.forward_modular(x=torch.randn(5, H), topk_weights=w, topk_ids=ids)
    assert out.shape == (5, H) and armed.checked == {"slots": None, "scratch": 0.0}


def test_the_check_reruns_only_the_first_rows_of_a_wide_step(monkeypatch):
    """The reference call of the check runs the stock path on the first CHECK_ROWS tokens
    only (its activations would add to vLLM's profile peak); the path's output is served
    whole, and it agrees with a full stock call."""
    from expertcache_cli.plugin import runtime

    monkeypatch.setattr(runtime, "CHECK_ROWS", 2)
    layer = Experts(seed=7)
    armed = mark_swept(arm(layer, slots=6, wide_inserts=6))
    seen = []
    stock_forward = armed._stock

    def counting(**kw):
        seen.append((kw["topk_ids"].shape[0], kw["topk_weights"].shape[0], kw["x"].shape[0]))
        return stock_forward(**kw)

    armed._stock = counting
    ids, w = routing(np.random.default_rng(7), 5)  # 10 ids > 6 slots: staged
    x = torch.randn(5, H)
    want = Experts.forward_modular(layer, x.clone(), w, ids)
    out = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    assert seen == [(5, 5, 5), (2, 2, 2)]  # the path (on the scratch), then 2 rows
    assert armed.checked["scratch"] == 0.0
    torch.testing.assert_close(out, want)


def test_a_failed_check_on_first_rows_serves_the_whole_stock_step(monkeypatch, caplog):
    """A path that computes something else, caught on the first rows: the whole step is
    served from the stock path (every row, not the reference's few)."""
    from expertcache_cli.plugin import runtime

    monkeypatch.setattr(runtime, "CHECK_ROWS", 2)
    layer = Experts(seed=8)
    armed = mark_swept(arm(layer, slots=6, wide_inserts=6))
    stock_forward = armed._stock

    def wrong_on_scratch(**kw):
        out = stock_forward(**kw)
        return out * 1.5 if layer.w13_weight.data_ptr() != armed.layer_w13_ptr else out

    armed.layer_w13_ptr = layer.w13_weight.data_ptr()
    armed._stock = wrong_on_scratch
    ids, w = routing(np.random.default_rng(8), 5)
    x = torch.randn(5, H)
    want = Experts.forward_modular(layer, x.clone(), w, ids)
    with caplog.at_level(logging.ERROR, logger="vllm.expertcache"):
        out = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    assert armed.checked["scratch"] > 0.02
    assert out.shape == (5, H)
    torch.testing.assert_close(out, want)
    assert "the scratch path's output differs" in caplog.text


def test_output_difference():
    from expertcache_cli.plugin.runtime import output_difference as diff

    a = torch.randn(4, 3)
    assert diff(a, a.clone()) == 0.0
    assert diff((a, a), (a, a + 0.1)) > 0
    assert diff(a * 1.001, a) == pytest.approx(0.001, rel=1e-3)
    assert diff("deferred", a) is None and diff(a, a[:2]) is None
    assert diff(torch.zeros(2), torch.zeros(2)) is None  # nothing proven
    assert diff(torch.ones(2), torch.zeros(2)) == float("inf")
    bad = a.clone()
    bad[0, 0] = float("nan")
    assert diff(bad, a) == float("inf")
    # padded rows are garbage on both paths: left out
    keep = torch.tensor([True, True, False, True])
    skewed = a.clone()
    skewed[2] += 100
    assert diff(skewed, a, keep) == 0.0
    assert diff((a, None), (a, None)) == 0.0


def test_row_differences():
    """Per row: one wrong row stands out at its own size however many rows agree; a row
    the reference left at zero proves nothing (not covered) unless the path's is not
    zero; non-finite values the reference has not differ by inf; shared experts' tuples
    compare row by row over their tensors."""
    from expertcache_cli.plugin.runtime import output_difference, row_differences

    a = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    wrong = a.clone()
    wrong[5] *= 1.5
    d, covered = row_differences(wrong, a, 32)
    assert d[5] == pytest.approx(0.5) and float(d[torch.arange(32) != 5].max()) == 0.0
    assert bool(covered.all())
    # over the step, the same row is diluted by the other 31
    assert output_difference(wrong, a) == pytest.approx(0.5 * float(a[5].norm() / a.norm()))
    assert output_difference(wrong, a) < 0.2
    zero = a.clone()
    zero[3] = 0
    d, covered = row_differences(zero, zero, 32)
    assert not bool(covered[3]) and int(covered.sum()) == 31 and float(d.max()) == 0.0
    off = zero.clone()
    off[3, 0] = 1.0
    d, _ = row_differences(off, zero, 32)
    assert d[3] == float("inf")
    nan = a.clone()
    nan[7, 2] = float("nan")
    d, _ = row_differences(nan, a, 32)
    assert d[7] == float("inf") and float(d[:7].max()) == 0.0
    d, covered = row_differences((a, wrong), (a, a), 32)
    assert d[5] > 0 and float(d[:5].max()) == 0.0 and bool(covered.all())
    assert row_differences("deferred", a, 32) is None
    assert row_differences(a, a, 16) is None  # no tensor with the step's rows


# -- kernel attributes that alias layer parameters (Marlin's g_idx) -----------------------


@pytest.mark.parametrize("swept", [False, True])
def test_the_check_is_not_fooled_by_an_output_in_a_reused_workspace(swept):
    """A kernel returning a view of a workspace the next call overwrites would make the
    reference call overwrite the path's output (equal by aliasing): the sweep and the
    check compare a copy, and serve that copy."""
    layer = Experts(seed=14)
    armed = arm(layer)
    if swept:
        mark_swept(armed)
    workspace = torch.zeros(8, H)
    stock_forward = Experts.forward_modular

    def in_workspace(self, x, topk_weights, topk_ids, **kw):
        out = stock_forward(self, x, topk_weights, topk_ids, **kw)
        if self.w13_weight.shape[0] != E:
            out = out * 1.5  # the slot path computes something else
        view = workspace[:x.shape[0]]
        view.copy_(out)
        return view

    armed._stock = in_workspace.__get__(layer)
    ids, w = routing(np.random.default_rng(14), 1)
    layer.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
    assert "forward_modular" not in layer.__dict__
    if swept:
        assert armed.checked["slots"] > 0.02
    else:
        assert armed.sweep_result.failed and armed.sweep_result.paths[0].worst > 0.02


def test_bookkeeping_that_fails_never_takes_serving_down(caplog):
    """A periodic report or a trace drain that raises is logged once and stops; the step
    goes on, and shutdown still logs the final counters."""
    from expertcache_cli.plugin.session import Session

    layer = Experts(seed=15)
    armed = arm(layer)

    class BadRecorder:
        calls = 0

        def maybe_flush(self):
            BadRecorder.calls += 1
            raise OSError("disk full")

    sess = Session(CacheConfig(slots=6, stats_every=1), [armed.decision], [armed],
                   BadRecorder())

    def broken():
        raise RuntimeError("no pinned memory")

    sess._counter_rows = broken
    caplog.set_level("INFO", logger="vllm.expertcache")
    for _ in range(3):
        sess.after_step()
    assert caplog.text.count("periodic stats failed (RuntimeError: no pinned memory)") == 1
    assert caplog.text.count("draining the routing trace failed (OSError: disk full)") == 1
    assert BadRecorder.calls == 1 and sess.cfg.stats_every == 0
    del sess._counter_rows  # the final report reads the real counters
    sess.recorder = None
    sess.close()
    assert "final hit rate" in caplog.text


def test_the_first_agreeing_check_is_announced_once_a_process(monkeypatch, caplog):
    from expertcache_cli.plugin import runtime

    monkeypatch.setattr(runtime, "_ANNOUNCED", {})
    caplog.set_level("INFO", logger="vllm.expertcache")
    layers = [Experts(seed=16), Experts(seed=17)]
    for layer in layers:
        arm(layer)
        ids, w = routing(np.random.default_rng(16), 1)
        layer.forward_modular(x=torch.randn(1, H), topk_weights=w, topk_ids=ids)
    lines = [r for r in caplog.records if "agreed with the stock path" in r.getMessage()
             and r.levelname == "INFO"]
    assert len(lines) == 1 and "every armed layer is checked once" in lines[0].getMessage()


# -- the sweep of every expert, and failures once captured --------------------------------
