"""The wide-steps device runner (bench/run_wide_on_device.sh) with every GPU step stubbed:
the arms it starts and with what, the trace it records, `plan --batch` against the measured
decode, the closing summary, and that a second call starts nothing done. Device minutes are
few; a runner bug must not be found on the device."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_runner_harness import make_runner

ROOT = Path(__file__).resolve().parents[2]

STUB = r'''#!/usr/bin/env python3
"""python3 for the runner: GPU steps recorded and faked; inline scripts run for real."""
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
env = ",".join(k + "=" + os.environ[k] for k in ("EC_BENCH_MEM", "EXPERT_CACHE_WIDE")
               if k in os.environ)
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(" ".join(args) + ("  ENV=" + env if env else "") + "\n")
if args[0] in ("-", "-c") or args[0].endswith(("groups.py", "wide_report.py", "trace_fit.py",
                                                 "wide_served.py")):
    os.execv(os.environ["REAL_PY"], [os.environ["REAL_PY"], *args])
if args[0].endswith("wide_steps.py"):
    name, out = args[1], Path(args[args.index("--out") + 1])
    envs = dict(e.split("=", 1) for i, e in enumerate(args) if i and args[i - 1] == "--env")
    if "EXPERT_CACHE_TRACE" in envs:
        Path(envs["EXPERT_CACHE_TRACE"]).write_bytes(b"npz")
    scale = {"floor": 1.0, "inplace": 1.2, "staged": 2.0, "resident": 8.0}.get(name, 1.5)
    rec = {"arm": name, "status": "ok",
           "ttft": {"2048": {"median_s": 0.3 / scale}},
           "decode": {str(n): {"tok_s": 10.0 * n * scale} for n in (1, 16, 32)},
           "greedy": ["same text"], "log": {"final": {"installs": 1}}}
    (out / f"{name}.json").write_text(json.dumps(rec))
    (out / f"{name}.log").write_text("log\n")
elif args[1:3] == ["vllm.entrypoints.cli.main", "serve"]:  # mem: the lines awaited
    print("(EngineCore) INFO [x] Actual usage is 15.0 GiB for weight")
    print("(EngineCore) INFO [x] Available KV cache memory: "
          + ("111.53" if "EXPERT_CACHE_WIDE" in os.environ else "113.47") + " GiB")
    sys.stdout.flush()
    __import__("time").sleep(60)  # a server runs until the runner ends its process group
elif args[1:3] == ["expertcache_cli", "size"]:
    print(json.dumps({"num_layers": 24, "num_moe_layers": 24, "num_experts": 128,
                      "bytes_per_expert": 9437184, "max_num_batched_tokens": 8192})
          if "--json" in args else "size: 64 slots")
elif args[1:3] == ["expertcache_cli", "probe-link"]:  # a real probe's file
    Path(args[args.index("--save") + 1]).write_text(Path(os.environ["PROBE_SRC"]).read_text())
elif args[1:3] == ["expertcache_cli", "plan"]:
    n = int(args[args.index("--batch") + 1])
    scale = {"in-place": 1.2, "staged-install": 2.0, "staged": 1.5}[args[args.index("--wide") + 1]]
    print(json.dumps({"rows": [{"predicted_tok_s": 10.0 * n * scale}]}))
'''


@pytest.fixture()
def runner(tmp_path):
    run = make_runner(tmp_path, "run_wide_on_device.sh",
                      ("e2e_vllm.py", "wide_report.py", "trace_fit.py", "wide_served.py",
                       "trace_routing.py", "wide_steps.py", "small_card.py"),
                      STUB, keep_bench_helpers=True, WSD=str(tmp_path / "ws"),
                      MODEL_DIR=str(tmp_path / "models"),
                      PROBE_SRC=str(ROOT / "tests" / "data" / "fp8-block-probe.json"))
    return run, tmp_path


def _arms(calls: list[str]) -> list[str]:
    return [c.split()[1] for c in calls if c.startswith("bench/wide_steps.py")]


def test_every_arm_then_the_predictions_and_the_summary(runner):
    run, tmp = runner
    calls, stdout = run()
    assert _arms(calls) == ["floor", "inplace", "staged", "resident", "trace1"]
    model = tmp / "models" / "m24w"
    assert (model / "config.json").exists() and '"num_hidden_layers": 24' in (
        model / "config.json").read_text()
    by = {c.split()[1]: c for c in calls if c.startswith("bench/wide_steps.py")}
    assert "--cpu-offload-gb 31" in by["floor"] and "EXPERT_CACHE_DISABLE=1" in by["floor"]
    assert "--cpu-offload-gb" not in by["resident"]
    assert "EXPERT_CACHE_WIDE=staged-install" in by["staged"]
    assert f"EXPERT_CACHE_TRACE={tmp / 'ws' / 'one.npz'}" in by["trace1"]
    # decode rounds of 64 tokens a stream (the whole table fits one run); the
    # trace is 48 requests of that shape in turn, no decode rounds of its own
    assert all("--max-tokens 64" in c for c in by.values())
    assert "--streams --requests 48 --greedy-streams 0" in by["trace1"]
    plans = [c for c in calls if c.startswith("-m expertcache_cli plan")]
    assert len(plans) == 4 and all("--resident-tok-s" in p for p in plans)
    predict = (tmp / "out" / "predict.txt").read_text()
    assert "16 streams in-place: plan --batch 16 predicts 192.0 tok/s, measured 192.0 (1.000)" \
        in predict
    assert "32 streams staged-install: plan --batch 32 predicts 640.0 tok/s" in predict
    assert "in place == staged: True" in stdout
    assert "staged ok TTFT ms {'2048': 150.0}" in stdout
    wide = (tmp / "out" / "wide.md").read_text()  # issue 15's tables, from the same records
    assert "| 2048 | 250.0 | 150.0 | 37.5 |" in wide and "TTFT 2048: staged" in wide
    assert "decode 16 streams: staged 2.00x the floor (met" in wide
    assert "--max-num-batched-tokens 8192" in by["staged"]
    again, _ = run()
    assert _arms(again) == []


def test_steps_pick_the_arms(runner):
    run, _ = runner
    calls, _ = run(STEPS="setup ckpt staged0", LAYERS="8")
    assert _arms(calls) == ["staged0"]
    assert "--cpu-offload-gb 11" in next(c for c in calls if c.startswith("bench/wide_steps.py"))


def test_predict_prices_staged_without_installs_once_that_arm_ran(runner):
    run, tmp = runner
    run(STEPS="setup ckpt plan inplace staged resident trace predict")
    assert "streams staged:" not in (tmp / "out" / "predict.txt").read_text()
    calls, _ = run(STEPS="staged0 predict")
    plans = [c for c in calls if c.startswith("-m expertcache_cli plan")]
    assert len(plans) == 6 and sum("--wide staged " in p for p in plans) == 2
    predict = (tmp / "out" / "predict.txt").read_text()
    # the stub's staged0 arm decodes 1.5x the floor rate, as its plan predicts
    assert "16 streams staged: plan --batch 16 predicts 240.0 tok/s, measured 240.0 (1.000)" \
        in predict


def test_mem_serves_in_place_and_staged_for_their_memory_report_only(runner):
    run, tmp = runner
    calls, _ = run(STEPS="setup ckpt mem")
    serves = [c for c in calls if c.startswith("-m vllm.entrypoints.cli.main serve")]
    assert len(serves) == 2 and _arms(calls) == []
    assert serves[0].endswith("ENV=EC_BENCH_MEM=1")
    assert serves[1].endswith("ENV=EC_BENCH_MEM=1,EXPERT_CACHE_WIDE=staged-install")
    assert all("--port 8712" in c and "--max-num-batched-tokens 8192" in c for c in serves)
    text = (tmp / "out" / "mem.txt").read_text()
    assert text.count("Available KV cache memory") == 2
    assert text.index("113.47 GiB") < text.index("111.53 GiB")  # in place, then staged


def test_mem_arms_picks_the_servers_started(runner):
    run, _ = runner
    calls, _ = run(STEPS="mem", MEM_ARMS="staged")
    serves = [c for c in calls if c.startswith("-m vllm.entrypoints.cli.main serve")]
    assert len(serves) == 1 and serves[0].endswith("EXPERT_CACHE_WIDE=staged-install")


def test_a_recording_routes_every_arm_on_a_checkpoint_of_its_width(runner):
    run, tmp = runner
    trace = ROOT / "traces" / "real-qwen3-30b-a3b-k6.npz"
    calls, stdout = run(TRACE=str(trace), STEPS="setup ckpt plan floor staged resident")
    model = tmp / "models" / "m24w-k6"
    assert '"num_experts_per_tok": 6' in (model / "config.json").read_text()
    fit = tmp / "ws" / "route-24.npz"
    assert fit.exists()  # the recording fitted to the 24 layers served
    by = {c.split()[1]: c for c in calls if c.startswith("bench/wide_steps.py")}
    assert list(by) == ["floor", "staged", "resident"]
    for c in by.values():
        assert f"--env EC_BENCH_TRACE_ROUTING={fit}" in c
        assert "--env EC_BENCH_TRACE_STREAMS=32" in c and "/bench/trace_hook:" in c
        assert f"serve {model} " in c
    first = (tmp / "out" / "wide.md").read_text().splitlines()[0]
    assert first.startswith("Routing of every server's decode: recorded (real model")
    # the same WSD under another routing: refused before anything starts
    calls, err = run(expect_rc=2, STEPS="floor")
    assert calls == [] and "holds a run routed by" in err and "give another WSD" in err


def test_without_a_trace_the_report_names_synthetic_routing(runner):
    run, tmp = runner
    run(STEPS="setup ckpt plan floor staged")
    first = (tmp / "out" / "wide.md").read_text().splitlines()[0]
    assert first == ("Routing of every server's decode: the dummy checkpoint's own routers "
                     "(synthetic routing)")


def test_a_trace_that_is_no_file_or_not_128_experts_is_refused(runner, tmp_path):
    run, _ = runner
    calls, err = run(expect_rc=2, TRACE=str(tmp_path / "none.npz"))
    assert calls == [] and "no such file" in err
    calls, err = run(expect_rc=2, TRACE=str(ROOT / "traces" / "real-olmoe-1b-7b-k8.npz"))
    assert "top-8 of 64 experts" in err
    assert not [c for c in calls if c.startswith("bench/wide_steps.py")]


def test_under_a_recording_predict_replays_the_ids_the_hook_served(runner):
    """No trace arm (every request would replay the same rows): predict is plan's formula on
    the hook's own ids for each server, beside each arm's measured rate."""
    pytest.importorskip("torch", reason="no torch: wide_served.py drives the routing hook")
    run, tmp = runner
    trace = ROOT / "traces" / "real-qwen3-30b-a3b-k6.npz"
    calls, stdout = run(TRACE=str(trace),
                        STEPS="setup ckpt plan inplace staged resident trace predict")
    assert _arms(calls) == ["inplace", "staged", "resident"]
    assert "trace: not recorded under TRACE" in stdout
    assert not [c for c in calls if c.startswith("-m expertcache_cli plan")]
    served = next(c for c in calls if c.startswith("bench/wide_served.py"))
    assert f"{tmp / 'ws' / 'route-24.npz'} {tmp / 'ws'} --slots 64 --hook-streams 32" in served
    predict = (tmp / "out" / "predict.txt").read_text()
    assert predict.startswith("routing: recorded (real model")
    # the stub's in-place arm decodes 16 streams at 192 tok/s
    assert "| 16 | in-place |" in predict and "| 192.0 |" in predict
    assert "| 32 | staged-install |" in predict
