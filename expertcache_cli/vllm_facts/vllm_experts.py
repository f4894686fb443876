"""Which experts kernel vLLM will run a quantised checkpoint on, as far as the cache cares.

The plugin arms the experts kernels it knows (`plugin.compat.KNOWN_EXPERTS`): vLLM's
Triton experts, and its Marlin experts, which run every 4-bit format on NVIDIA GPUs up to
Hopper (GPTQ, AWQ, compressed-tensors W4A16, NVFP4 weight-only, MXFP4 offloaded; vLLM's
default up to Ada, and on Hopper the kernel `serve` asks for, below). Asked for another
backend (``--moe-backend flashinfer_trtllm``, ``humming``, ``emulation``, ...), vLLM runs
them on a kernel the plugin declines, and a
cached `serve` of such a checkpoint would silently run at the offload floor, every layer
declined: this module says so before launch. Read from the installed vLLM's source,
importing nothing.

MXFP4 has a worse trap: on Hopper vLLM (0.26 to 0.33) prefers triton_kernels, whose
weight processing swaps the expert Parameters for swizzled tensors held as plain
attributes, which the offloader never re-offloads. Measured with vLLM 0.26 on an
8-layer gpt-oss-20b-shaped checkpoint (bench/results/formats.md): "Total CPU offloaded
parameters: 3.16" GB and still 5.8 GiB of weights in VRAM, the whole model. Offloading
MXFP4 experts therefore needs ``--moe-backend marlin`` (its repacked weights replace the
Parameters by name, so vLLM moves them back to host memory, and the plugin arms Marlin);
`offload_backend_args` adds it, or refuses the backends that keep the experts in VRAM.

From 0.32 vLLM ranks its Humming kernel ahead of Marlin for GPTQ, AWQ, compressed-tensors
W4A16 and NVFP4 on Hopper (``quantization/utils/humming/priority.py``, sm_90): served as
they come, those experts run on a kernel the plugin declines, every layer at the offload
floor. `offload_backend_args` passes ``--moe-backend marlin`` for them where the installed
vLLM has that ranking (elsewhere Marlin is what vLLM picks anyway, or a kernel the cache
cannot arm either), unless the user named a backend.

The other formats the cache arms run on vLLM's Triton experts, but vLLM (0.26 to 0.34)
picks them only on some GPUs: unquantised experts run on FlashInfer's kernels on Blackwell
(``oracle/unquantized.py``: FlashInfer first on CUDA, moved back on Hopper only), FP8 with
per-channel or per-tensor scales on CUTLASS or FlashInfer from Hopper on (``oracle/fp8.py``:
both ahead of Triton), block FP8 on DeepGEMM or FlashInfer on Blackwell (Triton is moved to
the front on Hopper only). Each of those is declined, every layer at the offload floor.
So where the cache is asked for, `offload_backend_args` pins ``--moe-backend triton`` for
them (every release maps it, for each of these formats, to the Triton experts; on the GPUs
where vLLM picks Triton anyway it changes nothing), unless the user named a backend. INT8
W8A8 runs on Triton on every NVIDIA GPU and is left as it comes.
"""

from __future__ import annotations

from ..errors import UserError
from . import installed_vllm, vllm_flags

WNA16_ORACLE = ("model_executor", "layers", "fused_moe", "oracle", "int_wna16.py")
#: the line of the WNA16 oracle that maps ``--moe-backend triton`` to the Triton experts
TRITON_WNA16 = '"triton": WNA16MoEBackend.TRITON'


MXFP4_ORACLE = ("model_executor", "layers", "fused_moe", "oracle", "mxfp4.py")
#: the line of the MXFP4 oracle that maps ``--moe-backend marlin`` to Marlin
MXFP4_MARLIN = '"marlin": [Mxfp4MoeBackend.MARLIN]'
#: ``--moe-backend`` values whose MXFP4 weights live outside the layer's Parameters (vLLM's
#: TRITON_BACKENDS on NVIDIA), so in VRAM whatever ``--cpu-offload-gb`` says
MXFP4_VRAM_BACKENDS = ("triton", "triton_unfused")


