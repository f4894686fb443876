"""`trace import`: other engines' routing recordings in the trace format, and the bundled
real traces that came through it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from expertcache_cli.commands import DEMO_TRACE, demo_trace_path
from expertcache_cli.rules.trace import TraceError, load
from expertcache_cli.rules.trace_import import read_route_csv, to_trace

TRACES = Path(__file__).resolve().parent.parent / "traces"
REAL = {  # file -> (MoE layers, experts, top_k, decode steps)
    "real-qwen3-30b-a3b-k6.npz": (48, 128, 6, 128),
    "real-gemma-4-26b-a4b-k6.npz": (30, 128, 6, 128),
    "real-gpt-oss-120b-k2.npz": (36, 128, 2, 64),
}

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
    layers, experts, k, decode = REAL[name]
    tr = load(TRACES / name)
    assert (tr.num_layers, tr.num_experts, tr.top_k) == (layers, experts, k)
    assert tr.source.startswith("recorded (real model") and "Apache-2.0" in tr.source
    single = tr.step_tokens == 1
    assert int(single.sum()) == decode and tr.step_tokens[0] > 1  # one prompt, then decode
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
    license_text = (TRACES / "licenses" / "BigMoeOnEdge-LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text
    for name in REAL:
        assert name in readme
    for name in ("demo-qwen3-30b-a3b-tasks.npz", "demo-olmoe-1b-7b-zipf.npz",
                 "demo-qwen3-30b-a3b-batch4.npz"):
        assert "synthetic" in load(TRACES / name).source
