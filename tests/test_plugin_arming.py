"""Arming decisions on stand-ins shaped like vLLM's RoutedExperts (no torch, no vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from plugin_standins import (
    FakeModel,
    FakeTensor,
    HummingIndexedExperts,
    RoutedExperts,
    SubstitutedRoutedExperts,
    TritonExperts,
    TrtLlmBf16ExpertsModular,
    UnquantizedFusedMoEMethod,
)

from expertcache_cli.config import CacheConfig, from_env
from expertcache_cli.plugin.arming import ARM, DECLINE, SKIP, plan_layer, summary_line
from expertcache_cli.plugin.session import find_moe_layers, layer_index
from expertcache_cli.vllm_facts.capture import rows_for_sizes

CFG = CacheConfig(slots=32)


def test_offloaded_bf16_layer_is_armed_with_weights_mirrored():
    d = plan_layer(RoutedExperts(), CFG)
    assert d.action == ARM, d.reason
    assert (d.num_experts, d.num_slots, d.top_k) == (128, 32, 8)
    names = [s.name for s in d.specs]
    assert names == ["w13_weight", "w2_weight"]  # routing bias [E] is not an expert tensor
    assert d.specs[0].shape == (64, 64) and d.specs[0].bytes_per_expert == 64 * 64 * 2
    assert d.slot_bytes == 32 * (64 * 64 * 2 + 64 * 32 * 2)


def test_scales_zero_points_and_biases_are_mirrored_with_the_weights():
    extra = {
        "w13_weight_scale": FakeTensor((128, 64, 4), "float32", uva=True),
        "w13_qzeros": FakeTensor((128, 16), "int8", uva=True),
        "w2_bias": FakeTensor((128, 64), "bfloat16"),  # resident but per-expert: mirrored too
        "w2_input_scale": FakeTensor((128,), "float32"),  # vLLM's non-expert list
    }
    d = plan_layer(RoutedExperts(extra_params=extra), CFG)
    assert d.action == ARM, d.reason
    got = {s.name: s.offloaded for s in d.specs}
    assert got == {"w13_weight": True, "w2_weight": True, "w13_weight_scale": True,
                   "w13_qzeros": True, "w2_bias": False}


def test_per_expert_scales_too_small_for_a_slab_travel_in_the_packed_row():
    """NVFP4's per-expert global scales are 4 bytes an expert: not a 16-byte slab, so not
    gathered on their own, but packed into one side row that is (and spread by the gather
    into the compact copies the kernel reads): the layer is armed with them, not declined.
    A load-time-only shape record (compressed-tensors' ``weight_shape``, 8 bytes) is not
    mirrored at all."""
    extra = {
        "w13_weight_scale_2": FakeTensor((128,), "float32", uva=True),
        "w2_weight_scale_2": FakeTensor((128,), "float32", uva=True),
        "w13_weight_shape": FakeTensor((128, 2), "float32", uva=True),
    }
    d = plan_layer(RoutedExperts(extra_params=extra), CFG)
    assert d.action == ARM, d.reason
    assert [s.name for s in d.specs] == ["w13_weight", "w2_weight"]
    assert [s.name for s in d.small] == ["w13_weight_scale_2", "w2_weight_scale_2"]
    assert d.small_row_bytes == 16
    weights = 64 * 64 * 2 + 64 * 32 * 2
    assert d.bytes_per_slot == weights + 16 + 8  # the packed row and the compact copies
    assert d.slot_bytes == 32 * d.bytes_per_slot + 128 * (16 + 8)
    line = summary_line([d], CFG, "0.26.0")
    assert "w13_weight_scale_2[float32 1, packed, spread]" in line
    off = summary_line([d], CacheConfig(slots=32, spread=False), "0.26.0")
    assert "w13_weight_scale_2[float32 1, packed, unpacked a step]" in off


def test_resident_layer_is_not_armed():
    d = plan_layer(RoutedExperts(uva=False), CFG)
    assert d.action == SKIP and "resident" in d.reason


def test_a_parameter_vllm_retired_is_not_mirrored():
    """vLLM 0.34 keeps some loaded parameters that no kernel reads (``retire_parameter``):
    one of odd slabs, which would decline the layer if mirrored, is left out."""
    odd = FakeTensor((128, 75), "float32", uva=True)
    odd.retired = True
    d = plan_layer(RoutedExperts(extra_params={"w13_input_global": odd}), CFG)
    assert d.action == ARM, d.reason
    assert "w13_input_global" not in [s.name for s in d.specs]


@pytest.mark.parametrize(
    "layer, needle",
    [
        (RoutedExperts(use_ep=True), "expert parallelism"),
        (RoutedExperts(lora=True), "LoRA on the experts"),
        (RoutedExperts(expert_map=FakeTensor((128,), "int32")), "expert parallelism"),
        (RoutedExperts(quant_method=UnquantizedFusedMoEMethod(monolithic=True)),
         "monolithic): no ids to remap; --moe-backend triton runs it on a kernel the cache "
         "arms"),
        (RoutedExperts(quant_method=SimpleNamespace(is_monolithic=False, moe_kernel=None)),
         "no modular kernel"),
        (RoutedExperts(quant_method=UnquantizedFusedMoEMethod(TrtLlmBf16ExpertsModular())),
         "TrtLlmBf16ExpertsModular is not known to index weights by id only (known: "
         "MarlinExperts, TritonExperts, TritonWNA16Experts); --moe-backend triton runs it"),
        (RoutedExperts(quant_method=UnquantizedFusedMoEMethod(HummingIndexedExperts())),
         "runs 4-bit experts on Humming on Hopper unless told --moe-backend marlin"),
        (RoutedExperts(device="cpu", uva=False), "without UVA"),
        (RoutedExperts(extra_params={"w13_g": FakeTensor((128, 75), "float32", uva=True)}),
         "w13_g (300 B): 300 bytes per expert in slabs that are not multiples of 16"),
        (RoutedExperts(extra_params={"w2_g": FakeTensor((128, 8, 8), "float32", uva=True,
                                                         contiguous=False)}),
         "not contiguous"),
        (RoutedExperts(buffers={"w13_sort_idx": FakeTensor((128, 32), "int32")}),
         "per-expert buffer w13_sort_idx"),
        (RoutedExperts(num_experts=16), "not below the layer's 16 experts"),
    ],
)
def test_unsupported_layers_are_declined_with_the_reason(layer, needle):
    d = plan_layer(layer, CFG)
    assert d.action == DECLINE
    assert needle in d.reason


def test_experts_held_outside_the_parameters_are_named_as_resident():
    """vLLM's MXFP4 triton_kernels path deletes the expert Parameters and keeps swizzled
    tensors as plain attributes: the offloader never moves them (H200, vLLM 0.26: all 5.8
    GiB in VRAM with experts "offloaded"). The startup line says so, first."""
    class Swizzled:  # triton_kernels' Tensor wrapper: not a torch tensor
        pass

    layer = RoutedExperts(quant_method=UnquantizedFusedMoEMethod(monolithic=True))
    del layer._params["w13_weight"], layer._params["w2_weight"]
    layer.w13_weight, layer.w2_weight = Swizzled(), Swizzled()
    d = plan_layer(layer, CFG)
    assert d.action == DECLINE
    assert "(w13_weight, w2_weight: Swizzled) outside the layer's parameters" in d.reason
    assert "--moe-backend marlin" in d.reason
    # the usual layer (weights are Parameters) is not flagged
    assert "outside the layer's parameters" not in plan_layer(RoutedExperts(
        quant_method=UnquantizedFusedMoEMethod(monolithic=True)), CFG).reason


def test_experts_aliased_under_a_second_name_are_not_called_outside():
    """Marlin WNA16 (compressed-tensors) and AWQ set ``layer.w13_weight =
    layer.w13_qweight``: one Parameter under two names, which torch lists once, under the
    first. H200, vLLM 0.26: the W4A16 and AWQ layers were declined as "outside the layer's
    parameters" while vLLM had offloaded them (1.4 GiB of weights in VRAM)."""
    layer = RoutedExperts()
    w13, w2 = layer._params.pop("w13_weight"), layer._params.pop("w2_weight")
    layer._params = {"w13_qweight": w13, "w2_qweight": w2, **layer._params,
                     "w13_weight": w13, "w2_weight": w2}
    layer.w13_weight, layer.w2_weight = w13, w2
    assert [n for n, _ in layer.named_parameters(recurse=False)][:2] == [
        "w13_qweight", "w2_qweight"]
    assert "outside the layer's parameters" not in plan_layer(layer, CFG).reason


def test_per_expert_tensor_held_by_the_quant_method_is_declined():
    qm = UnquantizedFusedMoEMethod()
    qm.w13_scale_cache = FakeTensor((128, 64), "float32")
    d = plan_layer(RoutedExperts(quant_method=qm), CFG)
    assert d.action == DECLINE and "w13_scale_cache" in d.reason


def test_per_expert_tensor_held_by_the_kernel_is_declined():
    experts = TritonExperts()
    experts.expert_offsets = FakeTensor((128,), "int32")
    d = plan_layer(RoutedExperts(quant_method=UnquantizedFusedMoEMethod(experts)), CFG)
    assert d.action == DECLINE and "expert_offsets" in d.reason


def test_a_layout_that_raises_is_declined_not_crashed():
    class Broken(RoutedExperts):
        def named_parameters(self, recurse=True):
            raise RuntimeError("boom")

    d = plan_layer(Broken(), CFG)
    assert d.action == DECLINE and "boom" in d.reason


def test_fraction_budget_rounds_per_layer():
    cfg = from_env({"EXPERT_CACHE_FRACTION": "0.3"})
    assert plan_layer(RoutedExperts(), cfg).num_slots == 38  # 0.3 * 128 = 38.4
    assert plan_layer(RoutedExperts(num_experts=64), cfg).num_slots == 19


def test_default_budget_is_a_quarter():
    assert plan_layer(RoutedExperts(), CacheConfig()).num_slots == 32


def test_summary_line_states_layers_budget_policy_tensors_and_the_trap():
    layers = [RoutedExperts(name=f"model.layers.{i}.mlp.experts") for i in range(3)]
    layers.append(RoutedExperts(uva=False, name="model.layers.3.mlp.experts"))
    layers.append(RoutedExperts(use_ep=True, name="model.layers.4.mlp.experts"))
    ds = [plan_layer(x, CFG) for x in layers]
    line = summary_line(ds, CFG, "0.26.0", max_num_seqs=8)
    assert "vLLM 0.26.0" in line
    assert "armed 3 of 5 MoE layers" in line
    assert "32 of 128 experts/layer" in line
    assert "policy lru" in line
    assert "w13_weight[bfloat16 64x64]" in line and "w2_weight[bfloat16 64x32]" in line
    assert "1 resident layer(s) not armed" in line and "1 declined" in line
    assert "TRAP" in line and "64 ids" in line  # 8 seqs x top-8 > 32 slots
    assert "TRAP" not in summary_line(ds, CFG, "0.26.0", max_num_seqs=4)
    # CUDA graphs pad a full batch of 3 to the 4-graph: 4 x 8 = 32 ids still fit 32 slots,
    # but with graphs of 1, 2 and 8 the batch runs as 8: 64 ids read through
    fits = summary_line(ds, CFG, "0.26.0", 3, decode_rows=rows_for_sizes([1, 2, 4, 8]))
    assert "TRAP" not in fits
    padded = summary_line(ds, CFG, "0.26.0", 3, decode_rows=rows_for_sizes([1, 2, 8]))
    assert "TRAP: a full batch of 3 seqs runs as 8 (CUDA-graph padding" in padded
    assert "64 ids > 32 slots" in padded and "--max-num-seqs 2" in padded


def test_summary_line_when_nothing_is_armed_says_why():
    ds = [plan_layer(RoutedExperts(uva=False), CFG)]
    line = summary_line(ds, CFG, "0.33.0")
    assert "armed 0 of 1" in line and "resident" in line and "stock path" in line


def test_find_moe_layers_and_layer_index():
    model = FakeModel([RoutedExperts(name=f"model.layers.{i}.mlp.experts") for i in range(4)])
    found = find_moe_layers(model)
    assert [n for n, _ in found] == [f"model.layers.{i}.mlp.experts" for i in range(4)]
    assert layer_index("model.layers.17.mlp.experts") == 17
    assert layer_index("experts") is None


def test_a_layer_class_that_remaps_routing_ids_is_declined_before_any_call():
    """0.33's SubstitutedRoutedExperts remaps the ids it is handed (logical -> physical):
    given slot ids it would read the wrong rows, past the slots. Declined at planning,
    with the class and the hook named; so is a hook replaced on the instance, and an
    expert_substitution on a layer whose class does not override anything."""
    cfg = CacheConfig(slots=32)
    d = plan_layer(SubstitutedRoutedExperts(), cfg)
    assert d.action == DECLINE
    assert d.reason.startswith("SubstitutedRoutedExperts overrides forward_modular")
    plain = RoutedExperts()
    plain.expert_substitution = SimpleNamespace()
    assert "substitutes experts" in plan_layer(plain, cfg).reason
    patched = RoutedExperts()
    patched.forward_modular = lambda **kw: kw
    assert "already replaced" in plan_layer(patched, cfg).reason
    assert plan_layer(RoutedExperts(), cfg).action == ARM


def test_speculative_decoding_draft_tokens_count_in_the_trap():
    """A verify step carries every sequence's draft tokens: with 3 (n-gram, MTP, EAGLE), a
    full batch of 8 is 32 tokens, padded to vLLM's 32-graph: 32 x top_k 8 = 256 ids. The
    startup TRAP says so and names the batch that fits (2 seqs x 4 tokens x 8 = 64)."""
    from expertcache_cli.plugin import speculative_tokens

    d = plan_layer(RoutedExperts(), CacheConfig(slots=80))
    sizes = [1, 2, 4, 8, 16, 24, 32]
    plain = summary_line([d], CacheConfig(slots=80), "0.33.0", max_num_seqs=8,
                         decode_rows=rows_for_sizes(sizes))
    assert "TRAP" not in plain  # 8 x 8 = 64 ids fit 80 slots
    spec = summary_line([d], CacheConfig(slots=80), "0.33.0", max_num_seqs=8,
                        decode_rows=rows_for_sizes(sizes, 1 + 3), spec_tokens=3)
    assert ("TRAP: a full batch of 8 seqs x (1 + 3 draft tokens, speculative decoding) x "
            "top_k 8 = 256 ids > 80 slots") in spec
    assert "--max-num-seqs 2 keeps every decode step on it" in spec
    vc = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3))
    assert speculative_tokens(vc) == 3
    assert speculative_tokens(SimpleNamespace(speculative_config=None)) == 0
    assert speculative_tokens(SimpleNamespace()) == 0


