"""The flagship runner's flow (bench/run_flagship_on_device.sh) with every GPU step stubbed:
the config-only model and the trace, the resident rate before any card, on each card
`size`, `plan` and the very command plan recommends (floor and cache alike, with the bench
hooks), the ballast held around them, nothing run twice, and the report's verdicts. Device
minutes are few; a runner bug must not be found on the device."""

from __future__ import annotations

import pytest
from bench_runner_harness import make_runner

pytest.importorskip("httpx", reason="the flagship report imports the bench's server client")

STUB = r'''#!/usr/bin/env python3
"""python3 for the runner: GPU steps recorded and faked, the report run for real."""
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(" ".join(args) + "\n")
if args[0].endswith("flagship_report.py"):
    os.execv(os.environ["REAL_PY"], [os.environ["REAL_PY"], *args])
if args[0].endswith("write_checkpoint.py"):
    d = Path(args[1]); d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
elif args[0].endswith("trace_fit.py") and args[1] == "--shape":
    print(f"4 128 36 {os.environ.get('STUB_REQUESTS', '1')}")  # top-k experts layers requests
elif args[0].endswith("trace_fit.py"):
    Path(args[2]).write_text("npz")
    print(f"{args[2]}: 36 layers; routing: synthetic, stub")
elif args[0].endswith("ballast.py"):
    print(json.dumps({"leave_gib": args[-1]}) if args[1] == "start" else "stopped")
elif args[:4] == ["-m", "expertcache_cli", "trace", "synth"]:
    Path(args[4]).write_text("npz")
elif args[:3] == ["-m", "expertcache_cli", "probe-link"]:
    Path(args[args.index("--save") + 1]).write_text("{}")
elif args[:3] == ["-m", "expertcache_cli", "size"]:
    vram = args[args.index("--vram") + 1]
    slots = {"24": 34, "32": 50}[vram]
    print(json.dumps({"verdict_text": f"cache at {slots} of 128 slots", "max_slots": slots})
          if "--json" in args else f"size text {vram}")
elif args[:3] == ["-m", "expertcache_cli", "plan"]:
    vram = args[args.index("--vram") + 1]
    model = args[args.index("--model") + 1]
    save = args[args.index("--save") + 1]
    flags = " ".join(args[args.index("--") + 1:])
    slots = {"24": 34, "32": 50}[vram]
    cmd = (f"expertcache serve {model} --vram {vram} --plan {save} -- {flags} --max-num-seqs 8"
           if os.environ.get("STUB_NO_FIT") != vram else None)
    rec = None if cmd is None else {
        "policy": "lru", "slots": slots, "predicted_tok_s": 55.0,
        "per_layer_predicted_tok_s": 56.0, "serve_command": cmd}
    Path(save).write_text(json.dumps({
        "rows": [{"policy": "lru", "slots": slots, "miss_rate": 0.26, "predicted_tok_s": 55.0}],
        "recommended": rec, "trace": {"source": "synthetic, stub tasks"}}))
    print(f"plan text {vram}")
elif args[0].endswith("small_card.py") and args[1] == "--print-prompt-tokens":
    os.execve(os.environ["REAL_PY"], [os.environ["REAL_PY"], *args],
              {**os.environ, "PYTHONPATH": os.environ["ROOT"]})
elif args[0].endswith("small_card.py"):
    name, out = args[1], Path(args[args.index("--out") + 1])
    status = "failed" if name == os.environ.get("STUB_FAIL") else "ok"
    if "--warm-only" in args:  # as small_card.py writes a warm-up: no runs, no tokens
        (out / f"{name}.json").write_text(json.dumps(
            {"status": status, "arm": name, "warm_only": True, "log": {}}))
        (out / f"{name}.log").write_text("log\n")
        sys.exit(0 if status == "ok" else 1)
    tok = {"resident": 200.0, "floor24": 21.0, "cache24": 54.0, "floor32": 21.5,
           "cache32": 80.0}[name]
    rec = {"status": status, "arm": name, "tok_s": [tok, tok + 1, tok - 1],
           "greedy": {"tokens": ["a", "b"], "logprob": [0.0, 0.0], "margin": [1.0, 1.0]},
           "log": {"startup_line": "expertcache: vLLM 0.26.0: armed 36 of 36 MoE layers"
                   if name.startswith("cache") else None, "declined": []}}
    (out / f"{name}.json").write_text(json.dumps(rec, indent=1))
    hooks = [] if name == os.environ.get("STUB_NO_HOOKS") else [
        "WARNING BENCH: weights synthesized: 400 tensors", "BENCH: trace routing in force: layer 0"]
    (out / f"{name}.log").write_text("\n".join(["log", *hooks]) + "\n")
'''


