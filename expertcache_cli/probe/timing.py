"""How every probe figure is timed: CUDA events around back-to-back calls after a warm-up,
the median of repeats; and device views of pinned host memory (the zero-copy path)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from .report import MiB, Rate


def _time_per_call(torch, fn: Callable[[], None], iters: int, repeats: int, warmup: int,
                   stream, on_warm: Callable[[], None] | None = None) -> list[float]:
    """Seconds per call of ``fn``: ``repeats`` samples of ``iters`` back-to-back calls,
    each bracketed by CUDA events on ``stream`` (the stream the calls enqueue on).
    ``on_warm`` runs once after the warm-up, before the first timed call."""
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        stream.synchronize()
        if on_warm is not None:
            on_warm()
        samples = []
        for _ in range(repeats):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record(stream)
            for _ in range(iters):
                fn()
            b.record(stream)
            b.synchronize()
            samples.append(a.elapsed_time(b) / 1e3 / iters)
    return samples


def _rate(path: str, nbytes: int, samples: list[float], note: str = "") -> Rate:
    med = statistics.median(samples)
    rates = [nbytes / s for s in samples if s > 0]
    spread = (max(rates) - min(rates)) / (nbytes / med) if rates and med > 0 else 0.0
    return Rate(path, nbytes, med, nbytes / med / 1e9 if med > 0 else 0.0, len(samples),
                spread, note)


def _iters_for(nbytes: int, target: int = 128 * MiB) -> int:
    """Back-to-back calls per sample so each sample moves ~128 MiB (amortises event cost)."""
    return max(1, min(256, target // max(1, nbytes)))


class _CudaView:
    """A ``__cuda_array_interface__`` over pinned host memory: with unified virtual
    addressing the host address is valid on the device, so torch kernels given this view
    read host memory in place (what vLLM's offloader and our gather do)."""

    def __init__(self, ptr: int, nbytes: int, typestr: str = "<i4", itemsize: int = 4):
        self.__cuda_array_interface__ = {
            "shape": (nbytes // itemsize,),
            "typestr": typestr,
            "data": (ptr, False),
            "version": 2,
        }


def device_view(torch, host, device: int):
    """A CUDA int32 tensor aliasing the pinned host tensor ``host`` (no copy)."""
    view = torch.as_tensor(_CudaView(host.data_ptr(), host.numel() * host.element_size()),
                           device=f"cuda:{device}")
    if view.data_ptr() != host.data_ptr():
        raise RuntimeError("torch copied the host buffer instead of viewing it in place")
    return view
