"""The plan check's device runner (bench/run_plan_check_on_device.sh) with every GPU step
stubbed: the resident baseline once, per trace a synthetic trace, `plan` with the probe and
the resident rate, one baseline over the budgets and the saved plan with the trace-routing
hook, and the comparison, run for real on what the stubs wrote. A second call starts
nothing that is done. Device minutes are few; a runner bug must not be found there."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_runner_harness import make_runner

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("httpx", reason="the comparison reads baseline files with the bench's client")

STUB = r'''#!/usr/bin/env python3
"""python3 for the runner: GPU steps recorded and faked, the comparison run for real."""
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(" ".join(args) + "  ENV=" + os.environ.get("EC_BENCH_TRACE_ROUTING", "") + "\n")
if args[0].endswith("plan_check.py"):
    os.execv(os.environ["REAL_PY"], [os.environ["REAL_PY"], *args])
if args[0].endswith("write_checkpoint.py"):
    d = Path(args[1]); d.mkdir(parents=True)
    (d / "model.safetensors.index.json").write_text("{}")
    sys.exit(0)
mod = args[1:3]
if mod == ["expertcache_cli", "probe-link"]:
    Path(args[args.index("--save") + 1]).write_text("{}")
elif mod == ["expertcache_cli", "trace"]:
    Path(args[4]).write_bytes(b"npz")  # trace synth PATH ...
elif mod == ["expertcache_cli", "plan"]:
    slots = [int(s) for s in args[args.index("--slots") + 1].split(",")]
    Path(args[args.index("--save") + 1]).write_text("{}")
    policy = args[args.index("--policy") + 1]
    rows = [{"policy": policy, "slots": s, "miss_rate": 0.5, "predicted_tok_s": 10.0 * s}
            for s in slots]
    print(json.dumps({"rows": rows, "recommended": {"per_layer_predicted_tok_s": 700.0}}))
elif mod == ["expertcache_cli", "baseline"]:
    out = Path(args[args.index("--out") + 1])
    arms = args[args.index("--arms") + 1].split(",")
    lines = [{"kind": "meta", "format": 1, "model": "m", "arms": arms, "runs": 1}]
    for arm in arms:  # measured: 5% above every prediction
        tok = 50.0 if arm == "resident" else (
            10.5 * int(arm.split(":")[1]) if arm.startswith("cache:") else 735.0)
        lines += [{"kind": "run", "arm": arm, "restart": 0, "run": 0, "tok_s": tok,
                   "ttft_s": 0.1, "tokens": 8, "server_id": "s-" + arm},
                  {"kind": "counters", "arm": arm, "restart": 0,
                   "counters": {"hit_rate": 0.9}}]
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
'''


@pytest.fixture()
def runner(tmp_path):
    run = make_runner(tmp_path, "run_plan_check_on_device.sh", ("plan_check.py",), STUB,
                      PC=str(tmp_path / "pc"), MODEL_DIR=str(tmp_path / "models"))
    return (lambda **extra: run(**extra)[0]), tmp_path


def _cmd(calls: list[str], what: str) -> list[str]:
    return [c for c in calls if what in c.split("  ENV=")[0]]


def test_one_resident_baseline_then_plan_and_baseline_per_trace(runner):
    run, tmp = runner
    calls = run(TRACES="tasks zipf", LAYERS="24")
    baselines = _cmd(calls, "expertcache_cli baseline")
    assert len(baselines) == 3
    assert "--arms resident " in baselines[0] and baselines[0].endswith("ENV=")
    for kind, call in zip(("tasks", "zipf"), baselines[1:], strict=True):
        arms = call.split("--arms ")[1].split()[0]
        assert arms == f"cache:16,cache:32,cache:64,plan:{tmp}/pc/plan-{kind}-24.json"
        assert call.endswith(f"ENV={tmp}/pc/{kind}-24.npz")  # routing from the trace
    assert all("--cpu-offload-gb 31" in c for c in baselines)  # 24 layers x 1.25 + 1
    plans = _cmd(calls, "expertcache_cli plan")
    assert len(plans) == 2 and all(f"--baseline {tmp}/pc/bl-resident-24.jsonl" in p
                                   for p in plans)
    for kind in ("tasks", "zipf"):
        lines = (tmp / "out" / f"compare-{kind}.txt").read_text().splitlines()
        assert len(lines) == 4 and all("(1.050, met: 10%)" in line for line in lines), lines
    # a second call: the checkpoint, probe, traces, plans and baselines are all there
    again = run(TRACES="tasks zipf", LAYERS="24")
    assert not _cmd(again, "write_checkpoint.py") and not _cmd(again, "probe-link")
    assert not _cmd(again, "expertcache_cli plan") and not _cmd(again, "trace synth")
    assert all("--resume" in c for c in _cmd(again, "expertcache_cli baseline"))


def test_traces_none_measures_only_the_resident_rate(runner):
    run, _ = runner
    calls = run(TRACES="none", LAYERS="8")
    assert [c.split("--arms ")[1].split()[0] for c in _cmd(calls, "baseline")] == ["resident"]
    assert not _cmd(calls, "expertcache_cli plan")


def test_plan_arm_can_be_left_out_and_a_copied_resident_baseline_is_reused(runner):
    run, tmp = runner
    (tmp / "pc").mkdir(parents=True, exist_ok=True)
    src = ROOT / "tests/data/plan-check-resident-24.jsonl"
    (tmp / "pc/bl-resident-24.jsonl").write_text(src.read_text())
    calls = run(TRACES="zipf", LAYERS="24", PLAN_ARM="0")
    baselines = _cmd(calls, "expertcache_cli baseline")
    # the copied resident file is complete: resumed, nothing left to run in it
    assert "--arms cache:16,cache:32,cache:64 " in baselines[-1]
    assert not any("plan:" in c for c in baselines)


def test_another_policy_plans_and_serves_it_beside_the_lru_files(runner):
    run, tmp = runner
    run(TRACES="zipf", LAYERS="24", PLAN_ARM="0")
    calls = run(TRACES="zipf", LAYERS="24", PLAN_ARM="0", POLICY="lfu")
    plans = _cmd(calls, "expertcache_cli plan")
    assert len(plans) == 1 and "--policy lfu" in plans[0]
    assert f"--save {tmp}/pc/plan-zipf-lfu-24.json" in plans[0]
    baselines = _cmd(calls, "expertcache_cli baseline")
    assert "--arms cache:16:lfu,cache:32:lfu,cache:64:lfu " in baselines[-1]
    assert f"--out {tmp}/pc/bl-zipf-lfu-24.jsonl" in baselines[-1]
    assert "--resume" not in baselines[-1]  # not the LRU run's file
    lines = (tmp / "out" / "compare-zipf-lfu.txt").read_text().splitlines()
    assert [line.split(":")[0] + ":" + line.split(":")[1] for line in lines[:3]] == [
        "cache:16", "cache:32", "cache:64"]
    assert all(":lfu: predicted" in line and "(1.050, met: 10%)" in line
               for line in lines[:3]), lines
