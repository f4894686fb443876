"""vLLM's CUDA-graph capture sizes and batch padding, as the sizing trap counts them.

The expected grids are worked by hand from `VllmConfig._set_cudagraph_sizes` in vLLM
0.26.0 (no uniform decode size) and 0.31.0-0.33.0 (max_num_seqs captured too).
"""

from __future__ import annotations

import pytest

from expertcache_cli.errors import UserError
from expertcache_cli.vllm_facts import capture

OLD = capture.settings_from_vllm_args([], version=(0, 26))
NEW = capture.settings_from_vllm_args([], version=(0, 33))


def test_default_grids_per_release():
    assert capture.capture_sizes(10, 2048, OLD) == [1, 2, 4, 8, 16]
    assert capture.capture_sizes(10, 2048, NEW) == [1, 2, 4, 8, 10, 16]
    assert capture.capture_sizes(3, 2048, OLD) == [1, 2, 4]
    big = capture.capture_sizes(300, 8192, OLD)
    assert big[:5] == [1, 2, 4, 8, 16] and big[-1] == 512 and 248 in big and 264 not in big
    assert 256 in big and 272 in big
    # max_num_batched_tokens caps the grid and is itself captured when it fits
    assert capture.capture_sizes(64, 20, OLD) == [1, 2, 4, 8, 16, 20]
    assert capture.settings_from_vllm_args([], version=(0, 30)).appends_max_num_seqs is False
    assert capture.settings_from_vllm_args([], version=(0, 31)).appends_max_num_seqs is True


def test_padding_and_the_safe_batch():
    assert capture.padded(10, [1, 2, 4, 8, 16]) == 16
    assert capture.padded(17, [1, 2, 4, 8, 16]) == 17  # past the largest graph: eager
    assert capture.padded_batch(10, 2048, OLD) == 16
    assert capture.safe_max_num_seqs(84, 8, 2048, OLD) == 8
    assert capture.safe_max_num_seqs(84, 8, 2048, NEW) == 10
    assert capture.safe_max_num_seqs(128, 8, 2048, OLD) == 16
    assert capture.safe_max_num_seqs(7, 8, 2048, OLD) == 0


@pytest.mark.parametrize("args, source", [
    (["--enforce-eager"], "--enforce-eager"),
    (["--enforce_eager"], "--enforce-eager"),
    (["--enforce-eager", "--port", "8000"], "--enforce-eager"),
    (["-O0"], "-O0"), (["-O", "0"], "-O0"), (["-O=0"], "-O0"),
    (["--optimization-level", "0"], "-O0"),
    (["--compilation-config", '{"cudagraph_mode": "NONE"}'], "cudagraph_mode NONE"),
    (["-cc", '{"cudagraph_mode": "NONE"}'], "cudagraph_mode NONE"),
    (["-cc.cudagraph_mode=NONE"], "cudagraph_mode NONE"),
    (["--compilation-config.cudagraph_mode=none"], "cudagraph_mode NONE"),
])
def test_eager_flags_pad_nothing(args, source):
    g = capture.settings_from_vllm_args(args, version=(0, 26))
    assert g.eager and g.source == source
    assert capture.capture_sizes(10, 2048, g) == [] and capture.padded_batch(10, 2048, g) == 10


@pytest.mark.parametrize("args, want", [
    (["--cudagraph-capture-sizes", "1", "2", "12", "--max-num-seqs", "8"], [1, 2, 12]),
    (["--cudagraph_capture_sizes=[1,12]"], [1, 12]),
    (["-cc", '{"cudagraph_capture_sizes": [4, 1, 4]}'], [1, 4]),
    (["--compilation-config={\"cudagraph_capture_sizes\": [3]}"], [3]),
    (["--max-cudagraph-capture-size", "8"], [1, 2, 4, 8]),
    (["-cc", '{"max_cudagraph_capture_size": 4}'], [1, 2, 4]),
    (["--performance-mode", "interactivity"], list(range(1, 21))),
    (["-O3"], [1, 2, 4, 8, 16]),
])
def test_explicit_graph_flags(args, want):
    g = capture.settings_from_vllm_args(args, version=(0, 26))
    assert not g.eager and capture.capture_sizes(10, 2048, g) == want


@pytest.mark.parametrize("args, words", [
    (["--compilation-config", "{nope"], "is not JSON"),
    (["-cc", "[1, 2]"], "must be a JSON object"),
    (["--cudagraph-capture-sizes", "a", "b"], "is not a list of batch sizes"),
    (["--cudagraph-capture-sizes", "0"], "needs positive batch sizes"),
    (["--max-cudagraph-capture-size", "x"], "is not an integer"),
])
def test_bad_graph_flags_are_one_clear_error(args, words):
    with pytest.raises(UserError, match=words):
        capture.settings_from_vllm_args(args, version=(0, 26))


