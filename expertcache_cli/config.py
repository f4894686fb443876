"""The plugin's configuration and its environment contract: the one module that knows the
``EXPERT_CACHE_*`` variables, reading them (`from_env`) and writing them (`CacheConfig.to_env`).

Why the environment: the plugin runs inside vLLM's processes (API server, engine core,
workers), which we do not launch ourselves and whose command line we cannot extend.
Environment variables reach every one of them. `serve`, `baseline` and the kernel loader
take the names from here, so a variable is spelled, parsed and documented once. This
module is pure Python so that the parsing rules are tested on CPU, and a bad value fails
at ``vllm serve`` startup with a single line naming the variable, instead of deep inside
a worker.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError
from .rules import budget
from .rules.policy import Policy, Wide

SLOTS = "EXPERT_CACHE_SLOTS"
FRACTION = "EXPERT_CACHE_FRACTION"
POLICY = "EXPERT_CACHE_POLICY"
DECAY = "EXPERT_CACHE_DECAY"
DISABLE = "EXPERT_CACHE_DISABLE"
LIB = "EXPERT_CACHE_LIB"
STATS = "EXPERT_CACHE_STATS"
TRACE = "EXPERT_CACHE_TRACE"
WIDE = "EXPERT_CACHE_WIDE"
PDL = "EXPERT_CACHE_PDL"
AUDIT = "EXPERT_CACHE_AUDIT"
MARLIN = "EXPERT_CACHE_MARLIN"
SPREAD = "EXPERT_CACHE_SPREAD"
PLANNED_WEIGHTS = "EXPERT_CACHE_PLANNED_WEIGHTS"

@dataclass(frozen=True)
class EnvVar:
    """One variable of the contract: what it means and its default, as the README's and
    docs/plugin.md's tables must state them (tests/test_config.py holds both tables
    against this one: the same variables, each default cell starting with ``default``,
    each meaning cell carrying every phrase of ``says``)."""

    meaning: str
    default: str
    #: phrases every text that documents the variable must carry: what it must not
    #: drift away from (backticks aside)
    says: tuple[str, ...]


#: every variable the plugin reads: the source the docs' tables are checked against
ENV_VARS: dict[str, EnvVar] = {
    SLOTS: EnvVar("slots per MoE layer (1 <= S < experts), or one per MoE layer: S1,S2,...",
                  "unset", ("S1,S2,...",)),
    FRACTION: EnvVar("slots per layer as a fraction of the experts (0 < F < 1)", "unset",
                     ("0 < F < 1",)),
    POLICY: EnvVar("replacement policy: lru (default) or lfu", "lru", ("lru", "lfu")),
    DECAY: EnvVar("LFU only: halve every priority each N steps of a layer (0 = never)", "0",
                  ("LFU only", "halve every priority each")),
    DISABLE: EnvVar("1 = do not arm any layer (the control arm; stock offload path)", "off",
                    ("stock offload path",)),
    LIB: EnvVar("path of a prebuilt kernel library (.so) instead of the NVRTC build", "unset",
                ("prebuilt", "instead of the NVRTC build")),
    STATS: EnvVar("log the live hit rate every N layer-steps (the counters are copied behind "
                  "the step's work and never waited for)", "0",
                  ("hit rate every", "never waited for")),
    TRACE: EnvVar("record the routing of every armed layer into this .npz at shutdown",
                  "unset", ("routing", ".npz", "shutdown")),
    WIDE: EnvVar("steps wider than the slots: in-place (default), staged or staged-install "
                 "(through a VRAM scratch of one layer's experts)", "in-place",
                 ("in-place", "staged-install", "scratch")),
    PDL: EnvVar("0 = launch the cache's kernels without programmatic dependent launch (on by "
                "default on sm_90 and newer with a 12.3+ driver: each starts while the kernel "
                "before it ends)", "on", ("programmatic dependent launch", "sm_90", "12.3+")),
    SPREAD: EnvVar("0 = fill the compact copies of per-expert tensors smaller than a gather "
                   "slab (NVFP4's global scales) with one copy after every cache step, instead "
                   "of by the gather as it installs them", "on",
                   ("one copy after every cache step", "by the gather")),
    AUDIT: EnvVar("1 = at shutdown, compare every occupied slot with its expert's weights and "
                  "the table with the slots, and log what differs (syncs; copies the slots' "
                  "experts once)", "off", ("at shutdown", "occupied slot")),
    MARLIN: EnvVar("1 = arm vLLM's Marlin experts in every 4-bit format (GPTQ, AWQ, W4A16, "
                   "NVFP4, MXFP4), 0 = in none; unset, only the formats served from slots "
                   "on a GPU (MXFP4, NVFP4; GPTQ, AWQ and W4A16: today every one), a format "
                   "added later declined until served",
                   "every 4-bit format", ("Marlin experts", "served from slots")),
    PLANNED_WEIGHTS: EnvVar("bytes the plan holds in VRAM beside the slots (the non-expert "
                            "weights and vLLM's rotary cache), set by expertcache serve: "
                            "where vLLM loaded more, the plugin warns at start that the "
                            "difference comes out of the KV cache's and the compile's room",
                            "unset", ("set by expertcache serve", "warns")),
}

#: the variables that change what a server measures or writes: a launcher that states a
#: configuration (`baseline`'s arms) clears every one it does not set. (LIB only picks
#: where the same kernels come from, PDL only how they are launched,
#: SPREAD only how the same bytes reach the slots, AUDIT only checks them at shutdown.)
MEANING = (SLOTS, FRACTION, POLICY, DECAY, DISABLE, STATS, TRACE, WIDE)

#: slots as a fraction of the experts when neither SLOTS nor FRACTION is given, for a
#: `CacheConfig` built in code (benches, tests); the plugin itself arms nothing unless a
#: budget is asked for (`CacheConfig.asked`)
DEFAULT_FRACTION = 0.25

#: the values that turn a boolean variable on (any case); launch.make_plan reads them too
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})
_FALSE = FALSE_WORDS | {""}  # unset reads as off


class ConfigError(UserError):
    """An EXPERT_CACHE_* variable holds a value the plugin cannot use."""


@dataclass(frozen=True)
class CacheConfig:
    """What the environment asks of the plugin, validated.

    ``slots``, ``slots_per_layer`` and ``fraction`` are the ways to state the budget; at
    most one is set (none: ``DEFAULT_FRACTION``). ``slots_per_layer`` is one budget per MoE
    layer in model order (``EXPERT_CACHE_SLOTS=40,52,...``, what `expertcache plan`
    recommends). The slot count of a layer needs its expert count (and, per layer, its
    position), so it is resolved per layer by `slots_for`.
    """

    disabled: bool = False
    slots: int | None = None
    slots_per_layer: tuple[int, ...] | None = None
    fraction: float | None = None
    policy: Policy = Policy.LRU
    decay: int = 0
    lib: str | None = None
    stats_every: int = 0
    trace_path: str | None = None
    wide: Wide = Wide.IN_PLACE
    pdl: bool = True
    #: the gather fills the small tensors' compact slot copies itself (`plugin.small`)
    spread: bool = True
    #: at shutdown, check the slots against their experts' weights (`Session.audit`)
    audit: bool = False
    #: what the plan holds in VRAM beside the slots (`plugin.memory.weights_warning`)
    planned_weights: int | None = None

    @property
    def asked(self) -> bool:
        """Whether a budget was asked for (``EXPERT_CACHE_SLOTS`` or ``FRACTION``, which
        `serve` and `baseline` set). The plugin arms nothing without one: installed into a
        vLLM environment, it must not cache a model nobody meant it to."""
        return (self.slots is not None or self.slots_per_layer is not None
                or self.fraction is not None)

    def slots_for(self, num_experts: int, index: int | None = None) -> int:
        """Slots for the ``index``-th MoE layer, of ``num_experts`` experts; ValueError when
        it cannot work.

        A budget of ``E`` or more is refused: every expert would be resident, which is
        what not offloading does, without the cache's per-step work.
        """
        if self.slots_per_layer is not None:
            if index is None or not 0 <= index < len(self.slots_per_layer):
                raise ValueError(
                    f"{SLOTS} lists {len(self.slots_per_layer)} per-layer budgets; MoE layer "
                    f"{index} has none"
                )
            s = self.slots_per_layer[index]
        elif self.slots is not None:
            s = self.slots
        else:
            frac = DEFAULT_FRACTION if self.fraction is None else self.fraction
            s = budget.slots_from_fraction(frac, num_experts)
        try:
            return budget.check_slots(s, num_experts, "the layer's ")
        except ValueError as exc:
            raise ValueError(f"slot budget {exc}") from None

    def budget_text(self) -> str:
        """How the budget was asked for, as the startup line states it."""
        if self.slots_per_layer is not None:
            return f"per-layer budgets ({SLOTS}, {len(self.slots_per_layer)} values)"
        if self.slots is not None:
            return f"{self.slots} slots/layer ({SLOTS})"
        if self.fraction is not None:
            return f"{self.fraction:g} of experts/layer ({FRACTION})"
        return f"{DEFAULT_FRACTION:g} of experts/layer (default)"

    def to_env(self) -> dict[str, str]:
        """The variables that make `from_env` read this configuration back (unset fields
        are left out: the plugin's defaults apply)."""
        env: dict[str, str] = {}
        if self.disabled:
            env[DISABLE] = "1"
        if self.slots is not None:
            env[SLOTS] = str(self.slots)
        if self.slots_per_layer is not None:
            env[SLOTS] = ",".join(map(str, self.slots_per_layer))
        if self.fraction is not None:
            env[FRACTION] = repr(self.fraction)
        if not self.disabled:
            env[POLICY] = self.policy.name.lower()
        if self.decay:
            env[DECAY] = str(self.decay)
        if self.lib:
            env[LIB] = self.lib
        if self.stats_every:
            env[STATS] = str(self.stats_every)
        if self.trace_path:
            env[TRACE] = self.trace_path
        if self.wide is not Wide.IN_PLACE:
            env[WIDE] = self.wide.value
        if not self.pdl:
            env[PDL] = "0"
        if not self.spread:
            env[SPREAD] = "0"
        if self.audit:
            env[AUDIT] = "1"
        if self.planned_weights is not None:
            env[PLANNED_WEIGHTS] = str(self.planned_weights)
        return env


#: the kernels take their integers as C ints: a larger value would wrap (4294967297 -> 1)
INT_MAX = 2**31 - 1


def _int(env: Mapping[str, str], name: str, lo: int) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected an integer >= {lo}") from None
    if not lo <= value <= INT_MAX:
        raise ConfigError(f"{name}={raw!r}: expected an integer from {lo} to {INT_MAX}")
    return value


def _bytes(env: Mapping[str, str], name: str) -> int | None:
    """A byte count (no C-int limit: it never reaches a kernel), or None where unset."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ConfigError(f"{name}={raw!r}: expected a byte count (an integer >= 0)")
    return int(raw)


def _bool(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in TRUE_WORDS:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{name}={env.get(name)!r}: expected 1 or 0")


def _on_unless_0(env: Mapping[str, str], name: str) -> bool:
    """A switch that is on by default: unset or empty is on, else `_bool`'s reading."""
    return env.get(name, "").strip() == "" or _bool(env, name)


def pdl_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether the kernels may use programmatic dependent launch (where the GPU and driver
    have it, which `binding` decides). On unless ``EXPERT_CACHE_PDL=0``: it takes the
    served step from 4.21 to 3.83 us a layer over stock (bench/results/kernels.md) with the
    same tokens; the switch stays as the way back should a driver mishandle it."""
    return _on_unless_0(os.environ if env is None else env, PDL)


def kernel_source(env: Mapping[str, str] | None = None) -> tuple[str | None, bool]:
    """Where the cache's kernels come from and how they launch, as the environment says:
    (the library ``EXPERT_CACHE_LIB`` names, or None for the NVRTC build; PDL per
    ``EXPERT_CACHE_PDL``). The commands hand it to `binding.select`, which reads no
    environment itself; the plugin hands over its `CacheConfig`'s ``lib`` and ``pdl``."""
    env = os.environ if env is None else env
    return env.get(LIB) or None, pdl_from_env(env)


#: the 4-bit formats whose Marlin experts have been served from slots against their floor
#: on a GPU (armed on every layer, every check at difference 0, greedy tokens identical:
#: bench/results/formats.md, bench/results/flagship.md): armed unless EXPERT_CACHE_MARLIN=0
MARLIN_SERVED = frozenset({"mxfp4", "nvfp4", "w4a16"})


def marlin_from_env(env: Mapping[str, str] | None = None, quant: str | None = None) -> bool:
    """Whether Marlin experts of format ``quant`` may be armed. ``EXPERT_CACHE_MARLIN=1``
    arms every format, ``=0`` none; unset, the formats served from slots on a GPU
    (`MARLIN_SERVED`). Every format's arming (the stock block order remapped to slots,
    ragged per-expert tensors in a side row) is tested against CPU stand-ins of vLLM 0.26's
    and 0.33's classes, but serving must not change for a user who did not ask until its
    format has been served against its floor. `size`, `plan` and `serve` read the same
    switch, so a plan never promises a cache the plugin would decline."""
    setting = marlin_setting(env)
    return quant in MARLIN_SERVED if setting is None else setting


def marlin_setting(env: Mapping[str, str] | None = None) -> bool | None:
    """``EXPERT_CACHE_MARLIN`` as set (True, False), or None where it is not set."""
    env = os.environ if env is None else env
    return _bool(env, MARLIN) if env.get(MARLIN, "").strip() else None


def from_env(env: Mapping[str, str] | None = None) -> CacheConfig:
    """Parse and validate the EXPERT_CACHE_* variables; ConfigError names the bad one."""
    env = os.environ if env is None else env
    disabled = _bool(env, DISABLE)

    raw_slots = env.get(SLOTS, "")
    per_layer: tuple[int, ...] | None = None
    if "," in raw_slots:
        try:
            per_layer = tuple(_int({SLOTS: x}, SLOTS, 1) or 0 for x in raw_slots.split(","))
        except ConfigError as exc:
            raise ConfigError(f"{SLOTS}={raw_slots!r}: per-layer budgets: {exc}") from None
        if 0 in per_layer:
            raise ConfigError(f"{SLOTS}={raw_slots!r}: an empty entry in the per-layer list")
        slots = None
    else:
        slots = _int(env, SLOTS, 1)
    fraction: float | None = None
    raw_frac = env.get(FRACTION)
    if raw_frac is not None and raw_frac.strip() != "":
        try:
            fraction = budget.check_fraction(float(raw_frac))
        except ValueError:
            raise ConfigError(
                f"{FRACTION}={raw_frac!r}: expected a number between 0 and 1 (exclusive)"
            ) from None
    if (slots is not None or per_layer is not None) and fraction is not None:
        raise ConfigError(f"{SLOTS} and {FRACTION} are both set: give one budget")

    raw_policy = env.get(POLICY, "").strip()
    decay = _int(env, DECAY, 0) or 0
    try:
        policy = budget.online_policy(raw_policy or None)[0]
    except ValueError as exc:
        raise ConfigError(f"{POLICY}={raw_policy!r}: {exc}") from None
    if decay and policy is not Policy.LFU:
        raise ConfigError(
            f"{DECAY}={decay} only applies to {POLICY}=lfu (policy is {policy.name.lower()})"
        )

    lib = env.get(LIB, "").strip() or None
    if lib is not None:
        if not Path(lib).is_file():
            raise ConfigError(f"{LIB}={lib!r}: no such file")
        with open(lib, "rb") as f:
            if f.read(4) != b"\x7fELF":
                raise ConfigError(f"{LIB}={lib!r}: not a shared library (no ELF header); build "
                                  "one with `expertcache build-kernels --library PATH`")

    stats_every = _int(env, STATS, 0) or 0

    trace_path = env.get(TRACE, "").strip() or None
    if trace_path is not None:
        if not trace_path.endswith(".npz"):
            raise ConfigError(f"{TRACE}={trace_path!r}: the file name must end in .npz")
        parent = Path(trace_path).expanduser().resolve().parent
        if not parent.is_dir():
            raise ConfigError(f"{TRACE}={trace_path!r}: directory {parent} does not exist")

    raw_wide = env.get(WIDE, "").strip()
    try:
        wide = Wide.parse(raw_wide) if raw_wide else Wide.IN_PLACE
    except ValueError as exc:
        raise ConfigError(f"{WIDE}={raw_wide!r}: {exc}") from None

    return CacheConfig(
        disabled=disabled,
        slots=slots,
        slots_per_layer=per_layer,
        fraction=fraction,
        policy=policy,
        decay=decay,
        lib=lib,
        stats_every=stats_every,
        trace_path=trace_path,
        wide=wide,
        pdl=pdl_from_env(env),
        spread=_on_unless_0(env, SPREAD),
        audit=_bool(env, AUDIT),
        planned_weights=_bytes(env, PLANNED_WEIGHTS),
    )
