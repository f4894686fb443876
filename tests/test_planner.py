"""`expertcache plan`: the prediction formula, its inputs' sources, the recommendation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from expertcache_cli.errors import UserError
from expertcache_cli.planning import planner
from expertcache_cli.rules.policy import Policy, Wide
from expertcache_cli.rules.trace import Trace, load

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "demo-qwen3-30b-a3b-tasks.npz"
PROBE = ROOT / "bench" / "results" / "probe-link-h200.json"
BASELINE = ROOT / "bench" / "results" / "baseline.jsonl"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expertcache_cli", "plan", *args],
                          capture_output=True, text=True, timeout=300)


def test_the_formula_is_resident_time_plus_the_misses_over_the_link():
    """24-layer Qwen3-30B-A3B shape, bf16 (9,437,184 B an expert), resident 465 tok/s, link
    49.4 GB/s: 141.8 experts over the link a token (the live installs of the 32-slot run)
    price at 34.2 tok/s, where vLLM measured 34.98."""
    inputs = planner.Inputs(9_437_184, "given", 49.4, "given", 465.0, "given")
    ms = planner.predict_ms(141.8, inputs)
    assert ms == pytest.approx(1000 / 465 + 1000 * 141.8 * 9_437_184 / 49.4e9)
    assert 1000 / ms == pytest.approx(34.2, abs=0.05)
    assert planner.predict_ms(0.0, inputs) == pytest.approx(1000 / 465)


def test_the_cache_step_is_paid_in_every_moe_layer_every_step():
    """A single stream decodes a token a step: 48 layers x the all-hit step's cost come on
    top of resident time, whatever the misses; a re-batched trace of N streams pays it
    once a step for N tokens."""
    inputs = planner.Inputs(4_732_928, "given", 48.8, "given", 279.87, "given",
                            step_us=3.7, step_source="measured")
    no_step = planner.Inputs(4_732_928, "given", 48.8, "given", 279.87, "given")
    one = planner.predict_ms(1.30, inputs, 48.0)
    assert one - planner.predict_ms(1.30, no_step, 48.0) == pytest.approx(48 * 3.7 / 1000)
    assert planner.predict_ms(1.30, no_step, 48.0) == planner.predict_ms(1.30, no_step)
    trace = load(TRACE)
    rows = {}
    for name, i in (("step", inputs), ("none", no_step)):
        rep = planner.plan_trace(trace, i, [Policy.LRU], [32], fits_upto=None,
                                 model={"name": "t"}, serve_model="/m", vram_gb=None)
        rows[name] = rep.rows[0]["predicted_ms_per_token"]
        assert rep.to_json()["step_us"] == i.step_us
    per_token = trace.num_layers * trace.steps / trace.tokens
    assert rows["step"] - rows["none"] == pytest.approx(per_token * 3.7 / 1000)


def test_a_staged_steps_hits_are_priced_as_device_copies(tmp_path):
    """A staged wide step copies each expert it finds in the slots into the scratch: with
    --wide staged-install every such hit costs its bytes at the hit-copy rate, a probe's
    `stage` where it measured one, else the planner's constant; in place nothing is
    staged and nothing changes."""
    # 4 experts, 2 slots, top-1; steps 0-1 install 0 and 1, then 3 wide steps of 3 tokens
    # route 0, 1, 2: each finds 0 and 1 in the slots and stages 2
    ids = np.array([[[0, -1, -1]], [[1, -1, -1]]] + [[[0, 1, 2]]] * 3)
    trace = Trace(ids, 4, 1, step_tokens=np.array([1, 1, 3, 3, 3])).validate()
    inputs = planner.Inputs(1_000_000, "given", 1.0, "given", 1000.0, "given",
                            hit_copy_gbps=100.0, hit_copy_source="probe")
    kw = dict(fits_upto=None, model={"name": "t"}, serve_model="/m", vram_gb=None)
    staged = planner.plan_trace(trace, inputs, [Policy.LRU], [2], wide=Wide.STAGED_INSTALL,
                                **kw).rows[0]
    tokens = trace.tokens  # every step priced as decode
    assert staged["staged_hits_per_token"] == pytest.approx(6 / tokens)
    ms = planner.predict_ms(staged["misses_per_token"], inputs)
    assert staged["predicted_ms_per_token"] == pytest.approx(ms + 6 / tokens * 1000 / 100e3)
    inplace = planner.plan_trace(trace, inputs, [Policy.LRU], [2], **kw).rows[0]
    assert inplace["staged_hits_per_token"] == 0
    assert inplace["predicted_ms_per_token"] == pytest.approx(
        planner.predict_ms(inplace["misses_per_token"], inputs))
    # no rate given: the measured constant, and the source says it was not measured here
    default = planner.Inputs(1, "b", 1.0, "l", 1.0, "r")
    assert default.hit_copy_gbps == planner.HIT_COPY_GBPS
    assert default.hit_copy_source.startswith("not measured")
    # a probe that measured the stage gives its rate
    assert planner.read_hit_copy(PROBE) is None
    data = json.loads(PROBE.read_text())
    data["stage_gbps"] = 1234.5
    saved = tmp_path / "probe.json"
    saved.write_text(json.dumps(data))
    gbps, src = planner.read_hit_copy(saved)
    assert gbps == 1234.5 and "the stage" in src and "NVIDIA H200" in src


def test_the_step_is_read_from_a_probe_that_measured_it(tmp_path):
    assert planner.read_probe(PROBE)[2] is None  # this probe predates the measurement
    data = json.loads(PROBE.read_text())
    data["step_us"] = 3.71
    saved = tmp_path / "probe.json"
    saved.write_text(json.dumps(data))
    us, src = planner.read_probe(saved)[2]
    assert us == 3.71 and "the cache step" in src and "NVIDIA H200" in src


def test_inputs_read_from_a_saved_probe_and_a_baseline_file(tmp_path):
    rate, src = planner.read_probe(PROBE)[:2]
    assert rate == pytest.approx(49.48, abs=0.01) and "NVIDIA H200" in src
    from expertcache_cli.baseline.runner import resident_from_baseline

    tok_s, src = resident_from_baseline(BASELINE)
    assert tok_s == pytest.approx(600.9, abs=0.1) and "3 restart(s)" in src
    with pytest.raises(UserError, match="not JSON"):
        planner.read_probe(BASELINE)[:2]  # JSON lines, not a probe
    other = tmp_path / "other.json"
    other.write_text('{"decode": {}}')
    with pytest.raises(UserError, match="no measured gather rate"):
        planner.read_probe(other)[:2]


def test_a_gather_only_probe_is_read_and_a_stand_in_gather_refused(tmp_path):
    """`probe-link --only gather` saves gather rows but no decode ceilings (no HBM figure):
    the rate is the row nearest the model's top_k, as the full probe's conclusion picks."""
    data = json.loads(PROBE.read_text())
    full_rate, _ = planner.read_probe(PROBE)[:2]
    want = next(r for r in data["gather"] if r["path"] == data["decode"]["gather_row"])
    assert full_rate == want["gbps"]
    data.pop("decode")
    only = tmp_path / "gather-only.json"
    only.write_text(json.dumps(data))
    rate, src = planner.read_probe(only)[:2]
    assert rate == full_rate and want["path"] in src
    data["gather_impl"] = "FALLBACK: torch index_select over a UVA view"
    only.write_text(json.dumps(data))
    with pytest.raises(UserError, match="stand-in"):
        planner.read_probe(only)[:2]


def test_the_recommendation_is_the_fastest_budget_that_fits():
    trace = load(TRACE)
    inputs = planner.Inputs(4_732_928, "given", 49.4, "given", 300.0, "given")
    rep = planner.plan_trace(trace, inputs, [Policy.LRU, Policy.LFU], [16, 32, 64],
                             fits_upto=32, model={"name": "t"}, serve_model="/m",
                             vram_gb=24, plan_file="p.json")
    fits = {(r["policy"], r["slots"]): r["fits"] for r in rep.rows}
    assert fits[("lru", 64)] is False and fits[("lru", 32)] is True
    rec = rep.recommended
    best = max((r for r in rep.rows if r["fits"]), key=lambda r: r["predicted_tok_s"])
    assert (rec["policy"], rec["slots"]) == (best["policy"], best["slots"]) == ("lru", 32)
    assert len(rec["per_layer_slots"]) == trace.num_layers
    assert sum(rec["per_layer_slots"]) <= 32 * trace.num_layers
    assert max(rec["per_layer_slots"]) < trace.num_experts
    # no batch flags: the command carries the --max-num-seqs 32 slots keep on the cache (4
    # x top-8 = 32 ids), which leaves the per-layer split no layer to shrink below 32
    assert rec["serve_command"] == ("expertcache serve /m --vram 24 --slots 32 --policy lru "
                                    "-- --max-num-seqs 4")
    assert rec["per_layer_slots"] == [32] * trace.num_layers
    for r in rep.rows:  # misses per token is what the replay counted, per token
        assert r["predicted_ms_per_token"] == pytest.approx(
            planner.predict_ms(r["misses_per_token"], inputs))


def test_cli_json_has_the_documented_keys_and_a_plan_file_serve_reads(tmp_path):
    out = tmp_path / "plan.json"
    r = _cli(str(TRACE), "--model", "qwen3-30b-a3b-w8a8", "--vram", "24", "--probe",
             str(PROBE), "--baseline", str(BASELINE), "--slots", "16,32,64", "--json",
             "--save", str(out))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["model"]["bytes_per_expert"] == 4_732_928 and d["link_gbps"] > 49
    assert d["resident_tok_s"] == pytest.approx(600.9, abs=0.1)
    assert set(d["rows"][0]) >= {"policy", "slots", "misses_per_token", "miss_rate",
                                 "predicted_ms_per_token", "predicted_tok_s"}
    assert set(d["recommended"]) >= {"policy", "slots", "per_layer_slots", "predicted_tok_s",
                                     "serve_command"}
    assert json.loads(out.read_text()) == d
    rec = planner.read_plan(out)
    assert rec["per_layer_slots"] == d["recommended"]["per_layer_slots"]
    # --size-from (serve's name for the sizing source) is the same option
    same = _cli(str(TRACE), "--size-from", "qwen3-30b-a3b-w8a8", "--vram", "24", "--probe",
                str(PROBE), "--baseline", str(BASELINE), "--slots", "16,32,64", "--json")
    assert same.returncode == 0, same.stderr
    assert json.loads(same.stdout)["rows"] == d["rows"]


@pytest.mark.parametrize("args, words", [
    (["--link-gbps", "50"], "plan needs the resident rate (--resident-tok-s R"),
    (["--resident-tok-s", "300", "--link-gbps", "0"], "--link-gbps must be a positive"),
    (["--resident-tok-s", "300", "--link-gbps", "50", "--vram", "24"], "--vram needs --model"),
    (["--resident-tok-s", "300", "--link-gbps", "50", "--slots", "128"], "not below"),
    (["--resident-tok-s", "300", "--link-gbps", "50", "--policy", "opt"], "lru or lfu"),
    (["--resident-tok-s", "300", "--link-gbps", "50", "--model", "mixtral-8x7b"], "experts"),
])
def test_cli_bad_input_is_one_line(args, words):
    r = _cli(str(TRACE), *args)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr


def test_plot_draws_predicted_tok_s_per_policy(tmp_path):
    pytest.importorskip("matplotlib", reason="plot extra (matplotlib) not installed")
    r = _cli(str(TRACE), "--link-gbps", "50", "--resident-tok-s", "300", "--slots", "8,32",
             "--plot", str(tmp_path / "p"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert f"plot written to {tmp_path / 'p.png'}" in r.stderr


def test_plan_for_a_batch_with_the_staged_path_says_what_it_rests_on():
    r = _cli(str(TRACE), "--model", "qwen3-30b-a3b-w8a8", "--probe", str(PROBE),
             "--resident-tok-s", "1022", "--batch", "16", "--slots", "64,96", "--wide",
             "staged-install", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["trace"]["batch"] == 16 and data["trace"]["wide"] == "staged-install"
    notes = " ".join(data["notes"])
    assert "aggregate at 16 streams" in notes and "(EXPERT_CACHE_WIDE)" in notes
    rows = {(x["policy"], x["slots"]): x for x in data["rows"]}
    assert rows[("lru", 96)]["predicted_tok_s"] > rows[("lru", 64)]["predicted_tok_s"]
    inplace = json.loads(_cli(str(TRACE), "--model", "qwen3-30b-a3b-w8a8", "--probe", str(PROBE),
                              "--resident-tok-s", "1022", "--batch", "16", "--slots", "64",
                              "--json").stdout)
    # in place at 64 slots every 16-stream step (128 ids) reads through: slower than staged
    assert inplace["rows"][0]["predicted_tok_s"] < rows[(inplace["rows"][0]["policy"], 64)][
        "predicted_tok_s"]
    assert "--wide staged-install predicts" in " ".join(inplace["notes"])


def test_a_batch_of_a_one_request_recording_warns_that_it_prices_one_user():
    """A served 24-layer recording of one stream (5 requests, one of them 1,024 tokens;
    bench/results/wide-steps.md): re-batched to 16 it predicted 180 tok/s in place where 16
    users ran 41; the plan says its streams share a request, and why that matters."""
    data = ROOT / "tests" / "data"
    r = _cli(str(data / "wide-one-request.npz"), "--model", "qwen3-30b-a3b", "--probe",
             str(data / "wide-one-request-probe.json"), "--resident-tok-s", "2637.9",
             "--slots", "64", "--batch", "16", "--json")
    assert r.returncode == 0, r.stderr
    notes = json.loads(r.stdout)["notes"]
    shared = [n for n in notes if n.startswith("the trace holds 5 request(s)")]
    assert shared and "as few as 1 distinct requests" in shared[0]
    assert "record at least 16 requests" in shared[0]


def test_a_fast_resident_rate_warns_that_the_host_may_pace_decoding():
    """H200: an 8-layer model at 614 tok/s resident ran 1.22x the additive prediction
    (installs hid in GPU idle time); the plan says where its model may not hold."""
    trace = load(TRACE)

    def notes(resident: float) -> list[str]:
        inputs = planner.Inputs(4_732_928, "given", 49.4, "given", resident, "given")
        return planner.plan_trace(trace, inputs, [Policy.LRU], [16], fits_upto=16,
                                  model={"name": "t"}, serve_model="/m",
                                  vram_gb=24).notes

    fast = [n for n in notes(614.0) if "host work" in n]
    assert fast and "1.63 ms a token" in fast[0]
    assert not any("host work" in n for n in notes(280.0))


def test_the_serve_command_is_one_line_at_80_columns_and_in_a_pipe(tmp_path):
    """`plan` prints the command to copy whole (no rich wrapping mid-command), and it is
    the one the plan file records."""
    import os

    args = [str(TRACE), "--model", "qwen3-30b-a3b-w8a8", "--vram", "24", "--probe", str(PROBE),
            "--resident-tok-s", "296.26", "--slots", "43,85", "--save",
            str(tmp_path / "plan.json"), "--", "--max-model-len", "8192", "--max-num-seqs", "8"]
    r = subprocess.run([sys.executable, "-m", "expertcache_cli", "plan", *args],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    cmd = json.loads((tmp_path / "plan.json").read_text())["recommended"]["serve_command"]
    assert len(cmd) > 80 and f"  {cmd}" in r.stdout.splitlines()
    assert cmd.endswith("-- --max-model-len 8192 --max-num-seqs 8")


def test_help_marks_the_inputs_a_machine_with_no_gpu_must_bring():
    import os

    r = subprocess.run([sys.executable, "-m", "expertcache_cli", "plan", "--help"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "on a machine with no GPU bring both" in text
    assert "Needed: the two rates (one of each pair)" in text
    for option, words in (("--link-gbps", "NEEDED on a machine with no GPU: this or --probe"),
                          ("--probe", "NEEDED on a machine with no GPU: this or --link-gbps"),
                          ("--resident-tok-s", "NEEDED everywhere: this or --baseline"),
                          ("--baseline", "NEEDED everywhere: this or --resident-tok-s")):
        line = next(x for x in r.stdout.splitlines()
                    if x.lstrip("│ ").startswith(f"{option} "))
        assert words in line, line


def test_cli_with_no_rates_says_what_to_pass_and_exits_2():
    r = _cli("--slots", "16")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "plan needs" in r.stderr
    assert "--resident-tok-s R" in r.stderr and "--baseline FILE" in r.stderr


# --------------------------------------------------------------------------- what serve takes

#: the top-8 model on the synthetic top-8 trace (the bundled real one ran at top-6)
W8A8 = [str(TRACE), "--model", "qwen3-30b-a3b-w8a8", "--vram", "24", "--probe", str(PROBE),
        "--resident-tok-s", "296.26"]


def _serve_accepts(cmd: str, plan_file: Path, **kw):
    """Run `serve`'s own checks (`launch.make_plan`) on the command `plan` printed."""
    from expertcache_cli.planning.launch import make_plan

    head, _, tail = cmd.partition(" -- ")
    assert "--size-from qwen3-30b-a3b-w8a8 --vram 24" in head
    return make_plan("Qwen/Qwen3-30B-A3B", 24, size_from="qwen3-30b-a3b-w8a8",
                     plan_file=str(plan_file) if "--plan" in head else None,
                     allow_trap="--allow-trap" in head, vllm_args=tail.split(),
                     launcher=["vllm"], environ={}, v2_runner_offloads=lambda: True,
                     wna16_triton=lambda: True, mxfp4_marlin=lambda: True, **kw)


