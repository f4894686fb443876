"""The plan check's device runner (bench/run_plan_check_on_device.sh) with every GPU step
stubbed: the resident baseline once, per trace a synthetic trace, `plan` with the probe and
the resident rate, one baseline over the budgets and the saved plan with the trace-routing
hook, and the comparison, run for real on what the stubs wrote. A recorded trace in traces/
is served on a checkpoint of its own top-k (its own probe and resident rate), the servers
route by it fitted to the layers, and `plan` (run for real here, on the CPU's numbers) is
given the ids as served. A second call starts nothing that is done. Device minutes are
few; a runner bug must not be found there."""

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
    log.write(" ".join(args) + "  RESTART=" + os.environ.get("EC_BENCH_TRACE_RESTART", "")
              + "  ENV=" + os.environ.get("EC_BENCH_TRACE_ROUTING", "") + "\n")
real = {**os.environ, "PYTHONPATH": os.environ["ROOT"]}  # this checkout's package
if args[0].endswith("plan_check.py") or args[0].endswith("trace_fit.py"):
    os.execve(os.environ["REAL_PY"], [os.environ["REAL_PY"], *args], real)
if args[0].endswith("write_checkpoint.py"):
    d = Path(args[1]); d.mkdir(parents=True)
    (d / "model.safetensors.index.json").write_text("{}")
    sys.exit(0)
mod = args[1:3]
if mod == ["expertcache_cli", "probe-link"]:
    Path(args[args.index("--save") + 1]).write_text("{}")
elif mod == ["expertcache_cli", "trace"]:
    Path(args[4]).write_bytes(b"npz")  # trace synth PATH ...
elif mod == ["expertcache_cli", "plan"] and "served" in args[3]:
    # a recorded trace as served: plan for real, on made-up rates in place of the probe,
    # the resident baseline and the checkpoint (the stubs wrote none)
    keep = [a for o in ("--slots", "--policy", "--save") for a in (o, args[args.index(o) + 1])]
    os.execve(os.environ["REAL_PY"], [os.environ["REAL_PY"], "-m", "expertcache_cli", "plan",
                                      args[3], "--link-gbps", "50", "--resident-tok-s", "400",
                                      *keep, "--json"], real)
elif mod == ["expertcache_cli", "plan"]:
    slots = [int(s) for s in args[args.index("--slots") + 1].split(",")]
    Path(args[args.index("--save") + 1]).write_text("{}")
    policy = args[args.index("--policy") + 1]
    rows = [{"policy": policy, "slots": s, "miss_rate": 0.5, "predicted_tok_s": 10.0 * s}
            for s in slots]
    print(json.dumps({"rows": rows, "recommended": {"per_layer_predicted_tok_s": 700.0},
                      "trace": {"path": args[3], "steps": 4000, "source": "synthetic, stub"}}))
elif mod == ["expertcache_cli", "baseline"]:
    out = Path(args[args.index("--out") + 1])
    arms = args[args.index("--arms") + 1].split(",")
    lines = [{"kind": "meta", "format": 1, "model": "m", "arms": arms,
              "runs": int(args[args.index("--runs") + 1]),
              "max_tokens": int(args[args.index("--max-tokens") + 1])}]
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
def full_runner(tmp_path):
    """The runner: ``run(**env)`` -> (calls, stdout), and its folder."""
    run = make_runner(tmp_path, "run_plan_check_on_device.sh",
                      ("plan_check.py", "trace_fit.py", "trace_routing.py"),
                      STUB, PC=str(tmp_path / "pc"), MODEL_DIR=str(tmp_path / "models"))
    return run, tmp_path


@pytest.fixture()
def runner(full_runner):
    run, tmp_path = full_runner
    return (lambda **extra: run(**extra)[0]), tmp_path


def _cmd(calls: list[str], what: str) -> list[str]:
    return [c for c in calls if what in c.split("  RESTART=")[0]]


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


def test_offload_arm_serves_the_floor_on_the_traces_routing_first(full_runner):
    run, tmp = full_runner
    calls, out = run(TRACES="zipf", LAYERS="24", PLAN_ARM="0", OFFLOAD_ARM="1")
    last = _cmd(calls, "expertcache_cli baseline")[-1]
    assert "--arms offload,cache:16,cache:32,cache:64 " in last
    assert last.endswith(f"ENV={tmp}/pc/zipf-24.npz")  # the floor routed as the cache arms
    assert "offload (the floor, same routing): 735.0 tok/s" in (
        tmp / "out" / "compare-zipf.txt").read_text()
    assert "OFFLOAD_ARM=1 bash bench/run_plan_check_on_device.sh" in out


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