def backend_name(raw: str) -> str:
    """A ``--moe-backend`` value as vLLM reads it: lower case, dashes as underscores
    (``Triton-Unfused`` is ``triton_unfused``)."""
    return raw.strip().lower().replace("-", "_")


def mxfp4_marlin_available(source: str | None = None) -> bool | None:
    """Whether the installed vLLM can run MXFP4 experts on Marlin (``--moe-backend marlin``);
    None without vLLM here. ``source``: the oracle's text (tests)."""
    return installed_vllm.source_says(MXFP4_MARLIN, MXFP4_ORACLE, source)


HUMMING_PRIORITY = ("model_executor", "layers", "quantization", "utils", "humming",
                    "priority.py")
#: the ranking's marker: the compute capabilities on which Humming outranks Marlin
HUMMING_PREFERRED = "_HUMMING_PREFERRED_CAPABILITIES"
#: formats whose oracle (int_wna16, nvfp4) applies that ranking to its default backends
HUMMING_FIRST = ("w4a16", "nvfp4")
#: formats the cache arms on vLLM's Triton experts (``--moe-backend triton`` in the
#: unquantized, int8 and fp8 oracles of 0.26-0.34)
TRITON_FORMATS = ("bf16", "fp16", "w8a8", "fp8", "fp8-block")
#: of them, the unquantised ones, whose oracle reads ``humming`` (and from 0.33 ``marlin``)
#: as auto: quantisation-only backends (0.26-0.32 refuse ``marlin`` for them at load)
UNQUANTISED = ("bf16", "fp16")
#: those of them that vLLM runs on another kernel on some NVIDIA GPUs, and which kernel
#: (INT8 W8A8 has no other there: Triton leads ``oracle/int8.py`` in 0.26-0.34)
PINNED_TRITON = {
    "bf16": "FlashInfer for unquantised experts on Blackwell GPUs",
    "fp16": "FlashInfer for unquantised experts on Blackwell GPUs",
    "fp8": "CUTLASS or FlashInfer for per-channel and per-tensor FP8 experts from Hopper on",
    "fp8-block": "DeepGEMM or FlashInfer for block FP8 experts on Blackwell GPUs",
}


def humming_ranked_first(source: str | None = None) -> bool | None:
    """Whether the installed vLLM ranks Humming ahead of Marlin for 4-bit experts on some
    GPUs (0.32+: Hopper); None without vLLM here, or without that ranking (0.26-0.31).
    ``source``: the ranking file's text (tests)."""
    return installed_vllm.source_says(HUMMING_PREFERRED, HUMMING_PRIORITY, source)


def _pinned(args: list[str], backend: str, note: str) -> tuple[list[str], str | None]:
    """``--moe-backend backend`` with the note that says why; nothing where the user named
    a backend (their choice is judged by `declined_kernel`)."""
    if vllm_flags.vllm_flag_value(args, "--moe-backend") is not None:
        return [], None
    return ["--moe-backend", backend], note