def test_the_known_releases_are_the_plugins():
    """The capture rule's releases are exactly those the plugin's version check accepts."""
    from expertcache_cli.vllm_facts.releases import version_refusal

    (lo_major, lo), (hi_major, hi) = capture.OLDEST_KNOWN, capture.NEWEST_KNOWN
    assert version_refusal(f"{lo_major}.{lo}.0") is None
    assert version_refusal(f"{hi_major}.{hi}.9") is None
    assert version_refusal(f"{lo_major}.{lo - 1}.0") is not None
    assert version_refusal(f"{hi_major}.{hi + 1}.0") is not None


def test_the_release_a_batch_is_padded_for():
    from expertcache_cli.vllm_facts.releases import known_range

    given = capture.serving_release("0.31.2", installed=(0, 26))
    assert (given.version, given.known, given.name) == ((0, 31), True, "0.31")
    here = capture.serving_release(None, installed=(0, 28))
    assert (here.version, here.known, here.source) == ((0, 28), True, "installed here")
    newer = capture.serving_release(None, installed=(0, 99))  # released after the plugin
    assert newer.version == (0, 99) and not newer.known
    assert f"outside the releases read ({known_range()})" in newer.source
    none = capture.serving_release(None, installed=None)
    assert none.version == capture.NEWEST_KNOWN and not none.known
    assert "newest known" in none.source and "--vllm-version" in none.source
    with pytest.raises(UserError, match=f"plugin runs on vLLM {known_range()}"):
        capture.serving_release("0.25")
    with pytest.raises(UserError, match="wants a release like 0.31, got 'new'"):
        capture.serving_release("new")


def test_a_batch_below_max_num_seqs_pads_to_the_next_graph():
    """vLLM 0.31+ captures max_num_seqs itself: a full batch of 10 on a server of 10 runs
    unpadded, where 0.26-0.30 (and any release at vLLM's default 256) pad it to 16."""
    assert capture.batch_tokens(10, 10, 2048, NEW) == 10
    assert capture.batch_tokens(10, 10, 2048, OLD) == 16
    assert capture.batch_tokens(10, 256, 2048, NEW) == 16
    assert capture.batch_tokens(9, 10, 2048, NEW) == 10
    assert capture.batch_tokens(600, 1024, 8192, NEW) == 600  # past the largest graph: eager


GPT_OSS = ("GptOssForCausalLM",)


def test_gpt_oss_raises_the_ceiling_and_drops_the_appended_batch():
    """vLLM's gpt-oss config sets the ceiling to 1024 before the sizes are drawn: 83 graphs
    at 4096 batched tokens, and from 0.31 a batch of 10 is no longer captured as 10."""
    old, new = capture.for_model(OLD, GPT_OSS), capture.for_model(NEW, GPT_OSS)
    assert old.max_capture == new.max_capture == 1024
    assert "GptOssForCausalLM" in new.source
    assert len(capture.capture_sizes(4, 4096, old)) == 83
    assert capture.capture_sizes(4, 4096, OLD) == [1, 2, 4, 8]
    assert capture.padded_batch(10, 2048, NEW) == 10
    assert capture.padded_batch(10, 2048, new) == 16
    assert capture.safe_max_num_seqs(40, 4, 2048, NEW) == 10
    assert capture.safe_max_num_seqs(40, 4, 2048, new) == 8


@pytest.mark.parametrize("args", [["--max-cudagraph-capture-size", "8"],
                                  ["--cudagraph-capture-sizes", "1", "2", "4"],
                                  ["--enforce-eager"]])
def test_a_users_graph_flags_win_over_the_models_ceiling(args):
    g = capture.settings_from_vllm_args(args, version=(0, 33))
    assert capture.for_model(g, GPT_OSS) == g


def test_other_architectures_keep_vllms_defaults():
    assert capture.for_model(NEW, ("Qwen3MoeForCausalLM",)) == NEW
    assert capture.for_model(NEW, ()) == NEW


# vLLM 0.34: decode graphs keyed by request count. Line numbers are vLLM 0.34.0's; the
# numbers were checked against vLLM's own functions run on CPU (_set_cudagraph_sizes,
# _split_cudagraph_capture_sizes, the gpt-oss config, CudaGraphManager.dispatch).

V34 = capture.settings_from_vllm_args([], version=(0, 34))


def _v34(*args: str) -> capture.GraphSettings:
    return capture.settings_from_vllm_args(list(args), version=(0, 34))


def _rows(batches, max_num_seqs, batched, g, q=1):
    return [capture.decode_rows(b, max_num_seqs, batched, g, q) for b in batches]