RECORDED = "real-qwen3-30b-a3b-k6 real-gpt-oss-120b-k2"


@pytest.fixture()
def recorded(full_runner):
    """The runner with the bundled recordings in its tree's traces/: ``run(**env)`` -> the
    calls, ``run(expect_rc=2, **env)`` -> (the calls, stdout and stderr)."""
    run, tmp = full_runner
    (tmp / "tree" / "traces").symlink_to(ROOT / "traces")

    def go(expect_rc: int = 0, **extra: str):
        calls, out = run(expect_rc=expect_rc, **extra)
        return calls if expect_rc == 0 else (calls, out)

    return go, tmp


def test_a_recording_is_served_at_its_own_width_and_plan_replays_what_was_served(recorded):
    from expertcache_cli.rules import trace as tracefile

    run, tmp = recorded
    pc, models = tmp / "pc", tmp / "models"
    calls = run(TRACES=RECORDED, LAYERS="24", PLAN_ARM="0")
    # one checkpoint per top-k, none of the top-8 shape (no synthetic trace asked for)
    writes = [c.split("  RESTART=")[0] for c in _cmd(calls, "write_checkpoint.py")]
    assert writes == [f"bench/write_checkpoint.py {models}/model24-k6 --layers 24 --top-k 6",
                      f"bench/write_checkpoint.py {models}/model24-k2 --layers 24 --top-k 2"]
    probes = _cmd(calls, "probe-link")
    assert [p.split("--model ")[1].split()[0] for p in probes] == [
        f"{models}/model24-k6", f"{models}/model24-k2"]
    assert [p.split("--save ")[1].split()[0] for p in probes] == [
        f"{pc}/probe-k6.json", f"{pc}/probe-k2.json"]
    baselines = _cmd(calls, "expertcache_cli baseline")
    prompt = "--prompt " + RUNNER_PROMPT
    assert all(prompt in c for c in baselines)
    assert len(baselines) == 4
    # plan's resident input gets three times the arms' runs (RES_RUNS), the arms RUNS
    assert ["--runs 9 --max-tokens 200" in c for c in baselines] == [True, False] * 2
    assert ["--runs 3 --max-tokens 200" in c for c in baselines] == [False, True] * 2
    for (k, name), (res, arms) in zip((("6", "real-qwen3-30b-a3b-k6"),
                                       ("2", "real-gpt-oss-120b-k2")),
                                      (baselines[:2], baselines[2:]), strict=True):
        model = f"{models}/model24-k{k}"
        # the resident rate of this top-k's model, under the hook the cache arms run
        # (routed by the recording: the hook's per-layer cost is in plan's baseline too)
        assert res.split()[3] == model and "--arms resident " in res
        assert res.endswith(f"RESTART=1  ENV={pc}/{name}-24.npz")
        assert f"--out {pc}/bl-resident-24-k{k}.jsonl" in res
        # the budgets, on the same model, routed by the recording at 24 layers
        assert arms.split()[3] == model
        assert "--arms cache:16,cache:32,cache:64 " in arms
        assert arms.endswith(f"ENV={pc}/{name}-24.npz")
        served = tracefile.load(pc / f"{name}-24.npz")
        assert served.num_layers == 24 and served.top_k == int(k)
        assert served.source.startswith("recorded (real model")
        # plan: the ids as served (a warm-up and 3 requests of 200 steps, each from row 0
        # with a 16-token prefill), priced and checked by this model
        fits = [c.split("  RESTART=")[0] for c in _cmd(calls, "trace_fit.py") if name in c
                and "--shape" not in c]
        assert fits == [
            f"bench/trace_fit.py {tmp}/tree/traces/{name}.npz {pc}/{name}-24.npz --layers 24",
            f"bench/trace_fit.py {pc}/{name}-24.npz {pc}/{name}-24-served800.npz --layers 24 "
            "--streams 1 --steps 800 --request-steps 200 --prefill-tokens 16"]
        plan = next(c for c in _cmd(calls, "expertcache_cli plan") if name in c)
        assert plan.split()[3] == f"{pc}/{name}-24-served800.npz"
        assert f"--model {model} --probe {pc}/probe-k{k}.json" in plan
        assert f"--baseline {pc}/bl-resident-24-k{k}.jsonl" in plan
        given = tracefile.load(pc / f"{name}-24-served800.npz")
        assert given.steps == 800 and given.num_layers == 24 and given.top_k == int(k)
        assert int(given.step_tokens[0]) == 16 and int(given.step_tokens[200]) == 16
        compare = (tmp / "out" / f"compare-{name}.txt").read_text().splitlines()
        assert [x.split(":")[1] for x in compare[:3]] == ["16", "32", "64"]
        assert all("over the 597 decode steps the runs timed (after the warm-up)" in x
                   for x in compare[:3])
        for x in compare[:3]:  # the token's time beyond the formula's, from the same figures
            measured = float(x.split(", measured ")[1].split()[0])
            formula = float(x.split("after the warm-up): predicted ")[1].split()[0])
            gap = float(x.split(" ms a token against it")[0].rsplit("; ", 1)[1])
            # the printed tok/s are rounded to 0.1: their rounding bounds the check
            slack = 1e-3 + 1e3 * 0.05 * (1 / measured ** 2 + 1 / formula ** 2)
            assert gap == pytest.approx(1e3 / measured - 1e3 / formula, abs=slack)
        assert compare[3].endswith(": not measured")  # the saved plan: PLAN_ARM=0
    # the table over both traces, its command, each row's routing the recording's source
    table = (tmp / "out" / "plan-check-table.md").read_text()
    assert table.splitlines()[0] == (
        f'Reproduce: `TRACES="{RECORDED}" LAYERS=24 SLOTS=16,32,64 RUNS=3 POLICY=lru '
        'PLAN_ARM=0 bash bench/run_plan_check_on_device.sh`')
    rows = [x for x in table.splitlines() if x.startswith("| real-")
            and "not measured" not in x]
    assert len(rows) == 6 and sum("recorded (real model" in x for x in rows) == 2
    assert sum("| (as above) |" in x for x in rows) == 4
    assert all(x.split(" | ")[0] in ("| real-qwen3-30b-a3b-k6-24-served800",
                                     "| real-gpt-oss-120b-k2-24-served800") for x in rows)
    # the files copied off the box make the same table (plan's trace travels beside it)
    import shutil
    import subprocess
    import sys

    off = tmp / "copied"
    shutil.copytree(tmp / "out", off)
    shutil.move(pc, tmp / "pc-away")
    names = ("real-qwen3-30b-a3b-k6", "real-gpt-oss-120b-k2")
    files = [str(off / f) for n in names for f in (f"plan-{n}.json", f"bl-{n}-24.jsonl",
                                                    f"plan-{n}.saved.json")]
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_check.py"), "--table",
                        *files], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = [x for x in r.stdout.splitlines() if x.startswith("| real-")
           and "not measured" not in x]
    assert len(got) == 6 and all(x.split(" | ")[6] != "-" for x in got)
    assert [x.split(" | ")[6] for x in got] == [x.split(" | ")[6] for x in table.splitlines()
                                                 if x.startswith("| real-")
                                                 and "not measured" not in x]
    shutil.move(tmp / "pc-away", pc)
    # a second call: every file is there; the baselines resume with nothing left to run
    again = run(TRACES=RECORDED, LAYERS="24", PLAN_ARM="0")
    assert not _cmd(again, "write_checkpoint.py") and not _cmd(again, "probe-link")
    assert not _cmd(again, "expertcache_cli plan")
    assert not [c for c in _cmd(again, "trace_fit.py") if "--shape" not in c]
    assert all("--resume" in c for c in _cmd(again, "expertcache_cli baseline"))