def offload_backend_args(quant: str, args: list[str], marlin: bool | None,
                         version: str | None = None, *,
                         humming: bool | None = None,
                         cached: bool = False) -> tuple[list[str], str | None]:
    """The vLLM flags that keep offloaded ``quant`` experts in host memory and on a kernel
    the cache arms, with the note that says why; raises `UserError` when the user's own
    ``--moe-backend`` (or the installed vLLM) cannot keep them offloaded. MXFP4 needs
    Marlin to stay offloaded; GPTQ/AWQ/W4A16 and NVFP4 need it where vLLM would pick
    Humming (``humming``: `humming_ranked_first`), and NVFP4 where the cache is asked for
    (``cached``: vLLM's native FP4 kernels lead on Blackwell); the formats on Triton get
    it pinned where the cache is asked for (see the module's docstring)."""
    if quant in HUMMING_FIRST and humming:
        which = f"vLLM {version}" if version else "this vLLM"
        return _pinned(args, "marlin", (
            f"{quant} experts: --moe-backend marlin is passed, because on Hopper {which} runs "
            "them on Humming by default, a kernel the cache does not arm"))
    if quant == "nvfp4" and cached:
        return _pinned(args, "marlin", (
            "nvfp4 experts: --moe-backend marlin is passed, the kernel the cache arms (vLLM "
            "picks its FlashInfer or CUTLASS FP4 kernels for them on Blackwell GPUs, which it "
            "does not)"))
    if quant in PINNED_TRITON and cached:
        return _pinned(args, "triton", (
            f"{quant} experts: --moe-backend triton is passed, the kernel the cache arms (vLLM "
            f"picks {PINNED_TRITON[quant]}, which it does not)"))
    if quant != "mxfp4":
        return [], None
    which = f"vLLM {version}" if version else "vLLM"
    stays = ("triton_kernels' MXFP4 layout is held outside the layer's parameters, where "
             "vLLM's offloader cannot move it, so every expert stays in VRAM whatever "
             "--cpu-offload-gb says (measured with vLLM 0.26)")
    chosen = vllm_flags.vllm_flag_value(args, "--moe-backend")
    chosen = backend_name(chosen) if chosen is not None else None
    if chosen in (*MXFP4_VRAM_BACKENDS, "auto"):
        picks = " (on NVIDIA it picks triton_kernels)" if chosen == "auto" else ""
        raise UserError(
            f"--moe-backend {chosen}{picks} cannot offload MXFP4 experts: {stays}; drop the flag "
            "(serve then passes --moe-backend marlin), or serve without offload on a card "
            "that holds every expert")
    if chosen is not None:  # the user's kernel (Marlin, FlashInfer): Parameters, offloaded
        return [], None
    if marlin is False:
        raise UserError(
            f"{which} cannot keep MXFP4 experts in host memory: it has no --moe-backend "
            f"marlin, and on its default kernel {stays}; upgrade vLLM, or serve without "
            "offload on a card that holds every expert")
    return ["--moe-backend", "marlin"], (
        f"MXFP4 experts offloaded: --moe-backend marlin is passed, because on {which}'s "
        "default kernel (triton_kernels) they would stay in VRAM: its layout is held outside "
        "the parameters vLLM's offloader moves")


def wna16_triton_available(source: str | None = None) -> bool | None:
    """Whether the installed vLLM can run 4-bit experts on Triton (``--moe-backend
    triton``); None without vLLM here. ``source``: the oracle's text (tests)."""
    return installed_vllm.source_says(TRITON_WNA16, WNA16_ORACLE, source)


#: ``--moe-backend`` values under which vLLM runs 4-bit experts on its Marlin experts
#: (auto: its default on NVIDIA up to Ada, and up to Hopper before 0.32; offloaded
#: MXFP4, and on 0.32+ GPTQ/AWQ/W4A16/NVFP4, get marlin from `serve`) or,
#: for the integer formats from 0.32, on its Triton WNA16 experts: kernels the plugin arms
ARMED_4BIT_BACKENDS = {"w4a16": ("auto", "marlin", "triton"), "nvfp4": ("auto", "marlin"),
                       "mxfp4": ("auto", "marlin")}


