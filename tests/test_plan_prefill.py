"""`plan` prices decode steps only: a recorded request's prefill is replayed (it warms the
cache decode then hits) but its fetches and tokens stay out of the predicted decode rate.

The expected numbers are computed here from the reference cache (`policy.LayerCache`, step
by step: `prefill_trace.reference_misses`) and the time model written out, not by the
engine or the planner under test.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from prefill_trace import (
    BYTES,
    DECODE_STEPS,
    LAYERS,
    PREFILL_TOKENS,
    prefill_trace,
    reference_misses,
)

from expertcache_cli.planning import planner
from expertcache_cli.rules.policy import Policy
from expertcache_cli.rules.trace import Trace

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "traces" / "real-qwen3-30b-a3b-k6.npz"
LINK, RESIDENT, STEP_US = 25.0, 200.0, 3.5


def _tok_s(misses: int, steps: int, tokens: int, layers: int = LAYERS) -> float:
    """The time model (planner's docstring), written out: resident time, the cache's step
    in every MoE layer every step, and the misses' bytes over the link, a token."""
    ms = (1000.0 / RESIDENT + layers * steps / tokens * STEP_US / 1000.0
          + 1000.0 * (misses / tokens) * BYTES / (LINK * 1e9))
    return 1000.0 / ms


def _plan(trace: Trace, slots: list[int]) -> planner.PlanReport:
    inputs = planner.Inputs(BYTES, "t", LINK, "t", RESIDENT, "t", step_us=STEP_US)
    return planner.plan_trace(trace, inputs, [Policy.LRU, Policy.LFU], slots, fits_upto=None,
                              model={"name": "t"}, serve_model="/m", vram_gb=None)


@pytest.mark.parametrize("policy", [Policy.LRU, Policy.LFU])
def test_plan_prices_the_decode_steps_after_the_prefill_warmed_the_cache(policy):
    t = prefill_trace()
    rep = _plan(t, [16, 56])
    rows = {r["slots"]: r for r in rep.rows if r["policy"] == policy.name.lower()}
    decode = range(1, t.steps)
    for slots in (16, 56):
        misses = reference_misses(t, policy, slots, decode)
        want = _tok_s(misses, DECODE_STEPS, DECODE_STEPS)
        assert rows[slots]["predicted_tok_s"] == pytest.approx(want, rel=1e-12)
        assert rows[slots]["misses_per_token"] == pytest.approx(misses / DECODE_STEPS)
        # priced as before (every step, the prefill's tokens too) it would differ
        every = reference_misses(t, policy, slots, range(t.steps))
        before = _tok_s(every, t.steps, DECODE_STEPS + PREFILL_TOKENS)
        assert abs(before / want - 1) > 0.02
    # at 56 slots the prefill installed experts that decode then hit: a cold cache
    # would have fetched them in decode
    cold = dataclasses.replace(t, topk_ids=t.topk_ids[1:], step_tokens=t.step_tokens[1:])
    assert reference_misses(cold, policy, 56, range(cold.steps)) > \
        reference_misses(t, policy, 56, decode)
    assert (rep.trace["decode_steps"], rep.trace["decode_tokens"]) == (DECODE_STEPS,
                                                                       DECODE_STEPS)
    assert (rep.trace["prefill_steps"], rep.trace["prefill_tokens"]) == (1, PREFILL_TOKENS)
    assert not any("step_tokens" in n for n in rep.notes)


def test_a_decode_only_trace_is_priced_as_before():
    t = prefill_trace()
    dec = dataclasses.replace(t, topk_ids=t.topk_ids[1:], step_tokens=t.step_tokens[1:])
    rep = _plan(dec, [16, 56])
    for r in rep.rows:
        misses = reference_misses(dec, Policy.parse(r["policy"]), r["slots"],
                                   range(dec.steps))
        # every step and every token, as plan priced any trace before prefills were told
        assert r["predicted_tok_s"] == pytest.approx(
            _tok_s(misses, dec.steps, int(dec.step_tokens.sum())), rel=1e-12)
    assert rep.trace["prefill_steps"] == 0 and rep.trace["decode_steps"] == dec.steps
    # a trace that cannot tell (no step_tokens) is priced the same, and says so once
    unknown = _plan(dataclasses.replace(dec, step_tokens=None), [16, 56])
    assert [r["predicted_tok_s"] for r in unknown.rows] == \
        [r["predicted_tok_s"] for r in rep.rows]
    assert unknown.trace["prefill_steps"] is None
    assert sum("step_tokens" in n for n in unknown.notes) == 1


def test_plan_says_how_many_prefill_steps_it_left_out_of_the_pricing():
    args = [sys.executable, "-m", "expertcache_cli", "plan", str(REAL), "--link-gbps", "25.6",
            "--resident-tok-s", "150", "--slots", "32,64", "--policy", "lru"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300,
                       env={"COLUMNS": "200", "PATH": "/usr/bin:/bin",
                            "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stdout.splitlines() if x.startswith("priced:")]
    assert line == ["priced: 128 decode steps, 128 tokens; 1 prefill step (28 tokens) "
                    "replayed, not priced"]
    j = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=300)
    assert j.returncode == 0, j.stderr
    plan = json.loads(j.stdout)
    assert {k: plan["trace"][k] for k in ("steps", "tokens", "decode_steps", "decode_tokens",
                                          "prefill_steps", "prefill_tokens")} == {
        "steps": 129, "tokens": 156, "decode_steps": 128, "decode_tokens": 128,
        "prefill_steps": 1, "prefill_tokens": 28}
    rec = plan["recommended"]
    # the per-layer split is chosen and priced on the same decode misses as the rows
    if rec["per_layer_misses_saved"] == 0:
        assert rec["per_layer_predicted_tok_s"] == pytest.approx(rec["predicted_tok_s"])
    else:
        assert rec["per_layer_predicted_tok_s"] > rec["predicted_tok_s"]
