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
    given = capture.serving_release("0.31.2", installed=(0, 26))
    assert (given.version, given.known, given.name) == ((0, 31), True, "0.31")
    here = capture.serving_release(None, installed=(0, 28))
    assert (here.version, here.known, here.source) == ((0, 28), True, "installed here")
    newer = capture.serving_release(None, installed=(0, 99))  # released after the plugin
    assert newer.version == (0, 99) and not newer.known
    assert "outside the releases read (0.26-0.33)" in newer.source
    none = capture.serving_release(None, installed=None)
    assert none.version == capture.NEWEST_KNOWN and not none.known
    assert "newest known" in none.source and "--vllm-version" in none.source
    with pytest.raises(UserError, match="plugin runs on vLLM 0.26-0.33"):
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
