"""The plan check's comparison (bench/plan_check.py): `plan --json` beside a baseline
results file, row by row, on CPU, before a device run depends on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import plan_check  # noqa: E402

TRACE = ROOT / "traces" / "demo-qwen3-30b-a3b-tasks.npz"


def _baseline(path: Path, arms: dict[str, float], hit: float = 0.9,
              requests: int | None = None) -> None:
    """A results file as `baseline` writes it: meta, one run per arm, counters."""
    lines = [{"kind": "meta", "format": 1, "model": "m", "arms": list(arms), "runs": 1}]
    for arm, tok_s in arms.items():
        lines.append({"kind": "run", "arm": arm, "restart": 0, "run": 0, "tok_s": tok_s,
                      "ttft_s": 0.1, "tokens": 8, "server_id": f"s-{arm}"})
        lines.append({"kind": "counters", "arm": arm, "restart": 0,
                      "counters": {"hit_rate": hit, "requests": requests}})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))



def _plan_at_16_and_64(trace: Path) -> subprocess.CompletedProcess:
    """`plan --json` of ``trace`` at 16 and 64 LRU slots on made-up rates (50 GB/s, 400
    tok/s resident): the plan the comparisons below are fed."""
    return subprocess.run([sys.executable, "-m", "expertcache_cli", "plan", str(trace),
                           "--link-gbps", "50", "--resident-tok-s", "400", "--slots", "16,64",
                           "--policy", "lru", "--json"], capture_output=True, text=True,
                          timeout=300)


def _plan_check(*args: object, timeout: int = 120) -> subprocess.CompletedProcess:
    """bench/plan_check.py run as the runner runs it."""
    return subprocess.run([sys.executable, str(ROOT / "bench" / "plan_check.py"),
                           *map(str, args)], capture_output=True, text=True, timeout=timeout)

def test_each_budget_and_the_saved_plan_beside_what_was_measured(tmp_path):
    saved = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "expertcache_cli", "plan", str(TRACE),
                        "--model", "qwen3-30b-a3b", "--link-gbps", "50", "--resident-tok-s",
                        "100", "--slots", "16,32,64", "--policy", "lru", "--save", str(saved),
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    pred = {f"cache:{row['slots']}": row["predicted_tok_s"] for row in plan["rows"]}
    # measured: 16 slots on the prediction, 32 slots 20% under it, 64 not run
    arms = {"cache:16": pred["cache:16"], "cache:32": 0.8 * pred["cache:32"]}
    per_layer = (plan["recommended"] or {}).get("per_layer_predicted_tok_s")
    if per_layer:
        arms[f"plan:{saved}"] = per_layer * 1.05
    bl = tmp_path / "bl.jsonl"
    # each server ran 100 decode steps: the trace's first 100 are replayed beside it
    _baseline(bl, arms, requests=100 * plan["trace"]["layers"] * plan["model"]["top_k"])
    plan_json = tmp_path / "p.json"
    plan_json.write_text(json.dumps(plan))
    out = _plan_check(plan_json, bl, saved)
    assert out.returncode == 0, out.stderr
    by = {line.split(": ", 1)[0]: line for line in out.stdout.splitlines()}
    assert "(1.000, met: 10%); hit rate live 0.900, replayed" in by["cache:16"]
    window = plan_check.window_hit_rate(TRACE, "lru", 16, 100)
    assert by["cache:16"].endswith(f" (over the 100 steps it served: {window:.3f})")
    whole = 1 - next(r["miss_rate"] for r in plan["rows"] if r["slots"] == 16)
    assert window != whole  # the first 100 steps are not the whole trace
    assert "(0.800, NOT met: 10%)" in by["cache:32"]
    assert by["cache:64"] == "cache:64: not measured"
    if per_layer:
        row = by[f"plan:{saved}"]
        assert "(1.050, met: 10%)" in row and ", replayed" not in row


def test_usage():
    assert plan_check.main([]) == 2


def test_served_steps_come_from_the_final_counters():
    assert plan_check.served_steps({"requests": 153792}, 24, 8) == 801
    assert plan_check.served_steps({}, 24, 8) is None
    assert plan_check.served_steps({"requests": 10}, 0, 8) is None


def test_timed_steps_are_each_runs_decode_steps_after_the_warm_up():
    # a warm-up and 3 runs of 200 tokens: steps 1-199 of requests 1, 2 and 3
    assert plan_check.timed_steps(800, 3, 200) == [(201, 400), (401, 600), (601, 800)]
    assert plan_check.timed_steps(4000, 3, 200) is None  # not a served trace: replayed whole
    assert plan_check.timed_steps(800, None, 200) is None
    assert plan_check.timed_steps(2, 1, 1) is None


def _served(tmp_path: Path, runs: int, tokens: int, layers: int = 4) -> Path:
    """The recorded Qwen3 trace as the hook serves a warm-up and ``runs`` requests."""
    out = tmp_path / "served.npz"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "trace_fit.py"),
                        str(ROOT / "traces" / "real-qwen3-30b-a3b-k6.npz"), str(out),
                        "--layers", str(layers), "--streams", "1", "--steps",
                        str((runs + 1) * tokens), "--request-steps", str(tokens),
                        "--prefill-tokens", "16", "--expert-bytes", "9437184"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out


def test_a_served_trace_is_also_predicted_over_the_steps_the_runs_timed(tmp_path):
    """plan's formula over the timed steps: the misses of those steps only (checked here
    against the replay's prefixes), the cache state carried in from the warm-up and the
    prefills."""
    import dataclasses

    from expertcache_cli.planning import planner
    from expertcache_cli.rules import trace as tracefile
    from expertcache_cli.rules.policy import Policy
    from expertcache_cli.rules.replay import replay

    served = _served(tmp_path, 2, 60)
    r = _plan_at_16_and_64(served)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    row = next(x for x in plan["rows"] if x["slots"] == 64)
    pred, hit, steps = plan_check.timed_prediction(plan, row, 2, 60)
    assert steps == 2 * 59
    tr = tracefile.load(served)

    def misses(n):
        head = dataclasses.replace(tr, topk_ids=tr.topk_ids[:n], step_tokens=tr.step_tokens[:n])
        return float(replay(head, [Policy.LRU], [64]).results.query("policy == 'lru'")
                     ["misses"].iloc[0])

    # a warm-up and 2 runs of 60 steps; the runs' decode steps are [61, 120) and [121, 180)
    assert tr.steps == 180
    missed = (misses(120) - misses(61)) + (misses(180) - misses(121))
    inputs = planner.Inputs(9437184, "t", 50.0, "t", 400.0, "t")
    want = 1000 / planner.predict_ms(missed / 118, inputs, 4.0)
    assert abs(pred - want) < 1e-6
    assert abs(hit - (1 - missed / (118 * 4 * 6))) < 1e-9
    # plan leaves the prefills out too, but prices the cold warm-up request's decode steps
    assert plan["trace"]["prefill_steps"] == 3 and plan["trace"]["decode_steps"] == 177
    assert pred > row["predicted_tok_s"]


def test_the_live_hit_rate_is_set_beside_the_replay_that_counts_as_the_cache_does(tmp_path):
    """`plan` prices decode steps only; the cache's counter also counts a prefill whose
    ids fit the slots (top-2: 16 tokens are 32 ids a layer), and not one
    read through. The line says the rate the live one is to equal where they differ."""
    from expertcache_cli.rules import trace as tracefile
    from expertcache_cli.rules.policy import Policy
    from expertcache_cli.rules.replay import replay

    out = tmp_path / "served.npz"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "trace_fit.py"),
                        str(ROOT / "traces" / "real-gpt-oss-120b-k2.npz"), str(out),
                        "--layers", "4", "--streams", "1", "--steps", "120",
                        "--request-steps", "60", "--prefill-tokens", "16",
                        "--expert-bytes", "9437184"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    tr = tracefile.load(out)
    prefill = (tr.step_tokens > 1).astype("int64")
    for slots in (16, 64):
        rep = replay(tr, [Policy.LRU], [slots], groups=prefill)
        decode, pre = rep.group(0).iloc[0], rep.group(1).iloc[0]
        counted = plan_check.counted_hit_rate(out, "lru", slots)
        if slots == 16:  # 16 tokens x 2 > 16 slots: read through, counted nowhere
            assert pre["read_through_steps"] == 2 * 4  # layer-steps
            assert counted == 1 - decode["installs"] / decode["requests"]
        else:
            assert pre["served_steps"] == 2 * 4 and pre["installs"] > 0
            want = 1 - (decode["installs"] + pre["installs"]) / (
                decode["requests"] + pre["requests"])
            assert abs(counted - want) < 1e-12
            assert counted < 1 - decode["installs"] / decode["requests"]


def test_one_table_over_traces_says_each_traces_routing_and_the_command(tmp_path):
    served = _served(tmp_path, 1, 40)
    files = []
    for name, trace in (("real", served), ("synth", TRACE)):
        r = _plan_at_16_and_64(trace)
        assert r.returncode == 0, r.stderr
        plan = json.loads(r.stdout)
        (tmp_path / f"{name}.json").write_text(r.stdout)
        arms = {f"cache:{x['slots']}": x["predicted_tok_s"] * 1.02 for x in plan["rows"]}
        bl = tmp_path / f"{name}.jsonl"
        _baseline(bl, arms)
        meta, *rest = bl.read_text().splitlines()
        meta = {**json.loads(meta), "runs": 1, "max_tokens": 40}
        bl.write_text("\n".join([json.dumps(meta), *rest]) + "\n")
        files += [str(tmp_path / f"{name}.json"), str(bl), str(tmp_path / "none.json")]
    cmd = "TRACES=real-qwen3-30b-a3b-k6 bash bench/run_plan_check_on_device.sh"
    out = _plan_check("--table", "--command", cmd, *files)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"Reproduce: `{cmd}`"
    rows = [x for x in lines if x.startswith("| served |") or x.startswith("| demo-")]
    # the per-layer plans were not served here: said so, not left out
    assert sum("| `plan:` per-layer split | " in x and "| not measured |" in x
               for x in rows) == 2
    rows = [x for x in rows if "not measured" not in x]
    assert len(rows) == 4
    real, synth = rows[:2], rows[2:]
    assert "recorded (real model, greedy decode, one prompt)" in real[0]
    assert "[as the hook serves 2 request(s) of 40 steps" in real[0]
    # each trace's first row says what plan was given (a table may join several machines)
    given = json.loads((tmp_path / "real.json").read_text())
    assert f"[plan given: gather {given['link_gbps']:.1f} GB/s, resident " in real[0]
    assert "[plan given: " not in real[1]
    assert "| (as above) |" in real[1] and "| (as above) |" in synth[1]
    assert "synthetic" in synth[0]
    for row in rows:
        assert "| 1.020 |" in row  # measured / plan's own prediction
    # the served trace's rows: plan's formula over the 39 timed steps, and its ratio
    assert all(row.split(" | ")[6] != "-" for row in real)
    assert all(row.split(" | ")[6] == "-" for row in synth)
    assert lines[-1].endswith("(over the timed steps where plan was given the served trace, "
                              "else plan's own prediction)")
    bad = _plan_check("--table", files[0], timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_an_offload_arm_gives_the_floor_and_each_cache_arms_gain_unjudged(tmp_path):
    r = _plan_at_16_and_64(TRACE)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    pj = tmp_path / "p.json"
    pj.write_text(r.stdout)
    arms = {"offload": 20.0, **{f"cache:{x['slots']}": x["predicted_tok_s"]
                                for x in plan["rows"]}}
    bl = tmp_path / "bl.jsonl"
    _baseline(bl, arms)
    out = _plan_check(pj, bl, tmp_path / "none.json")
    assert out.returncode == 0, out.stderr
    last = out.stdout.splitlines()[-1]
    gain = arms["cache:64"] / 20.0
    assert last.startswith("offload (the floor, same routing): 20.0 tok/s; cache:16 ")
    assert f"cache:64 {gain:.2f}x" in last
    tab = _plan_check("--table", pj, bl, tmp_path / "none.json")
    assert tab.returncode == 0, tab.stderr
    floor = [x for x in tab.stdout.splitlines() if "`offload`" in x]
    assert len(floor) == 1 and "| 20.0 | - | - | - |" in floor[0]
    # each measured row against plan's resident rate (400 tok/s here) and the floor
    assert floor[0].endswith(f"| {20.0 / 400:.3f} | 1.00 |")
    top = next(x for x in tab.stdout.splitlines() if "| `cache:64` |" in x)
    assert top.endswith(f"| {arms['cache:64'] / 400:.3f} | {gain:.2f} |")
    # the floor is not a predicted row: the count of judged rows leaves it out
    assert tab.stdout.splitlines()[-1].startswith("2 of 2 measured rows within 10%")
    # without an offload arm, no floor line
    _baseline(bl, {k: v for k, v in arms.items() if k != "offload"})
    again = _plan_check(pj, bl, tmp_path / "none.json")
    assert "(the floor, same routing)" not in again.stdout


def test_a_row_names_the_gpu_from_plans_probe_source_and_nothing_it_was_not_given():
    probed = {"link_source": "probe-link on NVIDIA H200 (/tmp/p.json: the gather, gather_8)",
              "link_gbps": 49.8, "resident_tok_s": 512.03}
    assert plan_check.measured_on(probed) == (
        " [plan given: NVIDIA H200, gather 49.8 GB/s, resident 512.0 tok/s]")
    # a rate typed on the command line names no GPU; a plan with no inputs says nothing
    typed = {"link_source": "--link-gbps", "link_gbps": 25.0}
    assert plan_check.measured_on(typed) == " [plan given: gather 25.0 GB/s]"
    # a typed link with a probed step: the step's probe still names the GPU
    step = "probe-link on NVIDIA H100 80GB HBM3 (p.json: the cache step, every expert a hit)"
    assert plan_check.measured_on({**typed, "step_source": step}) == (
        " [plan given: NVIDIA H100 80GB HBM3, gather 25.0 GB/s]")
    assert plan_check.measured_on({}) == ""
