"""Put back in host memory the offloaded weights that vLLM's weight processing moved to VRAM.

vLLM's UVA offloader marks each parameter it moved to pinned host memory with
``_vllm_is_uva_offloaded``. After loading, `process_weights_after_loading` runs each
layer inside `device_loading_context` (``vllm/model_executor/model_loader/utils.py``), whose
exit re-offloads a marked parameter only when it finds it unmarked: the sign, up to 0.26,
that the quantization method had registered a new Parameter in its place. From 0.33
`replace_parameter` keeps the Parameter object and rebinds its ``.data`` to the new
(device) tensor when the shape changes, so the mark survives and the exit leaves the
tensor in VRAM: every Marlin repack in 0.33, and in 0.34 the ones that grow (Marlin's
padding of the intermediate size; 0.34 copies a result that fits back into the host
storage). The weights the user offloaded then fill the card the cache was sized for
(vLLM issue #58178 reports the same of MXFP4's weight processing).

`reoffloading` wraps that context: a parameter marked before the layer's processing, still
the same object and still marked after it, whose data no longer sits where it sat, is
copied back to pinned host memory and viewed from the device, as vLLM's own exit does for
an unmarked one. One layer's new tensors are in VRAM at a time, as vLLM intends.
Pure of vLLM: the context, the host-view function and the pinning flag are handed in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

#: vLLM's mark on a parameter its UVA offloader moved to host memory
UVA_MARK = "_vllm_is_uva_offloaded"

#: the module holding `device_loading_context` (0.26.0, 0.33.0 and 0.34.0)
LOADER_UTILS_MODULE = "vllm.model_executor.model_loader.utils"
#: the context, and the function its exit uses to view a host tensor from the device
CONTEXT_NAME = "device_loading_context"
VIEW_NAME = "get_accelerator_view_from_cpu_tensor"


class Tally:
    """What the wrapper moved back in this process; ``first`` is called at the first."""

    def __init__(self, first: Callable[[], None] | None = None) -> None:
        self.params = 0
        self.bytes = 0
        self._first = first

    def add(self, nbytes: int) -> None:
        if self.params == 0 and self._first is not None:
            self._first()
        self.params += 1
        self.bytes += nbytes

    def line(self) -> str | None:
        """The summary, or None when nothing was moved."""
        if not self.params:
            return None
        return (f"{self.params} offloaded parameters ({self.bytes / 2**30:.2f} GiB) that "
                "vLLM's weight processing had left in VRAM were moved back to host memory")


def _marked(module: Any) -> dict[str, tuple[Any, int]]:
    """name -> (the parameter object, its data's address) of every marked parameter."""
    return {name: (p, p.data.data_ptr()) for name, p in module.named_parameters()
            if getattr(p, UVA_MARK, False)}


def reoffloading(context: Callable[..., Any], to_device_view: Callable[[Any], Any],
                 pin: Callable[[], bool], tally: Tally) -> Callable[..., Any]:
    """``context`` (vLLM's `device_loading_context`) with its exit completed: see the
    module's docstring. ``to_device_view(cpu_tensor)`` is vLLM's host-view function,
    ``pin()`` whether vLLM pins host copies (its own rule, read at each exit)."""

    @contextlib.contextmanager
    def wrapped(module: Any, target_device: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        on_device = target_device is not None and getattr(target_device, "type", "") != "cpu"
        before = _marked(module) if on_device else {}
        with context(module, target_device, *args, **kwargs) as out:
            yield out
        if not before:
            return
        import torch

        for name, p in module.named_parameters():
            seen = before.get(name)
            if (seen is None or seen[0] is not p or not getattr(p, UVA_MARK, False)
                    or p.data.data_ptr() == seen[1]):
                continue
            host = torch.empty_like(p.data, device="cpu", pin_memory=pin()).copy_(p.data)
            p.data = to_device_view(host)
            tally.add(host.numel() * host.element_size())

    wrapped.__wrapped__ = context  # type: ignore[attr-defined]
    wrapped.__name__ = getattr(context, "__name__", CONTEXT_NAME)
    wrapped.__doc__ = getattr(context, "__doc__", None)
    return wrapped


def patch_loader_utils(module: Any, tally: Tally) -> str | None:
    """Wrap ``module``'s `device_loading_context` once (`compat.wrap_once`); why not, or
    None when wrapped. ``module`` is vLLM's loader utilities (`LOADER_UTILS_MODULE`)."""
    from .compat import wrap_once

    view = getattr(module, VIEW_NAME, None)

    def pin() -> bool:  # the exit's own rule, from the names its module holds
        available = getattr(module, "is_pin_memory_available", None)
        envs = getattr(module, "envs", None)
        return bool((available() if callable(available) else True)
                    and not getattr(envs, "VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY", False))

    if not callable(view) or not wrap_once(
            module, CONTEXT_NAME, lambda context: reoffloading(context, view, pin, tally)):
        return (f"{LOADER_UTILS_MODULE} has no {CONTEXT_NAME} or {VIEW_NAME}: offloaded "
                "weights that vLLM's weight processing moves to VRAM stay there")
    return None