def declined_kernel(quant: str, moe_backend: str | None,
                    marlin: bool | None = None, *, humming: bool | None = None) -> str | None:
    """Why the plugin would decline every MoE layer of a ``quant`` checkpoint that vLLM
    runs with ``--moe-backend moe_backend`` (None: vLLM's default), or None where it can
    arm them. 4-bit experts on Marlin (vLLM's default up to Ada; on Hopper, where 0.32+
    prefers Humming, what `offload_backend_args` asks for) are armed where ``marlin``
    (default: `config.marlin_from_env`,
    ``EXPERT_CACHE_MARLIN=1``) allows; another backend named is not. Offloaded MXFP4 runs
    on Marlin (`offload_backend_args` passes it; a backend that keeps the experts in VRAM
    is refused there). ``humming`` (`humming_ranked_first`): a ``--moe-backend auto`` the
    user typed runs these formats on Humming on Hopper, which is declined."""
    if quant in TRITON_FORMATS:
        backend = backend_name(moe_backend or "auto")
        # (unquantised layers read humming, and from 0.33 marlin, as auto: `UNQUANTISED`)
        if backend in ("auto", "triton") or (quant in UNQUANTISED and backend in
                                             ("humming", "marlin")):
            return None
        return (f"vLLM runs these experts on --moe-backend {backend}, a kernel the cache "
                "does not arm (it arms vLLM's Triton experts: leave the flag out, and serve "
                "pins triton where vLLM would pick another)")
    if quant not in ARMED_4BIT_BACKENDS:
        return None
    backend = backend_name(moe_backend or "auto")
    if moe_backend is not None and backend == "auto" and humming and quant in HUMMING_FIRST:
        return ("vLLM runs these 4-bit experts under --moe-backend auto on Humming on Hopper, "
                "a kernel the cache does not arm (Marlin, which serve asks for when the flag "
                "is left out, it arms)")
    if backend not in ARMED_4BIT_BACKENDS[quant]:
        return (f"vLLM runs these 4-bit experts on --moe-backend {backend}, a kernel the "
                "cache does not arm (vLLM's default, Marlin, it arms)")
    if backend == "triton":
        return None
    from ..config import marlin_from_env

    if not (marlin_from_env(quant=quant) if marlin is None else marlin):
        return marlin_declined("these 4-bit experts", quant)
    return None


def marlin_declined(what: str, quant: str | None) -> str:
    """The one reason Marlin experts of format ``quant`` are declined (`config.marlin_from_env`
    said no), as the plugin and `size` both word it."""
    from ..config import MARLIN, MARLIN_SERVED, marlin_setting

    served = ", ".join(sorted(MARLIN_SERVED))
    if marlin_setting() is False:
        return f"vLLM runs {what} on Marlin, which {MARLIN}=0 keeps on the stock path"
    return (f"vLLM runs {what} on Marlin, which the cache arms by default only in the formats "
            f"served from its slots on a GPU ({served}; {quant or 'this format'} not yet): "
            f"{MARLIN}=1 arms it")


def triton_refusal(quant: str, args: list[str], triton: bool | None,
                   version: str | None = None) -> str | None:
    """``--moe-backend triton`` for 4-bit experts on a vLLM that has no such backend (0.26:
    its WNA16 oracle maps marlin, humming, flashinfer_trtllm, emulation): vLLM would stop
    at load with a ValueError; this says it before launch, or None."""
    backend = vllm_flags.vllm_flag_value(args, "--moe-backend")
    if quant != "w4a16" or backend_name(backend or "") != "triton" or triton is not False:
        return None
    which = f"vLLM {version}" if version else "the vLLM installed here"
    return (f"--moe-backend triton: {which} has no Triton kernel for 4-bit experts (it runs "
            "them on Marlin); vLLM 0.32 and later have one, or leave the flag out to serve "
            "them on Marlin, which the cache arms")


def kernel_note(quant: str, args: list[str], version: str | None = None) -> str | None:
    """What a cache forced onto a ``quant`` checkpoint (``--slots``) should be told about the
    kernel vLLM will pick: a backend the plugin declines on every layer; None where it
    arms that kernel (`declined_kernel` decides)."""
    backend = vllm_flags.vllm_flag_value(args, "--moe-backend")
    why = declined_kernel(quant, backend, humming=humming_ranked_first())
    if why is None:
        return None
    if backend is None:  # vLLM's default kernel, which the cache arms only when asked
        return f"{why}: every layer will be declined (the offload floor)"
    which = f"vLLM {version}" if version else "vLLM"
    kind, armed = ("experts", "Triton") if quant in TRITON_FORMATS else ("4-bit experts",
                                                                          "Marlin")
    return (f"{kind} on --moe-backend {backend_name(backend)}: {which} runs them on a "
            "kernel the cache does not arm, so every layer will be declined (the offload "
            f"floor); leave the flag out to run them on {armed}, which it arms")