@pytest.fixture()
def runner(tmp_path):
    run = make_runner(tmp_path, "run_flagship_on_device.sh",
                      ("flagship_report.py", "small_card.py", "synth_weights.py",
                       "trace_routing.py", "warmup_replay.py"), STUB,
                      keep_bench_helpers=True,
                      FS=str(tmp_path / "fs"))
    traces = tmp_path / "tree" / "traces"  # the bundled recording the runner defaults to
    traces.mkdir()
    (traces / "real-qwen3-30b-a3b-k6.npz").write_text("npz")
    return (lambda **extra: run(**extra)[0]), tmp_path


def _arm(calls: list[str], name: str) -> str:
    return next(c for c in calls if c.startswith(f"bench/small_card.py {name} "))


def _servers(calls: list[str]) -> list[str]:
    return [c.split()[1] for c in calls if c.startswith("bench/small_card.py")]


def test_every_step_as_a_new_user_runs_it_on_both_cards(runner):
    run, tmp = runner
    fs = tmp / "fs"
    calls = run()
    write = next(c for c in calls if "write_checkpoint.py" in c)
    assert "--format mxfp4 --experts 128 --layers 36 --vocab 201088" in write
    assert write.endswith("--config-only")
    # the bundled recording, narrowed to top-4 for the servers; plan's copy as they serve it
    assert not any("trace synth" in c for c in calls)
    fits = [c for c in calls if c.startswith("bench/trace_fit.py") and "--shape" not in c]
    assert fits[0] == (f"bench/trace_fit.py {tmp / 'tree' / 'traces' / 'real-qwen3-30b-a3b-k6.npz'}"
                       f" {fs / 'route-top4.npz'} --layers 36 --top-k 4")
    assert fits[1] == (f"bench/trace_fit.py {fs / 'route-top4.npz'} {fs / 'route-36.npz'} "
                       "--layers 36 --streams 1 --steps 1200 --request-steps 200 "
                       "--decode-only")
    assert _servers(calls) == ["resident", "warm24", "floor24", "cache24", "warm32", "floor32",
                               "cache32"]
    resident = _arm(calls, "resident")
    assert "vllm.entrypoints.cli.main serve" in resident and "--moe-backend marlin" in resident
    assert "--env EXPERT_CACHE_DISABLE=1" in resident
    for name in ("resident", "warm24", "floor24", "cache24", "warm32", "floor32", "cache32"):
        call = _arm(calls, name)
        assert "--env EC_BENCH_SYNTH_WEIGHTS=1" in call and "--load-format dummy" in call
        assert f"EC_BENCH_TRACE_ROUTING={fs / 'route-top4.npz'}" in call
        assert "bench/trace_hook" in call and "--runs 5" in call
        assert "--prompt-cycle" not in call  # a one-request recording: one prompt length
    for gib in ("24", "32"):
        plan = next(c for c in calls if c.startswith("-m expertcache_cli plan")
                    and f"--vram {gib}" in c)
        assert plan.split()[3] == str(fs / "route-36.npz")
        assert "--resident-tok-s 200.000" in plan and f"--model {fs / 'gpt-oss-120b'}" in plan
        assert plan.endswith("-- --max-model-len 8192 --attention-backend TRITON_ATTN "
                             "--load-format dummy")
        floor, cache = _arm(calls, f"floor{gib}"), _arm(calls, f"cache{gib}")
        # the command plan printed, as is, then the bench's server flags
        want = (f"-m expertcache_cli serve {fs / 'gpt-oss-120b'} --vram {gib} --plan "
                f"{fs / f'plan{gib}.json'} -- --max-model-len 8192")
        assert want in floor and want in cache
        assert floor.split(" -- ", 1)[1] == cache.split(" -- ", 1)[1]  # same vLLM flags
        assert "EXPERT_CACHE_DISABLE=1" in floor and "EXPERT_CACHE_DISABLE" not in cache
        assert "--port {port}" in cache
        # a warm-up start of the floor's very command and environment right before it
        warm = _arm(calls, f"warm{gib}")
        # (and, measuring nothing, it logs what vLLM's loaded weights are made of)
        assert " --env EC_BENCH_LOADED=1 " in warm and "EC_BENCH_LOADED" not in floor + cache
        assert warm.replace(f" warm{gib} ", " ").replace(" --warm-only", "").replace(
            " --env EC_BENCH_LOADED=1", "") == floor.replace(f" floor{gib} ", " ")
        # the ballast holds the card around size, plan and every server
        start = calls.index(f"bench/ballast.py start --leave {gib}")
        stop = next(i for i, c in enumerate(calls) if i > start and c == "bench/ballast.py stop")
        assert start < calls.index(plan) < calls.index(warm) < calls.index(floor) \
            < calls.index(cache) < stop
    assert calls.index(_arm(calls, "resident")) < calls.index(
        "bench/ballast.py start --leave 24")
    text = (tmp / "out" / "flagship.txt").read_text()
    assert "| 24 GiB | cache at 34 of 128 slots | lru, per-layer split of 34 slots a layer: " \
           "56.0 tok/s | 21.0 | 54.0 (2.57x) | 200.0 | 0.964 | identical (2) |" in text
    assert "routing of every server: synthetic, stub tasks" in text
    assert "bench hooks: weights synthesized and routing replayed in every server" in text
    assert "24 GiB: cache 2.57x the offload floor (met: at least 2x)" in text
    assert "from an earlier session" not in text  # every record measured in this run
    assert (tmp / "out" / "plan24.json").exists() and (tmp / "out" / "cache32.json").exists()
    assert (tmp / "out" / "plan24.txt").read_text().strip() == "plan text 24"
    again = run()  # re-entrant: nothing served, planned or ballasted twice
    assert _servers(again) == [] and not any(c.startswith("-m expertcache_cli plan")
                                             for c in again)
    assert not any("ballast.py start" in c for c in again)


