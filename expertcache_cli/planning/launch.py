"""`expertcache serve`: turn a card size into a sized `vllm serve` command with the cache.

The plan is pure (no torch, no vLLM, nothing launched) so that it is tested in CI: read
the vLLM flags the user passed after ``--`` that change the sizing (max-num-seqs,
max-model-len, memory utilisation, batched tokens, KV dtype), ask `sizing.plan` for the
slot budget and the ``--cpu-offload-gb`` that moves every expert to host memory, then
compose the environment (``EXPERT_CACHE_*``) and the argument vector. The sizing trap
(a full batch of ``max_num_seqs x top_k`` ids wider than the slots reads through,
silently) is refused unless the user accepts it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .. import config
from ..config import TRUE_WORDS, CacheConfig
from ..errors import UserError
from ..rules import budget
from ..rules.policy import Wide
from ..sizing import sizing
from ..sizing.sizing import SHORT_CONTEXT, Verdict
from ..vllm_facts import installed_vllm, releases, vllm_experts, vllm_flags, vllm_runner

#: flags serve sets itself; given by the user, the user's value wins (noted in the plan)
_OWNED_FLAGS = ("--cpu-offload-gb", "--cpu-offload-params", "--gpu-memory-utilization",
                "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                "--tensor-parallel-size")


# One reader of the user's vLLM flags, shared with `baseline`: it lives with `sizing.plan`.
flag_value = vllm_flags.vllm_flag_value
sizing_overrides = vllm_flags.plan_kwargs_from_vllm_args


def vllm_command() -> list[str]:
    """How to start vLLM here: the ``vllm`` script, else its module (no script on PATH)."""
    exe = shutil.which("vllm")
    if exe:
        return [exe]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


@dataclass
class ServePlan:
    """What `serve` will run: the sizing, the environment it adds, the command."""

    model: str
    size: object  # sizing.SizePlan
    env: dict[str, str]
    argv: list[str]
    notes: list[str] = field(default_factory=list)
    per_layer: list[int] | None = None

    def shell(self) -> str:
        """The plan as one shell line (``--dry-run`` prints it)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)


def _wide(given: Wide | str | None, planned: Wide | None, plan_file: str | None) -> Wide:
    """The wide-step mode to serve: the one given, else the plan file's, else in place;
    one line when the given one is not a mode or contradicts the plan's."""
    if given is not None:
        try:
            given = Wide.parse(given)
        except ValueError as exc:
            raise UserError(f"--wide: {exc}") from None
    if planned is not None and given is not None and given is not planned:
        raise UserError(
            f"--wide {given.value}: the plan {plan_file} was priced with --wide "
            f"{planned.value}; serve it that way (leave --wide out) or plan again with "
            f"--wide {given.value}")
    return given or planned or Wide.IN_PLACE


