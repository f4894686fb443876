"""The formats report (bench/formats_report.py): each goal of issue 11 computed from the
server records, met or not, without a server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

report = pytest.importorskip("formats_report", reason="the bench needs httpx")

GREEDY = {"tokens": ["w1", "w2"], "logprob": [-0.1, -0.2], "margin": [1.0, 1.0]}


def rec(tok_s, startup="expertcache: vLLM 0.26.0: armed 8 of 8 MoE layers; ...", installs=None,
        tokens=1000, hit_rate=None, greedy=GREEDY):
    r = {"status": "ok", "tok_s": tok_s, "greedy": greedy,
         "log": {"startup_line": startup, "declined": [], "check_line": None,
                 "final": {"hit_rate": hit_rate}}}
    if installs is not None:
        r.update(counters_before={"installs": 100}, counters_after={"installs": 100 + installs},
                 decode_tokens=tokens)
    return r


def test_prediction_and_all_hit_goals():
    # resident 500 tok/s = 2 ms a token; 2 installs a token x 10 MB at 50 GB/s = 0.4 ms more
    recs = {"floor": rec([50.0], startup=None), "resident": rec([500.0], startup=None),
            "cache": rec([410.0, 420.0, 500.0], installs=2000),
            "hot": rec([480.0], hit_rate=0.9999)}
    assert report.predicted_tok_s(500.0, 2.0, 10**7, 50.0) == pytest.approx(1000 / 2.4)
    lines = report.summarize("w8a8", recs, 10**7, 50.0)
    assert lines[0] == "w8a8: floor 50.0 tok/s; resident 500.0"
    assert "greedy vs floor identical (2 tokens)" in lines[1]
    assert lines[1].startswith("w8a8 cache: 420.0 tok/s (410-500); expertcache")  # median
    assert ("2.00 installs a token; predicted 416.7 tok/s, measured 1.008 of it (met: 10%)"
            in lines[1])
    assert lines[2] == ("w8a8 all-hit (--hot N, N slots): 480.0 tok/s = 0.960 of resident "
                        "(met: within 5%); hit rate 99.99%; greedy vs resident identical "
                        "(2 tokens)")


def test_goals_not_met_are_said_so_and_a_declined_format_has_no_goals():
    recs = {"floor": rec([50.0], startup=None), "resident": rec([500.0], startup=None),
            "cache": rec([300.0], installs=2000), "hot": rec([400.0], hit_rate=0.99)}
    lines = report.summarize("fp8-block", recs, 10**7, 50.0)
    assert "(NOT met: 10%)" in lines[1] and "(NOT met: within 5%)" in lines[2]
    declined = {"floor": rec([50.0], startup=None),
                "cache": rec([50.2], startup=None, greedy=None)}
    declined["cache"]["log"]["declined"] = ["expertcache: model.layers.0.mlp.experts: "
                                            "declined: MarlinExperts ..."]
    dead = {"status": "failed", "error": "health: exited",
            "log": {"cause": "ValueError: no kernel"}}
    failed = report.summarize("nvfp4", {"floor": dead}, None, None)
    assert failed[0] == ("nvfp4: floor - tok/s; resident -; floor failed (health: exited: "
                         "ValueError: no kernel)")
    assert report._startup(dead) == (
        "failed (health: exited: ValueError: no kernel)")
    lines = report.summarize("gptq", declined, 10**7, 50.0)
    assert lines[1] == ("gptq cache: 50.2 tok/s; expertcache: model.layers.0.mlp.experts: "
                        "declined: MarlinExperts ...; routing: the checkpoint's own random "
                        "routers (no trace)")
    assert len(lines) == 2


def test_main_reads_the_run_directory(tmp_path, capsys):
    (tmp_path / "w8a8-floor.json").write_text(json.dumps(rec([50.0], startup=None)))
    (tmp_path / "w8a8-cache.json").write_text(json.dumps(rec([400.0], installs=10)))
    (tmp_path / "w8a8-size.json").write_text(json.dumps({"bytes_per_expert": 4732928}))
    assert report.main(["w8a8", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "w8a8: floor 50.0 tok/s; resident -"
    assert out[1].startswith("w8a8 cache: 400.0 tok/s; expertcache: vLLM 0.26.0: armed 8 of 8")
    assert report.main([]) == 2


def test_a_folder_where_the_format_goes_is_one_line_and_exit_2(tmp_path, capsys):
    assert report.main([str(tmp_path), "mxfp4"]) == 2
    assert report.main(["--table", "mxfp4", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "formats_report.py: mxfp4 is not a folder of records (FORMAT DIR: the format first)",
        "formats_report.py --table: mxfp4 is not a folder of records (--table DIR FORMAT...)"]


def test_armed_reads_the_startup_line(tmp_path):
    armed = tmp_path / "a.json"
    armed.write_text(json.dumps(rec([1.0])))
    none = tmp_path / "n.json"
    none.write_text(json.dumps(rec([1.0], startup="expertcache: vLLM 0.26.0: armed 0 of 8 MoE "
                                                  "layers (MarlinExperts ...)")))
    assert report.main(["--armed", str(armed)]) == 0
    assert report.main(["--armed", str(none)]) == 1
    assert report.main(["--armed", str(tmp_path / "missing.json")]) == 1


def test_a_slot_path_the_first_call_check_sent_back_has_no_goals():
    """GPTQ on Marlin through the bench's trial hook (H200): armed 8 of 8, every layer
    differed at its first call and went back to the stock path. No prediction is made from
    an arm that served nothing from its slots, and its all-hit arm says so."""
    sent_back = rec([256.0], installs=0)
    sent_back["log"]["check_line"] = ("expertcache: first-call checks against the stock path: "
                                      "slots path 0 of 8 layers agreed, 8 differed")
    hot = json.loads(json.dumps(sent_back))
    recs = {"floor": rec([256.0], startup=None), "resident": rec([690.0], startup=None),
            "trial": sent_back, "hot": hot}
    lines = report.summarize("gptq", recs, 10**7, 50.0)
    assert "predicted" not in lines[1]
    assert lines[2].startswith("gptq all-hit: 256.0 tok/s, no layer served from its slots")
    assert report.slot_path_served(rec([1.0]))  # no check line yet: armed is enough


def test_a_format_serve_planned_without_the_cache_names_serves_reason():
    off = rec([236.0], startup=None)
    off["log"]["serve_line"] = "expertcache serve: nvfp4 on 139.8 GiB: runs only fully offloaded"
    lines = report.summarize("nvfp4", {"floor": rec([236.0], startup=None), "cache": off},
                             None, None)
    assert "cache off by serve's plan: runs only fully offloaded" in lines[1]
    assert report._weights({"log": {"weights_gib": 1.26}}) == ", 1.26 GiB of weights in VRAM"


def test_served_says_whether_any_layer_passed_its_first_call(tmp_path):
    ok, back = tmp_path / "ok.json", tmp_path / "back.json"
    ok.write_text(json.dumps(rec([1.0])))
    sent_back = rec([1.0])
    sent_back["log"]["check_line"] = "slots path 0 of 8 layers agreed, 8 differed"
    back.write_text(json.dumps(sent_back))
    assert report.main(["--served", str(ok)]) == 0
    assert report.main(["--served", str(back)]) == 1
    assert report.main(["--armed", str(back)]) == 0


def test_the_table_row_carries_each_goal_of_an_armed_and_a_declined_format():
    recs = {"floor": rec([50.0], startup=None), "resident": rec([500.0], startup=None),
            "cache": rec([410.0, 420.0, 500.0], installs=2000),
            "hot": rec([480.0], hit_rate=0.9999)}
    row = report.table_row("w8a8", recs, 10**7, 50.0)
    assert row == ("| w8a8 | armed 8 of 8 | identical (2) | 50.0 | 420.0 (8.40x) | - | "
                   "0.960 (480.0 / 500.0) | 1.008 (420.0 / 416.7) | - |")
    declined = {"floor": rec([256.0], startup=None), "cache": rec(
        [256.0], startup="expertcache: vLLM 0.26.0: armed 0 of 8 MoE layers (experts kernel "
                         "MarlinExperts is not known (known: TritonExperts)); serving on the "
                         "stock path")}
    row = report.table_row("gptq", declined, 10**7, 50.0)
    assert row.startswith("| gptq | declined: experts kernel MarlinExperts is not known "
                          "(known: TritonExperts) | identical (2) | 256.0 | 256.0 (1.00x) "
                          "| - | - |")
    assert report.TABLE_HEAD.splitlines()[0].count("|") == row.count("|")


def test_main_prints_the_table(tmp_path, capsys):
    (tmp_path / "w8a8-floor.json").write_text(json.dumps(rec([50.0], startup=None)))
    (tmp_path / "w8a8-cache.json").write_text(json.dumps(rec([400.0], installs=10)))
    assert report.main(["--table", str(tmp_path), "w8a8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == report.TABLE_HEAD.splitlines()[0] and out[2].startswith("| w8a8 | armed")


def test_each_bracketed_all_hit_server_says_its_tokens_compile_and_slot_audit():
    """The A/B/A lines carry what tells one all-hit server from another (one of three
    had other tokens than resident's; it was also the only cold compile:
    bench/results/all-hit.md)."""
    other = {"tokens": ["w1", "w9"], "logprob": [-0.1, -0.3], "margin": [1.0, 0.5]}
    hot = rec([470.0], hit_rate=0.998, greedy=other)
    hot["log"].update(compile="cold", audit_line="expertcache: slot audit at shutdown: 768 ...")
    warm = rec([472.0], hit_rate=0.998)
    warm["log"].update(compile="warm", audit_line="expertcache: slot audit at shutdown FAILED")
    recs = {"resident": rec([500.0], startup=None), "resident2": rec([500.0], startup=None),
            "hot": hot, "hot_stats": warm}
    lines = report.summarize("fp8-block", recs, None, None)
    assert lines[-2] == ("fp8-block all-hit [hot]: 470.0 tok/s = 0.940 of resident, 0.940 of "
                         "resident again; greedy vs resident part at token 1 of 2, margins "
                         "there 1.0000 / 0.5000, largest chosen-logprob difference before "
                         "0.0000; compile cold; slot audit ok")
    assert lines[-1].endswith("greedy vs resident identical (2 tokens); compile warm; "
                              "slot audit FAILED")


PLAN = {"rows": [{"policy": "lru", "slots": 16, "miss_rate": 0.5, "predicted_tok_s": 300.0},
                 {"policy": "lru", "slots": 32, "miss_rate": 0.25, "predicted_tok_s": 400.0},
                 {"policy": "lfu", "slots": 32, "miss_rate": 0.2, "predicted_tok_s": 420.0}],
        "trace": {"source": "recorded: gpt-oss-120b, 4 chat tasks"}}


def test_the_cache_arm_is_set_beside_plans_prediction_at_its_slots_with_its_routing():
    """Issue 29: the cache arm's tok/s against `plan`'s LRU row at the arm's own slots (its
    startup line), the verdict on the 10% goal, and the trace's source on the line and
    under the table."""
    cache = rec([380.0, 384.0, 390.0], installs=2000)
    cache["log"]["slots"] = 32
    cache["env"] = ["EC_BENCH_TRACE_ROUTING=/box/only/trace.npz"]
    recs = {"floor": rec([50.0], startup=None), "resident": rec([500.0], startup=None),
            "cache": cache}
    lines = report.summarize("mxfp4", recs, 10**7, 50.0, plan=PLAN)
    assert ("plan predicted 400.0 tok/s at 32 slots (replayed hit rate 0.750), measured 0.960 "
            "of it (met: 10%); routing: recorded: gpt-oss-120b, 4 chat tasks") in lines[1]
    row = report.table_row("mxfp4", recs, 10**7, 50.0, plan=PLAN)
    assert row.endswith("| 0.960 (384.0 / 400.0) |")
    slow = dict(cache, tok_s=[300.0])
    assert "measured 0.750 of it (NOT met: 10%)" in report.summarize(
        "mxfp4", dict(recs, cache=slow), None, None, plan=PLAN)[1]
    # no plan: the trace file the hook read, named where it is not readable here
    assert report.routing_of(cache, None) == "trace /box/only/trace.npz (not readable here)"
    unplanned = report.summarize("mxfp4", recs, 10**7, 50.0)[1]
    assert "no plan prediction (no FMT-plan.json" in unplanned
    assert unplanned.endswith("routing: trace /box/only/trace.npz (not readable here)")
    # slots from the command where the startup line has none; no row at other slots
    bare = {"argv": ["serve", "m", "--slots", "16"]}
    assert report.slots_of(bare) == 16 and report.plan_row(PLAN, 16)["predicted_tok_s"] == 300
    assert report.plan_row(PLAN, 64) is None and report.plan_row(None, 32) is None


def test_an_arm_no_trace_routed_is_never_held_to_a_plan_beside_it():
    cache = rec([380.0], installs=2000)
    cache["log"]["slots"] = 32
    cache["env"] = ["EXPERT_CACHE_STATS=400"]
    recs = {"floor": rec([50.0], startup=None), "resident": rec([500.0], startup=None),
            "cache": cache}
    line = report.summarize("fp8-block", recs, 10**7, 50.0, plan=PLAN)[1]
    assert "plan predicted" not in line and "no plan prediction" not in line
    assert line.endswith("routing: the checkpoint's own random routers (no trace)")
    assert report.table_row("fp8-block", recs, 10**7, 50.0, plan=PLAN).endswith("| - |")


def test_a_declined_cache_arm_gets_no_plan_verdict_but_says_its_routing():
    declined = rec([50.0], startup="expertcache: vLLM 0.26.0: armed 0 of 24 MoE layers (x)")
    declined["env"] = ["EC_BENCH_TRACE_ROUTING=/t.npz"]
    lines = report.summarize("awq", {"floor": rec([50.0], startup=None), "cache": declined},
                             10**7, 50.0, plan=PLAN)
    assert "plan predicted" not in lines[1]
    assert lines[1].endswith("routing: recorded: gpt-oss-120b, 4 chat tasks")


def test_median_prints_a_records_median_rate_for_the_runner(tmp_path, capsys):
    (tmp_path / "r.json").write_text(json.dumps(rec([10.0, 30.0, 20.0], startup=None)))
    assert report.main(["--median", str(tmp_path / "r.json")]) == 0
    assert capsys.readouterr().out.strip() == "20.000"
    (tmp_path / "dead.json").write_text(json.dumps({"status": "failed"}))
    assert report.main(["--median", str(tmp_path / "dead.json")]) == 1
    assert report.main(["--median", str(tmp_path / "missing.json")]) == 1


def test_the_table_says_what_routing_each_format_had(tmp_path, capsys):
    (tmp_path / "w8a8-floor.json").write_text(json.dumps(rec([50.0], startup=None)))
    cache = rec([400.0], installs=10)
    cache["env"] = ["EC_BENCH_TRACE_ROUTING=/box/t.npz"]
    (tmp_path / "w8a8-cache.json").write_text(json.dumps(cache))
    (tmp_path / "w8a8-plan.json").write_text(json.dumps(PLAN))
    assert report.main(["--table", str(tmp_path), "w8a8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-4:] == ["Routing of the floor and cache arms:",
                        "- w8a8: recorded: gpt-oss-120b, 4 chat tasks",
                        "Prompts of the measured runs:",
                        "- w8a8: one fixed 16-word prompt for every request"]
    cache["prompt_tokens"] = [16]  # a record of `run_prompt`'s requests
    (tmp_path / "w8a8-cache.json").write_text(json.dumps(cache))
    assert report.main(["--table", str(tmp_path), "w8a8"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "- w8a8: its own 16-word prompt a request in cache; one fixed prompt for every "
        "request in floor")


def test_a_floor_that_does_not_repeat_itself_is_said():
    """The cache's greedy tokens mean something only beside a floor that repeats its own."""
    floor = rec([50.0], startup=None)
    floor["greedy_again"] = {"tokens": ["w1", "w9"], "logprob": [-0.1, -0.3],
                             "margin": [1.0, 0.5]}
    lines = report.summarize("mxfp4", {"floor": floor, "cache": rec([100.0])}, None, None)
    assert "the floor's second greedy request vs its first part at token 1 of 2" in lines[1]
    floor["greedy_again"] = GREEDY
    lines = report.summarize("mxfp4", {"floor": floor, "cache": rec([100.0])}, None, None)
    assert "the floor's second greedy request vs its first identical (2 tokens)" in lines[1]


def test_the_cache_arms_hit_rate_over_its_timed_runs_is_in_its_line_and_row():
    """The hits between the stats lines around the measured runs (the MXFP4 row's counters:
    57,888 uses and 8,664 installs), said beside the cache's tok/s; a record without the
    uses counted says nothing rather than a guess."""
    cache = rec([137.1], installs=8664)
    cache["counters_before"].update(requests=19902)
    cache["counters_after"].update(requests=19902 + 57888)
    assert report.live_hit_rate(cache) == pytest.approx(1 - 8664 / 57888)
    recs = {"floor": rec([33.9], startup=None), "cache": cache}
    row = report.table_row("mxfp4", recs, None, None)
    assert "| 137.1 (4.04x) | 85.0% | - |" in row
    assert report.TABLE_HEAD.splitlines()[0].count("|") == row.count("|")
    assert "hits over the timed runs 85.0%" in report.summarize("mxfp4", recs, None, None)[1]
    assert report.live_hit_rate(rec([1.0], installs=5)) is None  # no uses counted
