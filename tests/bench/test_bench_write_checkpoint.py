"""The bench checkpoint writer's quantised layouts (bench/write_checkpoint.py), on the tiny
CPU shape: the tensor names, shapes and packing vLLM's loaders expect for each format."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the writer needs torch")
pytest.importorskip("safetensors", reason="the writer needs safetensors")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


@pytest.fixture()
def writer(monkeypatch):
    monkeypatch.setenv("EC_E2E_TINY", "1")
    for name in ("write_checkpoint", "e2e_vllm", "write_gpt_oss"):
        sys.modules.pop(name, None)
    import write_checkpoint

    return write_checkpoint


def _tensors(writer, fmt):
    return dict(writer.tensors(1, "cpu", fmt, vocab=64))


def test_pack_nibbles_puts_code_k_in_bits_4k(writer):
    codes = torch.arange(16, dtype=torch.int32).reshape(1, 16) % 16
    packed = writer.pack_nibbles(codes, 1)
    assert packed.shape == (1, 2)
    got = [(int(packed[0, 0]) >> (4 * k)) & 0xF for k in range(8)]
    assert got == list(range(8))
    awq = writer.pack_nibbles(codes, 1, writer.AWQ_PACK_ORDER)
    unpacked = [(int(awq[0, 0]) >> (4 * k)) & 0xF for k in range(8)]
    assert unpacked == list(writer.AWQ_PACK_ORDER)
    # vLLM unpacks AWQ with the inverse order [0, 4, 1, 5, 2, 6, 3, 7]
    assert [unpacked[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)] == list(range(8))


def test_gptq_layout(writer):
    shape = writer.shape
    t = _tensors(writer, "gptq")
    p = "model.layers.0.mlp.experts.0.gate_proj"
    h, inter = shape.HIDDEN, shape.MOE_INTER
    assert t[f"{p}.qweight"].shape == (h // 8, inter) and t[f"{p}.qweight"].dtype == torch.int32
    assert t[f"{p}.qzeros"].shape == (-(-h // 128), inter // 8)
    assert t[f"{p}.scales"].dtype == torch.float16
    assert t[f"{p}.g_idx"].tolist() == [i // 128 for i in range(h)]
    assert t["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16  # router unquantised
    assert writer.gptq_config()["desc_act"] is False


def test_gptq_with_act_order(writer):
    """desc_act: each g_idx assigns the input rows to full 128-row groups in a random order
    (vLLM 0.26 sorts them into Marlin's sort indices); the config says desc_act."""
    from expertcache_cli.sizing import formats

    shape = writer.shape
    t = _tensors(writer, "gptq-act")
    g_idx = t["model.layers.0.mlp.experts.0.gate_proj.g_idx"]
    h = shape.HIDDEN
    assert g_idx.dtype == torch.int32 and g_idx.shape == (h,)
    assert torch.bincount(g_idx.long()).tolist() == [128] * (h // 128)
    assert g_idx.tolist() != [i // 128 for i in range(h)]  # not in order
    cfg = writer.quantization_config("gptq-act", 1)
    assert cfg["desc_act"] is True and formats.wna16_scheme(
        {"quantization_config": cfg}).act_order


def test_awq_layout(writer):
    shape = writer.shape
    t = _tensors(writer, "awq")
    p = "model.layers.0.mlp.experts.0.down_proj"
    h, inter = shape.HIDDEN, shape.MOE_INTER
    assert t[f"{p}.qweight"].shape == (inter, h // 8)
    assert t[f"{p}.qzeros"].shape == (-(-inter // 128), h // 8)
    assert (int(t[f"{p}.qzeros"][0, 0]) & 0xF) == 8
    assert "mlp.gate" in writer.awq_config()["modules_to_not_convert"]


def test_nvfp4_layout(writer):
    shape = writer.shape
    t = _tensors(writer, "nvfp4")
    p = "model.layers.0.mlp.experts.0.up_proj"
    h, inter = shape.HIDDEN, shape.MOE_INTER
    assert t[f"{p}.weight"].shape == (inter, h // 2) and t[f"{p}.weight"].dtype == torch.uint8
    assert t[f"{p}.weight_scale"].shape == (inter, h // 16)
    assert t[f"{p}.weight_scale"].dtype == torch.float8_e4m3fn
    assert t[f"{p}.weight_scale_2"].shape == () and t[f"{p}.input_scale"].shape == ()
    cfg = writer.nvfp4_config()
    assert cfg["quant_algo"] == "NVFP4" and "lm_head" in cfg["ignore"]


@pytest.mark.parametrize("fmt, quant", [("gptq", "w4a16"), ("gptq-act", "w4a16"),
                                        ("awq", "w4a16"),
                                        ("nvfp4", "nvfp4"), ("w8a8", "w8a8")])
def test_sizing_reads_each_written_config(writer, tmp_path, fmt, quant):
    from expertcache_cli.sizing.formats import quant_from_config

    writer.write(tmp_path / fmt, 1, fmt, vocab=64)
    cfg = json.loads((tmp_path / fmt / "config.json").read_text())
    assert quant_from_config(cfg) == quant


def test_hot_routes_to_the_first_experts_only(writer):
    e, k = writer.shape.E, writer.shape.TOP_K
    hot = 8
    t = dict(writer.tensors(2, "cpu", "bf16", vocab=64, hot=hot))
    full = dict(writer.tensors(2, "cpu", "bf16", vocab=64))
    for i in range(2):
        gate = t[f"model.layers.{i}.mlp.gate.weight"]
        assert gate.shape[0] == e
        assert gate[hot:].abs().sum() == 0 and (gate[:hot].abs().sum(dim=1) > 0).all()
        # the hot rows are the same per-layer seeded rows as without --hot
        assert torch.equal(gate[:hot], full[f"model.layers.{i}.mlp.gate.weight"][:hot])
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(2000, writer.shape.HIDDEN, generator=gen)
    top = (h @ t["model.layers.0.mlp.gate.weight"].float().t()).topk(k, dim=1).indices
    # top-2 of 8 N(0, |h|^2) logits are both positive unless 7 of 8 are negative (3.5%)
    assert (top < hot).all(dim=1).float().mean() > 0.9


def test_mxfp4_is_gpt_oss_as_openai_ships_it(writer, tmp_path):
    import write_gpt_oss

    s = write_gpt_oss.shape()
    assert s == write_gpt_oss.TINY
    info = writer.write(tmp_path / "m", 2, "mxfp4", vocab=64, hot=4)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == ["GptOssForCausalLM"] and cfg["num_local_experts"] == 16
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert (tmp_path / "m" / "tokenizer.json").exists() and info["tensors"] > 0
    t = dict(write_gpt_oss.tensors(1, "cpu", 64, hot=4))
    p = "model.layers.0.mlp.experts"
    h, inter, e = s.hidden, s.inter, s.experts
    assert t[f"{p}.gate_up_proj_blocks"].shape == (e, 2 * inter, h // 32, 16)
    assert t[f"{p}.gate_up_proj_blocks"].dtype == torch.uint8
    assert t[f"{p}.gate_up_proj_scales"].shape == (e, 2 * inter, h // 32)
    assert int(t[f"{p}.gate_up_proj_scales"][0, 0, 0]) == 127 - 6  # e8m0 2^-6
    assert t[f"{p}.down_proj_blocks"].shape == (e, h, inter // 32, 16)
    assert t[f"{p}.down_proj_bias"].shape == (e, h)
    assert t["model.layers.0.self_attn.sinks"].shape == (s.heads,)
    assert t["model.layers.0.self_attn.q_proj.bias"].shape == (s.heads * s.head_dim,)
    assert t["model.layers.0.mlp.router.weight"][4:].abs().sum() == 0
    with pytest.raises(SystemExit, match="--hot 17: between 0"):
        writer.write(tmp_path / "x", 1, "mxfp4", vocab=64, hot=17)
    # gpt-oss-120b's expert count on the same shape (--experts)
    writer.write(tmp_path / "e", 1, "mxfp4", vocab=64, experts=24, hot=20)
    assert json.loads((tmp_path / "e" / "config.json").read_text())["num_local_experts"] == 24
    # and on the Qwen3 shape: a recording of a 64-expert model served as recorded
    writer.write(tmp_path / "q", 1, "gptq", vocab=64, experts=64, config_only=True)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["num_experts"] == 64
    gen = writer.tensors(1, "cpu", "bf16", 64, experts=64)
    gate = next(t for name, t in gen if name.endswith("mlp.gate.weight"))
    assert gate.shape[0] == 64  # the router picks among 64
    with pytest.raises(SystemExit, match="--experts 0: 1 or more"):
        writer.write(tmp_path / "y", 1, "gptq", vocab=64, experts=0)


def test_sizing_reads_the_gpt_oss_checkpoint_as_mxfp4(writer, tmp_path):
    from expertcache_cli.sizing import model_size

    writer.write(tmp_path / "m", 2, "mxfp4", vocab=64)
    m = model_size.load_model(str(tmp_path / "m"))
    assert m.quant == "mxfp4" and m.num_experts == 16 and m.top_k == 2
    import write_gpt_oss

    s = write_gpt_oss.shape()
    # per expert: gate_up and down blocks (half a byte a value), scales (a byte per 32
    # values), biases (bf16)
    values = 3 * s.hidden * s.inter
    assert m.bytes_per_expert == values // 2 + values // 32 + 2 * (2 * s.inter + s.hidden)


def test_top_k_sets_the_experts_a_token_and_nothing_else(writer, tmp_path):
    """--top-k K: a checkpoint routed at a recording's width (the trace hook replaces ids
    only where the widths agree); the default stays the shape's, and the weights are the
    same whatever the width."""
    from expertcache_cli.sizing import model_size

    k = writer.shape.TOP_K
    writer.write(tmp_path / "d", 1, "bf16", vocab=64)
    writer.write(tmp_path / "k", 1, "bf16", vocab=64, top_k=k + 1)
    cfg = json.loads((tmp_path / "k" / "config.json").read_text())
    assert cfg["num_experts_per_tok"] == k + 1
    assert json.loads((tmp_path / "d" / "config.json").read_text())["num_experts_per_tok"] == k
    assert model_size.load_model(str(tmp_path / "k")).top_k == k + 1
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "d" / "model-00001.safetensors"))
    b = load_file(str(tmp_path / "k" / "model-00001.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    # gpt-oss's shape too (its config says it twice)
    writer.write(tmp_path / "g", 1, "mxfp4", vocab=64, top_k=1, config_only=True)
    g = json.loads((tmp_path / "g" / "config.json").read_text())
    assert g["num_experts_per_tok"] == g["experts_per_token"] == 1
    with pytest.raises(SystemExit, match="--top-k 17: between 1 and the 16 experts"):
        writer.write(tmp_path / "x", 1, "bf16", vocab=64, top_k=17)


def test_a_top_k_no_router_can_pick_is_one_line_and_exit_2(tmp_path):
    import subprocess

    env = {**__import__("os").environ, "EC_E2E_TINY": "1", "PYTHONPATH": str(ROOT)}
    for bad in ("0", "17"):
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "write_checkpoint.py"),
                            str(tmp_path / "m"), "--layers", "1", "--top-k", bad],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 2 and r.stderr.strip() == (
            f"write_checkpoint: --top-k {bad}: between 1 and the 16 experts a layer")
        assert not (tmp_path / "m").exists()
