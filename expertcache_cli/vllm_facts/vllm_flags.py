"""A user's `vllm serve` flags, read as sizing needs them.

`serve`, `baseline` and `size -- FLAGS` pass the user's vLLM arguments through; the ones
that change a plan (context, batch, utilization, KV and state dtypes, CUDA-graph settings)
are read here, once, the way vLLM reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import UserError
from . import capture

#: vLLM flags that change a plan, and the `plan` keyword (and type) each one feeds. Every
#: caller that passes a user's vLLM arguments through (`serve`, `baseline`) reads them here.
VLLM_PLAN_FLAGS: dict[str, tuple[str, type | str]] = {
    "--max-model-len": ("max_model_len", int),
    "--max-num-seqs": ("max_num_seqs", int),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int),
    "--kv-cache-dtype": ("kv_cache_dtype", str),
    "--block-size": ("block_size", int),
    "--mamba-cache-dtype": ("mamba_cache_dtype", str),
    "--mamba-ssm-cache-dtype": ("mamba_ssm_cache_dtype", str),
    "--tensor-parallel-size": ("tensor_parallel_size", int),
    "--quantization": ("vllm_quantization", str),
    "--moe-backend": ("moe_backend", str),
    "--kv-cache-memory-bytes": ("kv_cache_memory_bytes", "bytes"),
    "--speculative-config": ("speculative_tokens", "spec"),
}


def speculative_tokens(raw: str) -> int:
    """Draft tokens a sequence carries into each verify step, from vLLM's
    ``--speculative-config`` JSON (``num_speculative_tokens``; MTP and EAGLE may leave it
    to the draft model: counted as 1, the least any method proposes)."""
    import json

    try:
        value = json.loads(raw)
    except ValueError:
        raise ValueError(raw) from None
    if not isinstance(value, dict):
        raise ValueError(raw)
    n = value.get("num_speculative_tokens")
    return 1 if n is None else max(int(n), 0)

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_bytes(raw: str) -> int:
    """An integer as vLLM reads ``--kv-cache-memory-bytes``: plain, or with a suffix,
    lower case decimal (``25.6k`` = 25,600) and upper case binary (``4G`` = 4 x 2**30,
    whole numbers only); raises ValueError otherwise."""
    text = raw.strip()
    if text and text[-1] in _BINARY:
        return int(text[:-1]) * _BINARY[text[-1]]
    if text and text[-1] in _DECIMAL:
        return int(float(text[:-1]) * _DECIMAL[text[-1]])
    return int(text)


#: vLLM's online quantisations sizing can follow: the --quantization value -> our format
ONLINE_FORMATS = {"fp8": "fp8"}


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


_SHORT = {"-tp": "--tensor-parallel-size", "-q": "--quantization",
          "-sc": "--speculative-config"}


def _aliases(args: Sequence[str]) -> list[str]:
    """vLLM's short spellings of the flags read here, spelled out (``-tp 2``, ``-q fp8``)."""
    out = []
    for a in args:
        key, sep, val = a.partition("=")
        out.append(_SHORT[key] + sep + val if key in _SHORT else a)
    return out


def online_quantization_refusal(args: Sequence[str], model_quant: str, model_name: str,
                                vllm_version: tuple[int, int] | None = None) -> str | None:
    """Why ``--quantization`` on an unquantised checkpoint cannot serve with offloaded
    experts, or None (no such flag, or a checkpoint already quantised: vLLM reads its own
    format then).

    Online quantisation creates the expert weights on the meta device and fills them while
    loading; vLLM's UVA offloader copies every selected parameter to the host before that,
    and a meta tensor has no data: vLLM 0.26 died at load ("Cannot copy out of meta
    tensor"), and 0.27-0.33 create and offload them the same way (read in their
    sources: online/moe_base.py, offloader/uva.py).
    """
    q = vllm_flag_value(_aliases(args), "--quantization")
    if not q or model_quant not in ("bf16", "fp16"):
        return None
    seen = "crashes vLLM 0.26 at load (seen)" if vllm_version in (None, (0, 26)) else (
        f"is, by its source, unsupported in vLLM {vllm_version[0]}.{vllm_version[1]} too")
    return (
        f"--quantization {q} quantises {model_name}'s {model_quant} weights while loading "
        f"(online), and offloading experts created that way {seen}: serve a pre-quantised "
        "checkpoint instead (e.g. Qwen/Qwen3-30B-A3B-FP8, RedHatAI's W8A8 INT8), or leave "
        "--quantization out"
    )


def _switch(args: Sequence[str], flag: str) -> bool | None:
    """A vLLM on/off flag, ``--flag`` / ``--no-flag`` (argparse's BooleanOptionalAction;
    the last one given wins), or None where neither is: vLLM's default then."""
    given = None
    for a in args:
        if a in (flag, "--no-" + flag[2:]):
            given = a == flag
    return given


def prefix_caching(args: Sequence[str]) -> bool | None:
    """vLLM's ``--[no-]enable-prefix-caching``, or None: vLLM's default."""
    return _switch(args, "--enable-prefix-caching")


def hybrid_kv_cache_manager(args: Sequence[str]) -> bool | None:
    """vLLM's ``--[no-]disable-hybrid-kv-cache-manager`` as whether the manager is on; off
    too with a ``--kv-transfer-config`` and no explicit ``--no-disable-...`` (vLLM turns it
    off for a connector that does not support it: taken as off, the larger reserve); None
    where vLLM decides."""
    disabled = _switch(args, "--disable-hybrid-kv-cache-manager")
    if disabled is None and vllm_flag_value(args, "--kv-transfer-config") is not None:
        return False
    return None if disabled is None else not disabled


def plan_kwargs_from_vllm_args(args: Sequence[str]) -> dict[str, Any]:
    """The keyword arguments for `plan` found among a user's vLLM flags (the CUDA-graph
    settings always: they decide how a decode batch is padded)."""
    out: dict[str, Any] = {"graphs": capture.settings_from_vllm_args(args)}
    if (caching := prefix_caching(args)) is not None:
        out["prefix_caching"] = caching
    if (manager := hybrid_kv_cache_manager(args)) is not None:
        out["hybrid_kv_cache_manager"] = manager
    args = _aliases(args)
    for flag, (key, kind) in VLLM_PLAN_FLAGS.items():
        raw = vllm_flag_value(args, flag)
        if raw is None:
            continue
        parse = (human_readable_bytes if kind == "bytes"
                 else speculative_tokens if kind == "spec" else kind)
        try:
            out[key] = parse(raw)
        except ValueError:
            what = ("byte count" if kind == "bytes" else "JSON object" if kind == "spec"
                    else kind.__name__)
            raise UserError(f"vLLM argument {flag} {raw!r} is not a valid {what}") from None
    return out


def with_flag(args: Sequence[str], flag: str, value: str) -> list[str]:
    """``args`` with every ``flag V`` / ``flag=V`` (short spellings too) replaced by one
    ``flag value`` at the end: an option of our own that wins over the flag after ``--``."""
    short = [k for k, v in _SHORT.items() if v == flag]
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        key = a.partition("=")[0]
        if key == flag or key in short:
            skip = "=" not in a
            continue
        out.append(a)
    return [*out, flag, value]
