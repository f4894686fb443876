"""`trace import`: other engines' routing recordings in the trace format, and the bundled
real traces that came through it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from expertcache_cli.commands import DEMO_TRACE, demo_trace_path
from expertcache_cli.rules.trace import DECODE, TraceError, load
from expertcache_cli.rules.trace_import import (
    RouteCsv,
    RouteJsonl,
    default_source,
    join,
    read_recording,
    read_route_csv,
    recording_trace,
    to_trace,
)

TRACES = Path(__file__).resolve().parent.parent / "traces"
REAL = {  # file -> (MoE layers, experts, top_k, decode steps, prefill steps, license file)
    "real-qwen3-30b-a3b-k6.npz": (48, 128, 6, 128, 1, "BigMoeOnEdge-LICENSE"),
    "real-gemma-4-26b-a4b-k6.npz": (30, 128, 6, 128, 1, "BigMoeOnEdge-LICENSE"),
    "real-gpt-oss-120b-k2.npz": (36, 128, 2, 64, 1, "BigMoeOnEdge-LICENSE"),
    # four prompts of 512 decode tokens each, one after another; their prefills unrecorded
    "real-olmoe-1b-7b-k8.npz": (16, 64, 8, 4 * 512, 0, "grouped-nf4-gemm-LICENSE"),
    "real-gpt-oss-20b-k4.npz": (24, 32, 4, 4 * 512, 0, "grouped-nf4-gemm-LICENSE"),
    # four prompts of 399, 399, 399 and 199 decode tokens; their prefills unrecorded
    "real-gpt-oss-120b-k4.npz": (36, 128, 4, 1396, 0, "nvmoe-LICENSE"),
    "real-deepseek-v2-lite-k6.npz": (26, 64, 6, 1396, 0, "nvmoe-LICENSE"),
}
#: each license file beside the bundled traces: the license a trace's source names, and
#: words its text must hold
LICENSES = {"BigMoeOnEdge-LICENSE": ("Apache-2.0", ("Apache License", "Version 2.0")),
            "grouped-nf4-gemm-LICENSE": ("MIT", ("MIT License", "Permission is hereby granted")),
            "nvmoe-LICENSE": ("MIT", ("MIT License", "Permission is hereby granted"))}

HEAD = """# route_trace v1
# model=/m/tiny.gguf arch=tinymoe n_layer=4 n_expert=8 n_expert_used=2
# layer=1 expert_bytes=100 dense_bytes=7
# layer=3 expert_bytes=300 dense_bytes=7
turn,phase,step,layer,slot,expert,weight,residency,expert_bytes,dropped
"""
# a 3-token prompt (the last MoE layer routes only the last position, as llama.cpp does),
# then 2 decode tokens at positions 3 and 4
ROWS = """0,0,0,1,0,5,0.6,0,100,0
0,0,0,1,1,2,0.4,0,100,0
0,0,1,1,0,7,0.5,0,100,0
0,0,1,1,1,5,0.5,0,0,0
0,0,2,1,0,0,0.9,0,100,0
0,0,2,1,1,1,0.1,0,100,0
0,0,2,3,0,4,0.7,0,300,0
0,0,2,3,1,6,0.3,0,300,0
0,1,3,1,0,5,0.8,1,0,0
0,1,3,1,1,7,0.2,1,0,0
0,1,3,3,0,6,0.6,1,0,0
0,1,3,3,1,3,0.4,0,300,0
0,1,4,1,0,2,0.5,1,0,0
0,1,4,1,1,0,0.5,1,0,0
0,1,4,3,0,3,0.9,1,0,0
0,1,4,3,1,4,0.1,1,0,0
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "t.route.csv"
    p.write_text(text)
    return p


def test_a_prefill_is_one_step_of_its_positions_and_each_decode_token_one_step(tmp_path):
    rc = read_route_csv(_write(tmp_path, HEAD + ROWS))
    assert (rc.num_experts, rc.top_k, rc.arch) == (8, 2, "tinymoe")
    tr = to_trace(rc)
    assert tr.topk_ids.shape == (3, 2, 6)  # 3 steps x 2 MoE layers x (3 positions x top-2)
    assert tr.step_tokens.tolist() == [3, 1, 1] and tr.tokens == 5
    assert tr.layers.tolist() == [1, 3] and tr.model == "/m/tiny.gguf"
    # prefill, layer 1: positions 0,1,2 in rank order; layer 3: only the last position, in
    # that position's place
    assert tr.topk_ids[0, 0].tolist() == [5, 2, 7, 5, 0, 1]
    assert tr.topk_ids[0, 1].tolist() == [-1, -1, -1, -1, 4, 6]
    assert tr.topk_ids[1, :, :2].tolist() == [[5, 7], [6, 3]]
    assert tr.topk_ids[2, :, :2].tolist() == [[2, 0], [3, 4]]
    assert (tr.topk_ids[1:, :, 2:] == -1).all()
    assert tr.expert_bytes == 200  # the layers' 100 and 300 B, averaged


