"""Step groups: `Trace.step_kinds` tells a prefill from decode, and the replay engine
counts each group of steps apart in one pass (`engine.sweep`'s ``groups``, `replay`'s
``by_group``), checked against the reference cache step by step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from prefill_trace import DECODE_STEPS, LAYERS, E, prefill_trace, reference_misses

from expertcache_cli.rules import engine
from expertcache_cli.rules.policy import Policy
from expertcache_cli.rules.replay import replay
from expertcache_cli.rules.trace import DECODE, PREFILL


def test_a_step_wider_than_the_decode_batch_is_a_prefill():
    t = prefill_trace()
    assert list(t.step_kinds()) == [PREFILL] + [DECODE] * DECODE_STEPS
    # a re-batched or synthetic batch runs every step at its streams: all decode
    assert not np.any(dataclasses.replace(t, step_tokens=np.full(t.steps, 4)).step_kinds())
    # the decode batch is the commonest width (the narrowest on a tie)
    wide = dataclasses.replace(t, step_tokens=np.array([28, 4, 4, 1] + [4] * 36 + [8]))
    assert list(np.nonzero(wide.step_kinds())[0]) == [0, t.steps - 1]
    tie = dataclasses.replace(t, step_tokens=np.array([2, 1] * 20 + [5]))
    assert list(np.nonzero(tie.step_kinds())[0]) == list(range(0, 40, 2)) + [40]
    # without step_tokens a trace cannot tell (a recorded prefill row holds distinct ids)
    assert dataclasses.replace(t, step_tokens=None).step_kinds() is None


def test_the_engine_counts_each_step_group_in_one_pass():
    t = prefill_trace()
    seq = np.ascontiguousarray(t.topk_ids[:, 1])
    widths = t.gate_widths()
    every = np.arange(t.steps)
    for slots in (16, 56):
        (c,) = engine.sweep(t.topk_ids[:, 1:2], E, [Policy.LRU], [slots],
                            widths=widths[:, 1:2], groups=every)
        per_step = engine.installs_per_step(seq, E, Policy.LRU, slots, widths=widths[:, 1])
        assert [c.group(s).installs for s in every] == list(per_step)
        for f in engine.LayerCounts.__dataclass_fields__:
            if f not in ("policy", "slots", "layer", "by_group"):
                assert getattr(c, f) == sum(getattr(c.group(s), f) for s in every), f
        # without groups: the same totals, no parts
        (whole,) = engine.sweep(t.topk_ids[:, 1:2], E, [Policy.LRU], [slots],
                                widths=widths[:, 1:2])
        assert whole.by_group == () and whole == dataclasses.replace(c, by_group=())
    with pytest.raises(ValueError, match="label each"):
        engine.sweep(t.topk_ids, E, [Policy.LRU], [16], groups=np.zeros(3))


def test_replay_reports_decode_and_prefill_apart():
    t = prefill_trace()
    rep = replay(t, [Policy.LRU], [16, 56])
    dec, pre = rep.group(DECODE), rep.group(PREFILL)
    for i, slots in enumerate((16, 56)):
        assert dec["misses"][i] == reference_misses(t, Policy.LRU, slots, range(1, t.steps))
        assert pre["misses"][i] == reference_misses(t, Policy.LRU, slots, range(1))
        assert dec["misses"][i] + pre["misses"][i] == rep.results["misses"][i]
    # 48 ids are wider than 16 slots: the prefill reads through; 56 slots serve it
    assert list(pre["read_through_steps"]) == [LAYERS, 0]
    assert list(dec["read_through_steps"]) == [0, 0]
