"""The tiny Qwen3-MoE model of the tests: one config factory, and the writer the real-vLLM
tests run (no GPU, no weights).

`qwen3_moe_config` is the one place a test builds a Qwen3-MoE ``config.json`` by hand;
`MAKE_MODEL` writes it, with a tokenizer, for every test that starts vLLM's CPU build,
run by that vLLM's python.
"""

from __future__ import annotations

import json
from typing import Any


def qwen3_moe_config(**overrides: Any) -> dict[str, Any]:
    """A Qwen3-MoE config small enough to start in seconds (8 experts, top-2, 2 layers).

    head_dim 64: vLLM's CPU attention backend has no kernels for very small heads.
    ``None`` in ``overrides`` removes a key.
    """
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True, "max_position_embeddings": 512,
        "vocab_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu",
    }
    cfg.update(overrides)
    return {k: v for k, v in cfg.items() if v is not None}


#: Written by the vLLM python (which has `tokenizers`): a character-level tokenizer and
#: the config above.
MAKE_MODEL = r"""
import json, sys
from pathlib import Path
from tokenizers import Tokenizer, models, pre_tokenizers
d = Path(sys.argv[1])
d.mkdir(parents=True, exist_ok=True)
config = json.loads(CONFIG_JSON)
vocab_size = config["vocab_size"]
words = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(32, 127)]
words += [f"<extra_{i}>" for i in range(vocab_size - len(words))]
tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
tok.save(str(d / "tokenizer.json"))
(d / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
    "unk_token": "<unk>", "model_max_length": 512}))
(d / "config.json").write_text(json.dumps(config, indent=1))
""".replace("CONFIG_JSON", repr(json.dumps(qwen3_moe_config())))
