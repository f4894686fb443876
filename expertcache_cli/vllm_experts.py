"""Which experts kernel vLLM will run a quantised checkpoint on, as far as the cache cares.

The plugin arms only experts kernels that index the weights by the routing id and nothing
else (`plugin.compat.KNOWN_EXPERTS`: vLLM's Triton experts). vLLM picks the kernel per
format in its backend oracles, and for 4-bit weights it prefers Marlin on NVIDIA GPUs
(0.26: Marlin is the only WNA16 backend there is besides FlashInfer's TRT-LLM kernel;
0.32 and 0.33 also offer Triton, chosen with ``--moe-backend triton``). MXFP4 goes to
Marlin or OpenAI's triton_kernels. A cached `serve` of such a checkpoint would silently run
at the offload floor, every layer declined; this module says so before launch, and names
the flag where the installed vLLM has a kernel the cache arms. Read from the installed
vLLM's source, importing nothing.
"""

from __future__ import annotations

from . import installed_vllm, vllm_flags

WNA16_ORACLE = ("model_executor", "layers", "fused_moe", "oracle", "int_wna16.py")
#: the line of the WNA16 oracle that maps ``--moe-backend triton`` to the Triton experts
TRITON_WNA16 = '"triton": WNA16MoEBackend.TRITON'


def wna16_triton_available(source: str | None = None) -> bool | None:
    """Whether the installed vLLM can run 4-bit experts on Triton (``--moe-backend
    triton``); None without vLLM here. ``source``: the oracle's text (tests)."""
    return installed_vllm.source_says(TRITON_WNA16, WNA16_ORACLE, source)


def kernel_note(quant: str, args: list[str], triton: bool | None,
                version: str | None = None) -> str | None:
    """What a cached `serve` of a ``quant`` checkpoint should be told about the kernel vLLM
    will pick, or None (a format on Triton experts, or a backend the user chose)."""
    which = f"vLLM {version}" if version else "vLLM"
    if quant == "mxfp4":
        return (f"{which} runs MXFP4 experts on Marlin or triton_kernels, which the cache "
                "does not arm yet: every layer will be declined (the offload floor)")
    if quant != "w4a16" or vllm_flags.vllm_flag_value(args, "--moe-backend") is not None:
        return None
    if triton is None:  # no vLLM here to read: what every release we know does
        return ("4-bit experts: vLLM runs them on Marlin by default, which the cache does not "
                "arm yet; from vLLM 0.32 `-- --moe-backend triton` runs them on Triton, which "
                "it arms")
    if triton:
        return (f"4-bit experts: {which} picks Marlin by default, which the cache does not "
                "arm yet; add `-- --moe-backend triton` to run them on vLLM's Triton WNA16 "
                "kernel, which it arms (each layer's first call is checked against the stock "
                "path)")
    return (f"4-bit experts: {which} runs them on Marlin, which the cache does not arm yet: "
            "every layer will be declined (the offload floor); vLLM 0.32 and later can run "
            "them on Triton (`--moe-backend triton`), which it arms")