def test_the_per_layer_split_keeps_every_layer_at_the_widest_decode_step():
    """85 slots at --max-num-seqs 8: a full decode batch is 64 ids. The unconstrained split
    of the demo trace puts layers at 56 slots, which serve refuses (the sizing trap); the
    recommended one keeps every layer at >= 64."""
    from expertcache_cli.planning import serving
    from expertcache_cli.rules.split import recommend

    trace = load(TRACE)
    (free,) = recommend(trace, Policy.LRU, [85])
    assert min(free.slots) < 64  # what used to be recommended
    inputs = planner.Inputs(4_732_928, "given", 49.5, "given", 296.26, "given")
    srv = serving.server(["--max-num-seqs", "8"], vllm_version="0.33")
    rep = planner.plan_trace(trace, inputs, [Policy.LRU], [85], fits_upto=85,
                             model={"name": "t"}, serve_model="/m", vram_gb=24,
                             plan_file="p.json", server=srv)
    rec = rep.recommended
    assert min(rec["per_layer_slots"]) >= 64 and rec["min_layer_slots"] == 64
    assert sum(rec["per_layer_slots"]) <= 85 * trace.num_layers
    assert rec["per_layer_misses_saved"] > 0 and rec["allow_trap"] is False
    assert rec["serve_command"] == "expertcache serve /m --vram 24 --plan p.json -- " \
                                   "--max-num-seqs 8"
    assert any("keeps >= 64 slots" in n for n in rep.notes)