def test_decode_only_drops_the_prefill_and_overrides_win(tmp_path):
    tr = to_trace(read_route_csv(_write(tmp_path, HEAD + ROWS)), prefill=False,
                  expert_bytes=9, model="m", source="s")
    assert tr.topk_ids.shape == (2, 2, 2) and tr.step_tokens.tolist() == [1, 1]
    assert (tr.expert_bytes, tr.model, tr.source) == (9, "m", "s")


@pytest.mark.parametrize("text, message", [
    ("turn,phase\n", "not a route trace"),
    ("# route_trace v1\n# model=x\nturn,phase,step,layer,slot,expert\n0,1,0,0,0,1\n",
     "no n_expert and n_expert_used"),
    (HEAD.replace("turn,phase,step,layer,slot,expert", "turn,phase,step,layer,slot"),
     "must name turn, phase, step, layer, slot, expert"),
    (HEAD, "no routings"),
    (HEAD + "0,1,3,1,0,x,0,0,0,0\n", ":6: expected integers"),
    (HEAD + "0,1,3,1,0,8,0,0,0,0\n", "expert 8 at step 3, layer 1 is outside 0..7"),
    (HEAD + "0,1,3,1,2,5,0,0,0,0\n", "slot 2 is outside 0..1"),
    (HEAD + "0,2,3,1,0,5,0,0,0,0\n", "phase 2 is neither"),
    (HEAD + "0,1,3,1,0,5,0,0,0,0\n0,1,3,1,1,5,0,0,0,0\n", "same expert twice"),
    (HEAD + "0,1,3,1,0,5,0,0,0,0\n0,1,3,1,0,6,0,0,0,0\n", "given twice"),
])
def test_a_file_that_is_not_a_routers_output_is_one_clear_error(tmp_path, text, message):
    with pytest.raises(TraceError, match=message):
        to_trace(read_route_csv(_write(tmp_path, text)))


