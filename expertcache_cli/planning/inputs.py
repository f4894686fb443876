"""What `expertcache plan` rests on, chosen from what the user gave.

A prediction is only as good as its inputs, and each input can come from more than one
place: the link rate from a saved probe, a number, a card's usual slot or a measurement
on this machine's GPU; the resident rate from a number or a baseline results file; an
expert's bytes from a model or from the trace; the budgets from ``--slots`` or a grid up
to what the card fits. Which source wins, what is refused and the one line that names a
missing input are decided here, once, so that the command line only parses options, calls
these in order and prints, and every source is said along with its number (`Inputs`).

Every function takes the options as given (None: not given) and raises `UserError` with
one line that names the option, which the command line prints and exits 2 on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UserError

if TYPE_CHECKING:
    from ..rules.policy import Wide
    from ..rules.trace import Trace
    from ..sizing.cards import Card
    from ..sizing.model_size import ModelSize
    from .planner import Inputs
    from .serving import Server

#: a rate and where it came from (said next to it wherever it is printed)
Sourced = tuple[float, str]
#: the link rate, its source, and the all-hit cache step (us a MoE layer, source) where the
#: same source measured it (a probe, a measurement here), else None
LinkRate = tuple[float, str, Sourced | None]

#: what each of the two rates is and how to give it (the help and the missing-input line)
LINK_INPUT = ("the link rate (--probe FILE, a saved `probe-link --json`, --link-gbps G, or "
              "--vram naming the card: its usual link, estimated)")
RESIDENT_INPUT = ("the resident rate (--resident-tok-s R, decode tok/s with every expert in "
                  "VRAM, or --baseline FILE, a `baseline` results file with a resident arm)")


def check_given(link_gbps: float | None, probe_file: Path | None,
                resident_tok_s: float | None, baseline: Path | None,
                card: Card | None = None) -> None:
    """Both rates the prediction rests on are given, checked before any work.

    Why before: the replay, the sizing and a measurement take seconds to minutes, and a
    missing rate found after them is time lost. The link may also be estimated for a card
    named by ``--vram`` or measured on this machine's GPU, so it is missing only where
    neither can be done; the resident rate is never measured here. Two sources of one
    rate are refused (which one was meant is not for `plan` to guess). One line names
    every missing rate and how to pass it.
    """
    if link_gbps is not None and probe_file is not None:
        raise UserError("give --link-gbps or --probe, not both")
    if resident_tok_s is not None and baseline is not None:
        raise UserError("give --resident-tok-s or --baseline, not both")
    missing, where = [], ""
    if link_gbps is None and probe_file is None and card is None:
        from ..device.kernel_check import device_arch
        from ..errors import DeviceUnavailable

        try:
            device_arch(0)
        except DeviceUnavailable:  # nothing to measure the link on
            missing.append(LINK_INPUT)
            where = ", on this machine with no GPU,"
    if resident_tok_s is None and baseline is None:
        missing.append(RESIDENT_INPUT)
    if missing:
        raise UserError(f"plan needs{where} " + " and ".join(missing))


def link_rate(link_gbps: float | None, probe_file: Path | None, model: str | None,
              card: Card | None = None) -> LinkRate:
    """The link rate and its source, and the cache step (us, source) where measured.

    Which source wins, and why: ``--link-gbps`` (the user's own number, said to be
    given), else ``--probe`` (a `probe-link` saved on the serving machine: its gather
    rate and, where it measured it, the all-hit cache step), else, for a card named by
    ``--vram``, the rate its usual PCIe slot gives (`cards.typical_link_gbps`), said to
    be an estimate, rather than a probe of whatever GPU this machine has (a plan for
    another card is usually made away from it), else a measurement now on this machine's
    GPU: the gather at ``model``'s expert slab, the rate the cache's own copies run at,
    and the step with every expert a hit. A measurement with the kernels' torch stand-in
    is refused: it is not the rate the cache would get.
    """
    if link_gbps is not None:
        if not math.isfinite(link_gbps) or link_gbps <= 0:
            raise UserError(f"--link-gbps must be a positive number, got {link_gbps}")
        return link_gbps, "given (--link-gbps)", None
    if probe_file is not None:
        from .planner import read_probe

        return read_probe(probe_file)
    if card is not None:
        from ..sizing.cards import typical_link_gbps

        return typical_link_gbps(card), (
            f"typical for the {card.label} on {card.link} (the measured share of a Gen5 "
            "x16 link the gather reaches, scaled): an estimate; `probe-link --save FILE` on "
            "the machine and --probe FILE measure yours"), None
    return _measured_link(model)


def _measured_link(model: str | None) -> LinkRate:
    """The gather rate and the all-hit step measured now on GPU 0 (`link_rate`'s last
    source), with the kernels the caller selected (`device.binding.select`: a command
    hands it the environment's choice, as every command that loads kernels does)."""
    from .. import probe
    from ..device.kernel_check import device_arch

    device_arch(0, hint=f"plan needs {LINK_INPUT}")
    rep = probe.probe_link(model=model, repeats=3, warmup=1, only=("gather", "step"))
    row = probe.gather_row(rep.gather, rep.model["top_k"]) if rep.model else None
    if row is None or probe.is_stand_in(rep.gather_impl):
        why = "; ".join(rep.errors) or "no gather rate"
        raise UserError(f"the link could not be measured here ({why}): give --link-gbps or "
                        "--probe")
    step = (rep.step_us, f"measured now on {rep.device_name} (the cache step, every expert "
            "a hit)") if rep.step_us > 0 else None
    return row.gbps, f"measured now on {rep.device_name} (the gather, {row.path})", step


def resident_rate(resident_tok_s: float | None, baseline: Path | None,
                  read_baseline: Callable[[Path], Sourced]) -> Sourced:
    """The resident decode rate and its source: ``--resident-tok-s``, else the resident
    arm of the ``--baseline`` results file, read by ``read_baseline``
    (`baseline.runner.resident_from_baseline`, handed in by the command line: planning
    reads no harness, and the file is read only when it is the source). Never measured:
    it needs a server holding every expert."""
    if resident_tok_s is not None:
        if not math.isfinite(resident_tok_s) or resident_tok_s <= 0:
            raise UserError(f"--resident-tok-s must be positive, got {resident_tok_s}")
        return resident_tok_s, "given (--resident-tok-s)"
    if baseline is not None:
        return read_baseline(baseline)
    raise UserError(f"plan needs {RESIDENT_INPUT}")


def plan_model(spec: str | None, trace: Trace, demo: bool = False,
               vllm_quantization: str | None = None) -> ModelSize | None:
    """The model ``--model`` names (a preset, a config.json or a model directory), or None,
    as vLLM will hold it: ``vllm_quantization`` is the server's ``--quantization``, which
    quantises an unquantised model while loading (`sizing.model_as_held`, as `size` and
    `serve` read it), so that the slots and the misses are priced at the bytes served.

    It must route as the trace does (the same experts and top_k): its bytes price the
    trace's misses, and a trace of another shape counts misses that model never has.
    ``demo``: the trace is the bundled demo (no TRACE given), which was recorded at fewer
    experts a token than its model's config, so the line says how to get a matching one.
    """
    if not spec:
        return None
    from ..sizing.model_size import load_model
    from ..sizing.sizing import model_as_held

    where = Path(spec) if Path(spec).exists() else spec
    m = model_as_held(load_model(where), where, None, vllm_quantization)
    if (m.num_experts, m.top_k) != (trace.num_experts, trace.top_k):
        hint = (f" (the bundled demo, recorded at {trace.top_k} experts a token): give a "
                f"TRACE routed top-{m.top_k}, recorded with EXPERT_CACHE_TRACE or made by "
                "`expertcache trace synth`" if demo else "")
        raise UserError(f"--model {spec}: {m.num_experts} experts top-{m.top_k}, the trace "
                        f"has {trace.num_experts} top-{trace.top_k}{hint}")
    return m


def expert_bytes(model: ModelSize | None, spec: str | None, trace: Trace,
                 tensor_parallel: int = 1) -> tuple[int, str]:
    """The bytes one GPU's link carries for a missed expert (one layer) and their source:
    the model's where ``--model`` was given (sized as it will be served: its format, its
    tensors), else what the trace recorded (`Trace.expert_bytes`: a served rank's own
    tensors); one line asking for ``--model`` when neither says. Under tensor parallelism
    every rank holds and gathers its 1/N of each expert over its own link, at once: a miss
    costs a rank's share, not the expert (`ModelSize.per_rank`)."""
    if model is not None:
        if tensor_parallel > 1:
            return (model.per_rank(tensor_parallel).bytes_per_expert,
                    f"--model {spec} ({model.source}), one of {tensor_parallel} "
                    "tensor-parallel ranks' share, each gathered over its GPU's own link")
        return model.bytes_per_expert, f"--model {spec} ({model.source})"
    if trace.expert_bytes:
        return int(trace.expert_bytes), "the trace's expert_bytes"
    raise UserError("the trace does not say how big an expert is: give --model M")


def card_slots(model: ModelSize | None, vram: str | None, mode: Wide, server: Server,
               batch: int | None) -> int | None:
    """The most slots a layer that fit on the ``--vram`` card (`planner.card_fits`), or
    None with no card: every budget is then assumed to fit, and the plan says so. A card
    needs ``--model``: what fits depends on everything else the model puts on it."""
    if vram is None:
        return None
    if model is None:
        raise UserError("--vram needs --model (what to put on the card)")
    from .planner import card_fits

    return card_fits(model, vram, mode, server, batch)


def prediction_inputs(per_expert: tuple[int, str], link: LinkRate,
                      resident: Sourced, hit_copy: Sourced | None = None) -> Inputs:
    """The `Inputs` of a prediction, each number with its source; the cache step comes
    with the link where that source measured it (a probe, a measurement here), else the
    step is priced at 0 and its source says it was not measured. ``hit_copy``: a staged
    hit's copy rate where a probe measured it (`planner.read_hit_copy`), else the
    measured constant, which its source names."""
    from .planner import Inputs

    inputs = Inputs(per_expert[0], per_expert[1], link[0], link[1], resident[0], resident[1])
    if link[2] is not None:
        inputs.step_us, inputs.step_source = link[2]
    if hit_copy is not None:
        inputs.hit_copy_gbps, inputs.hit_copy_source = hit_copy
    return inputs


def budgets(given: list[int] | None, trace: Trace, fits_upto: int | None) -> list[int]:
    """The slot budgets to predict: the ``--slots`` given, each below the trace's experts
    (`budget.budgets_below`), else a grid (`planner.slot_grid`) from top_k, the fewest
    slots a one-token step needs, up to the most the card fits, or E - 1 with no card:
    the recommendation is the best of these, so the grid spans every budget worth
    serving."""
    from ..rules.budget import budgets_below
    from .planner import slot_grid

    if given is not None:
        try:
            return budgets_below(given, trace.num_experts, "the trace's ")
        except ValueError as exc:
            raise UserError(f"--slots {exc}") from None
    upto = trace.num_experts - 1 if fits_upto is None else fits_upto
    return slot_grid(trace.num_experts, trace.top_k, upto)


def serve_model(spec: str | None) -> str:
    """What the printed `expertcache serve` command names as MODEL: a model directory
    ``--model`` gave (vLLM loads it as it is), else a placeholder for the model itself
    with ``--size-from`` the preset or config.json the plan was sized from (vLLM cannot
    load a preset's name), else a bare placeholder."""
    if spec and Path(spec).is_dir():
        return str(spec)
    return f"MODEL --size-from {spec}" if spec else "MODEL"


def model_facts(model: ModelSize | None, trace: Trace, per_expert: int,
                vram_gib: float | None, card: Card | None,
                fits_upto: int | None) -> dict[str, Any]:
    """The plan's ``model`` entry: what was planned for, named as the model names itself,
    else as the trace does; the shape is the trace's (what was replayed)."""
    return {"name": model.name if model else trace.model, "bytes_per_expert": per_expert,
            "num_experts": trace.num_experts, "top_k": trace.top_k,
            "num_moe_layers": trace.num_layers, "vram_gib": vram_gib,
            "card": card.describe() if card else None, "max_slots": fits_upto}
