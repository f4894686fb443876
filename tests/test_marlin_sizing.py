"""Sizing the 4-bit formats as vLLM's Marlin experts hold them (read in vLLM 0.26.0 and
0.33.0): the exact bytes of one expert after Marlin's repack and padding, for the real
configs in tests/configs and the shapes of the formats bench's checkpoints, and the same
slot size the plugin arms (one rule for the packed side row)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plugin_standins import FakeTensor, RoutedExperts

from expertcache_cli.config import CacheConfig
from expertcache_cli.plugin.arming import ARM, plan_layer
from expertcache_cli.sizing import formats, model_size, sizing


@pytest.fixture(autouse=True)
def _marlin_armed(monkeypatch):
    """Marlin arming is opt-in (EXPERT_CACHE_MARLIN=1) for the formats not yet served from
    slots (MXFP4 is armed by default): these tests are about what it does for every format,
    asked for (the default is tested on its own)."""
    monkeypatch.setenv("EXPERT_CACHE_MARLIN", "1")


CONFIGS = Path(__file__).parent / "configs"
BENCH = Path(__file__).resolve().parents[1] / "bench"


def _qwen3(qc: dict | None) -> dict:
    d = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
    if qc is not None:
        d["quantization_config"] = qc
    return d


@pytest.fixture
def release(monkeypatch):
    """Pin the installed vLLM the layout is read for."""
    def pin(version):
        monkeypatch.setattr(model_size.installed_vllm, "version", lambda: version)
    return pin


# Qwen3-30B-A3B: hidden 2048, moe_intermediate 768, group 128: w13 is 2048 x 1536 at 4 bits
# (1,572,864 B), w2 768 x 2048 (786,432 B); bf16 scales 16 x 1536 and 6 x 2048
WEIGHTS = 2048 * 768 + 768 * 2048 // 2
SCALES = (16 * 1536 + 6 * 2048) * 2
INT32_ZEROS = (16 * 1536 // 8 + 6 * 2048 // 8) * 4  # repacked by vLLM: int32, 8 a word
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


@pytest.mark.parametrize("version, extra", [
    # 0.26 keeps the checkpoint's qzeros as loaded, in the model's dtype (bf16), unrepacked
    ((0, 26), (16 * 1536 // 8 + 6 * 2048 // 8) * 2),
    # 0.33 repacks them for Marlin as int32 (held though unread: symmetric)
    ((0, 33), INT32_ZEROS),
    (None, INT32_ZEROS),  # no vLLM here: the newest layout
])
def test_gptq_as_each_release_holds_it(release, version, extra):
    release(version)
    m = model_size.model_from_config(_qwen3(GPTQ), "q")
    assert m.quant == "w4a16"
    assert m.bytes_per_expert == WEIGHTS + SCALES + extra
    assert [t.name for t in m.expert_tensors][:4] == ["w13_qweight", "w2_qweight",
                                                    "w13_scales", "w2_scales"]
    assert m.aligned and m.bytes_per_slot == m.bytes_per_expert * 48


def test_gptq_act_order_adds_g_idx_and_sort_indices_on_0_26(release):
    release((0, 26))
    m = model_size.model_from_config(_qwen3(GPTQ | {"desc_act": True}), "q")
    # int32 g_idx and sort indices: [2048] for w13, [768] for w2; never padded
    act = 2 * (2048 + 768) * 4
    assert m.bytes_per_expert == WEIGHTS + SCALES + (16 * 1536 // 8 + 6 * 2048 // 8) * 2 + act
    assert {"w13_g_idx", "w13_g_idx_sort_indices", "w2_g_idx", "w2_g_idx_sort_indices"} <= {
        t.name for t in m.expert_tensors}


def test_awq_and_compressed_tensors_w4a16(release):
    release((0, 33))
    awq = model_size.model_from_config(_qwen3({"quant_method": "awq", "bits": 4,
                                               "group_size": 128, "zero_point": True}), "a")
    assert awq.bytes_per_expert == WEIGHTS + SCALES + INT32_ZEROS
    ct = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "group_size": 128,
        "strategy": "group"}}}}
    w4 = model_size.model_from_config(_qwen3(ct), "w")
    # symmetric, no act order: weights and scales only (weight_shape is read at load only)
    assert w4.bytes_per_expert == WEIGHTS + SCALES
    assert [t.name for t in w4.expert_tensors] == ["w13_weight_packed", "w2_weight_packed",
                                                   "w13_weight_scale", "w2_weight_scale"]


def test_a_misaligned_intermediate_is_padded_as_marlins_tiles_need(release):
    """GLM-style 1,408 is a multiple of 128: kept; 1,000 is padded to 1,024 (64 and the
    group of 128); NVFP4 pads to 64 where hidden % 128 == 0."""
    release((0, 33))
    assert formats.marlin_intermediate("w4a16", 4096, 1408) == 1408
    assert formats.marlin_intermediate("w4a16", 4096, 1000) == 1024
    assert formats.marlin_intermediate("w4a16", 4096, 1000, act_order=True) == 1000
    assert formats.marlin_intermediate("nvfp4", 2048, 1000) == 1024
    assert formats.marlin_intermediate("nvfp4", 2880, 1000) == 1024
    assert formats.marlin_intermediate("nvfp4", 2880, 1030) == 1152
    d = _qwen3({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128}}}})
    d["moe_intermediate_size"] = 1000
    m = model_size.model_from_config(d, "w")
    assert m.bytes_per_expert == 2048 * 1024 + 1024 * 2048 // 2 + (16 * 2048 + 8 * 2048) * 2
    assert any("intermediate 1000 -> 1024" in n for n in m.notes)


def test_nvfp4_weights_fp8_scales_and_the_4_byte_global_scales():
    m = model_size.model_from_config(_qwen3({"quant_method": "modelopt",
                                             "quant_algo": "NVFP4"}), "n")
    # e2m1 weights, an e4m3 scale per 16 inputs, a float32 global scale per expert and GEMM
    main = WEIGHTS + (2048 // 16 * 1536 + 768 // 16 * 2048)
    assert m.bytes_per_expert == main + 4 + 4
    assert [t.name for t in m.expert_tensors if not t.aligned] == ["w13_weight_scale_2",
                                                                   "w2_weight_scale_2"]
    # a slot: the aligned slabs, the 8 B the kernel reads and their 16 B packed row
    assert m.aligned and m.bytes_per_slot == (main + 8 + 16) * 48


def test_the_probe_gathers_nvfp4s_slabs_as_the_plugin_lays_them_out():
    """`probe-link --model` times the step the plugin runs: the 4-byte global scales travel
    in one packed side row, not as slabs the gather refuses."""
    m = model_size.model_from_config(_qwen3({"quant_method": "modelopt",
                                             "quant_algo": "NVFP4"}), "n")
    slabs = formats.gather_slabs(list(m.expert_tensors))
    assert all(n % formats.SLAB_ALIGN == 0 for _, n in slabs)
    assert slabs[-1] == (formats.SIDE_ROW, 16)
    assert [n for n, _ in slabs[:-1]] == [t.name for t in m.expert_tensors if t.aligned]
    # a format with no ragged tensor gathers its tensors as they are
    w = model_size.model_from_config(_qwen3({"quant_method": "awq", "bits": 4,
                                             "group_size": 128, "zero_point": True}), "w")
    assert formats.gather_slabs(list(w.expert_tensors)) == [
        (t.name, t.nbytes) for t in w.expert_tensors]


@pytest.mark.parametrize("config, layers, experts", [("gpt-oss-20b.json", 24, 32),
                                                     ("gpt-oss-120b.json", 36, 128)])
def test_gpt_oss_mxfp4_as_marlin_holds_it(config, layers, experts):
    m = model_size.load_model(CONFIGS / config, quant="mxfp4")
    # hidden 2880 -> 3072, intermediate 2880 -> 2944 (MXFP4 on Marlin); e8m0 scale per 32,
    # bf16 biases at the padded widths
    w13 = 3072 * 2944 + 3072 // 32 * 5888 + 5888 * 2
    w2 = 2944 * 3072 // 2 + 2944 // 32 * 3072 + 3072 * 2
    assert m.bytes_per_expert == w13 + w2 == 14_431_744
    assert m.bytes_per_slot == 14_431_744 * layers
    assert m.expert_bytes == 14_431_744 * layers * experts


#: what the plugin mirrored when it armed a 24-layer gpt-oss-shaped MXFP4 checkpoint on
#: Marlin in vLLM 0.26.0 on the H200 (its startup line; `bench/run_formats_on_device.sh`)
SERVED_MXFP4 = ("w13_weight[int32 192x11776], w13_weight_scale[float8_e8m0fnu 96x5888], "
                "w2_weight[int32 184x6144], w2_weight_scale[float8_e8m0fnu 92x3072], "
                "w13_bias[bfloat16 5888], w2_bias[bfloat16 3072]")


def test_the_bytes_sized_for_mxfp4_are_the_bytes_a_served_layer_held():
    import math
    import re
    width = {"int32": 4, "float8_e8m0fnu": 1, "bfloat16": 2}
    held = sum(width[d] * math.prod(int(n) for n in dims.split("x"))
               for d, dims in re.findall(r"\[(\w+) ([\dx]+)\]", SERVED_MXFP4))
    m = model_size.load_model(CONFIGS / "gpt-oss-120b.json", quant="mxfp4")
    assert held == m.bytes_per_expert == 14_431_744


def test_gpt_oss_120b_on_a_24_gib_card_is_a_cache_as_typed():
    """The issue's case: `size --model gpt-oss-120b.json --quant mxfp4 --vram 24` used to
    answer "runs only fully offloaded ... no cache"; Marlin is armed now."""
    p = sizing.plan(model_size.load_model(CONFIGS / "gpt-oss-120b.json", quant="mxfp4"), 24)
    assert p.verdict == "cache" and 30 <= p.slots <= 40
    assert p.offload_args == ["--moe-backend", "marlin"]


def _bench_writer():
    import importlib.util
    import sys

    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("write_checkpoint", BENCH /
                                                  "write_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("fmt, quant, want", [
    ("gptq", "w4a16", WEIGHTS + SCALES + INT32_ZEROS),
    ("awq", "w4a16", WEIGHTS + SCALES + INT32_ZEROS),
    ("w4a16", "w4a16", WEIGHTS + SCALES),
    ("nvfp4", "nvfp4", WEIGHTS + 2048 // 16 * 1536 + 768 // 16 * 2048 + 8),
])
def test_the_formats_bench_checkpoints_shapes(release, fmt, quant, want):
    """The formats bench writes the Qwen3-30B-A3B expert shape with these quantization
    configs (bench/write_checkpoint.py): sized as vLLM 0.33 holds them."""
    release((0, 33))
    w = _bench_writer()
    cfg = _qwen3(w.quantization_config(fmt, 24))
    m = model_size.model_from_config(cfg, fmt)
    assert (m.quant, m.bytes_per_expert) == (quant, want)


_TORCH_NAMES = {"int32": "int32", "bf16": "bfloat16", "fp32": "float32",
                "fp8_e4m3": "uint8", "e8m0": "uint8"}


@pytest.mark.parametrize("quant, scheme", [
    ("w4a16", formats.Wna16Scheme("gptq", act_order=True)),
    ("w4a16", formats.Wna16Scheme("awq", zero_points=True)),
    ("nvfp4", None), ("mxfp4", None)])
def test_size_and_the_plugin_count_a_slot_alike(quant, scheme):
    """One rule for a slot's bytes: what `size` plans per expert equals what the plugin arms
    for a layer holding those very tensors (the packed side row included)."""
    tensors = formats.marlin_expert_tensors(quant, 256, 128, scheme=scheme,
                                            bias=quant == "mxfp4", layout="0.26")
    params = {t.name: FakeTensor((128, *t.shape), _TORCH_NAMES[t.dtype], uva=True)
              for t in tensors}
    layer = RoutedExperts(extra_params=params)
    for name in ("w13_weight", "w2_weight"):  # the stand-in's own bf16 weights: out
        if name not in params:
            del layer._params[name]
    d = plan_layer(layer, CacheConfig(slots=8))
    assert d.action == ARM, d.reason
    assert d.bytes_per_slot == formats.slot_bytes(tensors)
    assert sorted(s.name for s in d.specs + d.small) == sorted(t.name for t in tensors)