def make_plan(
    model: str,
    vram_gb: float,
    *,
    slots: int | None = None,
    fraction: float | None = None,
    policy: str = "lru",
    decay: int = 0,
    size_from: str | None = None,
    allow_trap: bool = False,
    vllm_args: Sequence[str] = (),
    launcher: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    device_total_gib: float | None = None,
    plan_file: str | None = None,
    wide: Wide | str | None = None,
    v2_runner_offloads: Callable[[], bool | None] = vllm_runner.v2_runner_offloads,
    v1_runner_present: Callable[[], bool | None] = vllm_runner.v1_runner_present,
    wna16_triton: Callable[[], bool | None] = vllm_experts.wna16_triton_available,
    mxfp4_marlin: Callable[[], bool | None] = vllm_experts.mxfp4_marlin_available,
    humming: Callable[[], bool | None] = vllm_experts.humming_ranked_first,
) -> ServePlan:
    """Size the cache for ``model`` on ``vram_gb`` GiB and compose the `vllm serve` call.

    ``device_total_gib``: the GPU vLLM will run on (`gpu_info.device_total_gib`); on a
    bigger GPU than the card, vLLM gets the card's share of it (see `sizing.plan`).
    ``v2_runner_offloads``: whether the vLLM that will run offloads on its V2 model runner
    (`vllm_runner`; tests pass their own); ``wna16_triton``: whether it can run 4-bit
    experts on Triton, ``mxfp4_marlin`` whether it can keep offloaded MXFP4 experts on
    the host with Marlin, ``humming`` whether it ranks Humming ahead of Marlin for 4-bit
    experts on Hopper (`vllm_experts`); ``v1_runner_present`` whether it still has a V1
    model runner (`vllm_runner`).
    ``plan_file``: a plan from `expertcache plan --save`; its per-layer budgets and policy
    are served, checked against this card (one per MoE layer, each below E, all of them
    within the bytes of the uniform budget that fits), with the wide-step mode it was
    priced with: ``wide`` None takes the plan's (in place without a plan), and a ``wide``
    that contradicts the plan's is refused, since the plan's predictions would not hold.
    """

    environ = os.environ if environ is None else environ
    model_refusal(model)
    per_layer: list[int] | None = None
    if plan_file is not None:
        if slots is not None or fraction is not None:
            raise UserError("give --plan or --slots / --fraction, not both")
        from .planner import read_plan

        rec = read_plan(plan_file)
        per_layer, policy = list(rec["per_layer_slots"]), rec["policy"]
    wide = _wide(wide, rec["wide"] if plan_file is not None else None, plan_file)
    try:
        pol = budget.online_policy(policy)[0]
    except ValueError as exc:
        raise UserError(f"--policy {policy!r}: {exc}") from None
    try:
        budget.online_policy(pol, decay)
    except ValueError as exc:
        raise UserError(f"--decay {decay}: {exc}") from None
    # (--slots with --fraction, and the fraction's range, are refused by sizing.plan)
    args = list(vllm_args)
    if args and args[0] == "--":
        args = args[1:]
    overrides = sizing_overrides(args)
    size = sizing.plan(
        size_from or model, vram_gb, slots=slots, fraction=fraction,
        device_total_gib=device_total_gib, wide=wide,
        narrowest=min(per_layer) if per_layer else None, **overrides
    )
    wide_mode = size.wide
    notes = list(size.notes)
    own: list[str] = []
    if size.verdict.offloads:
        _refuse_online_quantization(args, size_from or model)
    why = vllm_experts.triton_refusal(size.quant, args, wna16_triton(), installed_vllm.release())
    if why:
        raise UserError(why)
    if size.verdict is Verdict.DOES_NOT_FIT:
        shorter = next((f" ({n})" for n in size.notes if SHORT_CONTEXT in n), "")
        raise UserError(f"{size.model} on {size.where}: {size.verdict_text}{shorter}")
    if size.verdict is Verdict.FITS_OUTRIGHT:
        notes.append("every expert fits in VRAM: serving without offload, the cache stays off")
        env = CacheConfig(disabled=True).to_env()
    elif size.verdict is Verdict.OFFLOAD_NO_CACHE:
        # (the verdict's text says why: too little room for top_k slots, or ragged slabs)
        notes.append("experts offloaded, the cache off")
        env = CacheConfig(disabled=True).to_env()
    else:
        if per_layer is not None:
            _check_per_layer(per_layer, size, plan_file or "")
        # (sizing judged the trap against the narrowest layer: it reads through first)
        if size.trap and not allow_trap:
            narrow = min(per_layer) if per_layer else size.slots
            raise UserError(
                budget.trap_text(size.max_num_seqs, size.padded_batch, size.top_k, narrow,
                                 size.safe_max_num_seqs, size.graphs,
                                 size.speculative_tokens).replace(
                    "keeps every decode step on it",
                    "keeps every decode step on it (pass it after --), or --allow-trap to "
                    "serve anyway")
            )
        held = size.resident_bytes  # what stays beside the slots
        if per_layer is not None:
            env = CacheConfig(slots_per_layer=tuple(per_layer), policy=pol, decay=decay,
                              wide=wide_mode, planned_weights=held).to_env()
        else:
            env = CacheConfig(slots=size.slots, policy=pol, decay=decay, wide=wide_mode,
                              planned_weights=held).to_env()
    planned = size.vllm_args()
    for flag, value in zip(planned[::2], planned[1::2]):
        given = flag_value(args, flag) if flag in _OWNED_FLAGS else None
        if given is not None:
            if flag not in vllm_flags.VLLM_PLAN_FLAGS:
                notes.append(f"{flag} {given} given by you replaces the planned {value}")
            continue
        own += [flag, value]
    _refuse_extensible_kv(args, own)
    if config.SLOTS in env and environ.get(config.FRACTION, "").strip():
        env[config.FRACTION] = ""  # one budget only: the plan's slots win
        notes.append(f"{config.FRACTION} from your environment is replaced by the planned slots")
    if config.DISABLE not in env and env_disables(environ):
        notes.append(f"{config.DISABLE}=1 in your environment: the cache will not arm "
                     "(the control run)")
    vtext = installed_vllm.release()
    v1 = v1_runner_present()
    why = vllm_runner.runner_env_refusal(environ, v1, vtext)
    if why:  # vLLM would stop at start whatever is offloaded
        raise UserError(why)
    if flag_value([*own, *args], "--cpu-offload-gb") not in (None, "0"):
        extra, note = vllm_runner.offload_runner_env(environ, v2_runner_offloads(), vtext, v1)
        env.update(extra)
        notes += [note] if note else []
        # the installed vLLM asked, and the why; the flags (and their note) are the plan's
        # own unless the offload is the user's (a model that fits, offloaded anyway)
        flags, note = vllm_experts.offload_backend_args(size.quant, args, mxfp4_marlin(), vtext,
                                                        humming=humming(),
                                                        cached=config.SLOTS in env)
        if flags and flag_value(own, flags[0]) is None:
            own += flags
            notes += [note] if note else []
    if config.SLOTS in env:
        note = vllm_experts.kernel_note(size.quant, args, vtext)
        notes += [note] if note else []
    argv = [*(launcher or vllm_command()), "serve", model, *own, *args]
    return ServePlan(model=model, size=size, env=env, argv=argv, notes=notes, per_layer=per_layer)


