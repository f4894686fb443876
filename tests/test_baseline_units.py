"""`baseline` without a server: arms, commands, the results file, the summary math,
the warnings, the counters regex, and the CLI's handling of bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from expertcache_cli.baseline import store
from expertcache_cli.baseline.arms import parse_arm, parse_arms, round_order
from expertcache_cli.baseline.client import StreamResult, summarise_streams
from expertcache_cli.baseline.counters import latest_counters, parse_stats_line
from expertcache_cli.baseline.runner import BaselineConfig, plan_blocks
from expertcache_cli.baseline.server import build_command
from expertcache_cli.baseline.summary import indistinguishable, summarise, t975
from expertcache_cli.errors import UserError

# ---------------------------------------------------------------- arms


def test_parse_arms_kinds_and_env():
    arms = parse_arms("resident, offload,cache:32,cache:64:lfu")
    assert [a.name for a in arms] == ["resident", "offload", "cache:32", "cache:64:lfu"]
    res, off, c32, c64 = arms
    assert res.server_args(8) == []
    assert off.server_args(8) == ["--cpu-offload-gb", "8", "--cpu-offload-params", "experts"]
    assert c32.server_args(7.5)[1] == "7.5"
    assert off.env()["EXPERT_CACHE_DISABLE"] == "1"
    assert res.env()["EXPERT_CACHE_DISABLE"] == "1"
    env = c64.env(stats_every=100)
    assert env["EXPERT_CACHE_SLOTS"] == "64" and env["EXPERT_CACHE_POLICY"] == "lfu"
    assert env["EXPERT_CACHE_STATS"] == "100"
    assert env["EXPERT_CACHE_DISABLE"] is None  # an inherited DISABLE must not leak in
    assert c32.env()["EXPERT_CACHE_POLICY"] == "lru"  # the plugin's default, stated
    # every inherited variable that would change what an arm measures or writes is
    # removed (an inherited DECAY stops LRU servers at startup; TRACE makes arms share a file)
    for arm in arms:
        env = arm.env()
        for name in ("EXPERT_CACHE_DECAY", "EXPERT_CACHE_TRACE", "EXPERT_CACHE_FRACTION"):
            assert name in env and env[name] is None, (arm.name, name)
    assert off.env()["EXPERT_CACHE_STATS"] is None and "EXPERT_CACHE_LIB" not in off.env()


def test_a_cache_arm_can_stage_wide_steps():
    staged = parse_arm("cache:64:lru:staged-install")
    assert (staged.slots, staged.policy, staged.wide) == (64, "lru", "staged-install")
    assert staged.env()["EXPERT_CACHE_WIDE"] == "staged-install"
    assert parse_arm("cache:64:staged").env()["EXPERT_CACHE_WIDE"] == "staged"
    # in place is the plugin's default: stated by leaving the variable out (and removed
    # if inherited, so an inherited WIDE cannot turn an in-place arm into a staged one)
    assert parse_arm("cache:64").env()["EXPERT_CACHE_WIDE"] is None


@pytest.mark.parametrize("bad", ["", "cache", "cache:0", "cache:x", "resident,resident", "gpu",
                                 "cache:8:sideways", "cache:8:staged:lru"])
def test_parse_arms_rejects(bad):
    with pytest.raises(UserError):
        parse_arms(bad)


def test_a_plan_arm_serves_the_plans_per_layer_budgets(tmp_path):
    """`baseline --arms plan:PLAN.json` confirms exactly what `serve --plan` deploys."""
    from expertcache_cli.planning.planner import PLAN_FORMAT

    path = tmp_path / "My Plan.json"  # case and spaces kept: it is a path
    path.write_text(json.dumps({"format": PLAN_FORMAT, "recommended": {
        "policy": "lfu", "slots": 48, "per_layer_slots": [40, 56, 48]}}))
    arm = parse_arm(f"plan:{path}")
    assert arm.kind == "cache" and arm.name == f"plan:{path}" and arm.slots == 40
    env = arm.env()
    assert env["EXPERT_CACHE_SLOTS"] == "40,56,48" and env["EXPERT_CACHE_POLICY"] == "lfu"
    assert arm.offloaded and env["EXPERT_CACHE_WIDE"] is None  # priced in place
    path.write_text(json.dumps({"format": PLAN_FORMAT, "recommended": {
        "policy": "lru", "slots": 48, "per_layer_slots": [40, 56, 48], "wide": "staged"}}))
    assert parse_arm(f"plan:{path}").env()["EXPERT_CACHE_WIDE"] == "staged"  # as priced
    with pytest.raises(UserError, match="--plan .*cannot read"):
        parse_arm(f"plan:{tmp_path / 'missing.json'}")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UserError, match="not an expertcache plan file"):
        parse_arm(f"plan:{tmp_path / 'bad.json'}")


def test_offload_arm_needs_a_size():
    with pytest.raises(UserError, match="--cpu-offload-gb"):
        parse_arm("offload").server_args(None)


def test_cache_servers_drain_on_stop_unless_the_user_chose_a_shutdown_timeout():
    # vLLM's default shutdown SIGKILLs the engine at once, racing the final counters line
    cache, off = parse_arm("cache:8"), parse_arm("offload")
    assert cache.server_args(4, ["--max-num-seqs", "4"])[-2:] == ["--shutdown-timeout", "10"]
    assert "--shutdown-timeout" not in cache.server_args(4, ["--shutdown-timeout", "0"])
    assert "--shutdown-timeout" not in cache.server_args(4, ["--shutdown-timeout=3"])
    assert "--shutdown-timeout" not in off.server_args(4)  # the stock arms stay stock


def test_round_order_rotates_every_arm_through_every_position():
    names = ["a", "b", "c"]
    rounds = [round_order(names, r) for r in range(3)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    for pos in range(3):
        assert sorted(r[pos] for r in rounds) == names


def test_plan_blocks_skips_done_and_keeps_rotation(tmp_path):
    cfg = BaselineConfig(
        model="m",
        arms=parse_arms("resident,offload"),
        out=tmp_path / "r",
        restarts=2,
        cpu_offload_gb=1,
    )
    todo = [(r, a.name) for r, a in plan_blocks(cfg, {("resident", 0)})]
    assert todo == [(0, "offload"), (1, "offload"), (1, "resident")]


# ---------------------------------------------------------------- server command


def test_build_command_template_substitution():
    argv = build_command(
        "{python} -m srv --model '{model}' --port {port} {arm_args} --x {vllm_args}",
        model="/m dir",
        host="h",
        port=123,
        arm="offload",
        arm_args=["--cpu-offload-gb", "4"],
        vllm_args=["--max-model-len", "512"],
    )
    assert argv == [
        sys.executable,
        "-m",
        "srv",
        "--model",
        "/m dir",
        "--port",
        "123",
        "--cpu-offload-gb",
        "4",
        "--x",
        "--max-model-len",
        "512",
    ]


def test_build_command_appends_missing_multiword_placeholders():
    argv = build_command(
        "serve {model}", model="m", host="h", port=1, arm="a", arm_args=["--o"], vllm_args=["--v"]
    )
    assert argv == ["serve", "m", "--o", "--v"]


@pytest.mark.parametrize("tmpl", ["", "serve {nope}", "serve x{arm_args}", "serve 'unclosed"])
def test_build_command_rejects(tmpl):
    with pytest.raises(UserError):
        build_command(tmpl, model="m", host="h", port=1, arm="a", arm_args=[], vllm_args=[])


# ---------------------------------------------------------------- client arithmetic


def test_decode_rate_is_tokens_after_first_over_first_to_last():
    s = StreamResult(
        tokens=11, chunks=11, t_sent=0.0, t_first=0.5, t_last=2.5, finish_reason="length"
    )
    r = summarise_streams([s], wall_s=2.6)
    assert r.tok_s == pytest.approx(10 / 2.0)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.tokens == 11


def test_concurrent_streams_aggregate():
    a = StreamResult(5, 5, 0.0, 1.0, 3.0, "length")
    b = StreamResult(5, 5, 0.0, 2.0, 5.0, "length")
    r = summarise_streams([a, b], wall_s=5.0)
    assert r.tok_s == pytest.approx(8 / 4.0)  # (4 + 4) tokens over 1.0 .. 5.0
    assert r.ttft_s == pytest.approx(1.5)


# ---------------------------------------------------------------- results store


def test_store_appends_and_survives_cut_short_tail(tmp_path):
    p = tmp_path / "r.jsonl"
    with store.ResultsStore(p) as st:
        st.append({"kind": "meta", "format": store.FORMAT_VERSION})
        st.append({"kind": "run", "arm": "a", "restart": 0, "run": 0, "tok_s": 1.0})
    with open(p, "a") as fh:
        fh.write('{"kind": "run", "arm": "a", "rest')  # an interrupted write
    meta, recs = store.load(p)
    assert meta["kind"] == "meta" and len(recs) == 1
    with store.ResultsStore(p) as st:  # reopening drops the fragment before appending
        st.append({"kind": "run", "arm": "a", "restart": 0, "run": 1, "tok_s": 2.0})
    lines = p.read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line) for line in lines)


def test_store_keeps_complete_record_missing_its_newline(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"kind": "meta"}\n{"kind": "run", "tok_s": 3.0}')
    store.repair_tail(p)
    assert p.read_text().endswith("3.0}\n")


def test_store_refuses_garbage_in_the_middle(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"kind": "meta"}\nnot json\n{"kind": "run"}\n')
    with pytest.raises(UserError, match=":2:"):
        store.load(p)


def test_completed_blocks():
    recs = [
        {"kind": "run", "arm": "a", "restart": 0, "server_id": "s1"},
        {"kind": "run", "arm": "a", "restart": 0, "server_id": "s1"},
        {"kind": "run", "arm": "b", "restart": 0, "server_id": "s2"},  # cut short
        {"kind": "server", "status": "failed", "arm": "c", "restart": 0},
        {"kind": "server", "status": "healthy", "arm": "b", "restart": 1},
    ]
    assert store.completed_blocks(recs, runs=2) == {("a", 0), ("c", 0)}


def test_check_resumable():
    old = {
        "format": store.FORMAT_VERSION,
        "model": "m",
        "arms": ["a"],
        "runs": 2,
        "max_tokens": 8,
        "concurrency": 1,
        "prompt": "p",
        "restarts": 2,
    }
    store.check_resumable(old, {**old, "restarts": 3})  # growing is fine
    with pytest.raises(UserError, match="runs"):
        store.check_resumable(old, {**old, "runs": 3})
    with pytest.raises(UserError, match="restarts"):
        store.check_resumable(old, {**old, "restarts": 1})


# ---------------------------------------------------------------- summary


def _runs(arm: str, per_restart: list[list[float]], sid_prefix: str = "s") -> list[dict]:
    out = []
    for r, vals in enumerate(per_restart):
        for i, v in enumerate(vals):
            out.append(
                {
                    "kind": "run",
                    "arm": arm,
                    "restart": r,
                    "run": i,
                    "tok_s": v,
                    "ttft_s": 0.1,
                    "tokens": 8,
                    "server_id": f"{sid_prefix}{arm}{r}",
                }
            )
    return out


def test_t_quantiles():
    assert t975(2) == pytest.approx(4.303)
    assert t975(30) == pytest.approx(2.042)
    assert t975(60) == pytest.approx(2.000, abs=0.002)
    assert math.isnan(t975(0))


def test_summary_math_by_hand():
    recs = _runs("cache:4", [[10, 12], [14, 16], [11, 13]])
    recs += _runs("resident", [[100, 100]] * 3) + _runs("offload", [[20, 20]] * 3)
    s = summarise(recs, {"arms": ["resident", "offload", "cache:4"], "runs": 2})
    c = s.arm("cache:4")
    assert c.restarts == 3 and c.runs == 6
    assert c.restart_rates == [11, 15, 12]
    assert c.mean_tok_s == pytest.approx(38 / 3)
    assert c.between_sd == pytest.approx(math.sqrt(26 / 9 * 3 / 2))  # sd of 11, 15, 12
    assert c.within_sd == pytest.approx(math.sqrt(2))
    half = 4.303 * c.between_sd / math.sqrt(3)
    assert (c.ci_low, c.ci_high) == (pytest.approx(38 / 3 - half), pytest.approx(38 / 3 + half))
    assert c.ratio_resident == pytest.approx(38 / 300)
    assert c.ratio_offload == pytest.approx(38 / 60)
    assert c.recovered == pytest.approx((38 / 3 - 20) / 80)
    assert s.arm("resident").ratio_resident == pytest.approx(1.0)
    assert math.isnan(s.arm("offload").recovered)


def test_a_restart_decodes_its_runs_tokens_over_their_summed_time():
    """Runs of different prompts decode at different rates: a server that decoded 199
    tokens at 150 tok/s and twice 199 at 68 served 597 tokens in 7.18 s, 83.2 tok/s, not
    the 95.3 a mean of the three rates says. Runs without a decode time count by rate."""
    recs = _runs("cache:4", [[150.0, 68.0, 68.0], [100.0, 100.0, 100.0]])
    for r in recs:
        r["decode_s"] = 199 / r["tok_s"]
    s = summarise(recs, {"arms": ["cache:4"], "runs": 3})
    together = 597 / (199 / 150 + 2 * 199 / 68)
    assert s.arm("cache:4").restart_rates == [pytest.approx(together), pytest.approx(100.0)]
    assert s.arm("cache:4").mean_tok_s == pytest.approx((together + 100.0) / 2)
    # a run of twice the tokens weighs twice
    recs[0]["decode_s"] = 2 * 199 / 150
    s = summarise(recs, {"arms": ["cache:4"], "runs": 3})
    assert s.arm("cache:4").restart_rates[0] == pytest.approx(
        (2 * 199 + 2 * 199) / (2 * 199 / 150 + 2 * 199 / 68))
    untimed = _runs("a", [[150.0, 68.0, 68.0]])
    assert summarise(untimed, {"arms": ["a"], "runs": 3}).arm("a").mean_tok_s == (
        pytest.approx(286 / 3))


def test_summary_uses_only_the_latest_server_of_a_block():
    recs = _runs("a", [[1.0]], sid_prefix="old") + _runs("a", [[5.0, 7.0]], sid_prefix="new")
    s = summarise(recs, {"arms": ["a"], "runs": 2})
    assert s.arm("a").mean_tok_s == pytest.approx(6.0)
    assert s.superseded_runs == 1
    assert any("superseded" in w for w in s.warnings)


def _warn(s, text):
    return [w for w in s.warnings if text in w]


def test_warning_within_much_smaller_than_between():
    recs = _runs("resident", [[10.0, 10.01], [11.5, 11.51], [9.0, 9.02]])
    s = summarise(recs, {"arms": ["resident"], "runs": 2})
    assert _warn(s, "runs inside one server agree")
    calm = summarise(_runs("resident", [[10, 12], [11, 13], [10.5, 12.5]]), {"runs": 2})
    assert not _warn(calm, "runs inside one server agree")


def test_warning_cache_not_engaged_and_offload_not_offloaded():
    recs = _runs("resident", [[50, 50], [51, 51], [49, 49]])
    recs += _runs("offload", [[20, 20.2], [21, 21.1], [19.5, 19.6]])
    recs += _runs("cache:8", [[20.1, 20], [20.8, 21], [19.7, 19.6]])
    s = summarise(recs, {"arms": ["resident", "offload", "cache:8"], "runs": 2})
    assert _warn(s, "cache:8 is indistinguishable from the offload control")
    assert not _warn(s, "offload is indistinguishable from resident")
    engaged = _runs("resident", [[50, 50], [51, 51], [49, 49]])
    engaged += _runs("offload", [[20, 20], [21, 21], [19, 19]])
    engaged += _runs("cache:8", [[40, 40], [41, 41], [39, 39]])
    assert not _warn(summarise(engaged, {"runs": 2}), "indistinguishable")
    flat = _runs("resident", [[20, 20], [21, 21], [19, 19]]) + _runs(
        "offload", [[20, 20], [21, 21], [19, 19]]
    )
    assert _warn(summarise(flat, {"runs": 2}), "offload is indistinguishable from resident")


def test_warning_few_restarts_missing_control_failures_and_incomplete():
    recs = _runs("cache:8", [[10, 11], [12]])
    recs.append(
        {
            "kind": "server",
            "status": "failed",
            "arm": "cache:8",
            "restart": 2,
            "phase": "health",
            "reason": "boom",
        }
    )
    s = summarise(recs, {"arms": ["cache:8"], "runs": 2})
    assert _warn(s, "only 2 restart(s)")
    assert _warn(s, "no offload control arm")
    assert _warn(s, "1 server(s) failed")
    assert _warn(s, "fewer than 2 per restart")
    assert s.arm("cache:8").failed_servers == 1
    assert s.failures[0]["reason"] == "boom"


def test_indistinguishable_without_intervals_uses_two_percent():
    recs = _runs("offload", [[20.0]]) + _runs("cache:1", [[20.3]]) + _runs("cache:2", [[25.0]])
    s = summarise(recs, {"runs": 1})
    assert indistinguishable(s.arm("offload"), s.arm("cache:1"))
    assert not indistinguishable(s.arm("offload"), s.arm("cache:2"))


def test_summary_to_dict_is_json_clean():
    s = summarise(_runs("a", [[1.0]]), {"runs": 1})
    text = json.dumps(s.to_dict(), allow_nan=False)
    assert json.loads(text)["arms"][0]["between_sd"] is None


# ---------------------------------------------------------------- counters


def test_stats_line_parsing(tmp_path):
    # the plugin's line (expertcache_cli/plugin/session.py, Session.report), as vLLM logs it
    line = (
        "(EngineCore pid=5) INFO 11-30 02:00:01 [session.py:89] expertcache: live hit rate "
        "48.91% since last report, 49.02% overall (requests=51648 installs=26330 "
        "read-through steps=12 over 8 layers)"
    )
    got = parse_stats_line(line)
    assert got == {
        "hit_rate": pytest.approx(0.4902),
        "hit_rate_window": pytest.approx(0.4891),
        "requests": 51648,
        "installs": 26330,
        "read_through_steps": 12,
        "read_through_decode_steps": None,  # a plugin older than the decode-width count
        "staged_steps": None,  # no staged wide steps (EXPERT_CACHE_WIDE in-place)
        "staged_fetched": None,
        "layers": 8,
        "final": False,
    }
    now = parse_stats_line(line.replace("steps=12 over", "steps=12 (decode-width 3) over"))
    assert now["read_through_steps"] == 12 and now["read_through_decode_steps"] == 3
    staged = parse_stats_line(line.replace(
        "steps=12 over", "steps=0 (decode-width 0) staged steps=96 (fetched 2113) over"))
    assert (staged["staged_steps"], staged["staged_fetched"]) == (96, 2113)
    first = (
        "expertcache: live hit rate nan% since last report, nan% overall (requests=0 "
        "installs=0 read-through steps=0 over 8 layers)"
    )
    assert parse_stats_line(first)["hit_rate"] is None
    assert parse_stats_line("INFO: 127.0.0.1 GET /health 200") is None
    assert parse_stats_line("expertcache: armed 8 of 8 MoE layers, 32 slots") is None
    log = tmp_path / "s.log"
    log.write_text(
        "\n".join(
            ["boot", line, "noise", line.replace("requests=51648", "requests=60000"), "bye", ""]
        )
    )
    assert latest_counters(log)["requests"] == 60000
    assert latest_counters(tmp_path / "missing.log") is None


# ---------------------------------------------------------------- CLI


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "expertcache_cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["baseline", "m", "--arms", "cache:zero"], "bad arm"),
        (["baseline", "m", "--arms", "offload"], "--cpu-offload-gb"),
        (["baseline", "m", "--arms", "resident", "--runs", "0"], "--runs"),
        (["baseline", "m", "--cpu-offload-gb", "1", "--vram", "24"], "not both"),
        (["baseline", "report", "/nonexistent/results.jsonl"], "not found"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(args, needle, tmp_path):
    p = _cli(*args, "--out", str(tmp_path / "r.jsonl")) if args[1] != "report" else _cli(*args)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr
    assert "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_cli_refuses_to_overwrite_without_resume(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text('{"kind": "meta"}\n')
    p = _cli("baseline", "m", "--arms", "resident", "--out", str(out),
             "--server-cmd", "{python} -c pass")
    assert p.returncode == 2 and "--resume" in p.stderr


def test_cli_report_renders_table_and_json(tmp_path):
    out = tmp_path / "r.jsonl"
    recs = [{"kind": "meta", "format": 1, "arms": ["resident", "offload"], "runs": 2}]
    recs += _runs("resident", [[50, 50], [51, 51], [49, 49]])
    recs += _runs("offload", [[20, 20], [21, 21], [19, 19]])
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    p = _cli("baseline", "report", str(out))
    assert p.returncode == 0, p.stderr
    # in a pipe the table fits 80 columns: x offload stays (x resident is left out, named)
    assert "resident" in p.stdout and "offload" in p.stdout and "2.500" in p.stdout
    j = _cli("baseline", "report", str(out), "--json")
    data = json.loads(j.stdout)
    assert [a["arm"] for a in data["arms"]] == ["resident", "offload"]
    assert data["arms"][1]["ratio_resident"] == pytest.approx(0.4)
    assert data["arms"][0]["restart_rates"] == [pytest.approx(50), pytest.approx(51),
                                                pytest.approx(49)]


def test_cli_report_at_80_columns_and_in_a_pipe_keeps_every_value_whole():
    """As `replay`: rich assumes 80 columns in a pipe; no value is cut, whole columns are
    left out (the spreads first) and named; a wide terminal shows all of them."""
    import os

    report = Path(__file__).resolve().parent.parent / "bench" / "results" / \
        "baseline.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    for columns in (None, "80"):
        p = subprocess.run([sys.executable, "-m", "expertcache_cli", "baseline", "report",
                            str(report)], capture_output=True, text=True, timeout=120,
                           env=env if columns is None else {**env, "COLUMNS": columns})
        assert p.returncode == 0, p.stderr
        assert "…" not in p.stdout
        assert all(len(line) <= 80 for line in p.stdout.splitlines()), p.stdout
        for value in ("453.8 .. 747.9", "445.6", "70.1%", "88.1%", "5.458"):
            assert value in p.stdout
        assert "left out to fit 80 columns: runs, between sd, within sd" in p.stdout
    wide = subprocess.run([sys.executable, "-m", "expertcache_cli", "baseline", "report",
                           str(report)], capture_output=True, text=True, timeout=120,
                          env={**env, "COLUMNS": "200"}).stdout
    assert "left out" not in wide and "between sd" in wide and "59.2" in wide


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib", reason="plot extra (matplotlib) not installed")
    from expertcache_cli.baseline.plot import plot

    recs = _runs("resident", [[50, 51], [49, 48]]) + _runs("offload", [[20, 21], [19, 22]])
    s = summarise(recs, {"arms": ["resident", "offload"], "runs": 2})
    out = plot(s, recs, tmp_path / "p.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_torch_or_vllm_at_import():
    code = (
        "import sys, expertcache_cli.commands.baseline, expertcache_cli.baseline.runner;"
        "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ}, timeout=60
    )
    assert p.stdout.strip() == "[]", p.stderr


def test_bursty_streams_are_flagged():
    steady = StreamResult(256, 256, 0.0, 0.05, 2.0, "length", coalesced=200)
    burst = StreamResult(256, 256, 0.0, 1.46, 1.473, "length", coalesced=255)
    r = summarise_streams([steady], 2.0)
    assert not r.bursty  # tokens flushed in pairs are normal; the window is what matters
    assert r.e2e_tok_s == pytest.approx(256 / 2.0)
    b = summarise_streams([burst], 1.5)
    assert b.bursty and b.tok_s > 10000
    assert b.e2e_tok_s == pytest.approx(256 / 1.473)


def test_summary_leaves_out_bursty_runs_and_says_so():
    recs = _runs("resident", [[100.0, 102.0], [101.0, 103.0]])
    recs[1]["tok_s"], recs[1]["bursty"] = 19072.0, True
    s = summarise(recs, {"arms": ["resident"], "runs": 2})
    a = s.arm("resident")
    assert a.runs == 3 and a.restart_rates == [100.0, 102.0]
    assert s.bursty_runs == {"resident": 1}
    assert _warn(s, "left out 1 run(s) (1 of resident)")
    assert not _warn(s, "the file is incomplete")


def test_held_back_runs_are_left_out():
    # a starved server: the first token waits 0.67 s, then 127 tokens arrive in 0.21 s
    recs = _runs("resident", [[120.0, 140.0, 604.0], [130.0, 135.0, 128.0]])
    for r, (ttft, dec) in zip(recs, [(0.05, 1.06), (0.03, 0.9), (0.67, 0.21), (0.05, 0.98),
                                     (0.04, 0.94), (0.04, 0.99)]):  # fmt: skip
        r["ttft_s"], r["decode_s"] = ttft, dec
    s = summarise(recs, {"arms": ["resident"], "runs": 3})
    assert s.bursty_runs == {"resident": 1}
    # the two runs left: their tokens over their time
    assert s.arm("resident").restart_rates[0] == pytest.approx(
        (120.0 * 1.06 + 140.0 * 0.9) / (1.06 + 0.9))
    # a long prompt slows every first token of a server alike: nothing is left out
    for r in recs:
        r["ttft_s"] = 2.0
    assert summarise(recs, {"runs": 3}).bursty_runs == {}


def test_a_slow_first_token_then_a_usual_decode_is_kept():
    # H200, fresh machine: the first measured request waited 0.72 s for a Triton compile,
    # then decoded at its server's usual rate; it measured the decode and must count
    recs = _runs("resident", [[585.2, 601.0, 583.1], [539.0, 544.8, 540.5]])
    for r, ttft in zip(recs, [0.724, 0.022, 0.022, 0.037, 0.023, 0.024]):
        r["ttft_s"], r["decode_s"] = ttft, 199 / r["tok_s"]
    s = summarise(recs, {"arms": ["resident"], "runs": 3})
    assert s.bursty_runs == {}
    assert s.arm("resident").runs == 6
    # the client's own burst flag (whole answer in the last 20% of the request) is judged
    # the same way: at the arm's usual rate it counts, at a rush it is left out
    recs[3]["bursty"] = True
    assert summarise(recs, {"runs": 3}).bursty_runs == {}
    recs[3]["tok_s"] = 5000.0
    assert summarise(recs, {"runs": 3}).bursty_runs == {"resident": 1}


def test_recovered_share_needs_a_penalty_to_recover():
    recs = _runs("resident", [[20, 20], [21, 21], [19, 19]])
    recs += _runs("offload", [[20, 20], [21, 21], [19, 19]])
    recs += _runs("cache:8", [[20.5, 20.5], [21.5, 21.5], [19.5, 19.5]])
    s = summarise(recs, {"runs": 2})
    assert math.isnan(s.arm("cache:8").recovered)


def test_vram_on_a_bigger_gpu_gives_every_arm_the_cards_share():
    """`baseline --vram 24` on the H200 runs every arm as the 24 GiB card would
    (vLLM's utilization is of the whole GPU); flags the user gave are left alone."""

    from expertcache_cli.baseline.sizing_bridge import offload_from_vram

    args = ["--max-num-seqs", "4", "--max-model-len", "8192"]
    card = offload_from_vram("qwen3-30b-a3b-w8a8", 24, args)
    assert card.share_args == []
    share = offload_from_vram("qwen3-30b-a3b-w8a8", 24, args, device_total_gib=139.8)
    assert share.share_args == ["--gpu-memory-utilization", "0.1545",
                                "--max-num-batched-tokens", "2048"]
    assert share.cpu_offload_gb == card.cpu_offload_gb
    mine = offload_from_vram("qwen3-30b-a3b-w8a8", 24,
                             [*args, "--max-num-batched-tokens", "512"], device_total_gib=139.8)
    assert mine.share_args == ["--gpu-memory-utilization", "0.1545"]


def test_vram_without_a_batch_gives_every_arm_the_batch_size_chose():
    """No --max-num-seqs from the user: every arm runs the batch `size` chose (as `serve`
    would start), and the line saying so travels with the plan."""

    from expertcache_cli.baseline.sizing_bridge import offload_from_vram

    p = offload_from_vram("qwen3-30b-a3b-w8a8", 24, ["--max-model-len", "8192"])
    assert p.share_args == ["--max-num-seqs", str(p.max_num_seqs)] and p.max_num_seqs == 8
    assert p.batch_choice.startswith("--max-num-seqs 8, the widest batch")
    assert p.where == "24 GiB"
    named = offload_from_vram("qwen3-30b-a3b-w8a8", "l4", ["--max-model-len", "8192"])
    assert named.where.startswith("L4 (22.49 GiB") and named.max_slots < p.max_slots


def test_arm_warnings_word_the_trap_as_size_does():

    from expertcache_cli.baseline.sizing_bridge import offload_from_vram

    p = offload_from_vram("qwen3-30b-a3b-w8a8", 24,
                          ["--max-num-seqs", "8", "--max-model-len", "8192", "--enforce-eager"])
    got = p.arm_warnings(parse_arms("offload,cache:4,cache:40,cache:80,cache:120"), 1)
    assert got[0].startswith("cache:4: 1 stream(s) x top_k 8 = 8 ids per decode step exceed 4")
    assert got[1].startswith("cache:40: sizing trap: a full batch of 8 seqs x top_k 8 = 64 ids "
                             "> 40 slots") and "--max-num-seqs 5" in got[1]
    assert got[2] == f"cache:120: only {p.max_slots} slots fit" and len(got) == 3


def test_arm_warnings_say_when_size_plans_no_cache_at_all(monkeypatch):
    """gpt-oss-120b's MXFP4 experts offloaded on a 24 GiB card run on Marlin, which the
    plugin arms (with EXPERT_CACHE_MARLIN=1): a cache arm is fine. Asked onto a backend
    the plugin declines on every layer, a cache arm would run at the offload floor; the
    baseline says so before any server starts."""
    from expertcache_cli.baseline.sizing_bridge import offload_from_vram

    monkeypatch.setenv("EXPERT_CACHE_MARLIN", "1")
    args = ["--max-num-seqs", "1", "--max-model-len", "8192"]
    armed = offload_from_vram("gpt-oss-120b", 24, args)
    assert armed.no_cache is None and armed.max_slots >= 16
    assert armed.arm_warnings(parse_arms("offload,cache:16"), 1) == []
    p = offload_from_vram("gpt-oss-120b", 24, [*args, "--moe-backend",
                                               "flashinfer_trtllm_mxfp4_bf16"])
    got = p.arm_warnings(parse_arms("offload,cache:16"), 1)
    assert len(got) == 1 and got[0].startswith("cache:16: `size` plans no cache for this model")
    assert "offload floor" in got[0]


def test_offload_checks_run_for_offloaded_arms_only(monkeypatch):
    """--quantization on an unquantised model is refused when an arm offloads (vLLM cannot
    offload experts it quantises while loading), never for a resident-only run; a model
    sizing cannot read is left to vLLM."""
    from expertcache_cli.baseline import sizing_bridge

    online = ["--quantization", "fp8"]
    assert sizing_bridge.offload_checks("qwen3-30b-a3b", online, parse_arms("resident")) == (
        [], None)
    with pytest.raises(UserError, match="while loading"):
        sizing_bridge.offload_checks("qwen3-30b-a3b", online, parse_arms("resident,cache:8"))
    assert sizing_bridge.offload_checks("Org/unknown-moe", online, parse_arms("offload")) == (
        [], None)
    flags, note = sizing_bridge.offload_checks("qwen3-30b-a3b-w8a8", [], parse_arms("offload"))
    assert flags == [] and note is None  # w8a8 stays offloaded on its own kernel


def test_offloaded_arms_beside_a_cache_arm_pin_the_triton_experts_on_a_gpu():
    """bf16 experts beside a cache arm: floor and cache both get --moe-backend triton (the
    kernel the cache arms; vLLM picks FlashInfer on Blackwell); without a cache arm, or
    with vLLM's CPU build (no NVIDIA GPU here: it runs its own kernels and refuses the
    flag), nothing."""
    from expertcache_cli.baseline import sizing_bridge

    arms = parse_arms("resident,offload,cache:8")
    flags, note = sizing_bridge.offload_checks("qwen3-30b-a3b", [], arms)
    assert flags == ["--moe-backend", "triton"] and "bf16 experts" in note
    assert sizing_bridge.offload_checks("qwen3-30b-a3b", [], arms, cuda=False) == ([], None)
    assert sizing_bridge.offload_checks("qwen3-30b-a3b", [], parse_arms("offload")) == (
        [], None)


def test_plugin_state_reads_how_much_of_the_model_the_cache_served(tmp_path):
    from expertcache_cli.baseline.counters import plugin_state

    log = tmp_path / "s.log"
    log.write_text(
        "INFO expertcache: vLLM 0.26.0: armed 8 of 8 MoE layers; 64 of 128 experts/layer\n"
        "(restarted)\n"
        "INFO expertcache: vLLM 0.26.0: armed 7 of 8 MoE layers; 64 of 128 experts/layer\n"
        "ERROR expertcache: model.layers.3.mlp.experts: experts call on slots failed "
        "(RuntimeError: x); layer back on the stock path\n")
    assert plugin_state(log) == {"armed": 7, "moe_layers": 8, "fell_back": 1}
    (tmp_path / "stock.log").write_text("INFO vLLM started\n")
    assert plugin_state(tmp_path / "stock.log") is None
    assert plugin_state(tmp_path / "missing.log") is None


def test_a_cache_arm_the_cache_did_not_fully_serve_is_flagged():
    recs = _runs("cache:4", [[10, 12]]) + _runs("offload", [[5, 5]]) + _runs("plan:p.json", [[9]])
    recs += [{"kind": "counters", "arm": "cache:4", "restart": 0, "counters": {"hit_rate": 0.5},
              "plugin": {"armed": 6, "moe_layers": 8, "fell_back": 0}},
             {"kind": "counters", "arm": "plan:p.json", "restart": 0,
              "counters": {"hit_rate": 0.5}, "plugin": {"armed": 8, "moe_layers": 8,
                                                        "fell_back": 2}}]
    s = summarise(recs, {"arms": ["offload", "cache:4", "plan:p.json"], "runs": 1})
    assert any(w.startswith("cache:4: the plugin armed 6 of 8 MoE layers in 1 of 1 server(s)")
               for w in s.warnings)
    assert any(w.startswith("plan:p.json: 2 layer(s) went back to the stock path")
               for w in s.warnings)
    # a plan arm is a cache arm: compared with the offload control like one
    from expertcache_cli.baseline.summary import is_cache_arm

    assert is_cache_arm("plan:p.json") and is_cache_arm("cache:4") and not is_cache_arm("offload")