RUNNER_PROMPT = (
    "w17 w923 w4410 w88 w5120 w3 w777 w2048 w60 w1999 w4096 w31 w8000 w12 w640 w5")


def test_the_recorded_traces_prompt_is_the_benchs_16_words():
    """One prompt across the bench's servers, of one KV block: never prefix-cached, so
    every request prefills the 16 tokens plan is given."""
    runner_text = (ROOT / "bench" / "run_plan_check_on_device.sh").read_text()
    card = (ROOT / "bench" / "small_card.py").read_text()
    assert f'PROMPT16="{RUNNER_PROMPT}"' in runner_text
    assert f'PROMPT = "{RUNNER_PROMPT}"' in card
    assert len(RUNNER_PROMPT.split()) == 16 and "PREFILL=16" in runner_text


def test_synthetic_and_recorded_traces_side_by_side(recorded):
    run, tmp = recorded
    calls = run(TRACES="tasks real-qwen3-30b-a3b-k6", LAYERS="24", PLAN_ARM="0")
    writes = [c.split()[1] for c in _cmd(calls, "write_checkpoint.py")]
    assert writes == [f"{tmp}/models/model24", f"{tmp}/models/model24-k6"]
    baselines = _cmd(calls, "expertcache_cli baseline")
    assert [c.split("--out ")[1].split()[0].split("/")[-1] for c in baselines] == [
        "bl-resident-24.jsonl", "bl-tasks-24.jsonl", "bl-resident-24-k6.jsonl",
        "bl-real-qwen3-30b-a3b-k6-24.jsonl"]
    # the synthetic servers keep baseline's own prompt; the recording's get the 16 words
    assert [("--prompt" in c) for c in baselines] == [False, False, True, True]
    # the synthetic trace is replayed whole by plan: one hook counter across requests; the
    # recording's requests each start at its row 0, as plan is given them
    assert "  RESTART=0  ENV=" in baselines[1] and "  RESTART=1  ENV=" in baselines[3]
    rows = [x for x in (tmp / "out" / "plan-check-table.md").read_text().splitlines()
            if (x.startswith("| tasks-24 |") or x.startswith("| real-"))
            and "not measured" not in x]
    assert len(rows) == 6 and "| synthetic, stub |" in rows[0]


