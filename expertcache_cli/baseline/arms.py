"""Arms: the server configurations a baseline compares, and the order they run in.

An arm is a whole server configuration, not a request option, because what we measure
(expert residency, host reads, the cache) is fixed when the server loads its weights.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from .. import config
from ..config import CacheConfig
from ..errors import UserError
from ..rules.budget import online_names
from ..rules.policy import Policy, Wide

_CACHE_RE = re.compile(rf"^cache:(\d+)(?::({online_names('|')}))?"
                       rf"(?::({'|'.join(m.value for m in Wide)}))?$")


@dataclass(frozen=True)
class Arm:
    """One server configuration.

    kind: ``resident`` (stock vLLM, every expert in VRAM), ``offload`` (experts in pinned
    host memory, plugin disabled: the control) or ``cache`` (offloaded, plugin armed with
    ``slots`` slots per layer, ``policy`` and ``wide``, what steps wider than the slots
    do: `policy.Wide`).
    """

    name: str
    kind: str
    slots: int | None = None
    policy: str | None = None
    wide: Wide | None = None
    #: a ``plan:PLAN.json`` arm: the plan's per-layer budgets, served as `serve --plan` would
    slots_per_layer: tuple[int, ...] | None = None

    @property
    def offloaded(self) -> bool:
        return self.kind != "resident"

    def env(self, stats_every: int | None = None) -> dict[str, str | None]:
        """Environment overrides for this arm's server; ``None`` means "remove".

        The resident and offload arms disable the plugin outright, so they are the stock
        server; every arm drops any inherited ``EXPERT_CACHE_*`` variable that would change
        what it measures or writes (`config.MEANING`: an inherited DECAY would stop every
        cache server at startup, an inherited TRACE make them all write one file).
        """
        env: dict[str, str | None] = {k: None for k in config.MEANING}
        if self.kind == "cache":
            budget = ({"slots_per_layer": self.slots_per_layer} if self.slots_per_layer
                      else {"slots": self.slots})
            cfg = CacheConfig(**budget, policy=Policy.parse(self.policy or "lru"),
                              stats_every=stats_every or 0,
                              wide=self.wide or Wide.IN_PLACE)
        else:
            cfg = CacheConfig(disabled=True)
        env.update(cfg.to_env())
        return env

    def server_args(
        self, cpu_offload_gb: float | None, vllm_args: list[str] | tuple[str, ...] = (),
        offload_args: list[str] | tuple[str, ...] = (),
    ) -> list[str]:
        """vLLM arguments this arm adds: the expert offload for every arm but resident (with
        ``offload_args``, the flags a format needs to stay offloaded:
        `vllm_experts.offload_backend_args`), and a drain on shutdown for cache arms (unless
        ``vllm_args``, the user's, set one)."""
        if not self.offloaded:
            return []
        if cpu_offload_gb is None:
            raise UserError(
                f"arm {self.name!r} offloads experts: pass --cpu-offload-gb GB or --vram GB"
            )
        args = ["--cpu-offload-gb", _fmt_gb(cpu_offload_gb), "--cpu-offload-params", "experts",
                *offload_args]
        if self.kind == "cache" and not any(
            a == "--shutdown-timeout" or a.startswith("--shutdown-timeout=") for a in vllm_args
        ):
            args += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
        return args


#: Seconds vLLM's API server gives its engine process to exit when the baseline stops a
#: cache arm's server. vLLM's default (0, "abort") SIGKILLs the engine right after its
#: SIGTERM, before the engine's shutdown logs the plugin's final counters (source in
#: docs/design.md, measured constants). The server is idle when stopped, so a drain
#: costs nothing measured; only cache arms get it (they alone log counters, and a vLLM too
#: old for the flag is too old for the plugin), so resident and offload stay stock.
#: (`server.Server.stop` does the other half: only the leader gets SIGINT.)
SHUTDOWN_TIMEOUT_S = 10


def _fmt_gb(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def parse_arm(text: str) -> Arm:
    """``resident`` | ``offload`` | ``cache:S[:lru|lfu][:in-place|staged|staged-install]`` |
    ``plan:PLAN.json`` (a `plan --save` file: its per-layer budgets and policy, the way
    `serve --plan` serves them, so a baseline confirms exactly what is deployed)."""
    if text.strip().startswith("plan:"):
        from ..planning.planner import read_plan

        path = text.strip()[len("plan:"):]
        rec = read_plan(path)
        return Arm(name=text.strip(), kind="cache", slots=min(rec["per_layer_slots"]),
                   policy=rec["policy"], slots_per_layer=tuple(rec["per_layer_slots"]),
                   wide=rec["wide"])
    t = text.strip().lower()
    if t in ("resident", "offload"):
        return Arm(name=t, kind=t)
    m = _CACHE_RE.match(t)
    if not m:
        raise UserError(
            f"bad arm {text!r}: expected resident, offload, cache:SLOTS, "
            f"cache:SLOTS:{online_names('|')}, "
            "optionally :staged or :staged-install (wide steps through a scratch), or "
            "plan:PLAN.json"
        )
    slots = int(m.group(1))
    if slots <= 0:
        raise UserError(f"bad arm {text!r}: the slot budget must be at least 1")
    return Arm(name=t, kind="cache", slots=slots, policy=m.group(2),
               wide=Wide.parse(m.group(3)) if m.group(3) else None)


def parse_arms(text: str) -> list[Arm]:
    """A comma-separated list of arms, each named once."""
    parts = [p for p in (s.strip() for s in text.split(",")) if p]
    if not parts:
        raise UserError("--arms is empty: name at least one of resident, offload, cache:S")
    arms = [parse_arm(p) for p in parts]
    seen: set[str] = set()
    for arm in arms:
        if arm.name in seen:
            raise UserError(f"arm {arm.name!r} is named twice in --arms")
        seen.add(arm.name)
    return arms


def plugin_refusals(arms: list[Arm], server_cmd: str | None,
                    environ: Mapping[str, str] | None = None) -> list[str]:
    """Reasons the cache arms would run without the plugin, checked before any server
    starts: vLLM would serve them uncached, silently, and a cache arm that cannot arm
    measures the offload floor under the cache's name. ``VLLM_PLUGINS`` that leaves
    expertcache out; with the default server command (this python's vLLM), a plugin not
    installed here or a vLLM release whose MoE layout the plugin has not read. A
    ``server_cmd`` of the user's runs another environment, which this one cannot see into.
    No cache arm: nothing to refuse."""
    import os

    from ..planning.launch import plugin_installed

    if not any(a.kind == "cache" for a in arms):
        return []
    environ = os.environ if environ is None else environ
    out = []
    plugins = environ.get("VLLM_PLUGINS")
    if plugins is not None and "expertcache" not in [p.strip() for p in plugins.split(",")]:
        out.append(f"VLLM_PLUGINS={plugins!r} does not name expertcache: cache arms run uncached")
    if server_cmd is None and not plugin_installed():
        out.append(
            "the expertcache vLLM plugin is not installed in this python (pip install -e .): "
            "cache arms would run uncached"
        )
    if server_cmd is None:
        from ..vllm_facts import releases

        why = releases.installed_refusal()
        if why:
            out.append(f"{why}: the plugin would decline every layer and cache arms would "
                       "run uncached")
    return out


def round_order(arms: list[str], restart: int) -> list[str]:
    """The arm order for one restart round: the list rotated by the round index.

    Rotation puts each arm first (and last) in turn, so a slow drift of the machine
    (thermals, page cache, another tenant) does not always land on the same arm.
    """
    if not arms:
        return []
    k = restart % len(arms)
    return arms[k:] + arms[:k]
