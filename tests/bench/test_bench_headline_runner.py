"""The headline runner's flow (bench/run_headline_on_device.sh) with every GPU step stubbed:
the checkpoint written at the recording's top-k, every server (floor, cache, resident)
routed by the recording fitted to 48 layers, floor and cache the same `serve --vram N`
command as a user types it (the floor with the cache off), the ballast held around each
card, nothing run twice, bad input refused with one line, and the report's routing source,
width and table. Device minutes are few; a runner bug must not be found on the device."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from bench_runner_harness import make_runner, trace_of_64_experts

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("httpx", reason="the report imports the bench's server client")

QWEN = "real-qwen3-30b-a3b-k6"

STUB = r'''#!/usr/bin/env python3
"""python3 for the runner: GPU steps recorded and faked, trace_fit and the report real."""
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(" ".join(args) + "\n")
real = {**os.environ, "PYTHONPATH": os.environ["ROOT"]}  # this checkout's package
if args[0].endswith("headline_report.py") or args[0].endswith("trace_fit.py") \
        or args[0].endswith("flagship_report.py"):
    os.execve(os.environ["REAL_PY"], [os.environ["REAL_PY"], *args], real)
if args[0].endswith("write_checkpoint.py"):
    d = Path(args[1]); d.mkdir(parents=True)
    k = int(args[args.index("--top-k") + 1]) if "--top-k" in args else 8
    (d / "config.json").write_text(json.dumps({"num_experts_per_tok": k}))
    (d / "model.safetensors.index.json").write_text("{}")
elif args[0].endswith("ballast.py"):
    print(json.dumps({"leave_gib": args[-1]}) if args[1] == "start" else "stopped")
elif args[:3] == ["-m", "expertcache_cli", "size"]:
    vram = args[args.index("--vram") + 1]
    print(json.dumps({"slots": {"24": 85, "16": 51}[vram], "verdict_text": "cache",
                      "bytes_per_expert": 4732928}))
elif args[:3] == ["-m", "expertcache_cli", "probe-link"]:
    Path(args[args.index("--save") + 1]).write_text(json.dumps(
        {"device_name": os.environ.get("STUB_PROBE_GPU", "NVIDIA H100 80GB HBM3")}))
elif args[:3] == ["-m", "expertcache_cli", "plan"]:
    slots = int(args[args.index("--slots") + 1])
    print(json.dumps({"rows": [{"policy": "lru", "slots": slots, "miss_rate": 0.1,
                                "predicted_tok_s": {85: 160.0, 51: 100.0}[slots]}]}))
elif args[:3] == ["-m", "expertcache_cli", "serve"]:
    print("expertcache serve: dry run " + args[args.index("--vram") + 1])
elif args[0].endswith("small_card.py") and args[1] == "--print-prompt-tokens":
    os.execve(os.environ["REAL_PY"], [os.environ["REAL_PY"], *args],
              {**os.environ, "PYTHONPATH": os.environ["ROOT"]})
elif args[0].endswith("small_card.py"):
    name, out = args[1], Path(args[args.index("--out") + 1])
    env = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--env"]
    if "--warm-only" in args:  # as small_card.py writes a warm-up: no runs, no tokens
        status = "failed" if name == os.environ.get("STUB_FAIL") else "ok"
        (out / f"{name}.json").write_text(json.dumps(
            {"status": status, "arm": name, "warm_only": True, "env": env,
             "argv": args[args.index("--") + 1:], "log": {}}))
        (out / f"{name}.log").write_text("log\n")
        sys.exit(0 if status == "ok" else 1)
    tok = {"resident": 300.0, "floor24": 30.0, "cache24": 150.0, "floor16": 29.0,
           "cache16": 90.0}[name]
    status = "failed" if name == os.environ.get("STUB_FAIL") else "ok"
    rec = {"status": status, "arm": name, "tok_s": [tok, tok + 1, tok - 1], "env": env,
           "argv": args[args.index("--") + 1:],
           "greedy": {"tokens": ["a", "b"], "logprob": [0.0, 0.0], "margin": [1.0, 1.0]},
           "greedy_again": {"tokens": ["a", "b"], "logprob": [0.0, 0.0],
                            "margin": [1.0, 1.0]},
           "log": {"slots": 85 if name == "cache24" else 51, "armed_layers": 48,
                   "moe_layers": 48}}
    if "--prompt-cycle" in args:  # runs of different recorded requests decode unlike
        rec.update(prompt_cycle=int(args[args.index("--prompt-cycle") + 1]),
                   tok_s=[tok, 2 * tok, tok], run_tokens=[199, 199, 199],
                   prompt_tokens=[24, 32, 40])
    if name.startswith("cache"):
        rec["counters_before"] = {"requests": 1000, "installs": 100}
        rec["counters_after"] = {"requests": 11000, "installs": 1100}
    (out / f"{name}.json").write_text(json.dumps(rec, indent=1))
    routed = any(e.startswith("EC_BENCH_TRACE_ROUTING=") for e in env)
    hook = routed and name != os.environ.get("STUB_NO_HOOK")
    (out / f"{name}.log").write_text(
        "log\n" + ("WARNING BENCH: trace routing in force: layer 0\n" if hook else ""))
'''


def _make(tmp_path, **env: str):
    run = make_runner(tmp_path, "run_headline_on_device.sh",
                      ("headline_report.py", "flagship_report.py", "formats_report.py",
                       "small_card.py",
                       "synth_weights.py", "trace_routing.py", "trace_fit.py"), STUB,
                      keep_bench_helpers=True, HL=str(tmp_path / "hl"),
                      MODEL_DIR=str(tmp_path / "models"), **env)
    (tmp_path / "tree" / "traces").symlink_to(ROOT / "traces")
    return run


@pytest.fixture()
def runner(tmp_path):
    """The runner on the Qwen3 one-prompt recording (one recorded request: the simplest
    flow to follow); the default recording has its own test."""
    return _make(tmp_path, TRACE=f"traces/{QWEN}.npz"), tmp_path


def test_the_default_recording_is_the_published_tables(tmp_path):
    """With no TRACE the runner serves what the published headline table was measured on:
    gpt-oss-120b's four-prompt recording, on a checkpoint of its top-4."""
    run = _make(tmp_path)
    calls, _ = run(STEPS="setup model")
    write = next(c for c in calls if "write_checkpoint.py" in c)
    assert write.endswith("--top-k 4") and "w8a8-k4" in write
    trace = tmp_path / "tree" / "traces" / "real-gpt-oss-120b-k4.npz"
    assert f"bench/trace_fit.py --shape {trace}" in calls
    assert (tmp_path / "hl" / "trace.src").read_text().strip() == \
        "traces/real-gpt-oss-120b-k4.npz"


