"""expertcache: a VRAM cache of MoE expert slots for vLLM, and the tools to size it.

The public API is ``__all__`` below (documented in docs/api.md). Importing the package is
cheap on purpose: every vLLM process imports it when the plugin registers, and `replay`,
`size` and `trace` must start fast on any machine, so each name is loaded from its module
on first use (PEP 562) and torch and vLLM are imported only by the modules that drive a
GPU.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # the cache rules and the replay
    "Policy": "rules.policy",
    "LayerCache": "rules.policy",
    "replay_trace": "rules.replay",
    "Trace": "rules.trace",
    "load_trace": "rules.trace",
    "save_trace": "rules.trace",
    # sizing a model on a card
    "load_model": "sizing.model_size",
    "ModelSize": "sizing.model_size",
    "plan": "sizing.sizing",
    "SizePlan": "sizing.sizing",
    "plan_trace": "planning.planner",
    # the plugin's configuration
    "CacheConfig": "config",
    "from_env": "config",
    # the kernels and the link
    "SlotCache": "device.slotcache",
    "probe_link": "probe",
    # serving
    "make_serve_plan": "planning.launch",
    "BaselineConfig": "baseline.runner",
    "run_baseline": "baseline.runner",
}

#: names whose module spells them differently
_ALIASES = {"load_trace": "load", "save_trace": "save", "make_serve_plan": "make_plan",
            "replay_trace": "replay"}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'expertcache_cli' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), _ALIASES.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