def test_a_plan_for_a_given_batch_is_one_serve_takes(tmp_path):
    out = tmp_path / "plan.json"
    r = _cli(*W8A8, "--slots", "85", "--json", "--save", str(out), "--",
             "--max-model-len", "8192", "--max-num-seqs", "8")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)["recommended"]
    assert "--plan" in rec["serve_command"] and min(rec["per_layer_slots"]) >= 64
    plan = _serve_accepts(rec["serve_command"], out)
    assert plan.per_layer == rec["per_layer_slots"]


@pytest.mark.parametrize("version, slots, seqs, floor", [
    (None, 85, 8, 64), ("0.33", 84, 10, 80), ("0.26", 85, 8, 64)])
def test_with_no_batch_flags_the_command_carries_the_max_num_seqs_that_keeps_decode_on_the_cache(
        tmp_path, version, slots, seqs, floor):
    """No vLLM here: 8 sequences (64 ids) hold on every release the plugin runs on, where
    vLLM 0.31+ take 10 (10 is captured there, padded to 16 before). The card is sized for
    the batch `size` chooses, not for vLLM's default 256: 85 slots at 8 sequences, 84 at
    10 (0.33, where 84 slots keep 10 on the cache)."""
    out = tmp_path / "plan.json"
    extra = ["--vllm-version", version] if version else []
    r = _cli(*W8A8, "--slots", f"43,{slots}", "--json", "--save", str(out), *extra, "--",
             "--max-model-len", "8192")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    rec = data["recommended"]
    assert data["model"]["max_slots"] == slots and rec["slots"] == slots
    assert rec["serve_command"].endswith(f"-- --max-model-len 8192 --max-num-seqs {seqs}")
    assert rec["max_num_seqs"] == seqs and min(rec["per_layer_slots"]) >= floor
    note = next(n for n in data["notes"] if n.startswith("the command carries"))
    assert (f"--max-num-seqs {seqs}, the most" in note) and (
        ("a batch of 10 would stay on these slots" in note) == (version is None))
    if version != "0.33":  # serve here reads the 0.26-0.30 rule (no vLLM installed)
        _serve_accepts(rec["serve_command"], out)