def _servers(calls: list[str]) -> list[str]:
    return [c.split()[1] for c in calls if c.startswith("bench/small_card.py")]


def _arm(calls: list[str], name: str) -> str:
    return next(c for c in calls if c.startswith(f"bench/small_card.py {name} "))


def test_every_server_replays_the_recording_on_a_checkpoint_of_its_width(runner):
    from expertcache_cli.rules import trace as tracefile

    run, tmp = runner
    hl, model = tmp / "hl", tmp / "models" / "w8a8-k6"
    trace = tmp / "tree" / "traces" / f"{QWEN}.npz"
    calls, _ = run()
    write = next(c for c in calls if "write_checkpoint.py" in c)
    assert write == (f"bench/write_checkpoint.py {model} --layers 48 --format w8a8 --vocab "
                     "151936 --context 40960 --head-dim 128 --top-k 6")
    fits = [c for c in calls if c.startswith("bench/trace_fit.py") and "/served" not in c]
    # the shape asked at the model step (the checkpoint's top-k), then for each server's
    # prompts (its recorded requests): the same call
    fits = [c for n, c in enumerate(fits) if "--shape" not in c or c not in fits[:n]]
    assert all("--prompt-cycle" not in c for c in calls)  # one recorded request
    assert fits == [f"bench/trace_fit.py --shape {trace}",
                    f"bench/trace_fit.py {trace} {hl}/route-48.npz --layers 48",
                    f"bench/trace_fit.py --source {hl}/route-48.npz"]
    fitted = tracefile.load(hl / "route-48.npz")
    assert fitted.num_layers == 48 and fitted.top_k == 6
    assert _servers(calls) == ["resident", "warm24", "floor24", "cache24", "warm16", "floor16",
                               "cache16"]
    for name in ("resident", "warm24", "floor24", "cache24", "warm16", "floor16", "cache16"):
        call = _arm(calls, name)
        assert f"--env EC_BENCH_TRACE_ROUTING={hl}/route-48.npz" in call
        assert "--env PYTHONPATH=" in call and f"{tmp}/tree/bench/trace_hook:" in call
    resident = _arm(calls, "resident")
    assert f"vllm.entrypoints.cli.main serve {model} " in resident
    assert "--env EXPERT_CACHE_DISABLE=1" in resident and "--runs 5" in resident
    for gib in ("24", "16"):
        floor, cache = _arm(calls, f"floor{gib}"), _arm(calls, f"cache{gib}")
        # `expertcache serve MODEL --vram N` as typed, then the bench's server flags
        want = (f"-m expertcache_cli serve {model} --vram {gib} -- --max-model-len 8192 "
                "--attention-backend TRITON_ATTN --seed 0 --host 127.0.0.1 --port {port} "
                "--shutdown-timeout 10")
        assert floor.endswith(want) and cache.endswith(want)
        assert "--env EXPERT_CACHE_DISABLE=1" in floor and "--runs 3" in floor
        assert "EXPERT_CACHE_DISABLE" not in cache and "--env EXPERT_CACHE_STATS=480" in cache
        assert "--runs 5" in cache
        size = next(c for c in calls if c.startswith("-m expertcache_cli size")
                    and f"--vram {gib}" in c)
        assert size == f"-m expertcache_cli size --model {model} --vram {gib} --json -- " \
                       "--max-model-len 8192"
        dry = next(c for c in calls if "--dry-run" in c and f"--vram {gib}" in c)
        # a warm-up start of the floor's very command and environment right before it
        warm = _arm(calls, f"warm{gib}")
        assert warm.replace(f" warm{gib} ", " ").replace(" --warm-only", "") == \
            floor.replace(f" floor{gib} ", " ").replace(" --runs 3", "")
        # the ballast holds the card around what serve plans and every server
        start = calls.index(f"bench/ballast.py start --leave {gib}")
        stop = next(i for i, c in enumerate(calls) if i > start and c == "bench/ballast.py stop")
        assert start < calls.index(size) < calls.index(dry) < calls.index(warm) \
            < calls.index(floor) < calls.index(cache) < stop
    assert calls.index(resident) < calls.index("bench/ballast.py start --leave 24")
    report = (tmp / "out" / "headline.md").read_text()
    lines = report.splitlines()[1:]  # after the GPU line (none recorded by the stub)
    assert report.splitlines()[0] == "GPU: not recorded (no gpu.txt)."
    assert lines[0].startswith("Routing of every server: recorded (real model, greedy decode, "
                               "one prompt)") and "--n-expert-used 6" in lines[0]
    assert lines[1] == ("Width: the checkpoint routes top-6 of 128 experts: the width the "
                        "recording ran the model at (Qwen3-30B-A3B's config says 8), so each "
                        "token's experts are exactly the recorded ones, not a narrowing of "
                        "them.")
    assert lines[2] == "Trace routing in force in every server."
    assert f"Reproduce: `TRACE=traces/{QWEN}.npz bash bench/run_headline_on_device.sh`" \
        in report
    assert ("| 24 GiB | cache at the planned slots | 85 / 85 (48 of 48 layers armed) | "
            "150.00 median (149.00-151.00) | 5.00 | 0.500 | 90.00% | 160.0 (0.938) |") in report
    assert "| 24 GiB | floor: experts offloaded, no cache | - | 30.00 median (29.00-31.00) | " \
           "1.00 | 0.100 | - |" in report
    assert "| 16 GiB | cache at the planned slots | 51 / 51 (48 of 48 layers armed) |" in report
    assert "| whole GPU | resident: every expert in VRAM | - | 300.00 median (299.00-301.00) |" \
        in report
    assert "- 24 GiB: plan predicted 160.0 tok/s at 85 slots (replayed hit rate 0.900), " \
           "measured 0.938 of it (met: 10%)" in report
    assert "- 16 GiB: plan predicted 100.0 tok/s at 51 slots" in report
    assert "- 24 GiB: cache 5.00x the offload floor; the gap to resident recovered: 44.4%" \
        in report
    assert "- 16 GiB greedy tokens, cache vs resident: identical (2 tokens)" in report
    for name in ("resident", "floor24", "cache24", "floor16", "cache16"):
        assert json.loads((tmp / "out" / f"{name}.json").read_text())["status"] == "ok"
    assert (tmp / "out" / "size24.json").exists() and (tmp / "out" / "serve16.txt").exists()
    # a second call: nothing written, fitted, served or ballasted again
    again, _ = run()
    assert _servers(again) == [] and not any("write_checkpoint.py" in c for c in again)
    assert not any(c.startswith("bench/trace_fit.py") and "--layers" in c for c in again)
    assert not any("ballast.py start" in c for c in again)


