"""The profiler comparison (bench/profile_report.py) and the bench's profiled request
(bench/small_card.py --profile), on CPU: device minutes go to the trace, not to a parser
bug."""

from __future__ import annotations

import gzip
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import profile_report  # noqa: E402


def _trace(path: Path, steps: int, kernels: list[tuple[str, float, float]], gz=False) -> None:
    ev = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 3}
          for _ in range(steps)]
    ev += [{"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": d} for n, ts, d in kernels]
    ev.append({"ph": "i", "cat": "kernel", "name": "instant, not work", "ts": 0})
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::where", "ts": 0, "dur": 99})
    data = json.dumps({"traceEvents": ev})
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(data)
    else:
        path.write_text(data)


def test_busy_counts_overlapping_kernels_once_and_span_keeps_the_gaps(tmp_path):
    _trace(tmp_path / "a.pt.trace.json", 1, [("k1", 0, 10), ("k2", 5, 10), ("k3", 30, 5)])
    s = profile_report.summarize(tmp_path)
    assert (s.steps, s.busy_us, s.span_us, s.launches) == (1, 20.0, 35.0, 3)
    assert s.by_name["k1"] == [10.0, 1]
    # k1 alone 0-5, both 5-10, k2 alone 10-15, k3 alone: the overlap counts for neither
    assert s.alone == {"k1": 5.0, "k2": 5.0, "k3": 5.0}


def test_a_kernel_launched_early_adds_only_its_time_alone(tmp_path):
    """PDL: the gather starts inside the manager and waits; its duration (8) is not its cost
    (2, after the manager ends); back-to-back kernels do not count as overlapping."""
    _trace(tmp_path / "t.json", 1, [("manage", 0, 6), ("gather", 0, 8), ("gemm", 8, 4)])
    s = profile_report.summarize(tmp_path)
    assert s.alone == {"gather": 2.0, "gemm": 4.0}
    assert s.busy_us == 12.0


def test_the_comparison_names_the_kernels_the_cache_adds(tmp_path):
    a, b = tmp_path / "res", tmp_path / "hot"
    a.mkdir(), b.mkdir()
    # 2 steps each; the cache arm adds a manager and a where per step, and its GEMM 1 us slower
    _trace(a / "w.json.gz", 2, [("fused_moe_kernel", 0, 10), ("fused_moe_kernel", 100, 10)],
           gz=True)
    _trace(b / "w.json", 2, [("fused_moe_kernel", 0, 11), ("fused_moe_kernel", 100, 11),
                              ("expert_cache_manage_kernel", 20, 3),
                              ("expert_cache_manage_kernel", 120, 3),
                              ("elementwise_kernel<where>", 30, 2),
                              ("elementwise_kernel<where>", 130, 2)])
    lines = profile_report.compare(profile_report.summarize(a), profile_report.summarize(b),
                                   ("resident", "all-hit"), top=2)
    assert lines[0] == "decode steps profiled: resident 2, all-hit 2"
    assert "GPU busy a step: resident 10.0 us, all-hit 16.0 us (+6.0)" in lines
    assert "GPU launches a step: resident 1.0, all-hit 3.0 (+2.0)" in lines
    # ordered by the difference; the top 2 only; the host's lines follow
    kernels = lines[:next(i for i, t in enumerate(lines) if t.startswith("step period"))]
    assert kernels[-2].split()[0] == "+3.0" and kernels[-2].endswith(
        "expert_cache_manage_kernel")
    assert "(  1.0, alone    3.0)" in kernels[-2]
    assert kernels[-1].split()[0] == "+2.0" and "where" in kernels[-1]


def test_the_host_side_shows_whether_extra_time_is_every_step_or_a_few(tmp_path):
    """Each step's period between graph launches and the GPU's idle time in it: a periodic
    stall (one long step) moves the max, not the median; host calls compared per step."""
    def write(d: Path, periods: list[float], extra_ops: int) -> None:
        d.mkdir()
        ts, ev = 0.0, []
        for p in periods:
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts,
                       "dur": 2})
            ev.append({"ph": "X", "cat": "kernel", "name": "k", "ts": ts + 5, "dur": 80})
            ts += p
        ev += [{"ph": "X", "cat": "cpu_op", "name": "aten::cat", "ts": 1, "dur": 30}] * extra_ops
        (d / "t.json").write_text(json.dumps({"traceEvents": ev}))

    a, b = tmp_path / "a", tmp_path / "b"
    write(a, [100, 100, 100, 100, 100], 0)
    write(b, [100, 100, 400, 100, 100], 1)  # one stall, and one aten::cat in 5 steps
    lines = profile_report.compare(profile_report.summarize(a), profile_report.summarize(b),
                                   ("resident", "all-hit"))
    i = next(i for i, t in enumerate(lines) if t.startswith("step period"))
    assert lines[i] == ("step period, launch to launch: resident 100.0 us (p90 100.0, max "
                        "100.0); all-hit 100.0 us (p90 400.0, max 400.0)")
    assert lines[i + 1] == ("GPU idle in a step: resident 20.0 us (p90 20.0, max 20.0); "
                            "all-hit 20.0 us (p90 320.0, max 320.0)")
    assert lines[i + 3].split()[0] == "+6.0" and lines[i + 3].endswith("aten::cat")
    assert "(  0.2)" in lines[i + 3]


def test_no_graph_replay_or_no_trace_is_one_line_and_exit_2(tmp_path, capsys):
    a = tmp_path / "a"
    a.mkdir()
    _trace(a / "w.json", 0, [("k", 0, 1)])
    assert profile_report.main([str(a), str(a)]) == 2
    assert "no cudaGraphLaunch" in capsys.readouterr().err
    assert profile_report.main([str(a), str(tmp_path / "missing")]) == 2
    assert "no profiler trace" in capsys.readouterr().err


small_card = pytest.importorskip("small_card", reason="the bench needs httpx")


def test_profiled_request_sits_between_start_and_stop_and_waits_for_the_trace(
        tmp_path, monkeypatch):
    trace_dir = tmp_path / "prof"
    trace_dir.mkdir()
    (trace_dir / "old.pt.trace.json").write_text("{}")  # an earlier record: not this one's
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            seen.append(self.path)
            if self.path == "/stop_profile":
                (trace_dir / "new.pt.trace.json.gz").write_bytes(b"")
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        def fake_run(base_url, model_id, prompt, max_tokens):
            seen.append(f"request {max_tokens}")
            return SimpleNamespace(tok_s=42.0)

        monkeypatch.setattr(small_card, "measure_run", fake_run)
        rec = small_card.profile_decode(f"http://127.0.0.1:{srv.server_port}", "m",
                                        trace_dir, wait_s=5)
    finally:
        srv.shutdown()
    steps = small_card.PROFILE_SKIP + small_card.PROFILE_STEPS
    assert seen == ["/start_profile", f"request {steps + 16}", "/stop_profile"]
    assert rec["files"] == [str(trace_dir / "new.pt.trace.json.gz")] and rec["tok_s"] == 42.0
    cfg = json.loads(small_card.profiler_args(str(trace_dir))[1])
    assert cfg["delay_iterations"] == small_card.PROFILE_SKIP
    assert cfg["max_iterations"] == small_card.PROFILE_STEPS
    assert cfg["torch_profiler_with_stack"] is False