def _check_per_layer(per_layer: list[int], size: sizing.SizePlan, source: str) -> None:
    """A plan's per-layer budgets fit this model and card, or one line says why not."""
    layers, experts = size.num_moe_layers, size.num_experts
    if len(per_layer) != layers:
        raise UserError(f"--plan {source}: {len(per_layer)} per-layer budgets for a model of "
                        f"{layers} MoE layers (a plan made for another model?)")
    worst = max(per_layer)
    if min(per_layer) < size.top_k:
        raise UserError(f"--plan {source}: a layer budget of {min(per_layer)} slots is below "
                        f"top_k {size.top_k}: not even one token could be served from it")
    try:
        budget.check_slots(worst, experts)
    except ValueError as exc:
        raise UserError(f"--plan {source}: a layer budget of {exc}") from None
    if sum(per_layer) > size.max_slots * layers:
        need = sum(per_layer) * size.bytes_per_expert / 2**30
        room = size.max_slots * size.bytes_per_slot / 2**30
        raise UserError(f"--plan {source}: its slots need {need:.2f} GiB; this card has room "
                        f"for {room:.2f} GiB ({size.max_slots} a layer)")


#: vLLM 0.34's switch for its extensible KV cache, which it refuses beside
#: ``--kv-cache-memory-bytes`` ("it sizes the KV cache from measured memory")
EXTENSIBLE_KV_FLAG = "--enable-extensible-kv-cache"


def _refuse_extensible_kv(args: Sequence[str], own: Sequence[str]) -> None:
    """One line before launch, not vLLM's ValueError at start: the plan hands vLLM its KV
    bytes (so that a cold compile cannot shrink them), and vLLM 0.34 will not size an
    extensible KV cache from measured memory with them given."""
    asked = any(a == EXTENSIBLE_KV_FLAG or a.startswith(EXTENSIBLE_KV_FLAG + "=")
                for a in args)
    if asked and "--kv-cache-memory-bytes" in own:
        raise UserError(
            f"{EXTENSIBLE_KV_FLAG}: vLLM refuses it beside --kv-cache-memory-bytes, which "
            "serve passes with an offload so that a first start's compile cannot shrink the "
            "KV cache; leave the flag out (or give your own --kv-cache-memory-bytes)")


def _refuse_online_quantization(args: Sequence[str], spec: str) -> None:
    """Experts offloaded and quantised while loading: vLLM cannot do it (one line, the way)."""
    from ..sizing.model_size import load_model

    m = load_model(spec)
    why = vllm_flags.online_quantization_refusal(args, m.quant, m.name,
                                                 installed_vllm.version())
    if why:
        raise UserError(why)