def test_the_request_grid_from_034():
    assert V34.request_grid and V34.mode == "FULL_AND_PIECEWISE" and V34.appends_max_num_seqs
    assert not NEW.request_grid
    assert V34.source == "vLLM's defaults (0.34)"


def test_vllms_request_and_prefill_grids():
    # compilation.py:122-126: "every count up to 6, then ... 64 sizes at 1024"
    assert capture.decode_request_grid(10) == [1, 2, 3, 4, 5, 6, 8, 10]
    assert len(capture.decode_request_grid(1024)) == 64
    # compilation.py:89-99: "54 sizes at 8192"
    assert len(capture.prefill_token_grid(8192)) == 54


def test_default_decode_grid_is_the_shared_sizes_in_whole_requests():
    # vllm.py:2661-2671: decode sizes = min(cdiv(s, q), max_num_seqs) over the shared sizes
    assert capture.graph_grids(10, 2048, V34) == ([1, 2, 4, 8, 10, 16], [1, 2, 4, 8, 10], 10)
    assert _rows(range(1, 11), 10, 2048, V34) == [1, 2, 4, 4, 8, 8, 8, 8, 10, 10]


def test_gpt_oss_on_034_decodes_on_the_request_grid():
    """models/config.py:851-879: the 1024-token grid for prefill graphs only, decode graphs
    on the request grid up to 1024 // q requests: a full batch of 10 runs as 10 (0.33:
    16), and the safe batch at 40 slots and top-4 is 10 (0.33: 8)."""
    g = capture.for_model(V34, GPT_OSS)
    assert g.model_ceiling == 1024 and g.max_capture is None and "decode graphs" in g.source
    prefill, requests, limit = capture.graph_grids(10, 2048, g)
    assert len(prefill) == 83 and prefill[-1] == 1024
    assert requests == [1, 2, 3, 4, 5, 6, 8, 10] and limit == 10
    assert _rows(range(1, 11), 10, 2048, g) == [1, 2, 3, 4, 5, 6, 8, 8, 10, 10]
    assert capture.decode_rows(130, 256, 8192, g) == 144  # grid(256): ..., 128, 144
    assert capture.safe_max_num_seqs(40, 4, 2048, g) == 10
    assert capture.safe_max_num_seqs(40, 4, 2048, capture.for_model(NEW, GPT_OSS)) == 8


def test_without_a_decode_routine_decode_pads_on_the_prefill_sizes():
    # -O1 is PIECEWISE (vllm.py:318): no decode graphs (cudagraph_utils.py:306-312)
    g = capture.for_model(_v34("-O1"), GPT_OSS)
    assert g.mode == "PIECEWISE" and "-O1 (cudagraph_mode PIECEWISE)" in g.source
    assert capture.decode_rows(10, 10, 2048, g) == 16
    full = _v34("-cc", '{"cudagraph_mode": "FULL"}')
    assert full.mode == "FULL" and "cudagraph_mode FULL" in full.source
    assert capture.for_model(_v34("-O3"), GPT_OSS).mode == "FULL_AND_PIECEWISE"
    # before 0.34 the mode is kept but says nothing new: the source is the defaults'
    assert capture.settings_from_vllm_args(["-O1"], version=(0, 33)).source.startswith(
        "vLLM's defaults")


def test_speculative_decode_pads_whole_requests():
    """vllm.py:2409-2447 (q > 1: n x q sizes) and 2661-2671; dispatch takes the smallest
    decode graph of >= B requests (cudagraph_utils.py:575-595), q rows each: 5 requests x
    3 tokens run as 18 rows, where the token grid of 0.33's rule gives 16."""
    assert capture.graph_grids(10, 2048, V34, 3)[1] == [1, 2, 3, 4, 6, 8, 10]
    assert _rows((1, 5, 7, 10), 10, 2048, V34, 3) == [3, 18, 24, 30]
    assert capture.batch_tokens(5, 10, 2048, V34, query_len=3) == 18
    assert capture.batch_tokens(5, 10, 2048, NEW, query_len=3) == 16
    g = capture.for_model(V34, GPT_OSS)
    assert _rows((1, 5, 7, 9, 16), 16, 2048, g, 4) == [4, 20, 32, 40, 64]


def test_full_decode_only_has_no_token_graphs():
    # vllm.py:2711-2715 and cudagraph_utils.py:357-381: its mixed mode is NONE
    g = _v34("-cc.cudagraph_mode=full_decode_only")
    assert g.mode == "FULL_DECODE_ONLY"
    assert capture.decode_rows(600, 600, 8192, g) == 600  # past the 512 graphs: eager
    assert capture.decode_rows(512, 600, 8192, g) == 512


