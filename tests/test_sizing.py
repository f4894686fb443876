"""`expertcache size`: figures checked against hand arithmetic on real config.json files.

Every expected number below is worked out in the comment beside it from the config's
fields, not taken from the code under test. Where a model's published parameter count
is known, the bf16 total (2 bytes a parameter) is checked against it too: that catches a
forgotten norm or bias that a per-expert check would miss.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_moe import qwen3_moe_config

from expertcache_cli.errors import UserError
from expertcache_cli.sizing import cards, model_size, sizing
from expertcache_cli.sizing.presets import DEFAULT_PRESET, PRESETS
from expertcache_cli.vllm_facts import capture, vllm_flags

CONFIGS = Path(__file__).parent / "configs"
GiB = 1024**3


def cfg(name: str) -> Path:
    return CONFIGS / name


# ------------------------------------------------------------- the AMD original's model


def test_default_is_qwen3_30b_w8a8_and_its_expert_bytes():
    m = model_size.load_model()
    assert m.name == DEFAULT_PRESET and m.quant == "w8a8"
    assert (m.num_moe_layers, m.num_experts, m.top_k) == (48, 128, 8)
    # w13: 2*768 x 2048 int8 = 3,145,728 + 1536 fp32 scales = 6,144
    # w2 : 2048 x 768 int8 = 1,572,864 + 2048 fp32 scales = 8,192
    assert m.bytes_per_expert == 3_145_728 + 6_144 + 1_572_864 + 8_192 == 4_732_928
    assert m.bytes_per_slot == 4_732_928 * 48 == 227_180_544
    assert m.expert_bytes == 227_180_544 * 128 == 29_079_109_632
    # the AMD original: "~27 GB of experts (128 x ~212 MB)": its GB are GiB, 27.08 GiB / 128
    assert 27.0 < m.expert_bytes / GiB < 27.2
    assert 0.21 < m.bytes_per_slot / GiB < 0.213
    # non-expert: embed + lm_head bf16 2*151936*2048*2 = 1,244,659,712
    # per layer: q int8 4096*2048 + 4096*4, k/v 512*2048 + 512*4 each, o 2048*4096 + 2048*4
    #   = 18,903,040; q/k norm 2*128*2 = 512; 2 norms 8,192; router 128*2048*2 = 524,288
    #   = 19,436,032 x 48 = 932,929,536; final norm 4,096
    assert m.non_expert_bytes == 1_244_659_712 + 932_929_536 + 4_096 == 2_177_593_344
    # its "~3 GB else" is the bf16-attention figure; W8A8 attention makes it ~2 GiB
    assert 1.9 < m.non_expert_bytes / GiB < 3.1
    # KV: 48 layers x 2 (K,V) x 4 heads x 128 x 2 B
    assert m.kv_bytes_per_token == 48 * 2 * 4 * 128 * 2 == 98_304
    assert m.aligned


def test_seed_table_24_gib_gets_80_to_90_slots_with_a_short_context():
    p = sizing.plan(None, 24, max_model_len=4096)
    # 24 GiB x 0.9 = 21.6 GiB - 2.03 non-expert - 0.375 KV - ~0.99 runtime = 18.2 GiB
    # 18.2 GiB / 0.2116 GiB a slot = 86
    assert p.verdict == "cache" and 80 <= p.slots <= 90
    assert not p.fits_outright
    # every MoE layer's experts go to the host: ceil(27.08 + 0.5) = 28 GiB
    assert p.cpu_offload_gb == 28
    assert p.vllm_args()[-4:] == ["--cpu-offload-gb", "28", "--cpu-offload-params", "experts"]


def test_seed_table_long_context_costs_slots_and_says_so():
    p = sizing.plan(None, 24)  # vLLM default: the model's 40960 tokens
    assert p.max_model_len == 40960
    assert p.kv_reserved_bytes == 40960 * 98_304
    short = sizing.plan(None, 24, max_model_len=8192)
    assert p.slots < short.slots
    assert any("--max-model-len 8192" in n and str(short.slots) in n for n in p.notes)


def test_seed_table_40_gib_fits_outright():
    p = sizing.plan(None, 40)
    assert p.fits_outright and p.verdict == "fits_outright"
    assert p.slots == 128 and p.cpu_offload_gb == 0
    assert "--cpu-offload-gb" not in p.vllm_args()


def test_seed_table_32_gib_fits_outright_once_utilisation_allows():
    # weights 29.11 GiB + 0.82 runtime (8 sequences: graphs, sampler, workspaces) + 0.375 KV
    # = 30.31 GiB: more than 32 x 0.90 = 28.8, less than 32 x 0.95 = 30.4. The AMD
    # original's "fits outright" holds at 0.95, and the tool says so instead of pretending
    # 0.9 is enough.
    at_default = sizing.plan(None, 32, max_model_len=4096, max_num_seqs=8)
    assert at_default.verdict == "cache" and at_default.slots < 128
    assert at_default.utilization_to_fit_outright == 0.95
    assert "0.95" in at_default.verdict_text
    assert sizing.plan(None, 32, max_model_len=4096, max_num_seqs=8,
                       gpu_memory_utilization=0.95).fits_outright


# --------------------------------------------------------------------------- real configs


def test_qwen3_30b_bf16_total_is_its_published_parameter_count():
    m = model_size.load_model(cfg("qwen3-30b-a3b.json"))
    assert m.quant == "bf16"  # the config says bfloat16 and no quantization
    assert m.bytes_per_expert == 3 * 2048 * 768 * 2 == 9_437_184
    assert m.total_bytes == 2 * 30_532_122_624  # Qwen3-30B-A3B: 30.53 B parameters


def test_qwen3_30b_config_with_quant_w8a8_equals_the_default_preset():
    a = model_size.load_model(cfg("qwen3-30b-a3b.json"), quant="w8a8")
    b = model_size.load_model(DEFAULT_PRESET)
    assert (a.bytes_per_expert, a.non_expert_bytes, a.kv_bytes_per_token) == (
        b.bytes_per_expert, b.non_expert_bytes, b.kv_bytes_per_token)


def test_qwen3_235b():
    m = model_size.load_model(cfg("qwen3-235b-a22b.json"))
    assert (m.num_moe_layers, m.num_experts, m.top_k) == (94, 128, 8)
    assert m.bytes_per_expert == 3 * 4096 * 1536 * 2 == 37_748_736
    assert m.kv_bytes_per_token == 94 * 2 * 4 * 128 * 2 == 192_512
    assert m.total_bytes == 2 * 235_093_634_560  # 235.09 B parameters


def test_mixtral_8x7b():
    m = model_size.load_model(cfg("mixtral-8x7b.json"))
    assert (m.num_moe_layers, m.num_experts, m.top_k) == (32, 8, 2)
    assert m.bytes_per_expert == 3 * 4096 * 14336 * 2 == 352_321_536
    # embed + lm_head 2*32000*4096*2 = 524,288,000; per layer attention
    # (4096+1024+1024+4096)*4096*2 = 83,886,080 + norms 16,384 + router 8*4096*2 = 65,536
    assert m.non_expert_bytes == 524_288_000 + 32 * (83_886_080 + 16_384 + 65_536) + 8_192
    assert m.total_bytes == 2 * 46_702_792_704  # Mixtral-8x7B: 46.70 B parameters
    assert m.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2


def test_olmoe_qk_norms_over_the_whole_projection():
    m = model_size.load_model(cfg("olmoe-1b-7b-0125-instruct.json"))
    assert (m.num_moe_layers, m.num_experts, m.top_k) == (16, 64, 8)
    assert m.bytes_per_expert == 3 * 2048 * 1024 * 2
    assert m.total_bytes == 2 * 6_919_161_856  # OLMoE-1B-7B: 6.92 B parameters


def test_deepseek_v2_lite_mla_shared_experts_and_dense_first_layer():
    m = model_size.load_model(cfg("deepseek-v2-lite.json"))
    # first_k_dense_replace = 1: layer 0 is a dense MLP, layers 1..26 are MoE
    assert m.moe_layers == list(range(1, 27))
    assert (m.num_experts, m.top_k) == (64, 6)
    assert m.bytes_per_expert == 3 * 2048 * 1408 * 2 == 17_301_504
    # MLA caches the 512-wide latent plus the 64-wide rope key, once per layer
    assert m.kv_bytes_per_token == 27 * (512 + 64) * 2 == 31_104
    # the checkpoint report lists 15,706,484,224 parameters (shared experts are non-expert)
    assert m.total_bytes == 2 * 15_706_484_224


def test_gpt_oss_20b_mxfp4_with_biases_and_sliding_windows(monkeypatch):
    monkeypatch.setenv("EXPERT_CACHE_MARLIN", "1")  # the plan where Marlin is armed
    m = model_size.load_model(cfg("gpt-oss-20b.json"))
    assert m.quant == "mxfp4"  # from its quantization_config
    assert (m.num_moe_layers, m.num_experts, m.top_k) == (24, 32, 4)
    # offloaded, they run on Marlin (serve passes --moe-backend marlin), which vLLM creates
    # padded (hidden 2880 -> 3072, intermediate 2880 -> 2944) and holds so in host memory
    # and in a slot: w13 5888x3072 at 4 bits + e8m0 scale per 32 + bf16 bias, w2 3072x2944
    w13 = 2 * 2944 * 3072 // 2 + 2 * 2944 * 3072 // 32 + 2 * 2944 * 2
    w2 = 3072 * 2944 // 2 + 3072 * 2944 // 32 + 3072 * 2
    assert m.bytes_per_expert == w13 + w2 == 14_431_744  # the checkpoint's is 13,236,480
    assert m.bytes_per_slot == 14_431_744 * 24
    assert m.expert_bytes == 14_431_744 * 24 * 32
    assert any("Marlin kernel, which pads them" in n and "not 13.24" in n for n in m.notes)
    p = sizing.plan(m, 12, max_model_len=8192)
    # vLLM's Marlin experts are armed: a cache, and --cpu-offload-gb covers the padded bytes
    # (at its whole 131,072-token context the KV leaves 12 GiB no room for 4 slots)
    assert p.verdict == "cache" and p.slots >= m.top_k
    assert p.cpu_offload_gb >= m.expert_bytes / 2**30
    # 12 full-attention layers hold every token; 12 sliding ones only 128 tokens
    assert m.kv_bytes_per_token == 12 * 2 * 8 * 64 * 2 == 24_576
    assert m.kv_window_bytes_per_seq == 12 * 128 * 2 * 8 * 64 * 2
    assert m.aligned


def test_gpt_oss_120b_needs_quant_from_the_user_and_matches_the_preset():
    plain = model_size.load_model(cfg("gpt-oss-120b.json"))
    assert plain.quant == "bf16"  # this copy carries no quantization_config
    m = model_size.load_model(cfg("gpt-oss-120b.json"), quant="mxfp4")
    assert (m.num_moe_layers, m.num_experts, m.top_k) == (36, 128, 4)
    assert m.bytes_per_expert == 14_431_744  # Marlin's padded expert, as for the 20b
    assert m.expert_bytes == 14_431_744 * 36 * 128
    p = model_size.load_model("gpt-oss-120b")
    assert (p.bytes_per_expert, p.non_expert_bytes) == (m.bytes_per_expert, m.non_expert_bytes)


@pytest.mark.parametrize(
    "preset,config,quant",
    [
        ("qwen3-30b-a3b", "qwen3-30b-a3b.json", None),
        ("qwen3-30b-a3b-fp8", "qwen3-30b-a3b.json", "fp8-block"),
        ("qwen3-235b-a22b", "qwen3-235b-a22b.json", None),
        ("mixtral-8x7b", "mixtral-8x7b.json", None),
        ("mixtral-8x22b", "mixtral-8x22b.json", None),
        ("deepseek-v2-lite", "deepseek-v2-lite.json", None),
        ("olmoe-1b-7b", "olmoe-1b-7b-0125-instruct.json", None),
        ("gpt-oss-20b", "gpt-oss-20b.json", None),
    ],
)
def test_presets_agree_with_the_real_configs(preset, config, quant):
    a = model_size.load_model(preset)
    b = model_size.load_model(cfg(config), quant=quant)
    assert a.to_json() | {"model": "", "source": ""} == b.to_json() | {"model": "", "source": ""}


def test_every_preset_is_sized_and_aligned():
    for name in PRESETS:
        m = model_size.load_model(name)
        assert m.bytes_per_expert > 0 and m.non_expert_bytes > 0, name
        assert m.aligned, name


def test_fp8_block_scales():
    m = model_size.load_model("qwen3-30b-a3b-fp8")
    # w13 1536x2048 fp8 + ceil(1536/128)*ceil(2048/128)=12*16 fp32 scales; w2 16*6 scales
    assert m.bytes_per_expert == 1536 * 2048 + 12 * 16 * 4 + 2048 * 768 + 16 * 6 * 4


# --------------------------------------------------------------------------- quantisation


def _with_quant(base: str, qc: dict) -> dict:
    d = json.loads(cfg(base).read_text())
    d["quantization_config"] = qc
    return d


def test_quant_read_from_compressed_tensors_and_fp8_configs():
    ct_int8 = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}}}
    m = model_size.model_from_config(_with_quant("qwen3-30b-a3b.json", ct_int8), "x")
    assert m.quant == "w8a8" and m.bytes_per_expert == 4_732_928
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    m8 = model_size.model_from_config(_with_quant("qwen3-30b-a3b.json", fp8), "x")
    assert m8.quant == "fp8-block"
    w4 = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    m4 = model_size.model_from_config(_with_quant("qwen3-30b-a3b.json", w4), "x")
    # int4 packs 2 a byte; one bf16 scale per 128 inputs: w13 1536*16*2, w2 2048*6*2; and
    # the zero points vLLM keeps (the exact layouts: tests/test_marlin_sizing.py)
    assert m4.quant == "w4a16"
    assert m4.bytes_per_expert > (1536 * 2048 + 2048 * 768) // 2 + 1536 * 16 * 2 + 2048 * 6 * 2


def test_unknown_quant_method_is_a_user_error_naming_it():
    d = _with_quant("qwen3-30b-a3b.json", {"quant_method": "bitsandbytes"})
    with pytest.raises(UserError, match="bitsandbytes"):
        model_size.model_from_config(d, "x")
    # ...and --quant gets past it
    assert model_size.model_from_config(d, "x", quant="w4a16").quant == "w4a16"


def test_bad_inputs_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="unknown model"):
        model_size.load_model("no-such-model")
    with pytest.raises(UserError, match="--quant"):
        model_size.load_model(None, quant="int3")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        model_size.load_model(bad)
    dense = tmp_path / "dense.json"
    dense.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 10}))
    with pytest.raises(UserError, match="not a mixture-of-experts"):
        model_size.load_model(dense)
    with pytest.raises(UserError, match="--vram"):
        sizing.plan(None, -1)
    with pytest.raises(UserError, match="not both"):
        sizing.plan(None, 24, slots=10, fraction=0.5)
    with pytest.raises(UserError, match="--slots"):
        sizing.plan(None, 24, slots=500)


# --------------------------------------------------------------------------- plans


def test_trap_flagged_and_safe_max_num_seqs():
    old = capture.settings_from_vllm_args([], version=(0, 26))
    p = sizing.plan(None, 24, max_model_len=4096, max_num_seqs=4, graphs=old)
    assert p.trap_ids == 32 and not p.trap  # 4 x 8 = 32 ids <= 86 slots
    q = sizing.plan(None, 24, max_model_len=4096, max_num_seqs=16, graphs=old)
    assert q.trap and q.trap_ids == 128 and 64 < q.slots < 128
    # 10 seqs x 8 = 80 ids would fit, but vLLM 0.26 pads a batch of 10 to its 16 graph
    assert q.safe_max_num_seqs == 8
    assert any(n.startswith("sizing trap") for n in q.notes)


def test_the_trap_counts_the_batch_vllm_pads_to_a_cuda_graph():
    """84 slots, top-8: 10 sequences pad to 16 in 0.26 (128 ids > 84), not in
    0.31+ (which captures max_num_seqs itself) and not when vLLM runs eagerly."""
    model = model_size.load_model(None)
    kw = dict(max_model_len=8192, max_num_seqs=10, slots=84)
    old = sizing.plan(model, 24, graphs=capture.settings_from_vllm_args([], (0, 26)), **kw)
    assert old.padded_batch == 16 and old.trap and old.trap_ids == 128
    assert old.safe_max_num_seqs == 8
    note = next(n for n in old.notes if n.startswith("sizing trap"))
    assert "runs as 16 (CUDA-graph padding" in note and "--max-num-seqs 8" in note
    new = sizing.plan(model, 24, graphs=capture.settings_from_vllm_args([], (0, 33)), **kw)
    assert new.padded_batch == 10 and not new.trap and new.safe_max_num_seqs == 10
    eager = sizing.plan(model, 24, **kw, **vllm_flags.plan_kwargs_from_vllm_args(
        ["--enforce-eager"]))
    assert eager.padded_batch == 10 and not eager.trap and eager.graphs == "--enforce-eager"
    explicit = sizing.plan(model, 24, **kw, **vllm_flags.plan_kwargs_from_vllm_args(
        ["--cudagraph-capture-sizes", "1", "2", "12"]))
    assert explicit.padded_batch == 12 and explicit.trap  # 96 ids > 84
    assert explicit.safe_max_num_seqs == 2  # 3..10 pad to 12


def test_a_gpu_bigger_than_the_card_gets_the_cards_share():
    """An emulated 24 GiB card on the H200 (139.8 GiB as torch reports it): vLLM's
    utilization is a fraction of the GPU, so 0.9 x 24 GiB becomes 0.1545 of it; the plan
    itself is the 24 GiB card's."""
    card = sizing.plan(None, 24, max_model_len=8192, max_num_seqs=8)
    share = sizing.plan(None, 24, max_model_len=8192, max_num_seqs=8, device_total_gib=139.8)
    assert share.slots == card.slots and share.budget_bytes == card.budget_bytes
    assert share.gpu_memory_utilization == 0.1545  # floor(0.9 x 24 / 139.8, 4 places)
    assert share.gpu_memory_utilization * 139.8 <= 0.9 * 24
    args = share.vllm_args()
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.1545"
    assert args[args.index("--max-num-batched-tokens") + 1] == "2048"  # the card's default
    assert "--max-num-batched-tokens" not in card.vllm_args()
    assert any("share of a 139.80 GiB GPU" in n for n in share.notes)
    # (on the H200, 0.22 of it would hold every expert: that is not a 24 GiB card)
    assert share.utilization_to_fit_outright is None and "fits outright" not in share.verdict_text
    roomy = sizing.plan(None, 40, max_model_len=8192, max_num_seqs=8, device_total_gib=139.8,
                        gpu_memory_utilization=0.2)
    assert roomy.verdict == "cache" and roomy.utilization_to_fit_outright is not None
    assert 0.2 < roomy.utilization_to_fit_outright <= 0.99 * 40 / 139.8
    # a utilization the user gives is vLLM's: of the GPU
    given = sizing.plan(None, 24, max_model_len=8192, max_num_seqs=8,
                        gpu_memory_utilization=0.1, device_total_gib=139.8)
    assert given.budget_bytes == int(139.8 * 0.1 * sizing.GiB)
    with pytest.raises(UserError, match="more than --vram 24"):
        sizing.plan(None, 24, gpu_memory_utilization=0.9, device_total_gib=139.8)
    small = sizing.plan(None, 24, max_model_len=8192, max_num_seqs=8, device_total_gib=16)
    assert small.vram_gib == 16 and any("less than --vram 24" in n for n in small.notes)