def test_no_trace_serves_the_checkpoints_own_routers_at_top_8(runner):
    run, tmp = runner
    calls, _ = run(TRACE="none", STEPS="setup model resident card24 report")
    write = next(c for c in calls if "write_checkpoint.py" in c)
    assert write.split()[1] == f"{tmp}/models/w8a8" and "--top-k" not in write
    assert not any(c.startswith("bench/trace_fit.py") for c in calls)
    assert _servers(calls) == ["resident", "warm24", "floor24", "cache24"]
    assert not any("EC_BENCH_TRACE_ROUTING" in c for c in calls)
    report = (tmp / "out" / "headline.md").read_text().splitlines()[1:]
    assert report[0] == ("Routing of every server: no trace: the checkpoint's own per-layer "
                         "seeded routers (synthetic routing)")
    assert report[1] == "Width: top-8 of 128, the checkpoint's own routers."


def test_a_server_without_the_hooks_line_does_not_count(runner, monkeypatch):
    run, tmp = runner
    monkeypatch.setenv("STUB_NO_HOOK", "cache16")
    run()
    report = (tmp / "out" / "headline.md").read_text()
    assert "Trace routing NOT in force, these numbers do not count: cache16" in report


def test_bad_input_is_one_line_and_exit_2_before_anything(runner):
    run, tmp = runner
    for env, want in (
            ({"TRACE": str(tmp / "absent.npz")},
             f"TRACE={tmp / 'absent.npz'}: no such file (a routing trace .npz, or none: the "
             "checkpoint's own routers)"),
            ({"STEPS": "setup card32"},
             "STEPS: unknown step card32 (setup model probe resident card24 card16 plan "
             "report)")):
        calls, out = run(expect_rc=2, **env)
        assert calls == [] and out.strip() == want


