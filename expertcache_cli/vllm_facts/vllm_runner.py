"""Which of vLLM's two GPU model runners will load the model, and whether it offloads.

vLLM has a V1 runner (``v1/worker/gpu_model_runner.py``) and a V2 runner
(``v1/worker/gpu/model_runner.py``), picked by ``VLLM_USE_V2_MODEL_RUNNER`` or, unset,
by vLLM itself: in 0.26 V2 is the default for some MoE architectures (DeepSeek-V2,
Qwen2-MoE, GraniteMoE, ...), in 0.33 for nearly everything. The expert offload
(``--cpu-offload-gb``) only happens where the runner installs vLLM's offloader before it
builds the model (``set_offloader(create_offloader(...))``). vLLM 0.26's V2 runner never
does: the flag is silently ignored, every expert is allocated in VRAM, and a card too
small for the experts dies at load (seen on an emulated 24 GiB card:
``OutOfMemoryError`` while creating the W8A8 expert weights). 0.32's and 0.33's V2 runners
install it.

So, where the installed runner cannot offload, `serve` and `baseline` start vLLM with
``VLLM_USE_V2_MODEL_RUNNER=0`` (V1 offloads in every release the plugin supports), and
refuse when the user forced V2 on; the plugin logs the same reason when it finds itself in
such a runner. The check reads the installed vLLM's source and imports nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import FALSE_WORDS, TRUE_WORDS
from ..errors import UserError
from . import installed_vllm

ENV = "VLLM_USE_V2_MODEL_RUNNER"
V2_RUNNER_FILE = ("v1", "worker", "gpu", "model_runner.py")
#: the V1 runner's file: in 0.26-0.33, gone from 0.34 (its one runner is the V2 one)
V1_RUNNER_FILE = ("v1", "worker", "gpu_model_runner.py")
#: the call that makes a runner offload: the V1 runner and the newer V2 runners make it
INSTALLS_OFFLOADER = "set_offloader("


def why_no_offload(version: str | None = None) -> str:
    """The one wording of the problem, for `serve`, `baseline` and the plugin's log."""
    which = f"vLLM {version}'s" if version else "this vLLM's"
    return (f"{which} V2 model runner never installs the CPU offloader, so --cpu-offload-gb "
            "is ignored there and every expert is allocated in VRAM")


def v2_runner_offloads(source: str | None = None) -> bool | None:
    """Whether the installed vLLM's V2 runner installs the offloader; None when there is
    no vLLM here or no V2 runner in it (nothing to decide). ``source``: the runner's text
    (tests)."""
    return installed_vllm.source_says(INSTALLS_OFFLOADER, V2_RUNNER_FILE, source)


def v1_runner_present() -> bool | None:
    """Whether the installed vLLM still has a V1 model runner to pick (0.26-0.33: yes;
    0.34 removed it); None without vLLM here."""
    return installed_vllm.has_file(*V1_RUNNER_FILE)


def runner_env_refusal(environ: Mapping[str, str], v1_present: bool | None,
                       version: str | None = None) -> str | None:
    """Why the environment stops a vLLM without a V1 runner at start, or None. From 0.34
    ``VLLM_USE_V2_MODEL_RUNNER`` set to anything but ``1`` (``0``, ``true``, empty) is a
    ValueError in vLLM's own environment check, before any model loads."""
    raw = environ.get(ENV)
    if v1_present is not False or raw is None or raw == "1":
        return None
    which = f"vLLM {version}" if version else "this vLLM"
    return (f"{ENV}={raw} in your environment: {which} has no V1 model runner and refuses "
            f"to start with {ENV} set to anything but 1; unset it")


def offload_runner_env(environ: Mapping[str, str], offloads: bool | None,
                       version: str | None = None, v1_present: bool | None = None,
                       ) -> tuple[dict[str, str], str | None]:
    """The environment a server that offloads experts needs, and a note saying why.

    ``offloads``: `v2_runner_offloads` of the vLLM that will run. When its V2 runner
    cannot offload: ``{ENV: "0"}``, or `UserError` when ``environ`` forces V2 on (the
    server would die at load or overshoot the card). Otherwise nothing.
    """
    why = runner_env_refusal(environ, v1_present, version)
    if why:
        raise UserError(why)
    if offloads is not False:
        return {}, None
    if v1_present is False:  # no V1 to pin: the offload cannot happen on this vLLM
        raise UserError(f"{why_no_offload(version)}, and it has no V1 model runner to serve "
                        "the offload on instead")
    raw = environ.get(ENV, "").strip().lower()
    if raw in TRUE_WORDS:
        raise UserError(f"{ENV}={environ.get(ENV)} in your environment: {why_no_offload(version)}"
                        f"; unset it (or set {ENV}=0) so that vLLM's V1 runner offloads")
    note = (f"{why_no_offload(version)}: serving on the V1 runner ({ENV}=0)"
            if raw not in FALSE_WORDS else None)
    return {ENV: "0"}, note


def runner_ignores_offload(worker: Any, modules: Mapping[str, Any],
                           version: str | None = None) -> str | None:
    """Inside vLLM, before the model loads: why the worker's runner will not offload the
    experts it was asked to, or None. ``modules``: `sys.modules` (the runner's module is
    already imported; a module that never names the offloader call cannot install it)."""
    runner = getattr(worker, "model_runner", None)
    cfg = getattr(getattr(worker, "vllm_config", None), "offload_config", None)
    gb = getattr(getattr(cfg, "uva", None), "cpu_offload_gb", 0) or 0
    if runner is None or not gb:
        return None
    module = modules.get(type(runner).__module__)
    if module is None or not type(runner).__module__.endswith(".gpu.model_runner"):
        return None
    if hasattr(module, INSTALLS_OFFLOADER.rstrip("(")):
        return None
    return (f"{why_no_offload(version)} ({gb:g} GB asked for); the experts load into VRAM. "
            f"Set {ENV}=0 (`expertcache serve` does)")