def test_a_given_batch_wider_than_the_slots_comes_with_allow_trap(tmp_path):
    out = tmp_path / "plan.json"
    r = _cli(*W8A8, "--slots", "80", "--json", "--save", str(out), "--",
             "--max-model-len", "8192", "--max-num-seqs", "64")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    rec = data["recommended"]
    assert rec["allow_trap"] and " --allow-trap " in rec["serve_command"]
    assert rec["serve_command"].endswith("--max-num-seqs 64")  # the user's batch is kept
    note = next(n for n in data["notes"] if "--allow-trap" in n)
    assert "512 ids" in note and "more than 80 slots" in note
    assert "--max-num-seqs 8 keeps every decode step" in note
    _serve_accepts(rec["serve_command"], out)
    with pytest.raises(UserError, match="sizing trap"):
        _serve_accepts(rec["serve_command"].replace(" --allow-trap", ""), out)


def test_plan_batch_pads_as_the_server_will_and_serves_that_batch():
    """--batch 10 plans a server of 10: vLLM 0.31+ run the full batch unpadded (80 ids, so
    80 slots serve it), 0.26-0.30 pad it to 16 (128 ids read through at 80); the command
    carries --max-num-seqs 10, and with the release assumed a note says what 0.26-0.30
    would do with a layer narrower than their padding."""
    def run(*extra, vllm=()):
        r = _cli(*W8A8, "--slots", "80", "--policy", "lru", "--batch", "10", "--json",
                 *extra, "--", "--max-model-len", "8192", *vllm)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    new, old = run("--vllm-version", "0.33"), run("--vllm-version", "0.26")
    assert new["trace"]["batch_tokens"] == 10 and old["trace"]["batch_tokens"] == 16
    assert new["rows"][0]["predicted_tok_s"] > old["rows"][0]["predicted_tok_s"]
    assert new["recommended"]["serve_command"].endswith(
        "-- --max-model-len 8192 --max-num-seqs 10")
    assert new["recommended"]["min_layer_slots"] == 80
    assert old["recommended"]["allow_trap"] and not new["recommended"]["allow_trap"]
    assert any(n.startswith("a batch of 10 runs as 10 tokens a step (unpadded)")
               for n in new["notes"])
    server = run("--vllm-version", "0.33", vllm=("--max-num-seqs", "256"))
    assert server["trace"]["batch_tokens"] == 16  # 10 is not a graph of a 256 server
    assumed = run()
    assert assumed["recommended"]["vllm"] == "0.34"
    assert any(n.startswith("planned as vLLM 0.34 pads a batch") and "vLLM 0.26-0.30 pad a "
               "full batch of --max-num-seqs 10 to 128 ids" in n for n in assumed["notes"])
    staged = run("--wide", "staged-install", "--vllm-version", "0.33")["recommended"]
    assert staged["serve_command"].endswith("-- --max-model-len 8192 --max-num-seqs 10")
    assert not staged["allow_trap"] and "--wide staged-install" in staged["serve_command"]
    r = _cli(*W8A8, "--batch", "16", "--max-num-seqs", "8")
    assert r.returncode == 2 and "--batch 16 is more than --max-num-seqs 8" in r.stderr


