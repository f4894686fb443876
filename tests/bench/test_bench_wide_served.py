"""bench/wide_served.py: the ids the hook hands a wide-steps server, in its order, and plan's
formula on each timed round in the cache state the earlier forwards left."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="no torch: the routing hook it drives needs torch")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import wide_served  # noqa: E402

from expertcache_cli.rules.trace import Trace  # noqa: E402


def _one_stream(steps: int = 16, experts: int = 64, k: int = 2) -> Trace:
    """Row t routes experts 2t and 2t+1 (mod E): every row its own pair."""
    ids = (np.arange(steps)[:, None, None] * k + np.arange(k)) % experts
    ids = np.repeat(ids, 2, axis=1)  # two layers alike
    return Trace(ids.astype(np.int64), experts, k, expert_bytes=1000,
                 step_tokens=np.ones(steps, np.int64), source="recorded x").validate()


def test_the_schedule_times_each_rounds_decode_steps_only():
    plan = wide_served.schedule([1, 4], tokens=5)
    groups = [g for _, g in plan]
    assert groups.count(1) == 4 and groups.count(2) == 4  # a token each after the first
    timed = [t for t, g in plan if g == 2]
    assert timed == [4] * 4
    first = groups.index(2)
    assert plan[first - 1] == (4 * wide_served.STREAM_WORDS, 0)  # the round's prefill
    # the warm-up request and the TTFT prompts come first, as wide_steps.py sends them
    assert plan[0] == (wide_served.WARMUP_WORDS, 0)
    assert sum(1 for t, _ in plan if t == 8192) == wide_served.TTFT_RUNS


def test_the_hook_spaces_a_steps_streams_by_its_own_setting():
    tr = _one_stream()
    # a prefill (all experts), then decode steps of 2 streams on a hook set for 4
    st = wide_served.served(tr, [(40, 0), (2, 1), (2, 1)], hook_streams=4)
    first = st.topk_ids[0, 0]
    assert sorted(first[first >= 0].tolist()) == list(range(64))  # the router's: every expert
    # decode step 1: rows 1 and 1 + 16 // 4 = 5; step 2: rows 2 and 6
    assert st.topk_ids[1, 0][st.topk_ids[1, 0] >= 0].tolist() == [2, 3, 10, 11]
    assert st.topk_ids[2, 0][st.topk_ids[2, 0] >= 0].tolist() == [4, 5, 12, 13]
    assert st.step_tokens.tolist() == [40, 2, 2]
    assert "set for 4 streams" in st.source and st.source.startswith("recorded x")


def test_in_place_reads_a_wide_step_through_and_staged_prices_its_hits():
    from expertcache_cli.planning.planner import Inputs

    tr = _one_stream()
    plan = [(40, 0)] + [(1, 0)] * 15 + [(40, 0)] + [(4, 1)] * 3
    st = wide_served.served(tr, plan, hook_streams=4)
    groups = np.array([g for _, g in plan])
    inputs = Inputs(1_000_000, "b", 1.0, "l", 1000.0, "r", hit_copy_gbps=10.0)

    def at(n):
        return inputs if n == 4 else None

    # 4 streams x top-2 = 8 ids > 6 slots: wide; every routed expert read in place
    (ip,) = wide_served.predict(st, groups, [4], 6, "in-place", at)
    assert ip["misses_per_step_layer"] == 8 and ip["staged_hits_per_step_layer"] == 0
    # a token: 1 ms resident + 2 layers x 8 misses x 1 ms over the link / 4 tokens
    assert ip["predicted_tok_s"] == pytest.approx(1000 / 5) == ip["hits_free_tok_s"]
    (sg,) = wide_served.predict(st, groups, [4], 6, "staged-install", at)
    # the 1-stream steps left rows 10..15's experts in the six slots: some of each step hit
    assert sg["staged_hits_per_step_layer"] > 0
    assert sg["misses_per_step_layer"] + sg["staged_hits_per_step_layer"] == 8
    # each hit: 1 MB at 10 GB/s = 0.1 ms, on top of the hits-free prediction
    hits_ms = sg["staged_hits_per_step_layer"] * 2 / 4 * 0.1
    assert 1000 / sg["predicted_tok_s"] == pytest.approx(1000 / sg["hits_free_tok_s"] + hits_ms)
    assert wide_served.predict(st, groups, [4], 6, "in-place", lambda n: None) == []


def test_main_prints_each_arm_beside_its_prediction(tmp_path, capsys):
    tr = _one_stream()
    from expertcache_cli.rules import trace as tracefile

    path = tracefile.save(tr, tmp_path / "fit.npz")
    wsd = tmp_path / "ws"
    wsd.mkdir()
    (wsd / "size.json").write_text(json.dumps({"bytes_per_expert": 1_000_000}))
    (wsd / "probe.json").write_text((ROOT / "tests" / "data" / "fp8-block-probe.json")
                                    .read_text())
    for arm, rate in (("inplace", 5.0), ("staged", 9.0), ("resident", 50.0)):
        (wsd / f"{arm}.json").write_text(json.dumps(
            {"arm": arm, "decode": {"1": {"tok_s": rate}, "4": {"tok_s": 4 * rate}}}))
    assert wide_served.main([str(path), str(wsd), "--slots", "6", "--streams", "1", "4",
                             "--tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("routing: recorded x [as the hook served")
    assert "| 4 | in-place |" in out and "| 4 | staged-install |" in out
    assert "| staged |" not in out  # no staged0 arm ran
    assert "staged hits copied at 1,100 GB/s: not measured" in out
    assert wide_served.main([str(path), str(tmp_path / "none"), "--slots", "6"]) == 2
