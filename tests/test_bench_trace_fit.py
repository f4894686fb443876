"""bench/trace_fit.py: the trace `plan` predicts on is the one the served model replays
(the hook's layer rule, the format's expert bytes), and it still says what routing it is."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import trace_fit  # noqa: E402

from expertcache_cli import trace as tracefile  # noqa: E402


def _trace(layers: int, source: str | None = "synthetic, tasks") -> tracefile.Trace:
    ids = np.arange(5 * layers * 4).reshape(5, layers, 4) % 16
    return tracefile.Trace(ids, num_experts=16, top_k=4, expert_bytes=100, source=source)


def test_fewer_layers_take_the_first_and_more_repeat_as_the_hook_routes_them():
    t = _trace(6)
    short = trace_fit.fit(t, 4, expert_bytes=7)
    assert short.num_layers == 4 and np.array_equal(short.topk_ids, t.topk_ids[:, :4])
    assert short.expert_bytes == 7 and short.steps == t.steps
    assert short.source.startswith("synthetic, tasks [layers fitted to the served model's 4")
    long = trace_fit.fit(t, 9)
    assert np.array_equal(long.topk_ids[:, 6:], t.topk_ids[:, :3])  # layer i -> i mod 6
    assert long.expert_bytes == 100  # kept when none given
    same = trace_fit.fit(t, 6)
    assert same.source == "synthetic, tasks" and list(same.layers) == list(range(6))


def test_a_trace_without_source_still_says_so():
    assert trace_fit.source_of(_trace(2, None)) == "no source recorded"
    t = _trace(2, None)
    t.model = "gpt-oss-120b"
    assert trace_fit.source_of(t) == "no source recorded (model: gpt-oss-120b)"


def test_main_takes_the_bytes_from_size_and_refuses_a_size_file_without_them(tmp_path, capsys):
    src = tracefile.save(_trace(6), tmp_path / "t.npz")
    (tmp_path / "size.json").write_text(json.dumps({"bytes_per_expert": 4719744}))
    out = tmp_path / "fit.npz"
    assert trace_fit.main([str(src), str(out), "--layers", "3", "--size",
                           str(tmp_path / "size.json")]) == 0
    got = tracefile.load(out)
    assert got.num_layers == 3 and got.expert_bytes == 4719744
    assert "routing: synthetic, tasks [layers fitted" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("not json")
    assert trace_fit.main([str(src), str(tmp_path / "x.npz"), "--layers", "3", "--size",
                           str(tmp_path / "bad.json")]) == 2
    assert not (tmp_path / "x.npz").exists()
    assert trace_fit.main(["--source", str(src)]) == 0
    assert capsys.readouterr().out.strip() == "synthetic, tasks"
