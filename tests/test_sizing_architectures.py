"""Architectures whose layers are not all alike, and multimodal ones: what sizing counts.

Hybrid linear-attention models (Qwen3-Next, Qwen3.5) have their own file,
`test_hybrid_pages.py`.

Llama 4: a shared expert beside the routed ones in every MoE layer, and (Maverick) dense
layers of another width interleaved with the MoE ones.

Mamba hybrids (Jamba, Nemotron-H): which layers are MoE, and a note that their Mamba
layers are estimated.

The expected figures are worked by hand from the configs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hybrid_configs import CODER_NEXT

from expertcache_cli.sizing import model_size

CONFIGS = Path(__file__).parent / "configs"

#: Llama 4 Scout's text_config fields (meta-llama/Llama-4-Scout-17B-16E), as public config
#: parsers' tests quote them
SCOUT_TEXT = {
    "model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
    "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
    "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 16,
    "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "vocab_size": 202048,
    "attention_bias": False, "tie_word_embeddings": False, "use_qk_norm": True,
    "max_position_embeddings": 10485760, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
}


def test_llama4_counts_its_shared_expert_and_its_interleaved_dense_layers():
    """Every Llama 4 MoE layer has a shared expert of the experts' width beside the routed
    ones, and Maverick-style configs interleave dense layers of ``intermediate_size_mlp``."""
    h, inter = 5120, 8192
    attn = 2 * (h * 40 * 128 + 2 * h * 8 * 128 + 40 * 128 * h)
    expert = 3 * h * inter * 2
    layer = attn + 2 * h * 2 + 16 * h * 2 + expert  # norms, router, the shared expert
    scout = model_size.model_from_config(
        {"model_type": "llama4", "text_config": SCOUT_TEXT}, "scout")
    assert scout.moe_layers == list(range(48)) and scout.bytes_per_expert == expert
    assert scout.non_expert_bytes == 2 * 202048 * h * 2 + h * 2 + 48 * layer
    maverick = model_size.model_from_config(
        SCOUT_TEXT | {"num_local_experts": 128, "interleave_moe_layer_step": 2}, "maverick")
    assert maverick.moe_layers == list(range(1, 48, 2))
    dense = attn + 2 * h * 2 + 3 * h * 16384 * 2
    assert maverick.non_expert_bytes == (2 * 202048 * h * 2 + h * 2 + 24 * (layer - 16 * h * 2
                                         + 128 * h * 2) + 24 * dense)
    listed = model_size.model_from_config(SCOUT_TEXT | {"moe_layers": [1, 3, 99]}, "listed")
    assert listed.moe_layers == [1, 3]


@pytest.mark.parametrize("extra,moe", [
    ({"hybrid_override_pattern": "MEM*EMEM"}, [1, 4, 6]),  # Nemotron-H: E marks MoE layers
    ({"expert_layer_period": 2, "expert_layer_offset": 1, "mamba_d_state": 16},
     [1, 3, 5, 7]),  # Jamba
])
def test_mamba_hybrids_say_their_mamba_layers_are_estimated(extra, moe):
    cfg = {"hidden_size": 64, "num_hidden_layers": 8, "vocab_size": 100,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "intermediate_size": 32} | extra
    m = model_size.model_from_config(cfg, "hybrid")
    assert m.moe_layers == moe
    assert any("Mamba layers are not in the arithmetic" in n for n in m.notes)


def test_a_vision_encoder_is_estimated_as_a_vit():
    """Qwen3.5's vision tower: 27 blocks of width 1152 (MLP 4304) and a 2x2 patch merger
    to the language model's 2048; Llama 4's: 34 blocks of 1408 (MLP 5632) and a projector."""
    qwen = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
            "spatial_merge_size": 2, "out_hidden_size": 2048}
    blocks = 27 * (4 * 1152**2 + 2 * 1152 * 4304)
    assert model_size.vision_encoder_bytes(qwen) == 2 * (blocks + 4608**2 + 4608 * 2048)
    llama = {"hidden_size": 1408, "intermediate_size": 5632, "num_hidden_layers": 34,
             "projector_input_dim": 4096, "projector_output_dim": 4096}
    assert model_size.vision_encoder_bytes(llama) == 2 * (
        34 * (4 * 1408**2 + 2 * 1408 * 5632) + 4096 * 4096)
    text = {k: v for k, v in CODER_NEXT.items() if k != "full_attention_interval"}
    with_vision = model_size.model_from_config(
        {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": qwen}, "q35")
    alone = model_size.model_from_config(text, "q35")
    assert with_vision.non_expert_bytes - alone.non_expert_bytes == \
        model_size.vision_encoder_bytes(qwen)
    assert any("vision encoder (vision_config) estimated at" in n for n in with_vision.notes)


def test_a_checkpoints_safetensors_replace_the_vision_estimate(tmp_path):
    from test_sizing import _write_safetensors

    text = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 100, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": []}
    (tmp_path / "config.json").write_text(json.dumps(
        {"text_config": text, "vision_config": {"depth": 2, "hidden_size": 32}}))
    t = {f"model.layers.0.mlp.experts.{e}.{p}.weight": ("BF16", [32, 64])
         for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    t["visual.blocks.0.attn.qkv.weight"] = ("BF16", [96, 32])
    _write_safetensors(tmp_path / "model.safetensors", t)
    m = model_size.load_model(tmp_path)
    assert m.source == "checkpoint" and m.non_expert_bytes == 96 * 32 * 2
    assert not any("vision encoder" in n for n in m.notes)


def test_an_aux_loss_free_router_carries_its_float32_correction_bias():
    """DeepSeek-V3's `noaux_tc` routing adds a float32 score-correction bias a MoE layer
    (vLLM's `e_score_correction_bias`); GLM-4.5's router is float32 as well (checked
    against vLLM's own modules in test_vllm_architectures.py)."""
    with open(CONFIGS / "deepseek-v2-lite.json") as f:
        lite = json.load(f)
    greedy = model_size.model_from_config(lite, "lite")
    noaux = model_size.model_from_config(lite | {"topk_method": "noaux_tc"}, "lite")
    moe = len(greedy.moe_layers)
    assert noaux.non_expert_bytes - greedy.non_expert_bytes == moe * 64 * 4
    glm = model_size.model_from_config(lite | {"model_type": "glm4_moe"}, "glm")
    assert glm.non_expert_bytes - greedy.non_expert_bytes == moe * (64 * 2048 * 2 + 64 * 4)
