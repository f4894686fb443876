"""The plugin's configuration, read from the environment.

Why the environment: the plugin runs inside vLLM's processes (API server, engine core,
workers), which we do not launch ourselves and whose command line we cannot extend.
Environment variables reach every one of them. This module is pure Python so that the
parsing rules are tested on CPU, and a bad value fails at ``vllm serve`` startup with a
single line naming the variable, instead of deep inside a worker.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..policy import Policy

#: every variable the plugin reads, with a one-line meaning (README and docs/plugin.md)
ENV_VARS: dict[str, str] = {
    "EXPERT_CACHE_SLOTS": "slots per MoE layer (an integer, 1 <= S < experts)",
    "EXPERT_CACHE_FRACTION": "slots per layer as a fraction of the experts (0 < F < 1)",
    "EXPERT_CACHE_POLICY": "replacement policy: lru (default) or lfu",
    "EXPERT_CACHE_DECAY": "LFU only: halve every priority each N steps of a layer (0 = never)",
    "EXPERT_CACHE_DISABLE": "1 = do not arm any layer (the control arm; stock offload path)",
    "EXPERT_CACHE_LIB": "path of a prebuilt kernel library (.so) instead of the NVRTC build",
    "EXPERT_CACHE_STATS": "log the live hit rate every N layer-steps (syncs the device)",
    "EXPERT_CACHE_TRACE": "record the routing of every armed layer into this .npz at exit",
}

#: slots as a fraction of the experts when neither SLOTS nor FRACTION is given
DEFAULT_FRACTION = 0.25

#: the values that turn a boolean variable on (any case); launch.make_plan reads them too
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE = {"", "0", "false", "no", "off"}


class ConfigError(UserError):
    """An EXPERT_CACHE_* variable holds a value the plugin cannot use."""


@dataclass(frozen=True)
class CacheConfig:
    """What the environment asks of the plugin, validated.

    ``slots`` and ``fraction`` are the two ways to state the budget; at most one is set
    (neither: ``DEFAULT_FRACTION``). The per-layer slot count needs the layer's expert
    count, so it is resolved per layer by `slots_for`.
    """

    disabled: bool = False
    slots: int | None = None
    fraction: float | None = None
    policy: Policy = Policy.LRU
    decay: int = 0
    lib: str | None = None
    stats_every: int = 0
    trace_path: str | None = None

    def slots_for(self, num_experts: int) -> int:
        """Slots for a layer of ``num_experts`` experts; ValueError when it cannot work.

        A budget of ``E`` or more is refused: every expert would be resident, which is
        what not offloading does, without the cache's per-step work.
        """
        if self.slots is not None:
            s = self.slots
        else:
            from ..sizing import slots_from_fraction  # here: not on every process's import

            frac = DEFAULT_FRACTION if self.fraction is None else self.fraction
            s = slots_from_fraction(frac, num_experts)
        if s >= num_experts:
            raise ValueError(
                f"slot budget {s} is not below the layer's {num_experts} experts "
                "(nothing to cache: do not offload the experts instead)"
            )
        return s

    def budget_text(self) -> str:
        """How the budget was asked for, as the startup line states it."""
        if self.slots is not None:
            return f"{self.slots} slots/layer (EXPERT_CACHE_SLOTS)"
        if self.fraction is not None:
            return f"{self.fraction:g} of experts/layer (EXPERT_CACHE_FRACTION)"
        return f"{DEFAULT_FRACTION:g} of experts/layer (default)"


def _int(env: Mapping[str, str], name: str, lo: int) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected an integer >= {lo}") from None
    if value < lo:
        raise ConfigError(f"{name}={raw!r}: expected an integer >= {lo}")
    return value


def _bool(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in TRUE_WORDS:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{name}={env.get(name)!r}: expected 1 or 0")


def from_env(env: Mapping[str, str] | None = None) -> CacheConfig:
    """Parse and validate the EXPERT_CACHE_* variables; ConfigError names the bad one."""
    env = os.environ if env is None else env
    disabled = _bool(env, "EXPERT_CACHE_DISABLE")

    slots = _int(env, "EXPERT_CACHE_SLOTS", 1)
    fraction: float | None = None
    raw_frac = env.get("EXPERT_CACHE_FRACTION")
    if raw_frac is not None and raw_frac.strip() != "":
        try:
            fraction = float(raw_frac)
        except ValueError:
            raise ConfigError(
                f"EXPERT_CACHE_FRACTION={raw_frac!r}: expected a number between 0 and 1"
            ) from None
        if not (0.0 < fraction < 1.0) or math.isnan(fraction):
            raise ConfigError(
                f"EXPERT_CACHE_FRACTION={raw_frac!r}: expected a number between 0 and 1 "
                "(exclusive)"
            )
    if slots is not None and fraction is not None:
        raise ConfigError(
            "EXPERT_CACHE_SLOTS and EXPERT_CACHE_FRACTION are both set: give one budget"
        )

    raw_policy = env.get("EXPERT_CACHE_POLICY", "").strip()
    try:
        policy = Policy.parse(raw_policy) if raw_policy else Policy.LRU
    except ValueError:
        policy = None  # type: ignore[assignment]
    if policy not in (Policy.LRU, Policy.LFU):
        raise ConfigError(
            f"EXPERT_CACHE_POLICY={raw_policy!r}: choose lru or lfu "
            "(opt needs the future: it exists only in `expertcache replay`)"
        )

    decay = _int(env, "EXPERT_CACHE_DECAY", 0) or 0
    if decay and policy is not Policy.LFU:
        raise ConfigError(
            f"EXPERT_CACHE_DECAY={decay} only applies to EXPERT_CACHE_POLICY=lfu "
            f"(policy is {policy.name.lower()})"
        )

    lib = env.get("EXPERT_CACHE_LIB", "").strip() or None
    if lib is not None and not Path(lib).is_file():
        raise ConfigError(f"EXPERT_CACHE_LIB={lib!r}: no such file")

    stats_every = _int(env, "EXPERT_CACHE_STATS", 0) or 0

    trace_path = env.get("EXPERT_CACHE_TRACE", "").strip() or None
    if trace_path is not None:
        if not trace_path.endswith(".npz"):
            raise ConfigError(f"EXPERT_CACHE_TRACE={trace_path!r}: the file name must end in .npz")
        parent = Path(trace_path).expanduser().resolve().parent
        if not parent.is_dir():
            raise ConfigError(
                f"EXPERT_CACHE_TRACE={trace_path!r}: directory {parent} does not exist"
            )

    return CacheConfig(
        disabled=disabled,
        slots=slots,
        fraction=fraction,
        policy=policy,
        decay=decay,
        lib=lib,
        stats_every=stats_every,
        trace_path=trace_path,
    )
