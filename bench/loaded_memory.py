"""BENCH ONLY: what the device memory vLLM counts as "Model loading took" is made of.

Why: vLLM reports as the model's weights every byte allocated while it loads
(``torch.cuda.memory_allocated`` after minus before), and `size` plans the parameters. On
gpt-oss in MXFP4 on Marlin the two part by 0.2-0.3 GiB (4.32 GiB loaded where the plan
holds 3.99 on the flagship's offloaded floor; 4.21 beside its resident experts): tensors
the model holds outside its parameters, or parameters of a size `size` does not count.
With ``EC_BENCH_LOADED=1`` (and ``bench/trace_hook`` on PYTHONPATH) each GPU worker logs,
once its model runner has loaded, the allocated bytes split into the model's parameters
(experts and the rest), its buffers, the tensors its modules hold as plain attributes
(named), and live device tensors held elsewhere (grouped by shape and dtype), so that one
start names what the plan misses. Never part of the package.
"""

from __future__ import annotations

import gc
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

ENV = "EC_BENCH_LOADED"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
RUNNER_CLASS = "GPUModelRunner"
#: how many groups of tensors outside the model's parameters a line lists
TOP = 12

log = logging.getLogger("vllm.expertcache.bench")


@dataclass
class Breakdown:
    """Bytes on one device type, each storage counted once (the first name that reaches it)."""

    expert_params: int = 0
    other_params: int = 0
    buffers: int = 0
    #: "module.path.attr" -> bytes, tensors a module holds without registering them
    attributes: dict[str, int] = field(default_factory=dict)
    #: "shape dtype" -> (count, bytes), live tensors no module reaches
    elsewhere: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: parameters vLLM's UVA offloader moved to host memory: device tensors by type, host
    #: bytes in fact, so in no part above (nor in vLLM's figure)
    offloaded: int = 0

    @property
    def counted(self) -> int:
        return (self.expert_params + self.other_params + self.buffers
                + sum(self.attributes.values())
                + sum(b for _, b in self.elsewhere.values()))


def _storage(t: Any) -> tuple[int, int]:
    """(data pointer, bytes) of the whole storage behind ``t``: views share one entry."""
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def breakdown(model: Any, device_type: str = "cuda", scan: bool = True) -> Breakdown:
    """Walk ``model`` (parameters, buffers, tensor attributes of every module), then, with
    ``scan``, every live tensor the garbage collector knows of, keeping those on
    ``device_type`` whose storage nothing before reached."""
    import torch

    seen: set[int] = set()
    out = Breakdown()

    def take(t: Any) -> int:
        if not isinstance(t, torch.Tensor) or t.device.type != device_type:
            return 0
        ptr, nbytes = _storage(t)
        if ptr in seen or nbytes == 0:
            return 0
        seen.add(ptr)
        return nbytes

    for name, p in model.named_parameters(remove_duplicate=False):
        if getattr(p, "_vllm_is_uva_offloaded", False):
            out.offloaded += take(p)  # seen now: its views are not counted elsewhere
            continue
        n = take(p)
        if ".experts." in f".{name}":
            out.expert_params += n
        else:
            out.other_params += n
    for _, b in model.named_buffers(remove_duplicate=False):
        out.buffers += take(b)
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, value in vars(mod).items():
            if attr.startswith("_") or not isinstance(value, torch.Tensor):
                continue
            n = take(value)
            if n:
                out.attributes[f"{mod_name}.{attr}" if mod_name else attr] = n
    if scan:
        groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for obj in gc.get_objects():
            # type(), not isinstance(): the latter reads __class__, which lazy modules and
            # weak proxies among the collector's objects answer with warnings or errors
            if not issubclass(type(obj), torch.Tensor):
                continue
            n = take(obj)
            if n:
                g = groups[f"{tuple(obj.shape)} {str(obj.dtype).removeprefix('torch.')}"]
                g[0] += 1
                g[1] += n
        out.elsewhere = {k: (c, b) for k, (c, b) in groups.items()}
    return out


def lines(b: Breakdown, allocated: int, top: int = TOP) -> list[str]:
    """The log lines: the split, then the largest attribute tensors and unreached groups."""
    gib = 1 << 30
    head = (f"EC_BENCH_LOADED: allocated {allocated / gib:.3f} GiB = expert parameters "
            f"{b.expert_params / gib:.3f} + other parameters {b.other_params / gib:.3f} + "
            f"buffers {b.buffers / gib:.3f} + module attributes "
            f"{sum(b.attributes.values()) / gib:.3f} + held elsewhere "
            f"{sum(x for _, x in b.elsewhere.values()) / gib:.3f} + not found "
            f"{(allocated - b.counted) / gib:.3f} (offloaded to host, not counted: "
            f"{b.offloaded / gib:.3f})")
    out = [head]
    by_attr = defaultdict(lambda: [0, 0])  # the attribute's last name, over modules
    for name, n in b.attributes.items():
        a = by_attr[name.rsplit(".", 1)[-1]]
        a[0] += 1
        a[1] += n
    for attr, (c, n) in sorted(by_attr.items(), key=lambda kv: -kv[1][1])[:top]:
        out.append(f"EC_BENCH_LOADED attribute {attr}: {c} module(s), {n / (1 << 20):.2f} MiB")
    for key, (c, n) in sorted(b.elsewhere.items(), key=lambda kv: -kv[1][1])[:top]:
        out.append(f"EC_BENCH_LOADED elsewhere {key}: {c} tensor(s), {n / (1 << 20):.2f} MiB")
    return out


def patch_runner_class(cls: Any) -> bool:
    """Wrap ``cls.load_model`` (once) to log the breakdown after it returns."""
    orig = cls.__dict__.get("load_model")
    if orig is None:
        return False
    if getattr(orig, "_ec_loaded", False):
        return True

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        try:
            import torch

            gc.collect()
            allocated = torch.cuda.memory_allocated()
            # get_model() unwraps vLLM's CUDA-graph wrappers (a runner without it: .model)
            model = self.get_model() if hasattr(self, "get_model") else self.model
            for line in lines(breakdown(model), allocated):
                log.warning("%s", line)
        except Exception as exc:  # noqa: BLE001 - a bench probe never stops a start
            log.warning("EC_BENCH_LOADED: no breakdown (%s: %s)", type(exc).__name__, exc)
        return out

    load_model._ec_loaded = True  # type: ignore[attr-defined]
    cls.load_model = load_model
    return True


def install() -> bool:
    """Arrange the patch for when vLLM's GPU model runner is imported (no-op without ENV)."""
    if os.environ.get(ENV, "") in ("", "0"):
        return False
    from expertcache_cli.plugin import when_imported

    def patch(module: Any) -> None:
        cls = getattr(module, RUNNER_CLASS, None)
        if cls is None or not patch_runner_class(cls):
            log.error("BENCH: %s.%s has no load_model to wrap: no memory breakdown",
                      RUNNER_MODULE, RUNNER_CLASS)

    when_imported(RUNNER_MODULE, patch)
    return True