def test_records_of_one_routing_are_not_mixed_with_anothers(runner):
    run, tmp = runner
    run(STEPS="setup model")
    calls, out = run(expect_rc=2, TRACE="none", STEPS="report")
    assert calls == [] and out.strip() == (
        f"HL={tmp / 'hl'} holds a run routed by traces/{QWEN}.npz, not "
        "TRACE=none: give another HL")


def test_a_job_from_another_copy_of_the_tree_goes_on_with_the_run(runner):
    """A second detached job runs in its own copy of the tree: HL names the trace as typed
    in the checkout, so the same TRACE from the copy continues the run (its card, the
    report) and the report's command names the checkout's path, not a copy's."""
    run, tmp = runner
    run(STEPS="setup model probe resident card24")
    copy = tmp / "tree2"
    shutil.copytree(tmp / "tree", copy, symlinks=True)
    calls, _ = run(STEPS="card16 report", cwd=copy, TRACE=f"traces/{QWEN}.npz")
    assert _servers(calls) == ["warm16", "floor16", "cache16"]
    report = (tmp / "out" / "headline.md").read_text()
    assert f"Reproduce: `TRACE=traces/{QWEN}.npz bash bench/run_headline_on_device.sh`" \
        in report


def test_a_trace_of_another_expert_count_writes_no_checkpoint(runner):
    run, tmp = runner
    odd = trace_of_64_experts(tmp / "odd.npz")
    calls, out = run(expect_rc=2, TRACE=str(odd))
    assert out.strip().splitlines()[-1] == (
        f"TRACE={odd}: top-4 of 64 experts; the checkpoint has 128 experts")
    assert not any("write_checkpoint.py" in c for c in calls) and _servers(calls) == []