def test_forced_slots_and_fraction():
    p = sizing.plan(None, 24, max_model_len=4096, slots=64)
    assert p.slots == 64 and p.verdict == "cache"
    assert sizing.plan(None, 24, max_model_len=4096, fraction=0.25).slots == 32
    over = sizing.plan(None, 24, max_model_len=4096, slots=120)
    assert over.verdict == "does_not_fit" and "at most" in over.verdict_text


def test_a_fraction_counts_the_same_slots_in_size_and_in_the_plugin():
    from expertcache_cli.config import CacheConfig

    f = 20.5 / 128  # exactly half a slot: rounded up by both (round() would give 20)
    assert sizing.plan(None, 24, max_model_len=4096, fraction=f).slots == 21
    assert CacheConfig(fraction=f).slots_for(128) == 21


def test_small_cards_offload_without_cache_or_do_not_fit():
    # 4 GiB x 0.9 = 3.6 GiB - 2.03 - 0.375 - 0.82 (8 sequences) = 0.37 GiB: one slot,
    # fewer than top_k
    p = sizing.plan(None, 4, max_model_len=4096, max_num_seqs=8)
    assert p.verdict == "offload_no_cache" and p.slots == 0 and p.cpu_offload_gb == 28
    # vLLM's default 256 sequences: their graphs and sampler alone take 2 GiB more
    assert sizing.plan(None, 4, max_model_len=4096).verdict == "does_not_fit"
    q = sizing.plan(None, 2, max_model_len=4096, max_num_seqs=8)
    assert q.verdict == "does_not_fit" and not q.fits_outright


