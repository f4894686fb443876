"""The formats runner's flow (bench/run_formats_on_device.sh) with every GPU step stubbed:
which arms it starts for an armed, a declined and a sent-back format, that it writes each
checkpoint only when an arm still needs it and removes it when done, and that a second call
runs nothing. Device minutes are few; a runner bug must not be found on the device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_runner_harness import make_runner

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("httpx", reason="the formats report imports the bench's server client")

ARMED = "expertcache: vLLM 0.26.0: armed 8 of 8 MoE layers; 32 of 128 experts/layer as slots"
DECLINED = ("expertcache: vLLM 0.26.0: armed 0 of 8 MoE layers (experts kernel MarlinExperts "
            "is not known to index weights by id only)")

# what each stubbed server's record says: (startup line, first-call check line)
ARMS = {
    "fp8-block-cache": (ARMED, "slots path 8 of 8 layers agreed (largest relative difference 0)"),
    "fp8-block-hot": (ARMED, "slots path 8 of 8 layers agreed"),
    "gptq-cache": (DECLINED, None),
    "gptq-trial": (ARMED, "slots path 0 of 8 layers agreed, 8 differed"),
    "nvfp4-cache": (ARMED, "slots path 24 of 24 layers agreed (largest relative difference 0)"),
    "nvfp4-hot": (ARMED, "slots path 24 of 24 layers agreed"),
    "mxfp4-cache": (ARMED, "slots path 24 of 24 layers agreed"),
    "mxfp4-hot": (ARMED, "slots path 24 of 24 layers agreed"),
    "gptq-act-cache": (ARMED, "slots path 24 of 24 layers agreed"),
    "gptq-act-hot": (ARMED, "slots path 24 of 24 layers agreed"),
}

STUB = r'''#!/usr/bin/env python3
"""python3 for the runner: GPU steps recorded and faked, the report run for real."""
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(" ".join(args) + "\n")
if args[0].endswith("formats_report.py") or args[0].endswith("profile_report.py") or \
        args[1:2] == ["--print-profiler-config"]:
    os.execv(os.environ["REAL_PY"], [os.environ["REAL_PY"], *args])
if args[0].endswith("write_checkpoint.py"):
    d = Path(args[1]); d.mkdir(parents=True)
    (d / "model.safetensors.index.json").write_text("{}")
    live = sorted(p.parent.name for p in d.parent.glob("*/model.safetensors.index.json"))
    with open(os.environ["STUB_LOG"], "a") as log:  # what the disk holds while writing
        log.write("checkpoints on disk: " + " ".join(live) + "\n")
elif args[:4] == ["-m", "expertcache_cli", "trace", "synth"]:
    Path(args[4]).write_text("npz")
elif args[0].endswith("trace_fit.py"):
    Path(args[2]).write_text("npz")
elif args[:3] == ["-m", "expertcache_cli", "plan"]:
    slots = int(args[args.index("--slots") + 1])
    print(json.dumps({"rows": [{"policy": "lru", "slots": slots, "miss_rate": 0.25,
                                "predicted_tok_s": 104.0}],
                      "trace": {"source": "synthetic, stub trace", "path": args[3]}}))
elif args[:3] == ["-m", "expertcache_cli", "size"]:
    print(json.dumps({"bytes_per_expert": 4719744}))
elif args[:3] == ["-m", "expertcache_cli", "probe-link"]:
    Path(args[args.index("--save") + 1]).write_text("{}")
elif args[0].endswith("small_card.py"):
    name, out = args[1], Path(args[args.index("--out") + 1])
    startup, check = json.loads(os.environ["STUB_ARMS"]).get(name, [None, None])
    status = "failed" if name == os.environ.get("STUB_FAIL") else "ok"
    rec = {"status": status, "arm": name, "tok_s": [100.0, 101.0, 99.0],
           "env": [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--env"],
           "greedy": {"tokens": ["a"], "logprob": [0.0], "margin": [1.0]},
           "log": {"startup_line": startup, "check_line": check, "declined": []}}
    if "--warm-only" in args:  # as small_card.py writes a warm-up: no runs, no tokens
        rec = {"status": status, "arm": name, "warm_only": True, "env": rec["env"],
               "log": {"startup_line": None, "declined": []}}
    (out / f"{name}.json").write_text(json.dumps(rec, indent=1))
    (out / f"{name}.log").write_text("log\n")
    if "--profile" in args:  # a trace as vLLM's profiler writes it: 2 steps, 1 or 2 kernels
        d = Path(args[args.index("--profile") + 1]); d.mkdir(parents=True, exist_ok=True)
        ev = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 1}] * 2
        ev += [{"ph": "X", "cat": "kernel", "name": "fused_moe_kernel", "ts": 10 * i, "dur": 5}
               for i in range(2)]
        if name.endswith("-hot"):
            ev += [{"ph": "X", "cat": "kernel", "name": "expert_cache_manage_kernel",
                    "ts": 10 * i + 6, "dur": 2} for i in range(2)]
        (d / "w.pt.trace.json").write_text(json.dumps({"traceEvents": ev}))
'''


@pytest.fixture()
def runner(tmp_path):
    """A function that runs the runner for FORMATS, and the folder it writes in."""
    run = make_runner(tmp_path, "run_formats_on_device.sh",
                      ("formats_report.py", "small_card.py", "trace_routing.py",
                       "profile_report.py", "trace_fit.py"), STUB, keep_bench_helpers=True,
                      STUB_ARMS=json.dumps(ARMS), FM=str(tmp_path / "fm"))
    return (lambda formats, **extra: run(FORMATS=formats, **extra)[0]), tmp_path


def _servers(calls: list[str]) -> list[str]:
    return [c.split()[1] for c in calls if c.startswith("bench/small_card.py")]


def test_an_armed_format_runs_all_four_arms_and_cleans_up(runner):
    run, tmp = runner
    calls = run("fp8-block")
    assert _servers(calls) == ["fp8-block-warm", "fp8-block-floor", "fp8-block-cache",
                               "fp8-block-resident", "fp8-block-hot"]
    writes = [c.split()[1] for c in calls if "write_checkpoint.py" in c]
    assert writes == [str(tmp / "fm" / "fp8-block"), str(tmp / "fm" / "fp8-block-hot")]
    assert any("--layers 24" in c for c in calls if "write_checkpoint.py" in c)
    # both checkpoints removed once their arms are done; records and the report kept
    assert not (tmp / "fm" / "fp8-block").exists() and not (tmp / "fm" / "fp8-block-hot").exists()
    report = (tmp / "out" / "formats.txt").read_text()
    assert "fp8-block all-hit (--hot N, N slots): 100.0 tok/s" in report
    # a second call: every arm done, nothing written or started
    again = run("fp8-block")
    assert _servers(again) == [] and not any("write_checkpoint.py" in c for c in again)


def test_a_declined_format_with_a_sent_back_trial_gets_no_resident_or_all_hit_arm(runner):
    run, tmp = runner
    calls = run("gptq", TRIAL_FORMATS="gptq")
    assert _servers(calls) == ["gptq-warm", "gptq-floor", "gptq-cache", "gptq-trial"]
    assert [c.split()[1] for c in calls if "write_checkpoint.py" in c] == [
        str(tmp / "fm" / "gptq")]  # the hot checkpoint is never needed
    trial = next(c for c in calls if c.startswith("bench/small_card.py gptq-trial"))
    assert "EC_BENCH_TRY_KERNELS=BatchedMarlinExperts" in trial  # TRIAL_KERNELS' default
    assert not (tmp / "fm" / "gptq").exists()


def test_the_trial_runs_only_for_the_formats_named(runner):
    run, _ = runner
    # declined: no trial by default
    assert _servers(run("awq")) == ["awq-warm", "awq-floor", "awq-cache"]


def _call(calls, arm):
    return next(c for c in calls if c.startswith(f"bench/small_card.py {arm} "))


def test_a_4_bit_format_on_marlin_runs_every_arm_routed_by_a_trace(runner):
    """Issue 29's rows: NVFP4 (the Qwen3-30B-A3B shape) armed on Marlin runs floor, cache,
    resident and all-hit; both checkpoints are written at the recording's 6 experts a token
    and floor and cache route from the recorded Qwen3 trace as it is, the all-hit pair from
    its own routers; the floor/cache checkpoint is gone before the all-hit one is written
    (one format's checkpoint on the disk at a time)."""
    run, tmp = runner
    calls = run("nvfp4")
    assert _servers(calls) == ["nvfp4-warm", "nvfp4-floor", "nvfp4-cache", "nvfp4-resident",
                               "nvfp4-hot"]
    for arm in ("nvfp4-warm", "nvfp4-floor", "nvfp4-cache"):
        call = _call(calls, arm)
        assert "EC_BENCH_TRACE_ROUTING=" in call
        assert "route-top6-real-qwen3-30b-a3b-k6.npz" in call
        assert "bench/trace_hook" in call and "--slots 32" in call
    writes = [c for c in calls if "write_checkpoint.py" in c]
    assert len(writes) == 2 and all("--top-k 6" in c for c in writes)
    for arm in ("nvfp4-resident", "nvfp4-hot"):
        assert "EC_BENCH_TRACE_ROUTING" not in _call(calls, arm)
    assert "--moe-backend" not in _call(calls, "nvfp4-resident")
    disk = [c for c in calls if c.startswith("checkpoints on disk:")]
    assert disk == ["checkpoints on disk: nvfp4", "checkpoints on disk: nvfp4-hot"]
    assert not (tmp / "fm" / "nvfp4").exists()


def test_gpt_oss_mxfp4_has_128_experts_a_top_4_trace_and_a_marlin_resident(runner):
    run, tmp = runner
    calls = run("mxfp4")
    writes = [c for c in calls if "write_checkpoint.py" in c]
    assert all("--format mxfp4" in c and "--experts 128" in c for c in writes)
    # the recorded Qwen3 trace, narrowed once to each token's first 4 ids, routes both arms
    narrow = [c for c in calls if "trace_fit.py" in c and "--top-k 4" in c]
    assert len(narrow) == 1 and "traces/real-qwen3-30b-a3b-k6.npz" in narrow[0]
    assert not any("--top-k" in c for c in writes)  # gpt-oss's own top-4
    routed = str(tmp / "fm" / "route-top4-real-qwen3-30b-a3b-k6.npz")
    assert routed in _call(calls, "mxfp4-cache") and routed in _call(calls, "mxfp4-floor")
    assert "--slots 32" in _call(calls, "mxfp4-cache")
    # the all-hit ratio compares one kernel: resident on Marlin too
    assert "--moe-backend marlin" in _call(calls, "mxfp4-resident")
    assert "--moe-backend marlin" not in _call(calls, "mxfp4-hot")  # (serve passes it)


def test_qwen3s_own_top_8_is_routed_by_the_top_8_trace(runner):
    """QWEN_TOPK=8: the checkpoints keep Qwen3's own 8 experts a token, which the top-6
    recording cannot route, so floor and cache replay TRACE8 (default the synthetic one)."""
    run, tmp = runner
    calls = run("awq", QWEN_TOPK="8")
    assert all("--top-k 8" in c for c in calls if "write_checkpoint.py" in c)
    routed = str(tmp / "fm" / "route-top8-demo-qwen3-30b-a3b-tasks.npz")
    assert routed in _call(calls, "awq-floor") and routed in _call(calls, "awq-cache")


def test_gpt_oss_20bs_32_experts_get_16_slots_and_random_routing_stays_possible(runner):
    run, _ = runner
    calls = run("mxfp4", MXFP4_EXPERTS="32", ROUTING="random")
    assert "--slots 16" in _call(calls, "mxfp4-cache")
    assert all("--experts 32" in c for c in calls if "write_checkpoint.py" in c)
    assert not any("EC_BENCH_TRACE_ROUTING" in c for c in calls)
    assert not any("trace synth" in c for c in calls)


def test_gptq_with_act_order_is_a_format_of_its_own(runner):
    run, tmp = runner
    calls = run("gptq-act", TRACE="/data/olmoe-recorded.npz")
    assert _servers(calls) == ["gptq-act-warm", "gptq-act-floor", "gptq-act-cache",
                               "gptq-act-resident", "gptq-act-hot"]
    assert all("--format gptq-act" in c for c in calls if "write_checkpoint.py" in c)
    routed = tmp / "fm" / "route-top6-olmoe-recorded.npz"
    assert f"EC_BENCH_TRACE_ROUTING={routed}" in _call(calls, "gptq-act-cache")
    report = (tmp / "out" / "formats.txt").read_text()
    assert report.startswith("gptq-act: floor 100.0 tok/s")


def test_profile_records_both_all_hit_servers_and_compares_them(runner):
    """PROFILE=1: the resident and all-hit servers carry vLLM's profiler config and record
    one request; the comparison lands in OUT (where the all-hit cache's ~8 us a layer that
    the probed step does not explain goes)."""
    run, tmp = runner
    calls = run("fp8-block", PROFILE="1")
    for arm in ("fp8-block-resident", "fp8-block-hot"):
        call = next(c for c in calls if c.startswith(f"bench/small_card.py {arm} "))
        assert f"--profile {tmp / 'fm' / ('prof-' + arm)}" in call
        assert '"profiler": "torch"' in call and f"prof-{arm}" in call.split("--profiler-config")[1]
    floor = next(c for c in calls if c.startswith("bench/small_card.py fp8-block-floor "))
    assert "--profile" not in floor
    report = (tmp / "out" / "fp8-block-profile.txt").read_text()
    assert "GPU launches a step: resident 1.0, all-hit 2.0 (+1.0)" in report
    assert "expert_cache_manage_kernel" in report


def test_arms_runs_only_the_pair_asked_for_and_writes_only_its_checkpoint(runner):
    run, tmp = runner
    calls = run("fp8-block", ARMS="resident hot")
    assert _servers(calls) == ["fp8-block-resident", "fp8-block-hot"]
    assert [c.split()[1] for c in calls if "write_checkpoint.py" in c] == [
        str(tmp / "fm" / "fp8-block-hot")]
    assert not any("probe-link" in c for c in calls)


def test_hot_variants_and_resident_again_bracket_the_all_hit_servers(runner):
    """HOT_VARIANTS / RESIDENT_AGAIN (issue 11's noisy all-hit run): resident, the all-hit
    server, one per variant with its variables on top of the hot arm's, resident again;
    the hot checkpoint stays until every one of them is done, and the report compares each
    all-hit server with both residents."""
    run, tmp = runner
    calls = run("fp8-block", ARMS="resident hot", RUNS="8", RESIDENT_AGAIN="1",
                HOT_VARIANTS="nostats:EXPERT_CACHE_STATS=0 nopdl:EXPERT_CACHE_PDL=0,X=1")
    assert _servers(calls) == ["fp8-block-resident", "fp8-block-hot", "fp8-block-hot_nostats",
                               "fp8-block-hot_nopdl", "fp8-block-resident2"]
    nopdl = next(c for c in calls if c.startswith("bench/small_card.py fp8-block-hot_nopdl "))
    assert "--env EXPERT_CACHE_PDL=0 --env X=1" in nopdl
    # the all-hit server runs as users run it: no periodic report (the final line's hit rate)
    hot = next(c for c in calls if c.startswith("bench/small_card.py fp8-block-hot "))
    assert "EXPERT_CACHE_STATS" not in hot and "EXPERT_CACHE_STATS" not in nopdl
    nostats = next(c for c in calls if c.startswith("bench/small_card.py fp8-block-hot_nostats "))
    assert "--env EXPERT_CACHE_STATS=0" in nostats
    assert "--runs 8" in nopdl and "expertcache_cli serve" in nopdl
    again = next(c for c in calls if c.startswith("bench/small_card.py fp8-block-resident2 "))
    assert "EXPERT_CACHE_DISABLE=1" in again and "vllm.entrypoints.cli.main serve" in again
    assert not (tmp / "fm" / "fp8-block-hot").exists()
    report = (tmp / "out" / "formats.txt").read_text()
    assert "fp8-block resident again, after the all-hit servers: 100.0 tok/s" in report
    assert "fp8-block all-hit [hot_nopdl]: 100.0 tok/s (99-101) = 1.000 of resident, " \
           "1.000 of resident again" in report
    assert "fp8-block all-hit [hot]: 100.0" in report


def test_a_failed_variant_keeps_the_checkpoint_for_the_next_call(runner, monkeypatch):
    run, tmp = runner
    monkeypatch.setenv("STUB_FAIL", "fp8-block-hot_nostats")
    calls = run("fp8-block", ARMS="resident hot", HOT_VARIANTS="nostats:EXPERT_CACHE_STATS=0")
    assert "fp8-block-hot_nostats" in _servers(calls)
    assert (tmp / "fm" / "fp8-block-hot").exists()  # needed again: the variant failed
    again = run("fp8-block", ARMS="resident hot", HOT_VARIANTS="nostats:EXPERT_CACHE_STATS=0")
    assert _servers(again) == ["fp8-block-hot_nostats"]


def test_plan_predicts_the_cache_arm_on_the_fitted_trace_once_resident_has_its_rate(runner):
    """Issue 29: once the resident arm has run, the routing trace is fitted to the
    checkpoint's layers at the format's bytes an expert, `plan` runs on it with the probe,
    the resident arm's median and the cache arm's slots, and the table sets the cache arm
    beside plan's prediction and says what routing produced it."""
    run, tmp = runner
    calls = run("nvfp4")
    fit = [c for c in calls if c.startswith("bench/trace_fit.py")]
    assert len(fit) == 2  # the servers' copy at top-6, then plan's at the format's bytes
    assert fit[0].split()[1].endswith("traces/real-qwen3-30b-a3b-k6.npz")
    routed = str(tmp / "fm" / "route-top6-real-qwen3-30b-a3b-k6.npz")
    assert fit[1].split()[1] == routed  # what the hook read
    assert (f"--layers 24 --size {tmp / 'fm' / 'nvfp4-size.json'} --streams 1 --steps 1200 "
            "--request-steps 200 --decode-only" in fit[1])  # a warm-up and 5 requests
    plans = [c for c in calls if c.startswith("-m expertcache_cli plan")]
    assert len(plans) == 1
    assert plans[0].split()[3] == str(tmp / "fm" / "nvfp4-route.npz")
    assert "--resident-tok-s 100.000 --slots 32 --policy lru --json" in plans[0]
    assert f"--probe {tmp / 'fm' / 'nvfp4-probe.json'}" in plans[0]
    # after the resident arm and before the all-hit server, so that a job cut short during
    # the all-hit server keeps it
    order = [c.split()[1] if c.startswith("bench/small") else c.split()[0] for c in calls]
    assert order.index("nvfp4-resident") < calls.index(plans[0]) < order.index("nvfp4-hot")
    report = (tmp / "out" / "formats.txt").read_text()
    assert ("plan predicted 104.0 tok/s at 32 slots (replayed hit rate 0.750), measured "
            "0.962 of it (met: 10%); routing: synthetic, stub trace") in report
    assert (tmp / "out" / "nvfp4-plan.json").exists()
    table = (tmp / "out" / "table.md").read_text().splitlines()
    assert table[2].endswith("| 0.962 (100.0 / 104.0) |")
    assert "- nvfp4: synthetic, stub trace" in table
    again = run("nvfp4")  # planned once
    assert not any(c.startswith("-m expertcache_cli plan") for c in again)


def test_random_routing_and_a_declined_format_get_no_plan(runner):
    run, tmp = runner
    calls = run("fp8-block", ROUTING="random")
    assert not any("plan" in c.split()[:3] or "trace_fit" in c for c in calls)
    assert "routing: the checkpoint's own random routers (no trace)" in (
        tmp / "out" / "formats.txt").read_text()
    calls = run("awq")  # declined: no resident arm, so no rate to plan with
    assert not any(c.startswith("-m expertcache_cli plan") for c in calls)


def _without_name(call: str, warm: bool = False) -> str:
    """A small_card call with its arm name (and a warm-up's flag) left out: the command
    and environment the server ran with."""
    words = call.split()
    del words[1]
    return " ".join(w for w in words if not (warm and w == "--warm-only"))


def test_a_warm_up_start_of_the_floor_runs_before_the_compared_arms(runner):
    """vLLM's first start of a configuration compiles the model and parts from later
    starts at near-ties: a warm-up server with the floor's very command and environment
    starts first, so that neither the floor nor the cache (nor the trial) is that start;
    the report reads no warm-up record."""
    run, tmp = runner
    calls = run("fp8-block")
    warm = _call(calls, "fp8-block-warm")
    assert "--warm-only" in warm
    assert _without_name(warm, warm=True) == _without_name(_call(calls, "fp8-block-floor"))
    assert "--warm-only" not in _call(calls, "fp8-block-floor")
    rec = json.loads((tmp / "out" / "fp8-block-warm.json").read_text())
    assert rec["warm_only"] and "greedy" not in rec
    report = (tmp / "out" / "formats.txt").read_text()
    assert "warm" not in report
    assert "fp8-block cache: 100.0 tok/s" in report and "greedy vs floor identical" in report


def test_the_warm_up_is_not_run_again_once_done_nor_once_the_pair_is(runner):
    """Re-entrant as every arm: a warm-up whose record says ok is not run again (the cache
    failed: the next call runs only the cache), and none is run where floor and cache
    (and the trial) are done, even if its own record is missing."""
    run, tmp = runner
    calls = run("gptq", STUB_FAIL="gptq-cache")
    assert _servers(calls) == ["gptq-warm", "gptq-floor", "gptq-cache"]
    assert _servers(run("gptq")) == ["gptq-cache"]
    (tmp / "fm" / "gptq-warm.json").unlink()
    assert _servers(run("gptq")) == []
    # a trial asked for later: the warm-up runs again (its record gone), then the trial only
    assert _servers(run("gptq", TRIAL_FORMATS="gptq")) == ["gptq-warm", "gptq-trial"]


def test_arms_without_floor_or_cache_start_no_warm_up(runner):
    run, _ = runner
    assert "fp8-block-warm" not in _servers(run("fp8-block", ARMS="resident hot"))
    # the cache alone: the warm-up still runs before it
    assert _servers(run("awq", ARMS="cache")) == ["awq-warm", "awq-cache"]


def test_a_seeded_floor_and_cache_get_their_resident_pair_and_plan_and_are_said(runner):
    """A session given an earlier session's floor, cache, size and probe records (SEED)
    starts only the resident and all-hit servers, writes only their checkpoint, plans the
    cache arm from the seeded size and probe with this session's resident rate, and the
    report says which records came from the earlier session."""
    run, tmp = runner
    first = tmp / "first"
    run("mxfp4", FM=str(first), ARMS="floor cache", OUT=str(tmp / "out1"))
    seed = tmp / "seed"
    seed.mkdir()
    for p in (tmp / "out1").iterdir():  # what the first session's results.tgz brought back
        if p.suffix in (".json", ".log"):
            (seed / p.name).write_bytes(p.read_bytes())
    assert (seed / "mxfp4-cache.json").exists() and (seed / "mxfp4-size.json").exists()
    calls = run("mxfp4", SEED=str(seed))
    assert _servers(calls) == ["mxfp4-resident", "mxfp4-hot"]
    writes = [c.split()[1] for c in calls if "write_checkpoint.py" in c]
    assert writes == [str(tmp / "fm" / "mxfp4-hot")]
    assert not any(c.startswith("-m expertcache_cli size") for c in calls)
    plans = [c for c in calls if c.startswith("-m expertcache_cli plan")]
    assert len(plans) == 1 and f"--probe {tmp / 'fm' / 'mxfp4-probe.json'}" in plans[0]
    report = (tmp / "out" / "formats.txt").read_text()
    assert "from an earlier session, not measured in this one: " in report
    said = report.split("not measured in this one: ")[1].splitlines()[0]
    assert "mxfp4-cache.json" in said and "mxfp4-floor.json" in said
    assert "mxfp4-resident" not in said
    assert (tmp / "out" / "mxfp4-floor.json").exists()  # the row's records travel together
    table = (tmp / "out" / "table.md").read_text()
    assert "from an earlier session" in table


def test_seeded_records_of_one_format_are_not_said_under_another(tmp_path):
    """gptq-act's records are not gptq's, though their names share a prefix."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("fr", ROOT / "bench" / "formats_report.py")
    fr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fr)
    (tmp_path / "seeded.txt").write_text("gptq-act-floor.json\ngptq-cache.json\n")
    assert fr.seeded_lines(tmp_path, ["gptq"]) == [
        "from an earlier session, not measured in this one: gptq-cache.json"]
    assert fr.seeded_lines(tmp_path, ["awq"]) == []