def test_the_warm_up_runs_once_and_only_while_floor_or_cache_is_owed(runner):
    """Re-entrant as the other arms: a warm-up whose record says ok is not run again (the
    cache failed: the next call runs the cache only), and a card whose floor and cache are
    done starts no warm-up even where its record is missing. The report reads none."""
    run, tmp = runner
    hl = tmp / "hl"
    calls, _ = run(STEPS="setup model card24 report", STUB_FAIL="cache24")
    assert _servers(calls) == ["warm24", "floor24", "cache24"]
    rec = json.loads((hl / "warm24.json").read_text())
    assert rec["warm_only"] and "greedy" not in rec
    again, _ = run(STEPS="card24 report")
    assert _servers(again) == ["cache24"]
    (hl / "warm24.json").unlink()
    calls, _ = run(STEPS="card24 report")
    assert _servers(calls) == []
    report = (tmp / "out" / "headline.md").read_text()
    assert "warm" not in report and "| 24 GiB | cache at the planned slots |" in report


def test_a_seeded_resident_is_not_run_again_and_is_said(runner):
    """The card16 session given the card24 session's resident record (SEED) starts no
    resident server, compares against the seeded one, and the report says so."""
    run, tmp = runner
    first, _ = run(STEPS="setup model resident card24 report")
    assert "resident" in _servers(first)
    seed = tmp / "seed"
    seed.mkdir()
    for f in ("resident.json", "resident.log"):
        (seed / f).write_bytes((tmp / "hl" / f).read_bytes())
    (tmp / "hl" / "resident.json").unlink()  # a fresh box: the earlier record only seeded
    (tmp / "hl" / "resident.log").unlink()
    calls, _ = run(STEPS="setup model resident card16 report", SEED=str(seed))
    assert _servers(calls) == ["warm16", "floor16", "cache16"]
    text = (tmp / "out" / "headline.md").read_text()
    assert "from an earlier session, not measured in this one: resident.json, resident.log" \
        in text


def test_the_second_card_alone_on_another_gpu_is_its_own_table(runner):
    """A session whose GPU differs from the first card's cannot be seeded: the 16 GiB card
    run unseeded brings its own probe and resident, plan predicts it from them, and the
    report's table holds that card's rows and no 24 GiB row."""
    run, tmp = runner
    calls, _ = run(STEPS="setup model probe resident card16 plan report")
    assert _servers(calls) == ["resident", "warm16", "floor16", "cache16"]
    assert json.loads((tmp / "hl" / "plan16.json").read_text())["rows"][0]["slots"] == 51
    assert not (tmp / "hl" / "plan24.json").exists()
    table = [row for row in (tmp / "out" / "headline.md").read_text().splitlines()
             if row.startswith("| ")]
    assert any(row.startswith("| 16 GiB | cache at the planned slots | 51 / 51") and
               "| 90.00 median (89.00-91.00) |" in row and "| 100.0 (0.900) |" in row
               for row in table)
    assert not any(row.startswith("| 24 GiB") for row in table)


def test_the_report_names_the_gpu_the_setup_found(runner):
    """Cards are emulated on whatever GPU the job gets: the table says which one, in its
    header and in the resident row, from what the setup step recorded."""
    run, tmp = runner
    (tmp / "out").mkdir(exist_ok=True)
    (tmp / "out" / "env.txt").write_text("NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB\n"
                                         "vllm 0.26.0 torch 2.11.0+cu130\n")
    run(STEPS="setup model resident card24 report")
    assert (tmp / "hl" / "gpu.txt").read_text().strip() == "NVIDIA H100 80GB HBM3"
    report = (tmp / "out" / "headline.md").read_text()
    assert report.splitlines()[0].startswith("GPU: NVIDIA H100 80GB HBM3; the small cards "
                                             "emulated on it")
    assert "| whole NVIDIA H100 80GB HBM3 | resident: every expert in VRAM |" in report