def test_experts_handed_to_the_kernel_as_triton_views_are_declined():
    """vLLM 0.34's triton_kernels paths (MXFP4, online MXFP4, Quark) no longer replace the
    expert Parameters by swizzled wrappers (0.33: the "outside the layer's parameters"
    rule); they store the swizzled bytes in the Parameters and hand the kernel
    ``layer.w13_weight_triton`` (oracle/mxfp4.py ``triton_weight``), which rebinding the
    Parameters to slots would never reach. Declined by that name, whatever the kernel."""
    class TritonTensor:  # triton_kernels' Tensor wrapper: not a torch tensor
        pass

    layer = RoutedExperts()
    layer.w13_weight_triton, layer.w2_weight_triton = TritonTensor(), TritonTensor()
    d = plan_layer(layer, CFG)
    assert d.action == DECLINE
    assert "w13_weight_triton, w2_weight_triton" in d.reason
    assert "--moe-backend marlin" in d.reason
    assert plan_layer(RoutedExperts(), CFG).action == ARM


def test_the_trap_counts_vllm_034s_request_keyed_decode_graphs():
    """On 0.34 the plugin hands the decode width in as requests -> rows (`_decode_rows`):
    gpt-oss at max_num_seqs 10 runs a full batch as 10 rows (0.33's 1024-token grid: 16),
    and the safe batch is the largest whose rows fit, 8 (9 requests run as 10)."""
    from expertcache_cli.vllm_facts import capture

    oss = capture.for_model(capture.settings_from_vllm_args([], version=(0, 34)),
                            ("GptOssForCausalLM",))
    d = plan_layer(RoutedExperts(), CacheConfig(slots=72))
    rows = [capture.decode_rows(n, 10, 2048, oss) for n in range(1, 11)]
    line = summary_line([d], CacheConfig(slots=72), "0.34.0", max_num_seqs=10,
                        decode_rows=lambda n: rows[n - 1])
    assert ("TRAP: a full batch of 10 seqs x top_k 8 = 80 ids > 72 slots" in line
            and "--max-num-seqs 8 keeps" in line)
    at80 = CacheConfig(slots=80)
    d80 = plan_layer(RoutedExperts(), at80)
    assert "TRAP" not in summary_line([d80], at80, "0.34.0", max_num_seqs=10,
                                      decode_rows=lambda n: rows[n - 1])
    assert "runs as 16" in summary_line([d80], at80, "0.33.0", max_num_seqs=10,
                                        decode_rows=rows_for_sizes([1, 2, 4, 8, 16]))