def model_refusal(model: str) -> None:
    """MODEL is what vLLM will load: a sizing preset's name or a config.json is not.

    (`size` takes both; `serve` passes MODEL to `vllm serve`, which would fail on them
    after the whole plan was printed.)
    """
    from pathlib import Path

    from ..sizing.presets import PRESETS

    path = Path(model).expanduser()
    if path.is_file():
        raise UserError(
            f"MODEL {model} is a file; vLLM loads a model directory or a Hugging Face id: give "
            f"that as MODEL, and --size-from {model} if the sizing should read this file"
        )
    preset = PRESETS.get(model.strip().lower())
    if preset is not None and not path.is_dir():
        raise UserError(
            f"MODEL {model!r} is a sizing preset, not a model vLLM can load: give the model "
            f"itself (a local directory or a Hugging Face id; the preset stands for "
            f"{preset.hf_id}) and --size-from {model}"
        )


def launch_refusal(argv: Sequence[str]) -> str | None:
    """Why ``argv`` cannot start here, checked before the plan hands over the process."""
    import importlib.util

    exe = argv[0] if argv else ""
    if not exe or (shutil.which(exe) is None and not os.access(exe, os.X_OK)):
        return f"cannot start {exe!r}: not a program on PATH"
    if exe == sys.executable and "-m" in argv and importlib.util.find_spec("vllm") is None:
        return (f"vLLM is not installed in this python ({sys.executable}): "
                "pip install 'expertcache[vllm]' (or run serve from vLLM's environment)")
    return None


#: why `serve` refuses a plan that arms the cache where vLLM would not find the plugin
PLUGIN_MISSING = ("the expertcache vLLM plugin is not installed in this python (pip install "
                  "expertcache): vLLM would serve uncached")


def plugin_missing(plan: ServePlan) -> bool:
    """The plan arms the cache (it sets ``EXPERT_CACHE_SLOTS``) and this python's vLLM
    would not find the plugin (`plugin_installed`): the server would run uncached and look
    as if it worked. A plan with the cache off needs no plugin."""
    return config.SLOTS in plan.env and not plugin_installed()


def env_disables(environ: Mapping[str, str]) -> bool:
    """Whether the user's environment turns the cache off (``EXPERT_CACHE_DISABLE=1``, the
    control run): a plan then notes it, and nothing is refused for a cache that will not arm."""
    return environ.get(config.DISABLE, "").strip().lower() in TRUE_WORDS


def vllm_refusal(plan: ServePlan) -> str | None:
    """Why the vLLM installed here would not arm the cache ``plan`` asks for: its release is
    outside those whose MoE layout the plugin read (`releases.version_refusal`). The plugin
    would decline every layer inside the server, which would then serve at the offload
    floor with the slots' memory planned away from its KV cache and look as if it worked.
    None with the cache off or disabled (``EXPERT_CACHE_DISABLE=1``: the control run), or
    without a vLLM here (`launch_refusal` says that)."""
    if config.SLOTS not in plan.env:
        return None
    if env_disables(os.environ):
        return None  # the control run the user asked for: the cache is not to arm
    why = releases.installed_refusal()
    if why is None:
        return None
    return (f"{why}: the cache would not arm and vLLM would serve every expert from the "
            f"host; install a known release (pip install '{releases.pip_pin()}'), or serve "
            "without the cache (EXPERT_CACHE_DISABLE=1)")


def start_refusal(plan: ServePlan, missing: bool | None = None) -> str | None:
    """Why ``plan`` cannot start here, checked before `serve` hands over its process: its
    program (`launch_refusal`), else a cache it arms that no plugin would arm
    (`plugin_missing`; ``missing``: the caller's answer where it asked already, as a dry
    run does to warn of it), else a vLLM release the plugin does not know (`vllm_refusal`).
    None: it may start."""
    why = launch_refusal(plan.argv)
    if why:
        return why
    if missing is None:
        missing = plugin_missing(plan)
    return PLUGIN_MISSING if missing else vllm_refusal(plan)


def plugin_installed() -> bool:
    """Whether vLLM will find the plugin (the package's entry point metadata is installed)."""
    from importlib.metadata import entry_points

    return any(ep.name == "expertcache" for ep in entry_points(group="vllm.general_plugins"))
