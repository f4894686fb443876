"""vLLM's rotary cos/sin cache: VRAM a model holds beside its weights.

vLLM builds each distinct rotary embedding once (``get_rope`` caches them) with a
``cos_sin_cache`` buffer of one row a position, ``rotary_dim`` wide, in the model's dtype.
The buffer is in no checkpoint, so neither the config's arithmetic nor the safetensors
count it, yet vLLM's "Model loading took" does. For most models it is a few MiB; Llama 4
Scout declares 10,485,760 positions, so its cache alone is 2.5 GiB, which a 24 GiB card's
plan has to leave room for, and a first start's compile briefly needs it twice
(`sizing._compile_room`).
"""

from __future__ import annotations

from typing import Any

#: model types whose rotary cache vLLM builds in float32 whatever the model's dtype (its
#: ``get_rope(..., dtype=torch.float32)`` in 0.26-0.33)
FLOAT32_ROPE = frozenset({"gpt_oss"})

#: the config names vLLM reads a partial rotation from, in its order
PARTIAL_KEYS = ("partial_rotary_factor", "rotary_pct", "rotary_emb_fraction")

#: rope types whose cache vLLM sizes from the pre-scaling length times the factor
_SCALED_ORIGINAL = frozenset({"yarn", "deepseek_yarn", "deepseek_llama_scaling"})


def _parameter_sets(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The rotary parameter sets a config declares: one, or one a layer type (Gemma's
    full and sliding layers each carry their own, and vLLM builds a cache for each)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        return [{}]
    if params and all(isinstance(v, dict) for v in params.values()):
        return list(params.values())
    return [params]


def _positions(p: dict[str, Any], max_position: int) -> int:
    """Rows of one cache, as vLLM's rotary classes compute them."""
    kind = str(p.get("rope_type") or p.get("type") or "default")
    kind = {"su": "longrope"}.get(kind, kind)  # vLLM's name for the legacy one
    if kind in _SCALED_ORIGINAL:
        original = int(p.get("original_max_position_embeddings") or max_position)
        return int(original * float(p.get("factor", 1.0)))
    if kind == "linear":
        factors = p.get("factor", 1.0)
        factors = factors if isinstance(factors, list) else [factors]
        return sum(int(max_position * float(f)) for f in factors)
    if kind == "longrope":  # a short cache at the original length and a long one
        return int(p.get("original_max_position_embeddings") or 0) + max_position
    return max_position


def rope_cache_bytes(cfg: dict[str, Any], head_dim: int, max_position: int,
                     dtype_bytes: int = 2) -> int:
    """Bytes of every rotary cache vLLM builds for this config (0 where it has none).

    ``head_dim`` is the head the rotation applies to (MLA: the rope part of the query and
    key); ``partial_rotary_factor`` or ``rope_dim`` narrows it as vLLM's ``get_rope`` does.
    ``max_position`` is the model's ``max_position_embeddings``, which vLLM passes on;
    ``dtype_bytes`` the model's dtype, except for the `FLOAT32_ROPE` models.
    """
    if max_position <= 0 or head_dim <= 0:
        return 0
    if str(cfg.get("model_type", "")) in FLOAT32_ROPE:
        dtype_bytes = 4
    total, seen = 0, set()
    for p in _parameter_sets(cfg):
        factor = float(p.get("partial_rotary_factor")
                       or next((cfg[k] for k in PARTIAL_KEYS if cfg.get(k)), 1.0))
        rotary_dim = int(p.get("rope_dim") or head_dim * factor)
        rows = _positions(p, max_position)
        key = (rotary_dim, rows, repr(sorted(p.items())))
        if key in seen:
            continue
        seen.add(key)
        total += rows * rotary_dim * dtype_bytes
    return total