def test_decode_only_on_a_prefill_only_file_says_so(tmp_path):
    with pytest.raises(TraceError, match="no decode step"):
        to_trace(read_route_csv(_write(tmp_path, HEAD + ROWS.split("0,1,3")[0])), prefill=False)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expertcache_cli", "trace", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_import_writes_a_trace_that_info_reads(tmp_path):
    src = _write(tmp_path, HEAD + ROWS)
    r = _cli("import", str(src), str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "3 steps (2 decode, 1 prefill) x 2 layers, top-2 of 8, 5 tokens" in " ".join(
        r.stdout.split())
    tr = load(tmp_path / "out.npz")
    assert tr.source == "recorded: t.route.csv (route_trace v1, tinymoe)"
    assert _cli("info", str(tmp_path / "out.npz")).returncode == 0


@pytest.mark.parametrize("src", ["missing.csv", "README"])
def test_cli_import_of_a_bad_file_is_one_line_and_exit_2(tmp_path, src):
    (tmp_path / "README").write_text("hello\n")
    r = _cli("import", str(tmp_path / src), str(tmp_path / "out.npz"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "out.npz").exists()


@pytest.mark.parametrize("name", sorted(REAL))
def test_the_bundled_real_traces_are_a_routers_output(name):
    """Real routing looks like a router's: each token's experts distinct and in range, many
    experts per layer over the decode, and consecutive tokens not routed alike every time."""
    layers, experts, k, decode, prefills, license_file = REAL[name]
    tr = load(TRACES / name)
    assert (tr.num_layers, tr.num_experts, tr.top_k) == (layers, experts, k)
    assert tr.source.startswith("recorded (real model")
    assert LICENSES[license_file][0] in tr.source
    assert "synthetic" not in tr.source and tr.expert_bytes and tr.expert_bytes > 2**20
    single = tr.step_tokens == 1
    assert int(single.sum()) == decode and tr.steps == decode + prefills
    assert (tr.step_kinds() == DECODE).sum() == decode
    if prefills:  # one prompt's prefill, then its decode
        assert tr.step_tokens[0] > 1
    dec = tr.topk_ids[single][:, :, :k]
    assert (dec >= 0).all() and (dec < experts).all()
    assert all(len(set(row)) == k for row in dec.reshape(-1, k).tolist())
    per_layer = [len(np.unique(dec[:, layer])) for layer in range(layers)]
    assert min(per_layer) >= 3 * k
    same = (np.sort(dec[1:], axis=2) == np.sort(dec[:-1], axis=2)).all(axis=2)
    assert same.mean() < 0.5
    assert (TRACES / name).stat().st_size < 3 * 2**20


def test_the_default_demo_trace_is_a_real_recording_with_its_license_beside_it():
    assert DEMO_TRACE in REAL and demo_trace_path().name == DEMO_TRACE
    assert "synthetic" not in load(demo_trace_path()).source
    readme = (TRACES / "README.md").read_text()
    for name, (*_, file) in REAL.items():
        assert name in readme
        _, words = LICENSES[file]
        text = (TRACES / "licenses" / file).read_text()
        assert all(w in text for w in words) and f"licenses/{file}" in readme
    for name in ("demo-qwen3-30b-a3b-tasks.npz", "demo-olmoe-1b-7b-zipf.npz",
                 "demo-qwen3-30b-a3b-batch4.npz"):
        assert "synthetic" in load(TRACES / name).source
    # every bundled trace is either listed real one or a synthetic one, and the README names it
    for path in TRACES.glob("*.npz"):
        assert path.name in readme
        assert path.name in REAL or "synthetic" in load(path).source


# the routing JSONL of capture_routing.py: a meta line, then one line a decode token
META = {"model": "/m/tiny", "prompt": "prose", "steps": 3, "layers": 2, "top_k": 2,
        "n_experts": 8, "top_k_native": 2, "top_k_overridden": False, "prompt_tokens": 5,
        "decode": True}
STEPS = [{"0": [1, 5], "1": [0, 7]}, {"0": [1, 6], "1": [2, 7]}, {"0": [3, 4], "1": [2, 7]}]


def _jsonl(tmp_path: Path, meta: dict | None = None, steps: list | None = None,
           name: str = "t.jsonl", extra: str = "") -> Path:
    lines = [json.dumps({"meta": META if meta is None else meta})]
    lines += [json.dumps({"step": i, "token": 100 + i, "routed": r})
              for i, r in enumerate(STEPS if steps is None else steps)]
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n" + extra)
    return p


def test_a_routing_jsonl_is_one_decode_step_a_line(tmp_path):
    rec = read_recording(_jsonl(tmp_path))
    assert isinstance(rec, RouteJsonl) and (rec.num_experts, rec.top_k) == (8, 2)
    tr = recording_trace(rec)
    assert tr.topk_ids.shape == (3, 2, 2) and tr.step_tokens.tolist() == [1, 1, 1]
    assert tr.topk_ids[:, 0].tolist() == [[1, 5], [1, 6], [3, 4]]
    assert tr.topk_ids[:, 1].tolist() == [[0, 7], [2, 7], [2, 7]]
    assert tr.layers.tolist() == [0, 1] and tr.model == "/m/tiny"
    assert (tr.step_kinds() == DECODE).all() and tr.expert_bytes is None


def test_several_recordings_are_joined_in_turn_and_the_route_csv_still_reads(tmp_path):
    a = _jsonl(tmp_path, name="a.jsonl")
    b = _jsonl(tmp_path, meta={**META, "steps": 1, "prompt": "code"},
               steps=[{"1": [3, 0], "0": [2, 6]}], name="b.jsonl")
    recs = [read_recording(a), read_recording(b)]
    tr = join([recording_trace(r) for r in recs], ["a.jsonl", "b.jsonl"], expert_bytes=7)
    assert tr.topk_ids.shape == (4, 2, 2) and tr.expert_bytes == 7
    assert tr.topk_ids[3].tolist() == [[2, 6], [3, 0]]  # by layer, as the file names them
    # no prefill marks where b's prompt starts: the joined trace says it
    assert tr.request_starts().tolist() == [0, 3]
    assert default_source(recs, ["a.jsonl", "b.jsonl"]) == \
        "recorded: a.jsonl, b.jsonl (routing JSONL, /m/tiny)"
    assert isinstance(read_recording(_write(tmp_path, HEAD + ROWS)), RouteCsv)
    wide = _jsonl(tmp_path, meta={**META, "n_experts": 16}, name="c.jsonl")
    with pytest.raises(TraceError, match="c.jsonl: top-2 of 16 .* not recordings of one model"):
        join([recording_trace(read_recording(p)) for p in (a, wide)], ["a.jsonl", "c.jsonl"])


def test_a_readout_at_another_top_k_than_the_model_ran_says_so():
    rec = RouteJsonl(model="m", prompt="p", num_experts=8, top_k=4, layers=np.arange(1),
                     ids=np.zeros((1, 1, 4), np.int32), top_k_native=2)
    assert "read at top-4 of a router that routed 2: not what the model ran" in \
        default_source([rec], ["x.jsonl"])


@pytest.mark.parametrize("meta, steps, extra, message", [
    ({"model": "m"}, None, "", ":1: the meta line gives no n_experts and top_k"),
    ({**META, "n_experts": None}, None, "", "no n_experts and top_k"),
    ({**META, "top_k": True}, None, "", "no n_experts and top_k"),
    ({**META, "top_k": 9}, None, "", "n_experts=8 top_k=9 is not a router"),
    ({**META, "decode": False}, None, "", "not a decode recording"),
    (None, None, "{oops\n", ":5: not a JSON line"),
    (None, None, "[1, 2]\n", ":5: not a JSON object"),
    (None, None, '{"step": 7, "routed": {}}\n', ':5: expected {"step": 3'),
    (None, [{"0": [1, 5]}, {"0": [1, 6]}, {"0": [3, 4]}], "",
     "says 2 layers and the steps route 1"),
    (None, [{"a": [1, 5], "b": [0, 7]}] * 3, "", ":2: the routed layers must be named by integers"),
    (None, [{"0": [1, 5], "\u00b2": [0, 7]}] * 3, "", ":2: the routed layers must be named"),
    (None, [{"0": [1, 5], "01": [0, 7]}] * 3, "", ":2: the routed layers must be named"),
    (None, [{"0": list(range(500)), "1": [0, 7]}], "", ":2: layer 0 routes [0, 1, 2,"),
    (None, STEPS[:2] + [{"0": [3, 4]}], "", ":4: not the first step's layers (missing 1, extra "
     "none)"),
    (None, STEPS[:1] + [{"0": [1, 1], "1": [2, 7]}], "", ":3: layer 0 routes [1, 1], not 2 "
     "distinct experts in 0..7"),
    (None, [{"0": [1, 8], "1": [0, 7]}], "", ":2: layer 0 routes"),
    (None, [{"0": [1, 2.0], "1": [0, 7]}], "", ":2: layer 0 routes"),
    (None, [{"0": [1], "1": [0, 7]}], "", ":2: layer 0 routes"),
    (None, STEPS[:2], "", "says 3 steps and the file holds 2"),
    (None, [], "", "no steps after the meta line"),
])
def test_a_jsonl_that_is_not_a_routers_output_is_one_clear_error(tmp_path, meta, steps, extra,
                                                                  message):
    with pytest.raises(TraceError, match=re.escape(message)):
        recording_trace(read_recording(_jsonl(tmp_path, meta, steps, extra=extra)))


def test_cli_imports_jsonl_recordings_in_turn(tmp_path):
    a, b = _jsonl(tmp_path, name="a.jsonl"), _jsonl(tmp_path, name="b.jsonl")
    r = _cli("import", str(a), str(b), str(tmp_path / "out"), "--expert-bytes", "4096")
    assert r.returncode == 0, r.stderr
    assert "6 steps (6 decode, 0 prefill) x 2 layers, top-2 of 8, 6 tokens from 2 " \
        "recordings" in " ".join(r.stdout.split())
    tr = load(tmp_path / "out.npz")
    assert tr.source == "recorded: a.jsonl, b.jsonl (routing JSONL, /m/tiny)"
    assert tr.expert_bytes == 4096 and tr.steps == 6


@pytest.mark.parametrize("text", [
    '{"meta": {"top_k": 2}}\n',  # no n_experts
    json.dumps({"meta": META}) + '\n{"step": 0, "routed": {"0": [1, 99], "1": [0, 7]}}\n',
    json.dumps({"meta": META}) + "\n" + "{" * 5000 + "\n",
    json.dumps({"meta": META}) + "\n" + "[" * 200000 + "]" * 200000 + "\n",  # too deep
    "\xff\xfe{",
    "",
])
def test_cli_import_of_a_malformed_jsonl_is_one_line_and_exit_2(tmp_path, text):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(text.encode("latin-1"))
    good = _jsonl(tmp_path, name="good.jsonl")
    for args in ([src], [good, src]):  # alone, and after a good recording
        r = _cli("import", *map(str, args), str(tmp_path / "out.npz"))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1 and "bad.jsonl" in r.stderr
        assert not (tmp_path / "out.npz").exists()


# nvmoe's token-pairs JSONL: one line a decode token, [layer, expert] pairs in layer order
PAIRS = [[[1, 5], [1, 2], [3, 0], [3, 7]], [[1, 2], [1, 6], [3, 7], [3, 1]]]


def _pairs(tmp_path: Path, rows: list | None = None, name: str = "t.tokens.jsonl",
           text: str | None = None) -> Path:
    p = tmp_path / name
    p.write_text(text if text is not None else
                 "".join(json.dumps(r) + "\n" for r in (PAIRS if rows is None else rows)))
    return p


def test_token_pairs_are_one_decode_step_a_line_in_the_routers_rank_order(tmp_path):
    rec = read_recording(_pairs(tmp_path), num_experts=8)
    assert isinstance(rec, RouteJsonl) and (rec.num_experts, rec.top_k) == (8, 2)
    tr = recording_trace(rec)
    assert tr.layers.tolist() == [1, 3] and tr.step_tokens.tolist() == [1, 1]
    assert tr.topk_ids[:, 0].tolist() == [[5, 2], [2, 6]]  # as ranked, not sorted
    assert tr.topk_ids[:, 1].tolist() == [[0, 7], [7, 1]]
    assert default_source([rec], ["t.tokens.jsonl"]) == \
        "recorded: t.tokens.jsonl (token-pairs JSONL, ?)"


@pytest.mark.parametrize("rows, text, experts, message", [
    (None, None, None, "does not say how many experts a layer has: give --experts N"),
    (None, '[[1, 5], [1, 2]]\n{"a": 1}\n', 8, ":2: not a JSON array of [layer, expert] pairs"),
    (None, "[[1, 5, 0]]\n", 8, ":1: not a JSON array of [layer, expert] pairs"),
    (None, "[[1, true]]\n", 8, ":1: not a JSON array"),
    (None, "[]\n", 8, ":1: not a JSON array"),
    (None, "[[1, 2\n", 8, ":1: not a JSON line"),
    ([[[3, 0], [3, 7], [1, 5], [1, 2]]], None, 8, ":1: layer 1 after layer 3"),
    ([[[1, 5], [3, 0], [1, 2], [3, 7]]], None, 8, ":1: layer 1's pairs are not together"),
    ([PAIRS[0], [[1, 2], [1, 6]]], None, 8, ":2: routes layers 1..1 (1), not the first "
     "token's 1..3 (2)"),
    ([PAIRS[0], [[1, 2], [1, 2], [3, 7], [3, 1]]], None, 8, ":2: layer 1 routes [2, 2], not 2 "
     "distinct experts in 0..7"),
    ([PAIRS[0], [[1, 2], [1, 6], [3, 7]]], None, 8, ":2: layer 3 routes [7], not 2"),
    (None, None, 7, ":1: layer 3 routes [0, 7], not 2 distinct experts in 0..6"),
    (None, "\n", 8, "not a route trace"),
])
def test_token_pairs_that_are_not_a_routers_output_are_one_clear_error(tmp_path, rows, text,
                                                                       experts, message):
    with pytest.raises(TraceError, match=re.escape(message)):
        recording_trace(read_recording(_pairs(tmp_path, rows, text=text), experts))


def test_cli_imports_token_pairs_in_turn_and_wants_the_expert_count(tmp_path):
    a, b = _pairs(tmp_path, name="a.jsonl"), _pairs(tmp_path, PAIRS[:1], name="b.jsonl")
    out = tmp_path / "out.npz"
    r = _cli("import", str(a), str(b), str(out))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "give --experts N" in r.stderr
    assert not out.exists()
    r = _cli("import", str(a), str(b), str(out), "--experts", "8", "--expert-bytes", "4096")
    assert r.returncode == 0, r.stderr
    tr = load(out)
    assert tr.steps == 3 and tr.request_starts().tolist() == [0, 2]
    assert tr.source == "recorded: a.jsonl, b.jsonl (token-pairs JSONL, ?)"


def test_token_pairs_undecodable_past_the_first_buffer_is_one_line_and_exit_2(tmp_path):
    """The bad bytes sit past the first line and past the text layer's first read, so the
    reader meets them while parsing, not while the format is told apart."""
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b"".join(json.dumps(PAIRS[0]).encode() + b"\n" for _ in range(2000))
                    + b"\xff\xfe[[1, 2]]\n")
    r = _cli("import", str(src), str(tmp_path / "out.npz"), "--experts", "8")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "bad.jsonl: not a readable text file" in r.stderr
