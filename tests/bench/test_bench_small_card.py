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


class _Server:
    """A server that starts at once and writes a log line; what `serve_arm` drives."""

    def __init__(self, argv, env, log_path, host, port):
        self.argv, self.log_path = argv, log_path
        self.base_url, self.model_id = f"http://{host}:{port}", "m"
        self.stopped = False

    def start(self):
        self.log_path.write_text("(EngineCore) INFO Directly load the compiled graph(s) for "
                                 "compile range (1, 2048) from the cache, took 2.5 s\n")

    def wait_healthy(self, timeout_s):
        return 1.5

    def stop(self, grace_s):
        self.stopped = True


def test_warm_only_starts_sends_one_short_greedy_request_and_records_no_tokens(
        tmp_path, monkeypatch, capsys):
    """`--warm-only`: one short request (its first steps' kernels run), no measured runs
    and no greedy tokens; the record says it was a warm-up, and the greedy report passes
    over it."""
    sent = []

    def measure_run(base_url, model_id, prompt, max_tokens, *rest):
        sent.append(max_tokens)
        return type("Run", (), {"tokens": max_tokens, "tok_s": 1.0})()

    def no_greedy(*args):
        raise AssertionError("a warm-up asks for no greedy tokens")

    monkeypatch.setattr(small_card, "Server", _Server)
    monkeypatch.setattr(small_card, "free_port", lambda: 8123)
    monkeypatch.setattr(small_card, "smi_memory", lambda: None)
    monkeypatch.setattr(small_card, "measure_run", measure_run)
    monkeypatch.setattr(small_card, "greedy_ids", no_greedy)
    monkeypatch.setattr(small_card, "counters_now", no_greedy)
    monkeypatch.setattr(sys, "argv", [
        "small_card.py", "w-warm", "--out", str(tmp_path), "--runs", "5", "--warm-only",
        "--env", "EXPERT_CACHE_DISABLE=1", "--", "vllm", "serve", "/m", "--port", "{port}"])
    assert small_card.main() == 0
    assert sent == [small_card.WARM_TOKENS] and small_card.WARM_TOKENS <= 8
    rec = json.loads((tmp_path / "w-warm.json").read_text())
    assert rec["status"] == "ok" and rec["warm_only"] is True
    assert rec["argv"] == ["vllm", "serve", "/m", "--port", "8123"]
    assert rec["env"] == ["EXPERT_CACHE_DISABLE=1"]
    assert not {"greedy", "greedy_again", "tok_s"} & set(rec)
    assert rec["log"]["compile"] == "warm"
    assert json.loads(capsys.readouterr().out)["warm_only"] is True
    assert small_card.greedy_report([tmp_path / "w-warm.json"]) == []


def test_a_failed_warm_up_is_still_marked_a_warm_up(tmp_path, monkeypatch):
    class Dies(_Server):
        def wait_healthy(self, timeout_s):
            raise small_card.ServerFailed("start", "exited with 1")

    monkeypatch.setattr(small_card, "Server", Dies)
    monkeypatch.setattr(small_card, "free_port", lambda: 8123)
    monkeypatch.setattr(sys, "argv", ["small_card.py", "w-warm", "--out", str(tmp_path),
                                      "--warm-only", "--", "vllm", "serve", "/m"])
    assert small_card.main() == 1
    rec = json.loads((tmp_path / "w-warm.json").read_text())
    assert rec["status"] == "failed" and rec["warm_only"] is True


def test_every_measured_request_gets_its_own_prompt_and_the_greedy_check_the_fixed_one(
        tmp_path, monkeypatch):
    """The warm-up, each run and each concurrent stream send a prompt no other request of
    the server sent (a repeat would prefill from vLLM's prefix cache), in the same order
    in every server; the greedy check sends PROMPT, which no measured prompt shares a
    first word with."""
    sent: list[tuple[list[str], int]] = []
    greedy: list[int] = []

    def measure_run(base_url, model_id, prompt, max_tokens, concurrency=1):
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        sent.append((prompts, concurrency))
        return type("Run", (), {"tokens": max_tokens * concurrency, "tok_s": 1.0})()

    monkeypatch.setattr(small_card, "Server", _Server)
    monkeypatch.setattr(small_card, "free_port", lambda: 8123)
    monkeypatch.setattr(small_card, "smi_memory", lambda: None)
    monkeypatch.setattr(small_card, "measure_run", measure_run)
    monkeypatch.setattr(small_card, "counters_now", lambda log: None)
    monkeypatch.setattr(small_card, "greedy_ids",
                        lambda url, mid, n: greedy.append(n) or {"tokens": ["w3"] * n})

    def one_server(name):
        sent.clear()
        monkeypatch.setattr(sys, "argv", [
            "small_card.py", name, "--out", str(tmp_path), "--runs", "5", "--streams", "3",
            "--", "vllm", "serve", "/m", "--port", "{port}"])
        assert small_card.main() == 0
        return [p for prompts, _ in sent for p in prompts], json.loads(
            (tmp_path / f"{name}.json").read_text())

    prompts, rec = one_server("a")
    assert len(prompts) == 1 + 5 + 3 and len(set(prompts)) == len(prompts)
    assert small_card.PROMPT not in prompts and greedy == [64, 64]
    assert [c for _, c in sent] == [1, 1, 1, 1, 1, 1, 3]
    firsts = {p.split()[0] for p in prompts}
    assert len(firsts) == len(prompts) and small_card.PROMPT.split()[0] not in firsts
    assert rec["prompt_tokens"] == [len(p.split()) for p in prompts[1:6]]
    again, _ = one_server("b")
    assert again == prompts  # the same sequence in every server: arms compare


def test_the_run_prompts_are_one_kv_block_of_words_the_checkpoints_know():
    """Every prompt is 16 tokens, the prefill the runners' fitted traces give `plan`, and
    its words are in every bench checkpoint's vocabulary (w3 .. w8000)."""
    prompts = [small_card.run_prompt(i) for i in range(500)]
    assert {len(p.split()) for p in prompts} == {16} == {len(small_card.PROMPT.split())}
    assert len({p.split()[0] for p in prompts}) == 500
    words = [int(w[1:]) for p in prompts for w in p.split()]
    assert 3 <= min(words) and max(words) <= 8000


def test_prompts_cycle_over_a_traces_recorded_requests():
    """With a trace of R recorded requests, R consecutive requests' prompts have R lengths 8
    words apart, and the hook replays a different recorded request for each; the report
    line says so. Without it, every prompt is one 16-word KV block."""
    import small_card
    from trace_routing import PROMPT_STEP

    lengths = [len(small_card.run_prompt(i, 4).split()) for i in range(8)]
    assert lengths == [16, 24, 32, 40] * 2
    assert sorted((n // PROMPT_STEP) % 4 for n in lengths[:4]) == [0, 1, 2, 3]
    assert {len(small_card.run_prompt(i).split()) for i in range(6)} == {16}
    firsts = [small_card.run_prompt(i, 4).split()[0] for i in range(8)]
    assert len(set(firsts)) == 8  # no prompt is another's cached prefix
    line = small_card.prompts_line({"cache": {"tok_s": [1.0], "prompt_tokens": [24],
                                              "prompt_cycle": 4}})
    assert line.startswith("every request its own prompt of 16-40 words") and \
        "replay the trace's 4 recorded requests in turn" in line
