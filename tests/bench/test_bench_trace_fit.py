"""bench/trace_fit.py: the trace `plan` predicts on is the one the served model replays
(the hook's layer rule, the format's expert bytes), and it still says what routing it is."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import trace_fit  # noqa: E402

from expertcache_cli.rules import trace as tracefile  # noqa: E402


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


def test_narrowing_keeps_each_tokens_first_ids_and_says_so():
    ids = np.array([[[5, 6, 7, 8, 9, 10]], [[1, 2, 3, -1, -1, -1]]])  # 2 tokens x top-3
    t = tracefile.Trace(ids, num_experts=16, top_k=3, source="recorded x")
    n = trace_fit.narrow(t, 2)
    assert n.top_k == 2 and n.topk_ids.tolist() == [[[5, 6, 8, 9]], [[1, 2, -1, -1]]]
    assert "first 2 of its top-3" in n.source
    assert trace_fit.narrow(t, 3) is t
    for bad in (0, 4):
        try:
            trace_fit.narrow(t, bad)
        except ValueError:
            continue
        raise AssertionError(f"top-k {bad} accepted")


def test_as_served_cycles_rows_and_takes_the_front_of_each():
    ids = np.array([[[1, 2, 3, 4]], [[5, 6, -1, -1]], [[7, 8, -1, -1]]])  # top-2
    t = tracefile.Trace(ids, num_experts=16, top_k=2, source="recorded y")
    one = trace_fit.as_served(t, 1, 5)
    assert one.topk_ids[:, 0].tolist() == [[1, 2], [5, 6], [7, 8], [1, 2], [5, 6]]
    assert one.step_tokens.tolist() == [1] * 5 and "1 stream(s) x 5" in one.source
    three = trace_fit.as_served(t, 3, 2)  # wider than the rows: padded, as the hook keeps
    assert three.topk_ids[:, 0].tolist() == [[1, 2, 3, 4, -1, -1], [5, 6, -1, -1, -1, -1]]
    assert three.step_tokens.tolist() == [2, 1]


def test_the_cli_narrows_fits_and_serves(tmp_path):
    src = tracefile.save(tracefile.Trace(
        np.tile(np.arange(6), (4, 3, 1)), num_experts=16, top_k=3, source="recorded z"),
        tmp_path / "in.npz")
    out = tmp_path / "out.npz"
    rc = trace_fit.main([str(src), str(out), "--layers", "2", "--top-k", "2",
                         "--streams", "1", "--steps", "7"])
    got = tracefile.load(out)
    assert rc == 0 and got.topk_ids.shape == (7, 2, 2) and got.top_k == 2
    assert got.topk_ids[0, 0].tolist() == [0, 1]
    assert trace_fit.main([str(src), str(out), "--layers", "2", "--steps", "7"]) == 2
    assert trace_fit.main([str(src), str(out), "--layers", "2", "--top-k", "9"]) == 2


def test_as_served_restarts_each_request_at_its_prefill_row():
    ids = np.array([[[1, 2, 3, 4]], [[5, 6, -1, -1]], [[7, 8, -1, -1]]])  # top-2, row 0 wide
    t = tracefile.Trace(ids, num_experts=16, top_k=2, source="recorded y")
    got = trace_fit.as_served(t, 1, 8, request_steps=4, prefill_tokens=2)
    assert got.topk_ids[:, 0].tolist() == [[1, 2, 3, 4], [5, 6, -1, -1], [7, 8, -1, -1],
                                           [1, 2, -1, -1]] * 2
    assert got.step_tokens.tolist() == [2, 1, 1, 1] * 2
    assert "2 request(s) of 4 steps, each from row 0 (its prefill of 2 tokens)" in got.source
    plain = trace_fit.as_served(t, 1, 4, request_steps=4)  # no prefill width: one stream's
    assert plain.topk_ids[:, 0].tolist() == [[1, 2], [5, 6], [7, 8], [1, 2]]


def test_shape_says_top_k_experts_layers_and_requests_and_refuses_a_non_trace(tmp_path, capsys):
    """The runners pick the checkpoint a recording is served on from this line."""
    assert trace_fit.main(["--shape", str(ROOT / "traces" / "real-qwen3-30b-a3b-k6.npz")]) == 0
    assert capsys.readouterr().out.strip() == "6 128 48 1"  # one prompt: one request
    assert trace_fit.main(["--shape", str(ROOT / "traces" / "real-gpt-oss-120b-k2.npz")]) == 0
    assert capsys.readouterr().out.strip() == "2 128 36 1"
    assert trace_fit.main(["--shape", str(ROOT / "traces" / "real-olmoe-1b-7b-k8.npz")]) == 0
    assert capsys.readouterr().out.strip() == "8 64 16 4"  # four prompts in turn
    (tmp_path / "x.npz").write_text("not a trace")
    assert trace_fit.main(["--shape", str(tmp_path / "x.npz")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"trace_fit: {tmp_path / 'x.npz'}: not a routing trace") and \
        "\n" not in err


def test_decode_only_leaves_each_requests_prefill_out():
    ids = np.array([[[1, 2, 3, 4]], [[5, 6, -1, -1]], [[7, 8, -1, -1]]])  # top-2
    t = tracefile.Trace(ids, num_experts=16, top_k=2, source="recorded y")
    got = trace_fit.as_served(t, 1, 8, request_steps=4, decode_only=True)
    assert got.topk_ids[:, 0].tolist() == [[5, 6], [7, 8], [1, 2]] * 2
    assert got.steps == 6 and "prefills left out" in got.source


def test_streams_are_spaced_by_the_hooks_streams_not_the_steps():
    """A hook set for 8 streams (EC_BENCH_TRACE_STREAMS) decoding 2 puts them T // 8 rows
    apart: as_served writes that spacing when told the hook's streams, and refuses fewer
    than a step decodes (the hook would take that step for a prefill)."""
    ids = (np.arange(16)[:, None, None] * 2 + np.arange(2)).astype(np.int64)  # T16 L1 top-2
    t = tracefile.Trace(ids, num_experts=64, top_k=2, step_tokens=np.ones(16, np.int64),
                        source="recorded y")
    own = trace_fit.as_served(t, 2, 1)  # 16 // 2 = 8 rows apart
    assert own.topk_ids[0, 0].tolist() == [0, 1, 16, 17]
    hook = trace_fit.as_served(t, 2, 3, hook_streams=8)  # 16 // 8 = 2 rows apart
    assert hook.topk_ids[:, 0].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [4, 5, 8, 9]]
    assert "2 rows apart (the hook set for 8 streams)" in hook.source
    with pytest.raises(ValueError, match="fewer than the 2"):
        trace_fit.as_served(t, 2, 3, hook_streams=1)