def test_a_plan_priced_staged_is_served_staged_by_serve_plan(tmp_path):
    """A plan priced with `--wide staged-install` is served that way by `serve --plan`
    alone: the wide mode travels in the plan file, and a contradicting `--wide` is refused
    rather than serve a plan its prices do not describe."""
    out = tmp_path / "plan.json"
    r = _cli(*W8A8, "--slots", "64", "--wide", "staged-install", "--json", "--save", str(out),
             "--", "--max-model-len", "8192", "--max-num-seqs", "8")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["recommended"]["wide"] == "staged-install"
    head = "expertcache serve Qwen/Qwen3-30B-A3B --size-from qwen3-30b-a3b-w8a8 --vram 24 --plan"
    tail = " -- --max-model-len 8192 --max-num-seqs 8"
    plan = _serve_accepts(head + tail, out)
    assert plan.env["EXPERT_CACHE_WIDE"] == "staged-install"
    assert _serve_accepts(head + tail, out, wide="staged-install").env == plan.env
    with pytest.raises(UserError, match="--wide in-place: .* priced with --wide staged-install"):
        _serve_accepts(head + tail, out, wide="in-place")
    # a plan file from before the wide mode was saved there: the trace's, else in place
    from expertcache_cli.rules.policy import Wide

    data = json.loads(out.read_text())
    del data["recommended"]["wide"]
    out.write_text(json.dumps(data))
    assert planner.read_plan(out)["wide"] is Wide.STAGED_INSTALL
    del data["trace"]["wide"]
    out.write_text(json.dumps(data))
    assert planner.read_plan(out)["wide"] is Wide.IN_PLACE
    data["recommended"]["wide"] = "sideways"
    out.write_text(json.dumps(data))
    with pytest.raises(UserError, match="unknown wide-step mode 'sideways'"):
        planner.read_plan(out)