def test_fp8_kv_halves_the_reserve_and_overhead_override():
    a = sizing.plan(None, 24, max_model_len=4096, overhead_gb=1.0)
    b = sizing.plan(None, 24, max_model_len=4096, overhead_gb=1.0, kv_cache_dtype="fp8")
    assert a.overhead_bytes == GiB
    assert b.kv_reserved_bytes * 2 == a.kv_reserved_bytes
    assert b.slots >= a.slots


def test_big_cards_use_vllm_big_card_defaults():
    # (the batch vLLM would run: planned with the trap, where none is chosen)
    assert sizing.plan("qwen3-235b-a22b", 141, wide="staged-install").max_num_seqs == 1024
    assert sizing.plan("qwen3-235b-a22b", 24, wide="staged-install").max_num_seqs == 256


def test_plan_json_has_the_documented_keys():
    d = sizing.plan(None, 24, max_model_len=4096).to_json()
    for k in ("model", "num_experts", "top_k", "slots", "fits_outright", "cpu_offload_gb",
              "bytes_per_slot", "non_expert_bytes", "trap", "verdict", "vllm_args"):
        assert k in d, k
    json.dumps(d)


# --------------------------------------------------------------------------- checkpoints


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A real safetensors file (zero-filled) with these tensors."""
    size = {"BF16": 2, "F32": 4, "I8": 1, "U8": 1}
    header, off = {}, 0
    for name, (dt, shape) in tensors.items():
        n = size[dt]
        for d in shape:
            n *= d
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(off))


def test_checkpoint_directory_uses_safetensors_bytes(tmp_path):
    conf = qwen3_moe_config(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, vocab_size=100, max_position_embeddings=256)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    t: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("BF16", [100, 64])}
    for layer in range(2):
        for e in range(4):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            t[p + "gate_proj.weight"] = ("I8", [32, 64])
            t[p + "gate_proj.weight_scale"] = ("F32", [32, 1])
            t[p + "up_proj.weight"] = ("I8", [32, 64])
            t[p + "up_proj.weight_scale"] = ("F32", [32, 1])
            t[p + "down_proj.weight"] = ("I8", [64, 32])
            t[p + "down_proj.weight_scale"] = ("F32", [64, 1])
        t[f"model.layers.{layer}.mlp.gate.weight"] = ("BF16", [4, 64])
        t[f"model.layers.{layer}.mlp.shared_experts.up_proj.weight"] = ("BF16", [8, 64])
    t["model.layers.2.mlp.experts.0.up_proj.weight"] = ("I8", [32, 64])  # past num_hidden_layers
    _write_safetensors(tmp_path / "model-00001-of-00002.safetensors", dict(list(t.items())[:20]))
    _write_safetensors(tmp_path / "model-00002-of-00002.safetensors", dict(list(t.items())[20:]))
    m = model_size.load_model(tmp_path)
    assert m.source == "checkpoint"
    # per expert: 3 x 32x64 int8 = 6,144 + scales (32+32+64) x 4 = 512
    assert m.bytes_per_expert == 6_144 + 512
    assert m.moe_layers == [0, 1]
    # non-expert: embeddings 12,800 + per layer router 512 + shared expert 1,024
    assert m.non_expert_bytes == 100 * 64 * 2 + 2 * (4 * 64 * 2 + 8 * 64 * 2)
    assert any("past num_hidden_layers" in n for n in m.notes)


def test_w8a8_checkpoint_with_bf16_scales_is_sized_as_vllm_holds_it(tmp_path):
    """llm-compressor stores W8A8 scales in bf16; vLLM holds them as fp32 [out, 1], and a
    slot holds what vLLM holds: the slot is sized at vLLM's bytes, with a note."""
    conf = qwen3_moe_config(
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, vocab_size=100,
        quantization_config={"quant_method": "compressed-tensors", "config_groups": {
            "g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}})
    (tmp_path / "config.json").write_text(json.dumps(conf))
    t: dict[str, tuple[str, list[int]]] = {}
    for e in range(4):
        p = f"model.layers.0.mlp.experts.{e}."
        for proj, shape in (("gate_proj", [32, 64]), ("up_proj", [32, 64]),
                            ("down_proj", [64, 32])):
            t[p + proj + ".weight"] = ("I8", shape)
            t[p + proj + ".weight_scale"] = ("BF16", [shape[0], 1])
    _write_safetensors(tmp_path / "model.safetensors", t)
    m = model_size.load_model(tmp_path)
    assert m.quant == "w8a8" and m.source == "checkpoint"
    assert m.bytes_per_expert == 6_144 + (32 + 32 + 64) * 4  # not the file's 6,144 + 256
    assert any("fp32 scales" in n for n in m.notes)


def test_checkpoint_directory_without_safetensors_falls_back_to_config(tmp_path):
    (tmp_path / "config.json").write_text(cfg("olmoe-1b-7b-0125-instruct.json").read_text())
    m = model_size.load_model(tmp_path)
    assert m.bytes_per_expert == 3 * 2048 * 1024 * 2
    assert any("no safetensors" in n for n in m.notes)


def test_damaged_safetensors_header_is_a_user_error(tmp_path):
    (tmp_path / "config.json").write_text(cfg("olmoe-1b-7b-0125-instruct.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 50) + b"{nope")
    with pytest.raises(UserError, match="safetensors"):
        model_size.load_model(tmp_path)


# --------------------------------------------------------------------------- the command


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "expertcache_cli", "size", *args],
        capture_output=True, text=True, timeout=120,
    )


def test_cli_json_one_object():
    r = _cli("--vram", "24", "--max-model-len", "4096", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["model"] == DEFAULT_PRESET and d["num_experts"] == 128 and d["top_k"] == 8
    assert 80 <= d["slots"] <= 90 and d["fits_outright"] is False
    assert d["bytes_per_slot"] == 227_180_544 and d["non_expert_bytes"] == 2_177_593_344
    assert d["cpu_offload_gb"] == 28


def test_cli_reads_vllm_flags_after_the_double_dash_as_serve_does():
    """`size ... -- VLLM ARGS` plans as `serve` would for the same flags (the
    slot count `serve` arms is the one `size` printed), CUDA-graph padding included."""
    from expertcache_cli.planning.launch import make_plan

    flags = ["--max-model-len", "8192", "--max-num-seqs", "8", "--enforce-eager"]
    d = json.loads(_cli("--vram", "24", "--json", "--", *flags).stdout)
    p = make_plan("/models/w8a8", 24, size_from=DEFAULT_PRESET, vllm_args=flags,
                  launcher=["vllm"], environ={})
    assert d["slots"] == p.size.slots == int(p.env["EXPERT_CACHE_SLOTS"])
    assert (d["max_model_len"], d["max_num_seqs"], d["graphs"]) == (8192, 8, "--enforce-eager")
    # an option given to size itself wins over the same flag after --
    d = json.loads(_cli("--vram", "24", "--json", "--max-num-seqs", "2", "--", *flags).stdout)
    assert d["max_num_seqs"] == 2


def test_cli_table_and_card_sweep():
    r = _cli("--model", str(cfg("mixtral-8x7b.json")), "--vram", "48", "--max-model-len", "4096")
    assert r.returncode == 0, r.stderr
    assert "cache at" in r.stdout and "--cpu-offload-gb" in r.stdout
    r = _cli("--json")
    d = json.loads(r.stdout)
    assert [c["vram_gib"] for c in d["cards"]] == [
        cards.CARDS[n].gib for n in sizing.COMMON_CARDS]


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--model", "nope"], "unknown model"),
        (["--vram", "-3"], "--vram"),
        (["--quant", "int3"], "--quant"),
        (["--model", "missing/config.json"], "no such file"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, msg):
    r = _cli(*args)
    assert r.returncode == 2
    assert msg in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_notes_never_contradict_the_verdict():
    """Mixtral-8x7B at 24 GiB: 1 slot fits at its 32768-token context and still 1 at 8192;
    the note used to say '8192 leaves room for 0 slots' beside a verdict of 1."""
    p = sizing.plan(model_size.load_model(cfg("mixtral-8x7b.json")), 24)
    assert p.verdict == "offload_no_cache" and "room for 1 slot," in p.verdict_text
    assert not any("--max-model-len 8192" in n for n in p.notes)
    q = sizing.plan(None, 24)  # Qwen3-30B-A3B W8A8 at 40960: 8192 frees room for slots
    note = next(n for n in q.notes if "--max-model-len 8192" in n)
    # (at the batch the plan chose, 8 sequences: less runtime memory than vLLM's 256)
    assert q.max_num_seqs == 8
    assert "room for 85 slots: cache at 85 of 128" in note and q.slots < 85


def test_tensor_parallel_plans_one_gpu_of_several():
    """TP=2 shards every expert: a slot on one GPU holds half an expert, so twice the slots
    fit in the same per-GPU memory (the H200 run printed 2.25 GiB of slots where each rank
    held 1.12 GiB); --cpu-offload-gb is per GPU too, as vLLM takes it."""
    kw = dict(max_model_len=8192, max_num_seqs=8)
    one = sizing.plan("qwen3-30b-a3b", 24, **kw)
    two = sizing.plan("qwen3-30b-a3b", 24, tensor_parallel_size=2, **kw)
    assert two.bytes_per_slot * 2 == one.bytes_per_slot and two.tensor_parallel_size == 2
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token  # 4 KV heads split in 2
    assert two.slots > one.slots and two.cpu_offload_gb < one.cpu_offload_gb
    args = two.vllm_args()
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    via_flags = sizing.plan("qwen3-30b-a3b", 24, **kw, **vllm_flags.plan_kwargs_from_vllm_args(
        ["-tp", "2"]))
    assert via_flags.slots == two.slots
    eight = sizing.plan("qwen3-30b-a3b", 80, tensor_parallel_size=8, **kw)
    assert eight.kv_bytes_per_token * 4 == one.kv_bytes_per_token  # 4 heads: 1 a rank
    with pytest.raises(UserError, match="--tensor-parallel-size must be positive"):
        sizing.plan(None, 24, tensor_parallel_size=0)


def test_online_quantization_is_sized_as_vllm_will_hold_it():
    bf16 = sizing.plan("Qwen/Qwen3-30B-A3B", 24, max_model_len=8192)
    fp8 = sizing.plan("Qwen/Qwen3-30B-A3B", 24, max_model_len=8192, vllm_quantization="fp8")
    assert (bf16.quant, fp8.quant) == ("bf16", "fp8")
    assert fp8.bytes_per_expert < bf16.bytes_per_expert and fp8.slots > bf16.slots
    assert any("quantised at load" in n for n in fp8.notes)
    w8a8 = sizing.plan("qwen3-30b-a3b-w8a8", 24, max_model_len=8192, vllm_quantization="fp8")
    assert w8a8.quant == "w8a8"  # already quantised: its own format stands
    # the one place that decides it, for `size` (which prints the model) and `plan` alike
    m = model_size.load_model("Qwen/Qwen3-30B-A3B")
    held = sizing.model_as_held(m, "Qwen/Qwen3-30B-A3B", None, "fp8")
    assert held.quant == "fp8" and held.bytes_per_expert == fp8.bytes_per_expert
    assert held.notes[-1] == sizing.online_note("fp8", "fp8")
    assert sizing.model_as_held(m, "Qwen/Qwen3-30B-A3B", "bf16", "fp8") is m  # given: stands
    assert sizing.model_as_held(m, "Qwen/Qwen3-30B-A3B", None, None) is m


def test_nvfp4s_ragged_global_scales_travel_in_the_side_row_and_larger_ones_are_refused(
        tmp_path):
    """NVFP4's per-expert global scales are 4 bytes each: not 16-byte slabs, but the
    plugin packs them into a side row, so the model is cacheable and a slot counts the row
    (16 B) besides the compact copies the kernel reads (the expert's 8 B); ragged tensors
    past the side row's limit are refused with the verdict saying why."""
    from expertcache_cli.sizing import formats

    conf = qwen3_moe_config(hidden_size=256, moe_intermediate_size=128, quantization_config={
        "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16})
    assert formats.quant_from_config(conf) == "nvfp4"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(conf))
    m = model_size.load_model(path)
    assert m.aligned
    assert m.bytes_per_slot == (m.bytes_per_expert + 16) * m.num_moe_layers
    p = sizing.plan(m, 1, slots=4)
    assert p.verdict == "cache" and p.slots == 4
    big = dataclasses.replace(m, expert_tensors=m.expert_tensors + [
        formats.Tensor("w13_odd", (75,), "fp32", 300)])
    p = sizing.plan(big, 1, slots=4)
    assert p.verdict == "offload_no_cache" and p.slots == 0
    assert "w13_odd" in p.verdict_text and "more than the 256" in p.verdict_text


@pytest.mark.parametrize("spec, tp, words", [
    # Qwen3-30B-A3B: 32 attention heads, 4 KV heads, experts 768 wide
    ("qwen3-30b-a3b-w8a8", 3, ["32 attention heads do not divide by 3",
                               "4 KV heads neither divide by 3 nor divide it",
                               "(sizes it can: 1, 2, 4, 8, 16)"]),
    ("qwen3-30b-a3b-w8a8", 6, ["32 attention heads do not divide by 6"]),
    # 128x128 FP8 blocks: 768 / 4 = 192 a rank is not a whole number of blocks
    ("qwen3-30b-a3b-fp8", 4, ["768 splits into 192 a rank", "(sizes it can: 1, 2)"]),
    # MLA: the latent is not split, so only heads and the experts' width count
    ("deepseek-v2-lite", 3, ["16 attention heads", "intermediate size 1408 does not divide"]),
])
def test_a_tensor_parallel_size_vllm_cannot_split_is_refused(spec, tp, words):
    m = model_size.load_model(spec)
    why = m.tensor_parallel_refusal(tp)
    assert why is not None and all(w in why for w in words), why
    assert "KV heads" not in why or spec != "deepseek-v2-lite"
    with pytest.raises(UserError, match=f"--tensor-parallel-size {tp}: vLLM cannot split"):
        sizing.plan(spec, 24, tensor_parallel_size=tp)


def test_tensor_parallel_sizes_vllm_splits_are_planned():
    """KV heads fewer than the ranks are replicated (8 ranks over 4 heads), as vLLM does."""
    m = model_size.load_model("qwen3-30b-a3b-w8a8")
    for tp in (1, 2, 4, 8, 16):
        assert m.tensor_parallel_refusal(tp) is None
    assert sizing.plan(None, 24, tensor_parallel_size=8).tensor_parallel_size == 8
    assert model_size.load_model("mixtral-8x7b").tensor_parallel_refusal(8) is None


@pytest.mark.parametrize("args", [["-tp", "3"], ["--vram", "24", "--", "-tp", "3"],
                                  ["--vram", "24", "--", "--tensor-parallel-size=3"]])
def test_size_tp_3_is_one_line(args):
    r = _cli(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0
    assert "vLLM cannot split qwen3-30b-a3b-w8a8 3 ways" in r.stderr


def test_the_vllm_command_is_one_line_at_80_columns_and_in_a_pipe():
    """A command to copy is never broken by rich's wrapping: at 80 columns (and in this
    pipe) the whole `vllm serve` line, longer than 80, is one line of the output."""
    import os

    args = ["--vram", "24", "--", "--max-model-len", "8192", "--max-num-seqs", "8"]
    r = subprocess.run([sys.executable, "-m", "expertcache_cli", "size", *args],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    p = sizing.plan(None, 24, max_model_len=8192, max_num_seqs=8)
    want = "  vllm serve MODEL " + " ".join(p.vllm_args())
    assert len(want) > 80 and want in r.stdout.splitlines()
    assert r.stdout.splitlines()[-2:] == ["vLLM:", want]


def test_size_counts_speculative_draft_tokens_in_the_trap():
    """`size -- --speculative-config '{"num_speculative_tokens": 3}'`: a decode step of 8
    seqs carries 8 x (1 + 3) = 32 tokens; the trap and the safe batch count them."""
    from expertcache_cli.sizing import sizing
    from expertcache_cli.vllm_facts import vllm_flags

    kw = vllm_flags.plan_kwargs_from_vllm_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
         "--max-num-seqs", "8"])
    assert kw["speculative_tokens"] == 3 and kw["max_num_seqs"] == 8
    plain = sizing.plan(None, 24, max_num_seqs=8)
    spec = sizing.plan(None, 24, **kw)
    assert not plain.trap and plain.padded_batch == 8
    assert spec.trap and spec.padded_batch == 32 and spec.trap_ids == 32 * spec.top_k
    assert spec.speculative_tokens == 3 and spec.safe_max_num_seqs * 4 * 8 <= spec.slots
    assert any("8 seqs x (1 + 3 draft tokens" in n for n in spec.notes)
    assert vllm_flags.speculative_tokens('{"method": "mtp"}') == 1  # left to the model
    short = vllm_flags.plan_kwargs_from_vllm_args(["-sc", '{"num_speculative_tokens": 2}'])
    assert short["speculative_tokens"] == 2  # vLLM's short spelling of the flag


def test_the_verdict_is_one_enum_whose_names_the_json_keeps():
    p = sizing.plan("qwen3-30b-a3b", 24, max_model_len=8192, max_num_seqs=4)
    assert p.verdict is sizing.Verdict.CACHE and p.verdict.offloads
    assert type(p.to_json()["verdict"]) is str and p.to_json()["verdict"] == "cache"
    assert not sizing.Verdict.FITS_OUTRIGHT.offloads and not sizing.Verdict.DOES_NOT_FIT.offloads


def test_gpt_oss_is_sized_for_the_graphs_vllm_captures_for_it():
    """vLLM captures gpt-oss up to 1024 tokens (83 graphs where Qwen3 at the same flags
    has 51): the runtime reserve grows with them, and the config's architectures say so."""
    m = model_size.load_model(Path(__file__).parent / "configs" / "gpt-oss-120b.json", "mxfp4")
    assert m.architectures == ("GptOssForCausalLM",)
    plain = dataclasses.replace(m, architectures=())
    oss, other = sizing.plan(m, 24), sizing.plan(plain, 24)
    assert oss.overhead_bytes > other.overhead_bytes
    assert "GptOssForCausalLM" in oss.graphs


def test_a_context_too_long_for_the_card_says_what_8192_tokens_would_leave(tmp_path):
    """Mixtral-8x22B at its 65,536-token context on 24 GiB: the KV alone is 14 GiB and
    nothing fits; the plan says what the common 8,192 tokens would leave, and `serve`'s
    refusal carries that line."""
    config = CONFIGS / "mixtral-8x22b.json"
    p = sizing.plan(config, 24)
    assert p.verdict is sizing.Verdict.DOES_NOT_FIT
    (note,) = [n for n in p.notes if sizing.SHORT_CONTEXT in n]
    assert note.startswith("KV for one 65536-token sequence takes 14.00 GiB")
    short = sizing.plan(config, 24, max_model_len=8192)
    assert f"leaves room for {short.max_slots} slots: {short.verdict_text}" in note
    r = subprocess.run([sys.executable, "-m", "expertcache_cli", "serve", str(tmp_path),
                        "--size-from", str(config), "--vram", "24", "--dry-run"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "does not fit even with offload" in r.stderr and sizing.SHORT_CONTEXT in r.stderr