def test_a_card_before_the_resident_rate_plans_and_serves_nothing(runner):
    run, tmp = runner
    calls = run(STEPS="model card24")
    assert _servers(calls) == [] and not any("ballast.py start" in c for c in calls)
    assert not any(c.startswith("-m expertcache_cli plan") for c in calls)


def test_a_given_trace_routes_every_server_and_no_trace_is_synthesized(runner):
    run, tmp = runner
    given = tmp / "gpt-oss-recorded.npz"
    given.write_text("npz")
    calls = run(STEPS="model resident", TRACE=str(given))
    assert not any("trace synth" in c for c in calls)
    routed = tmp / "fs" / "route-top4.npz"
    assert f"EC_BENCH_TRACE_ROUTING={routed}" in _arm(calls, "resident")
    fit = next(c for c in calls if c.startswith("bench/trace_fit.py"))
    assert fit == f"bench/trace_fit.py {given} {routed} --layers 36 --top-k 4"


def test_a_missing_trace_stops_the_model_step(runner):
    run, tmp = runner
    with pytest.raises(AssertionError, match="no such file"):
        run(STEPS="model", TRACE=str(tmp / "absent.npz"))


def test_no_fitting_budget_serves_as_serve_plans_it_and_missing_hooks_void_the_numbers(
        runner, monkeypatch):
    run, tmp = runner
    monkeypatch.setenv("STUB_NO_FIT", "32")
    monkeypatch.setenv("STUB_NO_HOOKS", "cache24")
    calls = run()
    cache = _arm(calls, "cache32")
    assert f"serve {tmp / 'fs' / 'gpt-oss-120b'} --vram 32 -- --max-model-len 8192" in cache
    assert "--plan" not in cache
    text = (tmp / "out" / "flagship.txt").read_text()
    assert "| 32 GiB | cache at 50 of 128 slots | no budget fits |" in text
    assert ("bench hooks NOT in force, these numbers do not count: cache24: weights NOT "
            "synthesized, routing NOT replayed") in text


