"""Issue 15's tables from a wide-steps run (bench/wide_report.py), on CPU: the link bound of
a prefill, the ratios against in place and the floor, and each goal's verdict."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import wide_report  # noqa: E402

PROBE = ROOT / "tests" / "data" / "fp8-block-probe.json"
SIZE = {"num_layers": 24, "num_moe_layers": 24, "num_experts": 128,
        "bytes_per_expert": 9437184, "max_num_batched_tokens": 8192}


def _arm(d: Path, name: str, ttft_ms: dict[int, float], tok_s: dict[int, float],
         greedy=None) -> None:
    rec = {"arm": name, "status": "ok",
           "ttft": {str(n): {"median_s": v / 1000, "runs": []} for n, v in ttft_ms.items()},
           "decode": {str(s): {"tok_s": v} for s, v in tok_s.items()}}
    if greedy is not None:
        rec["greedy"] = greedy
    (d / f"{name}.json").write_text(json.dumps(rec))


def test_the_bound_is_resident_plus_the_missing_experts_of_every_chunk_and_layer():
    # 24 layers x (128 - 64) experts x 9.44 MB at 50 GB/s = 289.9 ms, once per chunk
    one = wide_report.bound_ms(30.0, 2048, SIZE, 64, 50.0)
    assert abs(one - (30.0 + 24 * 64 * 9437184 / 50e9 * 1e3)) < 1e-9
    two_chunks = wide_report.bound_ms(30.0, 8193, SIZE, 64, 50.0)
    assert abs((two_chunks - 30.0) - 2 * (one - 30.0)) < 1e-9
    assert wide_report.bound_ms(30.0, 512, SIZE, 128, 50.0) == 30.0  # every expert in slots


def test_tables_and_verdicts(tmp_path, capsys):
    from expertcache_cli.planning.planner import read_probe

    gbps = read_probe(PROBE)[0]  # the rate the report will use
    b2048 = wide_report.bound_ms(40.0, 2048, SIZE, 64, gbps)
    b8192 = wide_report.bound_ms(120.0, 8192, SIZE, 64, gbps)
    _arm(tmp_path, "floor", {}, {1: 27.0, 16: 100.0})
    _arm(tmp_path, "inplace", {512: 200.0, 2048: 700.0, 8192: 2000.0}, {1: 80.0, 16: 110.0},
         greedy=[["a", "b"], ["c"]])
    _arm(tmp_path, "staged", {512: 190.0, 2048: 1.10 * b2048, 8192: 1.30 * b8192},
         {1: 79.0, 16: 160.0}, greedy=[["a", "b"], ["c"]])
    _arm(tmp_path, "resident", {512: 15.0, 2048: 40.0, 8192: 120.0}, {1: 300.0, 16: 900.0})
    size = tmp_path / "size.json"
    size.write_text(json.dumps(SIZE))
    rc = wide_report.main([str(tmp_path), "--size", str(size), "--probe", str(PROBE),
                           "--slots", "64"])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"| 2048 | 700.0 | {1.10 * b2048:.1f} | 40.0 | {b2048:.1f} | 1.100 |" in out
    goal = {ln.split(":")[0]: ln for ln in out.splitlines() if "met" in ln}
    assert goal["TTFT 2048"] == "TTFT 2048: staged 1.100 of the link bound (met: within 15%)"
    assert goal["TTFT 8192"] == "TTFT 8192: staged 1.300 of the link bound (NOT met: within 15%)"
    assert goal["TTFT 512"] == "TTFT 512: staged 0.950 of in place (met: never slower)"
    assert goal["decode 16 streams"].startswith("decode 16 streams: staged 1.60x the floor (met")
    assert "0.988 of in place (met" in goal["decode 1 stream"]
    assert "in place vs staged identical (2 of 2 streams equal)" in out


def test_no_records_or_a_bad_probe_is_one_line_and_exit_2(tmp_path, capsys):
    size = tmp_path / "size.json"
    size.write_text(json.dumps(SIZE))
    assert wide_report.main([str(tmp_path), "--size", str(size), "--probe", str(PROBE),
                             "--slots", "64"]) == 2
    assert "no arm records" in capsys.readouterr().err
    bad = tmp_path / "probe.json"
    bad.write_text("{}")
    assert wide_report.main([str(tmp_path), "--size", str(size), "--probe", str(bad),
                             "--slots", "64"]) == 2
    assert capsys.readouterr().err.startswith("wide_report: ")


def test_staged_without_installs_gets_its_own_column_only_when_run(tmp_path, capsys):
    size = tmp_path / "size.json"
    size.write_text(json.dumps(SIZE))
    _arm(tmp_path, "inplace", {2048: 700.0}, {16: 110.0})
    _arm(tmp_path, "staged", {2048: 400.0}, {16: 160.0})
    argv = [str(tmp_path), "--size", str(size), "--probe", str(PROBE), "--slots", "64"]
    assert wide_report.main(argv) == 0
    assert "no install" not in capsys.readouterr().out
    _arm(tmp_path, "staged0", {2048: 450.0}, {16: 120.0})
    assert wide_report.main(argv) == 0
    rows = {ln.split("|")[1].strip(): ln for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("| ")}
    assert rows["prompt tokens"].endswith("staged, no install ms |")
    assert rows["2048"].endswith("| 450.0 |")
    assert rows["16"].endswith("| 120.0 |")


def test_a_run_without_the_floor_arm_says_so_instead_of_failing_the_goal(tmp_path, capsys):
    _arm(tmp_path, "inplace", {512: 200.0}, {1: 80.0, 16: 40.0})
    _arm(tmp_path, "staged", {512: 190.0}, {1: 79.0, 16: 70.0})
    size = tmp_path / "size.json"
    size.write_text(json.dumps(SIZE))
    assert wide_report.main([str(tmp_path), "--size", str(size), "--probe", str(PROBE),
                             "--slots", "64"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines()
                if ln.startswith("decode 16 streams"))
    assert "no floor arm in this run" in line and "NOT met" not in line
    assert "staged 1.750 of in place" in line
