"""The server a plan or a re-batched replay is for (`serving`): its --max-num-seqs, where
each number came from, and how its batches are padded per vLLM release."""

from __future__ import annotations

import pytest

from expertcache_cli.errors import UserError
from expertcache_cli.planning import serving
from expertcache_cli.vllm_facts import vllm_flags


def test_the_option_wins_over_the_flag_after_dashes():
    assert vllm_flags.with_flag(["--max-num-seqs", "64", "--port", "1"], "--max-num-seqs",
                                "8") == ["--port", "1", "--max-num-seqs", "8"]
    assert vllm_flags.with_flag(["--max-num-seqs=64"], "--max-num-seqs", "8") == [
        "--max-num-seqs", "8"]
    assert vllm_flags.with_flag(["-tp", "2"], "--tensor-parallel-size", "4") == [
        "--tensor-parallel-size", "4"]
    s = serving.server(["--max-num-seqs", "64"], max_num_seqs=8, installed=None)
    assert (s.max_num_seqs, s.seqs_given, s.vllm_args) == (8, True, ["--max-num-seqs", "8"])


def test_where_the_servers_batch_comes_from():
    given = serving.server(["--max-num-seqs", "32"], batch=10, installed=(0, 33))
    assert (given.max_num_seqs, given.seqs_source) == (32, "given")
    assert given.batch_tokens(10) == 16  # 10 is not a graph of a 32-sequence server
    users = serving.server([], batch=10, installed=(0, 33))
    assert users.max_num_seqs == 10 and not users.seqs_given and users.batch_tokens(10) == 10
    assert "the batch" in users.seqs_source
    default = serving.server([], installed=(0, 33))
    assert default.max_num_seqs == 256 and default.max_num_batched_tokens == 2048
    big = serving.server([], vram_gib=80, installed=(0, 33))
    assert (big.max_num_seqs, big.max_num_batched_tokens) == (1024, 8192)
    with pytest.raises(UserError, match="--batch 16 is more than --max-num-seqs 8"):
        serving.server(["--max-num-seqs", "8"], batch=16)
    with pytest.raises(UserError, match="--max-num-seqs must be positive"):
        serving.server([], max_num_seqs=0)


def test_a_batch_is_described_with_what_it_rests_on():
    s = serving.server([], batch=10, installed=None)
    line = s.describe_batch(10)
    assert line.startswith("a batch of 10 runs as 10 tokens a step (unpadded): "
                           "--max-num-seqs 10 (the batch")
    assert "vLLM 0.34 (none here: the newest known" in line
    old = serving.server([], batch=10, vllm_version="0.26")
    assert "runs as 16 tokens a step (padded to a CUDA graph)" in old.describe_batch(10)
    assert "vLLM 0.26 (given (--vllm-version))" in old.describe_batch(10)
    eager = serving.server(["--enforce-eager", "--max-num-seqs", "16"], batch=10)
    assert eager.batch_tokens(10) == 10 and "CUDA graphs: --enforce-eager" in (
        eager.describe_batch(10))
    assert eager.to_json(10)["batch_tokens"] == 10


def test_an_assumed_release_counts_the_batches_that_must_stay_on_the_cache_as_the_oldest():
    """85 slots, top-8: vLLM 0.31+ keep 10 sequences on the cache (10 is captured), 0.26-0.30
    only 8 (10 pads to 16). With no vLLM here the safe batch is the one that holds on both."""
    assumed = serving.server([], installed=None)
    assert assumed.safe_max_num_seqs(85, 8) == 8 and assumed.widest_ids(8, 10) == 128
    known = serving.server([], vllm_version="0.33")
    assert known.safe_max_num_seqs(85, 8) == 10 and known.widest_ids(8, 10) == 80
    assert serving.server([], installed=(0, 26)).safe_max_num_seqs(85, 8) == 8


def test_a_gpt_oss_server_pads_as_its_model_config_says():
    """gpt-oss's ceiling of 1024 reaches plan and replay through the model, the --model's
    or the preset the trace's recorded name starts with."""
    from expertcache_cli.sizing.model_size import load_model

    arch = serving.architectures_of(None, "gpt-oss-20b (MXFP4, transformers), top-4 of 32")
    assert arch == ("GptOssForCausalLM",)
    assert serving.architectures_of(load_model("gpt-oss-120b"), None) == arch
    assert serving.architectures_of(None, "a model no preset knows") == ()
    plain = serving.server([], batch=10, vllm_version="0.33", installed=None)
    oss = serving.server([], batch=10, vllm_version="0.33", installed=None, architectures=arch)
    assert plain.batch_tokens(10) == 10
    assert oss.batch_tokens(10) == 16
    assert "GptOssForCausalLM" in oss.describe_batch(10)