def test_the_warm_up_runs_once_and_only_while_floor_or_cache_is_owed(runner):
    """Re-entrant as the other arms: a warm-up whose record says ok is not run again (the
    cache failed: the next call runs the cache only), and a card whose floor and cache are
    done starts no warm-up even where its record is missing. The report reads none."""
    run, tmp = runner
    fs = tmp / "fs"
    calls = run(STEPS="model probe resident card24 report", STUB_FAIL="cache24")
    assert _servers(calls) == ["resident", "warm24", "floor24", "cache24"]
    assert _servers(run(STEPS="card24 report")) == ["cache24"]
    (fs / "warm24.json").unlink()
    assert _servers(run(STEPS="card24 report")) == []
    text = (tmp / "out" / "flagship.txt").read_text()
    assert "warm24" not in text and "identical (2)" in text


def test_a_seeded_probe_and_resident_rate_are_not_measured_again_and_are_said(runner):
    """A card's session given an earlier session's records (SEED) skips the probe and the
    resident server, plans from the seeded rate, and the report says what came so."""
    import json

    run, tmp = runner
    seed = tmp / "seed"
    seed.mkdir()
    (seed / "probe.json").write_text("{}")
    (seed / "resident.json").write_text(json.dumps(
        {"status": "ok", "arm": "resident", "tok_s": [150.0, 151.0, 149.0]}))
    (seed / "resident.log").write_text(
        "log\nWARNING BENCH: weights synthesized: 400 tensors\n"
        "BENCH: trace routing in force: layer 0\n")
    calls = run(STEPS="setup model probe resident card24 report", SEED=str(seed))
    assert not any(c.startswith("-m expertcache_cli probe-link") for c in calls)
    assert _servers(calls) == ["warm24", "floor24", "cache24"]
    plan = next(c for c in calls if c.startswith("-m expertcache_cli plan"))
    assert "--resident-tok-s 150.000" in plan
    text = (tmp / "out" / "flagship.txt").read_text()
    assert ("from an earlier session, not measured in this one: probe.json, resident.json, "
            "resident.log") in text


def test_a_seeded_floor_and_its_plan_leave_the_warm_up_and_the_cache_to_run(runner):
    """A card whose floor an earlier session measured (SEED: its record and the plan it
    served) runs the warm-up start and the cache only, with the seeded plan's command and no
    new `plan`; the report lists the seeded records."""
    import json

    run, tmp = runner
    first = run(STEPS="setup model probe resident card24 report")
    assert _servers(first)[-2:] == ["floor24", "cache24"]
    seed = tmp / "seed"
    seed.mkdir()
    fs = tmp / "fs"
    for name in ("probe.json", "resident.json", "resident.log", "floor24.json",
                 "floor24.log", "plan24.json", "plan24.txt"):
        (seed / name).write_bytes((fs / name).read_bytes())
    for f in fs.iterdir():  # the next session's box starts bare
        if f.is_file():
            f.unlink()
    calls = run(STEPS="setup model card24 report", SEED=str(seed))
    assert _servers(calls) == ["warm24", "cache24"]
    assert not any(c.startswith("-m expertcache_cli plan") for c in calls)
    assert f"--plan {fs / 'plan24.json'}" in _arm(calls, "cache24")
    assert json.loads((fs / "floor24.json").read_text())["status"] == "ok"
    text = (tmp / "out" / "flagship.txt").read_text()
    assert "floor24.json, floor24.log, plan24.json, plan24.txt" in text


def test_a_recording_of_several_requests_is_replayed_in_turn(runner):
    """A trace of four recorded requests (gpt-oss-120b's own): every server's prompts grow by
    8 words a request (small_card.py --prompt-cycle 4), and plan is told each request's
    prompt length, so that it replays the recorded requests the servers replayed."""
    run, tmp = runner
    fs = tmp / "fs"
    calls = run(STUB_REQUESTS="4")
    fit = next(c for c in calls if c.startswith(f"bench/trace_fit.py {fs / 'route-top4.npz'} "))
    assert fit.endswith("--decode-only --prompt-tokens 16,24,32,40")
    for name in ("resident", "warm24", "floor24", "cache24"):
        assert "--prompt-cycle 4" in _arm(calls, name)
