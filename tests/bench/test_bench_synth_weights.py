"""bench/synth_weights.py: under `--load-format dummy`, vLLM's dummy fill is followed by the
weights the bench's checkpoint writer draws, through the model's own load_weights; only
gpt-oss in MXFP4 is accepted; the hook says so in one line or says it did not run."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import synth_weights  # noqa: E402
import write_gpt_oss  # noqa: E402

GPT_OSS_120B = write_gpt_oss.config(
    write_gpt_oss.Shape(experts=128), layers=36, vocab=201088, context=131072)


class Model:
    """What vLLM's model offers the loader: load_weights over (name, tensor) pairs."""

    def __init__(self, order: list[str]) -> None:
        self.order, self.got = order, []

    def load_weights(self, pairs):
        self.order.append("model.load_weights")
        self.got = list(pairs)
        return {name for name, _ in self.got}


def _loader_class(order: list[str]) -> type:
    class DummyModelLoader:
        def load_weights(self, model, model_config):
            order.append("dummy fill")

    return DummyModelLoader


def _config(hf: dict) -> types.SimpleNamespace:
    return types.SimpleNamespace(hf_config=hf)


def test_the_dummy_fill_is_followed_by_the_drawn_weights_and_one_line(caplog):
    order: list[str] = []
    cls = _loader_class(order)
    drawn = []

    def pairs(hf, device):
        drawn.append((hf["num_hidden_layers"], device))
        return iter([("model.layers.0.mlp.experts.gate_up_proj_blocks", 1), ("lm_head.weight", 2)])

    assert synth_weights.patch_loader_class(cls, pairs, device=lambda: "cuda")
    assert synth_weights.patch_loader_class(cls, pairs, device=lambda: "cuda")  # once only
    model = Model(order)
    with caplog.at_level(logging.WARNING, logger="vllm.expertcache.bench"):
        cls().load_weights(model, _config(GPT_OSS_120B))
    assert order == ["dummy fill", "model.load_weights"]  # one fill, one load: not wrapped twice
    assert drawn == [(36, "cuda")] and len(model.got) == 2
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(synth_weights.DONE_LINE + ": 2 tensors of gpt_oss (36 layers x 128 "
                           "experts) loaded through the model's load_weights")


def test_a_loader_without_load_weights_is_not_patched_and_install_says_so(monkeypatch, caplog):
    assert not synth_weights.patch_loader_class(type("Other", (), {}))
    monkeypatch.delenv(synth_weights.ENV, raising=False)
    assert not synth_weights.install()  # not asked for: nothing arranged
    module = types.ModuleType(synth_weights.LOADER_MODULE)
    monkeypatch.setitem(sys.modules, synth_weights.LOADER_MODULE, module)
    monkeypatch.setenv(synth_weights.ENV, "1")
    with caplog.at_level(logging.ERROR, logger="vllm.expertcache.bench"):
        assert synth_weights.install()
    assert "weights NOT synthesized" in caplog.text
    order: list[str] = []
    module.DummyModelLoader = _loader_class(order)
    assert synth_weights.install()
    assert getattr(module.DummyModelLoader.load_weights, "_ec_synth", False)


def test_the_shape_is_read_from_the_served_config_and_only_gpt_oss_mxfp4_is_drawn():
    s = synth_weights.shape_of(GPT_OSS_120B)
    assert s == write_gpt_oss.Shape(experts=128)  # gpt-oss-120b: the 20b's shape, 128 experts
    obj = types.SimpleNamespace(**GPT_OSS_120B)  # vLLM hands a config object, not a dict
    assert synth_weights.shape_of(obj) == s
    # vLLM 0.26 renames the method in the config the loader sees
    renamed = dict(GPT_OSS_120B, quantization_config={"quant_method": "gpt_oss_mxfp4"})
    assert synth_weights.shape_of(renamed) == s
    with pytest.raises(RuntimeError, match="only gpt-oss in MXFP4"):
        synth_weights.shape_of({"model_type": "qwen3_moe", "quantization_config": None})
    with pytest.raises(RuntimeError, match="quant 'fp8'"):
        synth_weights.shape_of(dict(GPT_OSS_120B, quantization_config={"quant_method": "fp8"}))


def test_every_server_draws_the_same_weights_the_checkpoint_writer_would_write():
    """Greedy tokens compare across servers only if each draws the same weights: the pairs
    are the writer's own, seeded, for the served config's shape (tiny here, on the CPU)."""
    torch = pytest.importorskip("torch", reason="drawing weights needs torch")
    tiny = write_gpt_oss.TINY
    hf = write_gpt_oss.config(tiny, layers=2, vocab=64, context=256)
    a = dict(synth_weights.gpt_oss_pairs(hf, "cpu"))
    b = dict(write_gpt_oss.tensors(2, "cpu", 64, 0, tiny))
    assert a.keys() == b.keys()
    assert "model.layers.1.mlp.experts.gate_up_proj_blocks" in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    again = dict(synth_weights.gpt_oss_pairs(hf, "cpu"))
    assert all(torch.equal(a[k], again[k]) for k in a)


def test_the_flagships_model_directory_sizes_as_gpt_oss_120b_with_no_weights(tmp_path):
    """`write_checkpoint.py --config-only` (the flagship's model): config and tokenizer, no
    safetensors, and `size` reads it as gpt-oss-120b, Marlin's padded experts and all."""
    pytest.importorskip("tokenizers", reason="the bench tokenizer needs tokenizers")
    import write_checkpoint

    from expertcache_cli.sizing.model_size import load_model

    out = tmp_path / "gpt-oss-120b"
    info = write_checkpoint.write(out, 36, "mxfp4", 201088, context=131072, experts=128,
                                  config_only=True)
    assert info == {"bytes": 0, "shards": 0, "tensors": 0}
    assert not list(out.glob("*.safetensors")) and (out / "tokenizer.json").exists()
    m = load_model(out)
    assert (m.num_layers, m.num_experts, m.top_k) == (36, 128, 4)
    assert m.bytes_per_expert == 14431744  # as vLLM holds it after Marlin's padding
    config = json.loads((out / "config.json").read_text())
    assert synth_weights.shape_of(config) == write_gpt_oss.Shape(experts=128)