def test_plan_replays_what_each_cache_server_was_handed(runner):
    """The plan step predicts each card's cache arm on the ids its server replayed (a
    warm-up and the arm's runs, 200 tokens each from row 0) at the slots it armed, with this
    run's probe and resident rate; a probe of another GPU model shows no prediction."""
    from expertcache_cli.rules import trace as tracefile

    run, tmp = runner
    hl = tmp / "hl"
    calls, _ = run(STEPS="setup model probe resident card24 plan")
    assert calls.index(next(c for c in calls if "probe-link" in c)) < \
        calls.index(_arm(calls, "resident"))
    fit = next(c for c in calls if c.startswith("bench/trace_fit.py") and "served24" in c)
    assert fit.endswith(f"{hl}/served24.npz --layers 48 --size {hl}/size24.json --streams 1 "
                        "--steps 800 --request-steps 200 --decode-only")
    served = tracefile.load(hl / "served24.npz")
    assert served.num_layers == 48 and served.steps == 4 * 199  # 4 requests, each prefill left out
    plan = next(c for c in calls if c.startswith("-m expertcache_cli plan"))
    assert plan == (f"-m expertcache_cli plan {hl}/served24.npz --probe {hl}/probe.json "
                    "--resident-tok-s 300.000 --slots 85 --policy lru --json")
    assert json.loads((hl / "plan24.json").read_text())["rows"][0]["slots"] == 85
    assert not (hl / "plan16.json").exists()  # no cache16 arm: nothing to predict
    # another GPU's probe: the column stays empty and the report says why
    (hl / "plan24.json").unlink()
    (hl / "probe.json").write_text(json.dumps({"device_name": "NVIDIA H200"}))
    (hl / "gpu.txt").write_text("NVIDIA H100 80GB HBM3\n")
    run(STEPS="plan report")
    report = (tmp / "out" / "headline.md").read_text()
    assert "- 24 GiB: plan's probe ran on NVIDIA H200, the servers on NVIDIA H100 80GB " \
           "HBM3: no prediction shown" in report
    assert "| 24 GiB | cache at the planned slots | 85 / 85 (48 of 48 layers armed) | " \
           "150.00 median (149.00-151.00) | 5.00 | 0.500 | 90.00% | - |" in report


def test_a_recording_of_several_requests_is_replayed_in_turn(runner):
    """gpt-oss-120b's own recording (four prompts, top-4 of 128) on the headline shape: every
    server cycles its prompts over the four recorded requests, and plan is told the prompt
    lengths, so that it replays what they replayed."""
    run, tmp = runner
    hl = tmp / "hl"
    trace = tmp / "tree" / "traces" / "real-gpt-oss-120b-k4.npz"
    calls, _ = run(TRACE=str(trace), STEPS="setup model probe resident card24 plan report")
    assert "--top-k 4" in next(c for c in calls if "write_checkpoint.py" in c)
    for name in ("resident", "warm24", "floor24", "cache24"):
        assert "--prompt-cycle 4" in _arm(calls, name)
    fit = next(c for c in calls if c.startswith("bench/trace_fit.py") and "served24" in c)
    assert fit.endswith("--decode-only --prompt-tokens 16,24,32,40")
    assert (hl / "plan24.json").exists()
    # runs of different requests are taken together (tokens over summed time), not by
    # their median (one request's rate), in the table and in plan's resident rate
    report = (tmp / "out" / "headline.md").read_text()
    assert "| 24 GiB | cache at the planned slots | 85 / 85 (48 of 48 layers armed) | " \
        "180.00 over the runs (150.00-300.00) | 5.00 | 0.500 |" in report
    assert "Prompts: every request its own prompt of 16-40 words" in report
    plan = next(c for c in calls if c.startswith("-m expertcache_cli plan"))
    assert "--resident-tok-s 360.000" in plan
