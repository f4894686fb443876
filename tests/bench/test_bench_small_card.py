"""The small-card bench's own logic (bench/small_card.py), without a server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

small_card = pytest.importorskip("small_card", reason="the bench needs httpx")


def arm(tokens, logprob, margin):
    return {"tokens": tokens, "logprob": logprob, "margin": margin}


def test_identical_completions_say_so():
    a = arm(["w1", "w2"], [-0.1, -0.2], [3.0, 2.0])
    c = small_card.compare_greedy(a, dict(a))
    assert c["identical"] and c["first_difference"] is None
    assert c["max_logprob_diff_before"] == 0.0


def test_a_split_reports_the_margins_there_and_the_numbers_before():
    a = arm(["w1", "w2", "w3"], [-0.1, -0.2, -0.70], [3.0, 2.0, 0.001])
    b = arm(["w1", "w2", "w9"], [-0.1, -0.25, -0.69], [3.0, 1.9, 0.002])
    c = small_card.compare_greedy(a, b)
    assert not c["identical"]
    assert c["first_difference"] == 2
    assert (c["margin_a"], c["margin_b"]) == (0.001, 0.002)
    assert c["max_logprob_diff_before"] == pytest.approx(0.05)


def test_older_files_with_ids_only_still_compare():
    c = small_card.compare_greedy(["w1", "w2"], ["w1", "w3"])
    assert c["first_difference"] == 1 and c["margin_a"] is None


def test_a_shorter_completion_is_not_identical():
    assert not small_card.compare_greedy(["w1"], ["w1", "w2"])["identical"]


def test_greedy_report_names_each_pair_and_each_rerun(tmp_path):
    same = arm(["w1", "w2"], [-0.1, -0.2], [1.0, 1.0])
    other = arm(["w1", "w5"], [-0.1, -0.3], [1.0, 0.01])
    (tmp_path / "floor.json").write_text(json.dumps(
        {"arm": "floor", "greedy": same, "greedy_again": same}))
    (tmp_path / "cache.json").write_text(json.dumps({"arm": "cache", "greedy": other}))
    (tmp_path / "failed.json").write_text(json.dumps({"arm": "failed", "status": "failed"}))
    (tmp_path / "wide.json").write_text(json.dumps({"arm": "wide", "greedy": [["w1"], ["w2"]]}))
    for name, model in (("pad5", "/tmp/model"), ("pad8", "/tmp/model")):  # another checkpoint
        (tmp_path / f"{name}.json").write_text(json.dumps(
            {"arm": name, "greedy": other, "argv": ["python3", "-m", "vllm", "serve", model]}))
    lines = small_card.greedy_report(sorted(tmp_path.glob("*.json")))
    assert lines[0] == "floor vs its own second run: identical (2 tokens)"
    assert lines[1].startswith(
        "cache vs floor: part at token 1 of 2, margins there 0.0100 / 1.0000")
    assert lines[2] == "pad5 vs pad8: identical (2 tokens)"
    assert len(lines) == 3


def test_read_log_finds_the_startup_line_and_the_root_cause(tmp_path):
    log = tmp_path / "s.log"
    log.write_text(
        "(EngineCore) INFO expertcache: vLLM 0.26.0: armed 48 of 48 MoE layers; 82 of 128 "
        "experts/layer as slots [82 slots/layer (EXPERT_CACHE_SLOTS)]; 17.35 GiB of slots\n"
        "(EngineCore) ERROR [core.py:1330] ValueError: To serve at least one request with the "
        "model's max seq len (8192), (0.75 GiB KV cache is needed\n"
        "(APIServer) RuntimeError: Engine core initialization failed. See root cause above.\n")
    got = small_card.read_log(log)
    assert (got["armed_layers"], got["moe_layers"], got["slots"]) == (48, 48, 82)
    assert got["cause"].startswith("ValueError: To serve at least one request")


def test_read_log_keeps_serves_wrapped_headline(tmp_path):
    """`serve` prints its verdict wrapped to the terminal; the record keeps it whole (the
    formats report names it where serve planned no cache)."""
    log = tmp_path / "s.log"
    log.write_text("# expertcache baseline: python3 -m expertcache_cli serve M\n"
                   "expertcache serve: nvfp4 on 139.8 GiB: runs only fully offloaded: per-expert \n"
                   "tensors (w13_weight_scale_2) are not multiples of 16 bytes; no cache\n"
                   "  note: experts offloaded, the cache off\n"
                   "  running: EXPERT_CACHE_DISABLE=1 vllm serve M\n")
    got = small_card.read_log(log)
    assert got["serve_line"] == ("expertcache serve: nvfp4 on 139.8 GiB: runs only fully "
                                 "offloaded: per-expert tensors (w13_weight_scale_2) are not "
                                 "multiples of 16 bytes; no cache")


def test_read_log_keeps_the_slot_audit_and_whether_vllm_compiled(tmp_path):
    log = tmp_path / "s.log"
    log.write_text(
        "(EngineCore) INFO [backends.py:393] Compiling a graph for compile range (1, 4096) "
        "takes 12.00 s\n"
        "(EngineCore) INFO [session.py:250] expertcache: slot audit at shutdown: 768 occupied "
        "slots in 24 layers hold their experts' bytes in all 4 mirrored tensors\n")
    got = small_card.read_log(log)
    assert got["compile"] == "cold" and got["audit_line"].startswith(
        "expertcache: slot audit at shutdown: 768")
    log.write_text("(EngineCore) INFO [backends.py:292] Directly load the compiled graph(s) "
                   "for compile range (1, 4096) from the cache, took 2.545 s\n")
    got = small_card.read_log(log)
    assert got["compile"] == "warm" and "audit_line" not in got
