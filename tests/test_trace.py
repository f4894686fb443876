"""Trace files: round trip, and every malformed file gets one line and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from expertcache_cli.rules.trace import Trace, TraceError, load, save


def good(tmp_path: Path) -> Path:
    ids = np.array([[[0, 3, -1]], [[2, 1, 1]]], dtype=np.int32)
    t = Trace(ids, num_experts=4, top_k=2, expert_bytes=4096, model="m", source="test")
    return save(t, tmp_path / "good.npz")


def test_round_trip(tmp_path):
    path = good(tmp_path)
    t = load(path)
    assert t.topk_ids.tolist() == [[[0, 3, -1]], [[2, 1, 1]]]
    assert (t.num_experts, t.top_k, t.expert_bytes, t.model, t.source) == (4, 2, 4096, "m", "test")
    assert t.tokens == 2  # 5 valid ids on layer 0 // top_k


def test_save_adds_suffix(tmp_path):
    t = Trace(np.zeros((1, 1, 1), np.int32), 2, 1)
    assert save(t, tmp_path / "x").name == "x.npz"


def write_npz(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


CASES = {
    "not_npz": lambda p: (p.write_text("hello"), p)[1],
    "missing_keys": lambda p: write_npz(p, topk_ids=np.zeros((1, 1, 1), np.int32)),
    "float_ids": lambda p: write_npz(
        p, topk_ids=np.zeros((2, 1, 2), np.float32), num_experts=4, top_k=2
    ),
    "ids_too_big": lambda p: write_npz(
        p, topk_ids=np.array([[[0, 9]]], np.int32), num_experts=4, top_k=2
    ),
    "empty": lambda p: write_npz(p, topk_ids=np.zeros((0, 1, 2), np.int32), num_experts=4, top_k=2),
    "only_padding": lambda p: write_npz(
        p, topk_ids=np.full((2, 1, 2), -1, np.int32), num_experts=4, top_k=2
    ),
    "wrong_rank": lambda p: write_npz(
        p, topk_ids=np.zeros((3, 2), np.int32), num_experts=4, top_k=2
    ),
    "missing_file": lambda p: p,
}

MESSAGES = {
    "not_npz": "not a readable",
    "missing_keys": "missing key(s) num_experts, top_k",
    "float_ids": "integer array",
    "ids_too_big": "expert id 9 at step 0, layer 0",
    "empty": "empty",
    "only_padding": "only padding",
    "wrong_rank": "[steps, layers, ids]",
    "missing_file": "no such file",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_trace_library_error(tmp_path, case):
    path = CASES[case](tmp_path / f"{case}.npz")
    with pytest.raises(TraceError) as info:
        load(path)
    assert MESSAGES[case] in str(info.value)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", ["replay", "trace info"])
def test_malformed_trace_cli_one_line_exit_2(tmp_path, case, command):
    path = CASES[case](tmp_path / f"{case}.npz")
    proc = subprocess.run(
        [sys.executable, "-m", "expertcache_cli", *command.split(), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("expertcache: error:"), proc.stderr
    assert MESSAGES[case] in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def _single_stream() -> Trace:
    """Two layers, top-2 of 16: a 3-token prefill, then 6 decode steps (ids 0..11)."""
    ids = np.full((7, 2, 6), -1, np.int32)
    ids[0, :, :] = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    for t in range(1, 7):
        ids[t, 0, :2] = [2 * (t - 1), 2 * (t - 1) + 1]
        ids[t, 1, :2] = [15, 14 - t]
    return Trace(ids, 16, 2, step_tokens=np.array([3, 1, 1, 1, 1, 1, 1]), source="test")


def test_rebatch_interleaves_offset_streams_of_the_decode_steps():
    from expertcache_cli.planning.rebatch import rebatch

    tr = rebatch(_single_stream(), 3)
    assert tr.topk_ids.shape == (6, 2, 6)  # 6 decode steps, 3 streams x top-2
    assert tr.tokens == 18  # the streams' tokens, not the graph padding
    assert tr.step_tokens.tolist() == [4] * 6  # vLLM pads a batch of 3 to 4
    assert (tr.gate_widths() == 8).all()
    layer0 = tr.topk_ids[:, 0, :]
    # stream 0 starts at decode step 0, stream 1 at 2, stream 2 at 4, each wrapping
    assert sorted(layer0[0].tolist()) == [0, 1, 4, 5, 8, 9]
    assert sorted(layer0[5].tolist()) == [2, 3, 6, 7, 10, 11]
    assert rebatch(_single_stream(), 1).topk_ids.shape == (6, 2, 2)
    assert rebatch(_single_stream(), 5, padded_tokens=5).step_tokens[0] == 5


def test_rebatch_refuses_what_it_cannot_model():
    from expertcache_cli.errors import UserError
    from expertcache_cli.planning.rebatch import rebatch

    with pytest.raises(UserError, match="--batch must be >= 1"):
        rebatch(_single_stream(), 0)
    batched = _single_stream()
    batched.step_tokens = np.full(7, 4)
    with pytest.raises(UserError, match="no single-token .decode. step .steps of up to 4"):
        rebatch(batched, 2)


def _requests_trace(requests: int, decode: int) -> Trace:
    """One stream serving ``requests`` prompts in turn: a 4-token prefill, then ``decode``
    single-token steps each; every request routes its own two experts (top-2 of 64)."""
    rows, tokens = [], []
    for r in range(requests):
        pre = np.full((1, 1, 8), -1, np.int32)
        pre[0, 0, :] = np.arange(8) % 64
        rows.append(pre)
        tokens.append(4)
        dec = np.full((decode, 1, 8), -1, np.int32)
        dec[:, 0, :2] = [2 * r, 2 * r + 1]
        rows.append(dec)
        tokens += [1] * decode
    return Trace(np.concatenate(rows), 64, 2, step_tokens=np.array(tokens), source="test")


def test_a_rebatch_says_when_its_streams_share_a_request_and_prices_distinct_ones_apart():
    from expertcache_cli.planning.rebatch import rebatch, shared_note

    one = rebatch(_requests_trace(1, 40), 4)
    assert one.extra["shared"] == {"requests": 1, "streams": 4, "fewest": 1, "median": 1.0}
    assert "in 1 request(s)" in one.source
    note = shared_note(one)
    assert note.startswith("the trace holds 1 request(s), so the 4 re-batched streams are in "
                           "as few as 1 distinct requests")
    assert "record at least 4 requests" in note
    # all four streams in one request: two experts a step, as one user
    assert all(len(set(r[r >= 0].tolist())) == 2 for r in one.topk_ids[:, 0, :])

    many = rebatch(_requests_trace(8, 10), 4)  # streams 20 steps apart: 2 requests apart
    assert many.extra["shared"]["fewest"] == 4 and shared_note(many) is None
    # four users in four requests: eight distinct experts at every step
    assert all(len(set(r[r >= 0].tolist())) == 8 for r in many.topk_ids[:, 0, :])

    few = rebatch(_requests_trace(3, 10), 4)  # 30 steps, streams 7 apart: some share
    assert 1 < few.extra["shared"]["fewest"] < 4
    assert shared_note(few) is not None
    # no step_tokens: the recording did not mark its prefills, nothing to say
    unmarked = _requests_trace(1, 40)
    unmarked.step_tokens = None
    assert shared_note(rebatch(unmarked, 4)) is None


def _naive_rebatch_ids(trace: Trace, n: int) -> np.ndarray:
    """The streams side by side, every id of every stream: ``[T, L, n x W]`` (what a
    re-batch is, written the obvious way; `rebatch` keeps each step's distinct experts)."""
    single = np.asarray(trace.step_tokens) == 1
    dec = trace.topk_ids[single]
    t = dec.shape[0]
    return np.concatenate([np.roll(dec, -((i * t) // n), axis=0) for i in range(n)], axis=2)


@pytest.mark.parametrize("n", [1, 3, 7, 40, 1000])
def test_a_rebatch_counts_as_the_streams_side_by_side_in_bounded_memory(n):
    """Every count of every policy, mode and budget, and the reuse distances, equal those of
    the naive [T, L, n x W] array, while the trace stays [T, L, at most E] for any n (n past
    the trace's 30 decode steps included: those streams are copies)."""
    from expertcache_cli.planning.rebatch import rebatch
    from expertcache_cli.rules import engine
    from expertcache_cli.rules.policy import Policy, Wide
    from expertcache_cli.rules.replay import reuse_percentiles

    rng = np.random.default_rng(n)
    e, k, t = 24, 3, 31
    ids = np.stack([np.stack([rng.choice(e, k, replace=False) for _ in range(2)])
                    for _ in range(t)]).astype(np.int32)
    ids = np.concatenate([ids, np.full((t, 2, 2), -1, np.int32)], axis=2)  # padded columns
    ids[0, :, :] = rng.integers(0, e, (2, k + 2))  # a prefill: not re-batched
    base = Trace(ids, e, k, step_tokens=np.array([2] + [1] * (t - 1)), source="test")
    tr = rebatch(base, n)
    naive = _naive_rebatch_ids(base, n)
    assert tr.topk_ids.shape[:2] == naive.shape[:2] == (t - 1, 2)
    assert tr.topk_ids.shape[2] <= min(e, n * k)  # bounded by E, whatever n
    assert tr.ids_per_step == n * k and tr.tokens == n * (t - 1)
    for s in range(t - 1):
        for layer in range(2):
            got, want = tr.topk_ids[s, layer], naive[s, layer]
            assert sorted(got[got >= 0].tolist()) == sorted(set(want[want >= 0].tolist()))
    pols = [Policy.LRU, Policy.LFU, Policy.OPT]
    for wide in Wide:
        a = engine.sweep(tr.topk_ids, e, pols, [2, 5, 12], 2, widths=tr.gate_widths(), wide=wide)
        b = engine.sweep(naive, e, pols, [2, 5, 12], 2, widths=tr.gate_widths(), wide=wide)
        assert a == b
    assert reuse_percentiles(tr) == reuse_percentiles(Trace(naive, e, k))
    assert (n > t - 1) == ("copies" in tr.source)


def test_a_long_trace_rebatched_to_100000_streams_stays_the_size_of_its_experts():
    """`replay --batch 100000` on a 3000-step, 48-layer, top-8 trace: the streams side by side
    would be 3000 x 48 x 800,000 ids. Re-batched, the trace holds at most E=128 ids a layer-step."""
    from expertcache_cli.planning.rebatch import rebatch

    demo = load(Path(__file__).resolve().parent.parent / "traces" / "demo-qwen3-30b-a3b-tasks.npz")
    tr = rebatch(demo, 100_000)
    assert tr.topk_ids.shape[:2] == (3000, 48) and tr.topk_ids.shape[2] <= 128
    assert tr.topk_ids.nbytes <= 3000 * 48 * 128 * 4
    assert tr.ids_per_step == 800_000 and tr.extra["batch"] == 100_000
    # 100,000 streams start at only 3,000 distinct steps: every step routes what all do
    assert (np.sort(tr.topk_ids[0], axis=1) == np.sort(tr.topk_ids[-1], axis=1)).all()


def test_a_rebatch_to_more_streams_than_memory_holds_is_every_start_once():
    from expertcache_cli.planning.rebatch import rebatch

    tr = rebatch(_single_stream(), 10**12)  # never an array of 10**12 streams
    assert tr.extra["shared"]["streams"] == 10**12 and tr.tokens == 6 * 10**12
    assert tr.topk_ids.shape == (6, 2, 12)  # layer 0: all 12 of its experts at every step
    assert "999999999994 of them copies" in tr.source


def test_shared_requests_counts_streams_that_start_together_once():
    from expertcache_cli.planning.rebatch import shared_requests

    req = np.array([0] * 9 + [1] * 9)  # the decode steps of two requests
    many = shared_requests(req, [(i * 18) // 5000 for i in range(5000)], 5000)
    assert many["streams"] == 5000 and many["requests"] == 2
    assert many["fewest"] == many["median"] == 2  # the 18 distinct starts span both


def test_reuse_distance_counts_an_expert_once_a_layer_step():
    """Two tokens routing expert 1 in one step are one use of it, as `requests` counts."""
    from expertcache_cli.rules.replay import reuse_percentiles

    once = Trace(np.array([[[1, 2]], [[3, -1]], [[1, 3]]], np.int32), 4, 1)
    twice = Trace(np.array([[[1, 2, 1, 2]], [[3, -1, 3, -1]], [[1, 3, 1, 3]]], np.int32), 4, 2)
    # expert 1 re-used at step 2 after {3} (2 is older: at its own step), expert 3 after none
    assert reuse_percentiles(once, (50, 100)) == {"p50": 0.5, "p100": 1.0, "reuses": 2}
    assert reuse_percentiles(twice, (50, 100)) == reuse_percentiles(once, (50, 100))


def _steps(tokens: list[int], requests: list[int] | None = None) -> Trace:
    ids = np.zeros((len(tokens), 1, 2), np.int32)
    return Trace(ids, 4, 2, step_tokens=np.array(tokens),
                 requests=None if requests is None else np.array(requests)).validate()


def test_requests_start_at_prefills_or_where_the_recording_says():
    # derived: a prefill (a step wider than decode) opens a request, the first step too
    assert _steps([5, 1, 1, 7, 1, 1]).request_ids().tolist() == [0, 0, 0, 1, 1, 1]
    assert _steps([1, 1, 7, 1]).request_ids().tolist() == [0, 0, 1, 1]
    # recorded: decode-only requests that no prefill marks, renumbered in trace order
    tr = _steps([1, 1, 1, 1, 1], [3, 3, 8, 8, 9])
    assert tr.request_ids().tolist() == [0, 0, 1, 1, 2]
    assert tr.request_starts().tolist() == [0, 2, 4]
    assert Trace(np.zeros((2, 1, 2), np.int32), 4, 2).request_ids() is None  # cannot tell


def test_requests_must_be_one_non_negative_entry_a_step(tmp_path):
    from expertcache_cli.rules.trace import TraceError, load, save

    with pytest.raises(TraceError, match="one entry a step"):
        _steps([1, 1], [0])
    with pytest.raises(TraceError, match="non-negative"):
        _steps([1, 1], [0, -1])
    back = load(save(_steps([1, 1, 1], [0, 0, 1]), tmp_path / "r.npz"))
    assert back.requests.tolist() == [0, 0, 1]


def test_rebatch_counts_requests_the_recording_marks():
    from expertcache_cli.planning.rebatch import rebatch

    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(16, 2, replace=False) for _ in range(40)])[:, None, :]
    marked = Trace(ids.astype(np.int32), 16, 2, step_tokens=np.ones(40, np.int64),
                   requests=np.repeat(np.arange(4), 10))
    assert rebatch(marked, 4, 4).extra["shared"]["requests"] == 4
    unmarked = Trace(ids.astype(np.int32), 16, 2, step_tokens=np.ones(40, np.int64))
    assert rebatch(unmarked, 4, 4).extra["shared"]["requests"] == 1
