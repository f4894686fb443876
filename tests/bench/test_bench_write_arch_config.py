"""bench/write_arch_config.py: a real architecture's config cut to fewer layers keeps the
model's mix of layer kinds, and sizes as that architecture."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import write_arch_config as wac  # noqa: E402

from expertcache_cli.sizing import model_size  # noqa: E402


def test_llama4_keeps_a_nope_layer_every_fourth():
    m = model_size.model_from_config(wac.config("llama4-scout", 8), "scout-8")
    assert m.num_layers == 8 and m.moe_layers == list(range(8))
    assert (m.chunked_layers, m.attention_chunk) == (6, 8192)
    assert m.kv_bytes_per_token == 2 * 2 * 8 * 128 * 2  # the two NoPE layers


def test_qwen3_next_keeps_a_full_attention_layer_every_fourth():
    m = model_size.model_from_config(wac.config("qwen3-next", 8), "next-8")
    assert m.linear_state is not None
    assert (m.linear_state.layers, m.linear_state.full_layers) == (6, 2)
    assert (m.num_experts, m.top_k) == (512, 10)


@pytest.mark.parametrize("arch,layers", [("llama4-scout", 6), ("qwen3-next", 0),
                                         ("qwen3-next", 52), ("mixtral", 8)])
def test_a_cut_that_breaks_the_pattern_or_an_unknown_model_is_refused(arch, layers):
    with pytest.raises(SystemExit):
        wac.config(arch, layers)