def test_034s_own_size_keys():
    # vllm.py:2614-2625, 2647-2654: 64 > max_num_seqs is dropped; past 7 requests the
    # token-keyed graphs serve
    g = _v34("-cc", '{"decode_cudagraph_capture_request_sizes": [1, 3, 7, 64]}')
    assert g.decode_sizes == (1, 3, 7, 64)
    assert "decode_cudagraph_capture_request_sizes" in g.source
    assert _rows((2, 4, 8, 10), 10, 2048, g) == [3, 7, 8, 10]
    # compilation.py:54-68: a 24-token decode budget holds 8 requests x 3
    g = _v34("-cc.max_decode_cudagraph_capture_tokens=24")
    assert g.max_decode_tokens == 24
    assert _rows((8, 9), 10, 2048, g, 3) == [24, 30]
    # a user's own sizes leave gpt-oss's grids alone (models/config.py:851-866)
    g = _v34("-cc", '{"max_decode_cudagraph_capture_requests": 4}')
    assert capture.for_model(g, GPT_OSS) == g
    assert capture.graph_grids(10, 2048, g)[1] == [1, 2, 3, 4]
    # 0.33 has no such keys: read from 0.34 only
    assert capture.settings_from_vllm_args(
        ["-cc.max_decode_cudagraph_capture_tokens=24"], version=(0, 33)).max_decode_tokens is None


@pytest.mark.parametrize("args, words", [
    (["--max-cudagraph-capture-size", "8", "-cc.prefill_cudagraph_capture_token_sizes=[1]"],
     "vLLM 0.34 refuses"),
    (["-cc.max_decode_cudagraph_capture_requests=x"], "is not an integer"),
    (["-cc", '{"decode_cudagraph_capture_request_sizes": [0, 2]}'], "needs positive"),
])
def test_bad_034_graph_flags_are_one_clear_error(args, words):
    with pytest.raises(UserError, match=words):
        _v34(*args)


def test_rows_from_vllms_resolved_config():
    # the fields the plugin reads in the worker: gpt-oss at S=10, T=2048 (decode graphs
    # on the request grid), and -O1 (the token grid only)
    assert capture.rows_from_resolved(9, 1, 10, [1, 2, 3, 4, 5, 6, 8, 10], [1], 1024, None,
                                      "FULL_AND_PIECEWISE") == 10
    assert capture.rows_from_resolved(9, 1, 10, [1, 2, 3, 4, 5, 6, 8, 10], [1, 2, 4, 8, 16],
                                      1024, None, "PIECEWISE") == 16
    assert capture.rows_from_resolved(9, 1, 10, [1, 2, 4, 8, 10], [1, 2], 16, None,
                                      "NONE") == 9
    # a decode token budget of 24 at q=3: graphs hold up to 8 requests
    assert capture.rows_from_resolved(9, 3, 10, [1, 2, 4, 8, 10], [30], 30, 24,
                                      "FULL_AND_PIECEWISE") == 30
    rows = capture.rows_for_sizes([1, 2, 8], 1)
    assert capture.safe_for_rows(32, 8, rows) == capture.safe_for_sizes(32, 8, [1, 2, 8]) == 2


def test_034_pads_one_token_steps_as_033_did():
    """On vLLM's defaults with one token a step, 0.34's request grid is 0.33's capture
    sizes in other words: every batch pads the same, and the graphs vLLM records (which
    the runtime's graph memory counts) are the same. The 0.26 rule still pads a full
    batch at least as wide, so `Server.safety_graphs` stays a bound."""
    for seqs in (1, 3, 8, 10, 33, 130, 256, 300, 600):
        for batched in (16, 100, 512, 2048, 8192):
            assert [capture.batch_tokens(b, seqs, batched, V34) for b in range(1, seqs + 1)] \
                == [capture.batch_tokens(b, seqs, batched, NEW) for b in range(1, seqs + 1)]
            assert capture.graph_sizes(seqs, batched, V34) == capture.capture_sizes(
                seqs, batched, NEW)
            for q in (1, 2, 4):
                assert capture.padded_batch(seqs, batched, OLD, q) >= capture.padded_batch(
                    seqs, batched, V34, q)


def test_graph_sizes_count_both_grids_from_034():
    # vllm.py:2681-2731: the recorded sizes are the decode graphs' n x q with the prefill
    # sizes; gpt-oss keeps 0.33's 83 sizes at 4096 batched tokens for prefill, and its
    # request grid adds a 3-request decode graph
    assert len(capture.graph_sizes(4, 4096, capture.for_model(NEW, GPT_OSS))) == 83
    oss = capture.graph_sizes(4, 4096, capture.for_model(V34, GPT_OSS))
    assert len(oss) == 84 and oss[:4] == [1, 2, 3, 4] and oss[-1] == 1024
    g = _v34("-cc.cudagraph_mode=FULL_DECODE_ONLY")
    assert capture.graph_sizes(10, 2048, g) == [1, 2, 4, 8, 10]