def test_a_trace_that_is_not_there_is_one_line_and_exit_2_before_anything(recorded):
    run, tmp = recorded
    calls, out = run(expect_rc=2, TRACES="tasks real-nope")
    assert calls == []
    line = out.strip()
    assert line.startswith("TRACES: real-nope: no such trace (tasks, zipf, none, or a "
                           "recording in traces/: ") and "real-qwen3-30b-a3b-k6" in line
    assert "\n" not in line


def test_a_recording_of_64_experts_and_four_prompts_is_served_as_recorded(recorded):
    """OLMoE's recording: a checkpoint of 64 experts top-8, the budgets scaled to them, and
    a prompt of its own a request, whose length picks the recorded request replayed."""
    from expertcache_cli.rules import trace as tracefile

    run, tmp = recorded
    pc, models = tmp / "pc", tmp / "models"
    name = "real-olmoe-1b-7b-k8"
    calls = run(TRACES=name, LAYERS="24", PLAN_ARM="0")
    writes = [c.split("  RESTART=")[0] for c in _cmd(calls, "write_checkpoint.py")]
    assert writes == [f"bench/write_checkpoint.py {models}/model24-k8-e64 --layers 24 "
                      "--top-k 8 --experts 64"]
    res, arms = _cmd(calls, "expertcache_cli baseline")
    assert f"--out {pc}/bl-resident-24-k8-e64.jsonl" in res
    assert "--arms cache:8,cache:16,cache:32 " in arms  # 16/32/64 of 128 -> of 64
    # the warm-up and the 3 runs: four prompts of 16, 24, 32 and 40 words, none alike
    prompts = arms.split("--prompt ")[1:]
    words = [p.split(" --")[0].split() for p in prompts]
    assert [len(w) for w in words] == [16, 24, 32, 40]
    assert len({w[0] for w in words}) == 4 and res.count("--prompt ") == 4
    fits = [c.split("  RESTART=")[0] for c in _cmd(calls, "trace_fit.py")
            if "--shape" not in c]
    assert fits[1].endswith("--prefill-tokens 16 --prompt-tokens 16,24,32,40")
    given = tracefile.load(pc / f"{name}-24-served800.npz")
    src = tracefile.load(ROOT / "traces" / f"{name}.npz")
    # request q replays recorded request (16 + 8q) // 8 mod 4 = 2, 3, 0, 1 from its first
    # row (its prefill's place), then on: row 1 of each request is its first decode step
    starts = src.request_starts()
    for q, recorded_request in enumerate((2, 3, 0, 1)):
        assert int(given.step_tokens[q * 200]) == 16  # its prefill, which plan leaves out
        assert given.topk_ids[q * 200 + 1, 0, :8].tolist() == \
            src.topk_ids[starts[recorded_request] + 1, 0, :8].tolist()
    plan = next(c for c in _cmd(calls, "expertcache_cli plan") if name in c)
    assert "--slots 8,16,32 " in plan and f"--probe {pc}/probe-k8-e64.json" in plan
