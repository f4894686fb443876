"""A user's `vllm serve` flags, read as sizing needs them.

`serve`, `baseline` and `size -- FLAGS` pass the user's vLLM arguments through; the ones
that change a plan (context, batch, utilization, KV dtype, CUDA-graph settings) are read
here, once, the way vLLM reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import capture
from .errors import UserError

#: vLLM flags that change a plan, and the `plan` keyword (and type) each one feeds. Every
#: caller that passes a user's vLLM arguments through (`serve`, `baseline`) reads them here.
VLLM_PLAN_FLAGS: dict[str, tuple[str, type]] = {
    "--max-model-len": ("max_model_len", int),
    "--max-num-seqs": ("max_num_seqs", int),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int),
    "--kv-cache-dtype": ("kv_cache_dtype", str),
    "--tensor-parallel-size": ("tensor_parallel_size", int),
}


def vllm_flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``--flag V`` or ``--flag=V`` in ``args`` (last one wins), else None."""
    value = None
    for i, a in enumerate(args):
        if a == flag:
            if i + 1 >= len(args):
                raise UserError(f"vLLM argument {flag} has no value")
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _aliases(args: Sequence[str]) -> list[str]:
    """vLLM's short spellings of the flags read here, spelled out (``-tp 2``)."""
    return ["--tensor-parallel-size" if a == "-tp" else
            "--tensor-parallel-size=" + a[4:] if a.startswith("-tp=") else a for a in args]


def plan_kwargs_from_vllm_args(args: Sequence[str]) -> dict[str, Any]:
    """The keyword arguments for `plan` found among a user's vLLM flags (the CUDA-graph
    settings always: they decide how a decode batch is padded)."""
    out: dict[str, Any] = {"graphs": capture.settings_from_vllm_args(args)}
    args = _aliases(args)
    for flag, (key, kind) in VLLM_PLAN_FLAGS.items():
        raw = vllm_flag_value(args, flag)
        if raw is None:
            continue
        try:
            out[key] = kind(raw)
        except ValueError:
            raise UserError(
                f"vLLM argument {flag} {raw!r} is not a valid {kind.__name__}"
            ) from None
    return out
