"""`expertcache replay` and `expertcache trace` end to end, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from expertcache_cli.commands import DEMO_TRACE, demo_trace_path
from expertcache_cli.rules.trace import load

TRACES = Path(__file__).resolve().parent.parent / "traces"
#: a fixed, long, top-8 trace for counts that tests pin (synthetic: 3000 steps x 48 layers)
TASKS = TRACES / "demo-qwen3-30b-a3b-tasks.npz"


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "expertcache_cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "160"},
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def distinct_requests(path: Path) -> int:
    ids = load(path).topk_ids
    total = 0
    for t in range(ids.shape[0]):
        for layer in range(ids.shape[1]):
            row = ids[t, layer]
            total += len(set(row[row >= 0].tolist()))
    return total


def test_default_trace_is_bundled():
    assert demo_trace_path().name == DEMO_TRACE
    assert (TRACES / DEMO_TRACE).exists()


def test_replay_default_prints_table():
    out = cli("replay").stdout
    assert DEMO_TRACE in out and "experts fetched" in out
    for word in ("lru", "lfu", "opt", "reuse distance"):
        assert word in out


@pytest.mark.parametrize("name", sorted(p.name for p in TRACES.glob("*.npz")))
def test_replay_json_on_every_demo_trace(name):
    path = TRACES / name
    # 16 and 32 slots, or a quarter and a half of a trace's experts where it has fewer than 64
    experts = load(path).num_experts
    slots = (min(16, experts // 4), min(32, experts // 2))
    obj = json.loads(cli("replay", str(path), "--slots", f"{slots[0]},{slots[1]}", "--json").stdout)
    assert obj["trace"]["path"] == str(path)
    rows = obj["results"]
    assert {(r["policy"], r["slots"]) for r in rows} == {
        (p, s) for p in ("lru", "lfu", "opt") for s in slots
    }
    requests = distinct_requests(path)
    for r in rows:
        assert r["requests"] == requests
        assert isinstance(r["misses"], int) and 0 < r["misses"] <= requests
        assert r["miss_rate"] == pytest.approx(r["misses"] / requests)
        assert r["misses"] == r["installs"] + r["read_through_ids"]
    by = {(r["policy"], r["slots"]): r for r in rows}
    for s in slots:
        assert by[("opt", s)]["misses"] <= by[("lru", s)]["misses"]
        assert by[("lru", s)]["vs_lru"] == 1.0 and by[("opt", s)]["vs_opt"] == 1.0


def test_replay_without_slots_takes_its_budgets_from_the_traces_experts(tmp_path):
    """No --slots: E/8, E/4, E/2 (3E/4 in place of one at or below top_k), never E or
    more, on the bundled OLMoE trace (64 experts) and a default `trace synth` output."""
    from expertcache_cli.rules.budget import default_budgets

    assert default_budgets(128, 8) == [16, 32, 64]  # the demo trace's table, as documented
    assert default_budgets(64, 8) == [16, 32, 48]
    assert default_budgets(8, 2) == [4, 6] and default_budgets(2, 1) == [1]
    for e in range(2, 300):
        for k in (1, 2, 8):
            got = default_budgets(e, k)
            assert got and all(1 <= s < e for s in got) and len(got) <= 3, (e, k, got)
    cli("trace", "synth", str(tmp_path / "t.npz"))
    for path in (TRACES / "demo-olmoe-1b-7b-zipf.npz", tmp_path / "t.npz"):
        obj = json.loads(cli("replay", str(path), "--policy", "lru", "--json").stdout)
        assert obj["trace"]["num_experts"] == 64
        assert [r["slots"] for r in obj["results"]] == [16, 32, 48]


def _strict(text: str):
    """json.loads that refuses NaN and Infinity, as RFC 8259 (and jq, browsers) do."""
    def refuse(word):
        raise ValueError(f"not JSON: {word}")

    return json.loads(text, parse_constant=refuse)


def test_replay_json_of_a_one_step_trace_is_strict_json_with_null_for_the_undefined(tmp_path):
    """One step: nothing is re-used, so the reuse-distance percentiles are undefined."""
    cli("trace", "synth", str(tmp_path / "one.npz"), "--steps", "1")
    out = cli("replay", str(tmp_path / "one.npz"), "--json").stdout
    assert "NaN" not in out
    obj = _strict(out)
    assert obj["reuse_distance"] == {"p50": None, "p90": None, "p99": None, "reuses": 0}
    assert all(isinstance(r["miss_rate"], float) for r in obj["results"])
    assert "reuse distance" not in cli("replay", str(tmp_path / "one.npz")).stdout


def test_json_text_is_strict_and_keeps_what_is_defined():
    from expertcache_cli.commands import json_text

    obj = {"a": float("nan"), "b": [np.float64(float("inf")), np.int64(3), 2.5],
           "c": {"d": -float("inf"), "e": "x", "f": None, "g": True}}
    assert _strict(json_text(obj)) == {"a": None, "b": [None, 3, 2.5],
                                       "c": {"d": None, "e": "x", "f": None, "g": True}}


def test_batched_trace_reports_read_through_below_width():
    path = TRACES / "demo-qwen3-30b-a3b-batch4.npz"  # 32 ids a step
    rows = json.loads(cli("replay", str(path), "--slots", "16,32", "--json").stdout)["results"]
    by = {(r["policy"], r["slots"]): r for r in rows}
    assert by[("lru", 16)]["read_through_steps"] == 1500 * 48 and by[("lru", 16)]["installs"] == 0
    assert by[("lru", 32)]["read_through_steps"] == 0
    text = cli("replay", str(path), "--slots", "16").stdout
    assert "read through" in text


def test_wide_modes_and_a_rebatched_trace_as_the_user_sees_them():
    """16 streams of the demo trace at 64 slots: every step is wide (128 ids). In place
    and staged-without-installs fetch every routed expert (nothing fills the slots);
    staged-install fetches a third of them. The counts add up in every mode."""
    def run(wide):
        obj = json.loads(cli("replay", "--batch", "16", "--slots", "64", "--policy", "lru",
                             "--wide", wide, "--json").stdout)
        assert obj["wide"] == wide and obj["batch"] == 16
        return obj["results"][0]

    inplace, staged, install = run("in-place"), run("staged"), run("staged-install")
    for r in (inplace, staged, install):
        assert r["misses"] == r["installs"] + r["read_through_ids"] + r["staged_ids"]
        assert r["requests"] == inplace["requests"]
    assert inplace["read_through_steps"] == staged["staged_steps"] == install["staged_steps"] > 0
    assert staged["misses"] == inplace["misses"] == inplace["requests"]
    assert install["misses"] < 0.5 * inplace["misses"]
    text = cli("replay", "--batch", "16", "--slots", "64", "--wide", "staged-install").stdout
    assert "staged-install layer-steps" in text and "EXPERT_CACHE_WIDE=staged-install" in text


def test_bytes_and_transfer_time(tmp_path):
    obj = json.loads(cli("replay", "--slots", "32", "--link-gbps", "50", "--json").stdout)
    r = next(r for r in obj["results"] if r["policy"] == "lru")
    eb = obj["trace"]["expert_bytes"]
    assert r["bytes_moved"] == r["misses"] * eb
    assert r["bytes_per_token"] == pytest.approx(r["bytes_moved"] / obj["trace"]["tokens"])
    assert r["transfer_ms_per_token"] == pytest.approx(r["bytes_per_token"] / 50e9 * 1e3)


def test_per_layer_split_and_csv(tmp_path):
    csv = tmp_path / "out.csv"
    path = TRACES / "demo-olmoe-1b-7b-zipf.npz"
    obj = json.loads(
        cli(
            "replay",
            str(path),
            "--slots",
            "16",
            "--policy",
            "lru",
            "--per-layer",
            "--json",
            "--csv",
            str(csv),
        ).stdout
    )
    assert len(obj["per_layer"]) == 16
    (split,) = obj["split"]
    assert sum(split["slots"]) <= 16 * 16 and split["misses"] <= split["uniform_misses"]
    lru16 = obj["results"][0]
    assert split["uniform_misses"] == lru16["misses"]
    frame = pd.read_csv(csv)
    assert len(frame) == 16 and frame["installs"].sum() == lru16["installs"]


def test_decay_and_insert_cap_change_lfu():
    base = json.loads(cli("replay", "--slots", "32", "--policy", "lfu", "--json").stdout)
    decayed = json.loads(
        cli("replay", "--slots", "32", "--policy", "lfu", "--decay", "8", "--json").stdout
    )
    capped = json.loads(
        cli("replay", "--slots", "32", "--policy", "lfu", "--max-inserts", "1", "--json").stdout
    )
    m = [o["results"][0] for o in (base, decayed, capped)]
    assert m[0]["misses"] != m[1]["misses"]
    assert m[2]["dropped"] > 0 and m[0]["dropped"] == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (("replay", "--slots", "abc"), "--slots wants comma-separated integers"),
        (("replay", "--slots", "0"), "positive integers"),
        (("replay", "--slots", "128"), "not below the trace's 128 experts"),
        (("replay", "--policy", "mru"), "unknown policy 'mru'"),
        (("replay", "--device", "tpu"), "--device must be cpu or cuda"),
        (("replay", "--wide", "sideways"), "--wide: unknown wide-step mode 'sideways'"),
        (("replay", "--wide", "staged", "--device", "cuda"),
         "--device cuda replays the manager's in-place"),
        (("replay", "--batch", "0"), "--batch must be >= 1"),
        (("replay", str(TRACES / "demo-qwen3-30b-a3b-batch4.npz"), "--batch", "2"),
         "no single-token (decode) step"),
        (("trace", "synth", "/tmp/x.npz", "--kind", "nope"), "--kind must be one of"),
        (("trace", "synth", "/tmp/x.npz", "--experts", "4", "--top-k", "8"), "exceeds experts"),
    ],
)
def test_usage_errors_are_one_line_exit_2(args, message):
    proc = cli(*args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_trace_synth_and_info(tmp_path):
    out = tmp_path / "b.npz"
    knobs = "--kind batched --batch 3 --steps 40 --layers 2 --experts 16 --top-k 2 --seed 7"
    cli("trace", "synth", str(out), *knobs.split())
    t = load(out)
    assert t.topk_ids.shape == (40, 2, 6) and t.source.startswith("synthetic:batched")
    assert t.tokens == 120
    info = json.loads(cli("trace", "info", str(out), "--json").stdout)
    assert info["width"] == 6 and info["ids_per_step_max"] == 6 and info["padding_fraction"] == 0
    again = tmp_path / "c.npz"
    cli("trace", "synth", str(again), *knobs.split())
    assert np.array_equal(load(again).topk_ids, t.topk_ids)  # seeded: reproducible
    assert "num_experts" in cli("trace", "info", str(out)).stdout


def test_output_paths_are_checked_before_the_sweep(tmp_path):
    """A --csv that cannot be written is one line and exit 2 before any work; a good one
    is written whole, with the user's umask, and no temporary file is left beside it."""
    for bad, words in ((tmp_path, "is a directory"),
                       (tmp_path / "missing" / "r.csv", "does not exist")):
        r = subprocess.run([sys.executable, "-m", "expertcache_cli", "replay", "--csv",
                            str(bad)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    out = tmp_path / "r.csv"
    r = subprocess.run([sys.executable, "-m", "expertcache_cli", "replay", "--slots", "16",
                        "--policy", "lru", "--csv", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert out.read_text().startswith("policy,slots,") and sorted(os.listdir(tmp_path)) == [
        "r.csv"]
    assert out.stat().st_mode & 0o044  # readable by others under a usual umask


def test_decay_without_lfu_is_refused():
    r = subprocess.run([sys.executable, "-m", "expertcache_cli", "replay", "--decay", "8",
                        "--policy", "lru,opt"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--decay 8 applies to lfu only" in r.stderr


def test_a_split_never_recommends_a_budget_the_plugin_refuses():
    """64-expert layers: a split that gives one layer all 64 slots cannot be served
    (S must be below E), so the grid stops at 63."""
    from expertcache_cli.rules.policy import Policy
    from expertcache_cli.rules.split import recommend, slot_grid
    from expertcache_cli.rules.trace import load

    assert max(slot_grid(64, [32, 64])) <= 63 and slot_grid(64, [63])[-1] == 63
    trace = load(TRACES / "demo-olmoe-1b-7b-zipf.npz")  # 64 experts
    (split,) = recommend(trace, Policy.LRU, [48])
    assert max(split.slots) <= 63 and sum(split.slots) <= 48 * trace.num_layers


def test_a_batch_is_padded_as_the_server_pads_it():
    """10 streams at 96 slots, top-8: on a server of 10 sequences vLLM 0.31+ runs the batch
    unpadded (80 ids: served from the slots), 0.26-0.30 pad it to 16 (128 ids: every step
    reads through), and so does any release on a server of 256 (10 is not a graph there)."""
    def run(*extra):
        obj = json.loads(cli("replay", str(TASKS), "--batch", "10", "--slots", "96",
                             "--policy", "lru", "--json", *extra).stdout)
        return obj["server"], obj["results"][0]

    new, new_row = run("--vllm-version", "0.33")
    assert new["batch_tokens"] == 10 and new["max_num_seqs"] == 10 and new_row[
        "read_through_steps"] == 0
    old, old_row = run("--vllm-version", "0.26")
    assert old["batch_tokens"] == 16 and old_row["read_through_steps"] == 3000 * 48
    wide, _ = run("--vllm-version", "0.33", "--", "--max-num-seqs", "256")
    assert wide["batch_tokens"] == 16 and wide["max_num_seqs_source"] == "given"
    opt, _ = run("--vllm-version", "0.33", "--max-num-seqs", "10", "--", "--max-num-seqs", "256")
    assert opt["batch_tokens"] == 10  # the option wins over the flag after --
    eager, _ = run("--", "--max-num-seqs", "64", "--enforce-eager")
    assert eager["batch_tokens"] == 10 and eager["graphs"] == "--enforce-eager"
    text = cli("replay", str(TASKS), "--batch", "10", "--slots", "96", "--policy", "lru",
               "--vllm-version", "0.26").stdout
    assert "gate at 16 tokens" in text
    assert "batch: a batch of 10 runs as 16 tokens a step (padded to a CUDA graph): " \
           "--max-num-seqs 10" in " ".join(text.split())


@pytest.mark.parametrize("args, words", [
    (["--max-num-seqs", "8"], "give --batch"),
    (["--vllm-version", "0.31"], "give --batch"),
    (["--", "--max-num-seqs", "8"], "give --batch"),
    (["--batch", "16", "--max-num-seqs", "8"], "--batch 16 is more than --max-num-seqs 8"),
    (["--batch", "16", "--vllm-version", "0.40"], "plugin runs on vLLM 0.26-0.34"),
    (["--batch", "16", "--", "--max-num-seqs", "x"], "--max-num-seqs 'x'"),
    ([str(TRACES / DEMO_TRACE), "stray", "--batch", "4"], "unknown option or argument 'stray'"),
])
def test_the_servers_flags_bad_input_is_one_line(args, words):
    r = cli("replay", *args, check=False)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr


def test_a_split_is_recommended_for_a_policy_a_server_runs():
    """`replay --per-layer` splits for the first online policy asked, else LRU: Belady's
    optimum needs the future and serves nothing."""
    from expertcache_cli.rules.policy import Policy
    from expertcache_cli.rules.split import split_policy

    assert split_policy([Policy.OPT, Policy.LFU, Policy.LRU]) is Policy.LFU
    assert split_policy([Policy.OPT]) is Policy.LRU


def test_the_live_counters_view_of_a_replay_leaves_out_the_steps_read_through():
    """One layer, 4 slots, top-2: a 3-token prefill (6 ids > 4 slots, read through), then
    decode steps {0,1}, {0,1}, {2,3}: the cache installs 4 and serves 6 ids, so its counter
    says 1 - 4/6; the replay's own miss rate also counts the prefill's 4 distinct ids."""
    from expertcache_cli.rules.policy import Policy
    from expertcache_cli.rules.replay import live_hit_rate, live_requests, replay
    from expertcache_cli.rules.trace import Trace

    ids = np.full((4, 1, 6), -1, dtype=np.int32)
    ids[0, 0] = [0, 1, 2, 3, 0, 1]
    ids[1, 0, :2], ids[2, 0, :2], ids[3, 0, :2] = [0, 1], [0, 1], [2, 3]
    tr = Trace(topk_ids=ids, num_experts=8, top_k=2,
               step_tokens=np.array([3, 1, 1, 1], dtype=np.int32))
    row = replay(tr, [Policy.LRU], [4]).results.iloc[0]
    assert (row["read_through_ids"], row["installs"], row["requests"]) == (4, 4, 10)
    assert live_requests(int(row["requests"]), int(row["read_through_ids"])) == 6
    live = live_hit_rate(int(row["installs"]), int(row["requests"]),
                         int(row["read_through_ids"]))
    assert live == pytest.approx(1 - 4 / 6)
    assert 1 - row["miss_rate"] == pytest.approx(1 - 8 / 10)
    assert np.isnan(live_hit_rate(0, 4, 4))  # nothing served from slots
