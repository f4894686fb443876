"""`expertcache plan`: from a routing trace to predicted decode speed per policy and budget.

The loop a user otherwise closes in their head: replay the trace to count the experts
that would cross the host link per token at each slot budget, then price them at the
link's measured rate on top of the resident decode time:

    ms/token = 1000 / R + layer_steps_per_token x step_us / 1000
               + 1000 x misses_per_token x bytes_per_expert / (link_gbps x 1e9)
               + 1000 x staged_hits_per_token x bytes_per_expert / (hit_copy_gbps x 1e9)

``misses`` are every expert fetched over the link (installs into slots plus the distinct
ids of read-through steps), counted on the decode steps only (`priced_steps`): a recorded
request starts with its prompt's prefill, one step of many tokens, which is replayed (its
installs are what decode then hits) but not priced, since decode tok/s is what is
predicted and a prefill's fetches and tokens are not decode's. ``R`` is the fully
resident decode rate on the same GPU, and
``step_us`` what the cache's step costs per MoE layer even when every expert hits (the
manager and a gather with nothing to copy: `probe-link`'s ``step`` measurement; 0 when it
was not measured, and the source says so). The step term is there because every MoE layer
runs a cache step each token whether or not it misses: left out, the sum over-predicts by
that time, which on a many-layer model is a tenth of a millisecond a token or more.
``staged_hits`` are the experts a staged wide step (`--wide staged`/`staged-install`)
finds in the slots: each is copied from its slot into the scratch over device memory, a
twentieth of a miss's time, but with a real model's routing a wide decode step is mostly
hits (35-46 a layer against 1-5 misses at 16 and 32 streams), so left out they made the
staged prediction 1.4-1.8x the served rate (bench/results/wide-steps.md).
Each input says where it came from (given, a saved probe, a baseline results file), so a
prediction is never quieter about its basis than a measurement.

The recommendation is the policy and uniform budget with the best predicted tok/s among
those `size` says fit on the card, plus the per-layer split of the same total (`split`),
and the exact `expertcache serve` command; `PlanReport.to_json` is the plan file
`serve --plan` reads.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from ..rules.budget import ONLINE_POLICIES, online_names
from ..rules.policy import Policy, Wide
from ..rules.trace import DECODE, PREFILL, Trace
from ..vllm_facts import capture
from .rebatch import shared_note
from .serving import Server

#: the plan file's format (serve --plan checks it)
PLAN_FORMAT = 1


@dataclass
class Inputs:
    """What the prediction rests on, and where each number came from."""

    bytes_per_expert: int
    bytes_source: str
    link_gbps: float
    link_source: str
    resident_tok_s: float
    resident_source: str
    step_us: float = 0.0
    step_source: str = "not measured (probe-link --only gather,step measures it)"
    hit_copy_gbps: float = 0.0  # a staged hit's copy, slots -> scratch (0: HIT_COPY_GBPS)
    hit_copy_source: str = ""

    def __post_init__(self) -> None:
        if self.hit_copy_gbps <= 0:
            self.hit_copy_gbps = HIT_COPY_GBPS
            self.hit_copy_source = ("not measured: the planner's measured constant "
                                    "(probe-link --only stage measures your GPU's)")


#: GB/s of a staged step's hit copies (slots -> scratch, the gather kernel over device
#: memory) where no probe measured them: an H100 80GB HBM3's, the slower of the two GPUs
#: measured (1,101 GB/s at 32 hits of a 9.4 MB expert; an H200 1,500-1,900). Source in
#: docs/design.md, measured constants
HIT_COPY_GBPS = 1100.0


def predict_ms(misses_per_token: float, inputs: Inputs,
               layer_steps_per_token: float = 0.0,
               staged_hits_per_token: float = 0.0) -> float:
    """Decode milliseconds per token: resident time, the cache's own step in every MoE
    layer, the misses' bytes over the link and a staged step's hits copied on the device."""
    return (1000.0 / inputs.resident_tok_s + layer_steps_per_token * inputs.step_us / 1000.0
            + 1000.0 * misses_per_token * inputs.bytes_per_expert / (inputs.link_gbps * 1e9)
            + 1000.0 * staged_hits_per_token * inputs.bytes_per_expert
            / (inputs.hit_copy_gbps * 1e9))


#: single-stream resident rates above this are where vLLM's host work, not the GPU, may pace
#: decoding, so the additive sum can under-predict; measured, source in
#: docs/design.md, measured constants
HOST_PACED_TOK_S = 400.0


def _read_json(path: str | Path, option: str, writer: str) -> Any:
    """A JSON file a user named, or one line naming the option and what writes the file."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise UserError(f"{option} {path}: cannot read ({exc.strerror})") from None
    except ValueError:
        raise UserError(f"{option} {path}: not JSON (write it with {writer})") from None


def read_probe(path: str | Path) -> tuple[float, str, tuple[float, str] | None]:
    """A saved `probe-link --json`, read once: the gather rate with its source, and the
    all-hit cache step (us per MoE layer, source) where that probe measured it."""
    data = _read_json(path, "--probe", "probe-link --save")
    return (*_link_of(data, path), _step_of(data, path))


def _link_of(data: Any, path: str | Path) -> tuple[float, str]:
    from ..probe.report import Rate, gather_row, is_stand_in

    if not isinstance(data, dict):
        raise UserError(f"--probe {path}: not a probe-link --json file")
    if is_stand_in(str(data.get("gather_impl", ""))):
        raise UserError(f"--probe {path}: its gather is a torch stand-in, not the cache's "
                        "kernel (the kernels were not built there): probe again with them")
    model = data.get("model")
    top_k = model.get("top_k") if isinstance(model, dict) else None
    try:
        rows = [Rate(**r) for r in data.get("gather") or []]
        # the row nearest the model's top_k, as the probe's own conclusion picks it; a
        # `--only gather` probe has these rows but no decode ceilings
        best = gather_row(rows, top_k) if isinstance(top_k, int) else None
    except (TypeError, ValueError, IndexError):
        raise UserError(f"--probe {path}: its gather rows are not probe-link's") from None
    rate = best.gbps if best is not None else None
    if not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise UserError(f"--probe {path}: holds no measured gather rate (its gather rows)")
    where = data.get("device_name", "a GPU")
    return float(rate), f"probe-link on {where} ({path}: the gather, {best.path})"


def _step_of(data: Any, path: str | Path) -> tuple[float, str] | None:
    us = data.get("step_us") if isinstance(data, dict) else None
    if not isinstance(us, (int, float)) or not math.isfinite(us) or us <= 0:
        return None
    where = data.get("device_name", "a GPU")
    return float(us), f"probe-link on {where} ({path}: the cache step, every expert a hit)"


def read_hit_copy(path: str | Path) -> tuple[float, str] | None:
    """A saved probe's staged hit-copy rate (`probe-link`'s ``stage``) with its source, or
    None where that probe did not measure it."""
    data = _read_json(path, "--probe", "probe-link --save")
    gbps = data.get("stage_gbps") if isinstance(data, dict) else None
    if not isinstance(gbps, (int, float)) or not math.isfinite(gbps) or gbps <= 0:
        return None
    where = data.get("device_name", "a GPU")
    return float(gbps), f"probe-link on {where} ({path}: the stage, hits from slots)"


@dataclass(frozen=True)
class Priced:
    """The steps a prediction prices, and the prefills it replays but leaves out."""

    steps: int  # decode steps
    tokens: int  # their tokens (a re-batched trace: its streams', not the padding)
    prefill_steps: int | None  # None: the trace cannot tell (every step priced as decode)
    prefill_tokens: int = 0


def priced_steps(trace: Trace) -> Priced:
    """The decode steps of ``trace`` (`Trace.step_kinds`) and their tokens; every step
    where the trace cannot tell prefill from decode, as before the kinds were known."""
    kinds = trace.step_kinds()
    if kinds is None or not np.any(kinds == PREFILL):
        return Priced(trace.steps, max(1, trace.tokens), None if kinds is None else 0)
    tokens = np.asarray(trace.step_tokens, dtype=np.int64)
    decode = kinds == DECODE
    return Priced(int(decode.sum()), max(1, int(tokens[decode].sum())),
                  int((~decode).sum()), int(tokens[~decode].sum()))


def slot_grid(num_experts: int, top_k: int, upto: int, points: int = 12) -> list[int]:
    """Budgets worth predicting: from top_k (one token's experts) up to ``upto``."""
    upto = min(upto, num_experts - 1)
    if upto < top_k:
        return []
    step = max(1, (upto - top_k) // (points - 1))
    grid = set(range(top_k, upto + 1, step)) | {upto}
    return sorted(grid)


@dataclass
class PlanReport:
    """The prediction table, the recommendation and what it rests on."""

    model: dict[str, Any]
    inputs: Inputs
    trace: dict[str, Any]
    rows: list[dict[str, Any]]
    recommended: dict[str, Any] | None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        i = self.inputs
        return {
            "format": PLAN_FORMAT,
            "model": self.model,
            "trace": self.trace,
            "link_gbps": i.link_gbps,
            "link_source": i.link_source,
            "resident_tok_s": i.resident_tok_s,
            "resident_source": i.resident_source,
            "step_us": i.step_us,
            "step_source": i.step_source,
            "hit_copy_gbps": i.hit_copy_gbps,
            "hit_copy_source": i.hit_copy_source,
            "rows": self.rows,
            "recommended": self.recommended,
            "notes": self.notes,
        }


def plan_trace(
    trace: Trace,
    inputs: Inputs,
    policies: list[Policy],
    budgets: list[int],
    *,
    fits_upto: int | None,
    model: dict[str, Any],
    serve_model: str,
    vram_gb: float | str | None,
    plan_file: str | None = None,
    vllm_args: list[str] | None = None,
    wide: Wide = Wide.IN_PLACE,
    batch: int | None = None,
    server: Server | None = None,
) -> PlanReport:
    """Replay ``trace`` at every (policy, budget) and predict decode speed; recommend.

    ``fits_upto``: the most slots `size` says fit on the card (None: not sized, every
    budget assumed to fit, and the notes say so). ``wide``: how steps wider than the
    slots are modelled; ``batch``: the trace was re-batched to that many streams
    (`rebatch.rebatch`), and the resident rate is then the aggregate at that batch.
    ``server``: the batch flags and vLLM release served with (`serving.server`; default:
    read from ``vllm_args``): the recommendation is one `serve` takes (`serveable`).
    """
    from ..rules.replay import replay
    from ..rules.split import recommend
    from .serving import server as read_server

    if server is None:
        from ..sizing.cards import parse_vram

        server = read_server(vllm_args or [], batch=batch, vram_gib=parse_vram(vram_gb)[0])
    vllm_args = server.vllm_args

    if not budgets:
        raise UserError("no slot budget to predict: the card holds fewer than top_k slots")
    online = [p for p in policies if p in ONLINE_POLICIES]
    if not online:
        raise UserError("--policy: plan recommends a policy the plugin runs: "
                        f"{online_names()}")
    # one replay of every step (prefills install what decode hits), counted by step kind
    report = replay(trace, online, budgets, wide=wide)
    priced = priced_steps(trace)
    decode = report.group(DECODE)
    tokens = priced.tokens
    # every layer runs the cache's step once a step, and a step decodes tokens / steps
    layer_steps = trace.num_layers * priced.steps / tokens
    rows = []
    for r in decode.itertuples():
        if Policy.parse(r.policy) not in online:
            continue
        mpt, hpt = r.misses / tokens, r.staged_hits / tokens
        ms = predict_ms(mpt, inputs, layer_steps, hpt)
        rows.append({
            "policy": r.policy,
            "slots": int(r.slots),
            "misses_per_token": mpt,
            "staged_hits_per_token": hpt,
            "miss_rate": float(r.miss_rate),
            "predicted_ms_per_token": ms,
            "predicted_tok_s": 1000.0 / ms,
            "fits": fits_upto is None or int(r.slots) <= fits_upto,
        })
    rows.sort(key=lambda r: (r["policy"], r["slots"]))
    notes = []
    if priced.prefill_steps is None:
        notes.append("the trace does not record its steps' tokens (step_tokens), so a prefill "
                     "cannot be told from decode: every step is priced as decode")
    if fits_upto is None:
        notes.append("no --vram: every budget is assumed to fit; give --vram to plan for a card")
    fitting = [r for r in rows if r["fits"]]
    recommended = None
    if fitting:
        best = max(fitting, key=lambda r: (round(r["predicted_tok_s"], 6), -r["slots"]))
        pol = Policy.parse(best["policy"])
        serve = serveable(server, best["slots"], trace.top_k, wide, batch)
        (split,) = recommend(trace, pol, [best["slots"]], wide=wide,
                             floor=min(serve.floor, best["slots"]), decode_only=True)
        # the split moves slots between layers, not steps across the gate: its staged hits
        # are taken as the uniform budget's (a hit's copy is a twentieth of a miss)
        split_ms = predict_ms(split.misses / tokens, inputs, layer_steps,
                              best["staged_hits_per_token"])
        use_split = split.misses < split.uniform_misses
        served = min(split.slots) if use_split and plan_file else best["slots"]
        older = older_release_note(serve, served, server)
        recommended = {
            "policy": best["policy"],
            "slots": best["slots"],
            "per_layer_slots": [int(s) for s in split.slots],
            "layers": [int(x) for x in trace.layer_names()],
            "predicted_tok_s": best["predicted_tok_s"],
            "per_layer_predicted_tok_s": 1000.0 / split_ms,
            "per_layer_misses_saved": int(split.saved),
            "max_num_seqs": serve.max_num_seqs,
            "min_layer_slots": serve.floor or None,
            "allow_trap": serve.allow_trap,
            "wide": wide.value,
            "vllm": server.release.name,
            "vllm_source": server.release.source,
            "serve_command": serve_command(serve_model, vram_gb, best, plan_file, use_split,
                                           serve.vllm_args, wide, serve.allow_trap),
        }
        notes += serve.notes + ([older] if older else [])
        if not use_split:
            notes.append("the per-layer split finds nothing better than the uniform budget")
    wide_rows = decode["staged_steps"] + decode["read_through_steps"]
    if wide is not Wide.IN_PLACE:
        notes.append(f"wide steps are modelled {wide.value}, the path `serve --wide "
                     f"{wide.value}` runs (EXPERT_CACHE_WIDE)")
    elif int(wide_rows.max()) > 0:
        notes.append("some budgets read wide steps through the host in place (tokens x top_k "
                     "> slots); --wide staged-install predicts the staged path")
    if not batch and inputs.resident_tok_s > HOST_PACED_TOK_S:
        notes.append(
            f"resident {inputs.resident_tok_s:.0f} tok/s is {1000 / inputs.resident_tok_s:.2f} "
            "ms a token, where vLLM's per-token host work rather than the GPU may set the pace: "
            "installs then partly hide in GPU idle time and the measured rate can beat this "
            "prediction")
    if batch:
        notes.append(server.describe_batch(batch))
        notes.append(f"re-batched to {batch} streams from one stream's routing: the resident "
                     f"rate must be the aggregate at {batch} streams, and real users' routing "
                     "is less alike (this errs towards hits)")
        shared = shared_note(trace)
        if shared:
            notes.append(shared)
    return PlanReport(model=model, inputs=inputs, trace={
        "path": None, "steps": trace.steps, "layers": trace.num_layers,
        "tokens": trace.tokens, "num_experts": trace.num_experts, "top_k": trace.top_k,
        "decode_steps": priced.steps, "decode_tokens": priced.tokens,
        "prefill_steps": priced.prefill_steps, "prefill_tokens": priced.prefill_tokens,
        "source": trace.source, "wide": wide.value, "batch": batch,
        "batch_tokens": server.batch_tokens(batch) if batch else None}, rows=rows,
        recommended=recommended, notes=notes)


@dataclass
class Serveable:
    """What makes a recommendation one `serve` takes: the vLLM flags to serve with, the
    fewest slots any layer may have, and whether it needs ``--allow-trap``."""

    vllm_args: list[str]
    max_num_seqs: int | None  # the batch the command serves (None: vLLM's own default)
    floor: int  # the per-layer split keeps every layer at >= this
    allow_trap: bool
    notes: list[str]
    #: where the release is assumed: a full batch's ids on the oldest release, where it
    #: pads wider than the one assumed (a layer below them is refused there)
    older_ids: int | None = None


def serveable(server: Server, slots: int, top_k: int, wide: Wide,
              batch: int | None) -> Serveable:
    """The flags, the per-layer floor and the notes that make a budget of ``slots`` (and
    its per-layer split) a plan `serve` takes as printed.

    Why: `serve` refuses a layer below top_k, and, in place, a plan whose narrowest layer
    holds fewer slots than a full decode batch's ids (``padded max_num_seqs x top_k``: the
    sizing trap); with no batch flags it picks the ``--max-num-seqs`` the narrowest layer
    allows. So the per-layer split keeps every layer at or above the widest decode step,
    and the command carries the ``--max-num-seqs`` it was planned for: the user's where
    given, or the ``--batch`` priced (kept either way, with ``--allow-trap`` and a note
    when even the uniform budget is narrower than that batch), or else the largest the
    uniform budget keeps on the cache, counted where the release is assumed as the
    release that pads most pads it (`serving.Server.safety_graphs`), so it holds on every
    release. Staged wide steps have no trap: only a ``--batch`` is carried, so that the
    server pads it as priced.
    """
    args, notes = list(server.vllm_args), []
    flag = "--max-num-seqs"
    if wide is not Wide.IN_PLACE:
        if batch and not server.seqs_given:
            args += [flag, str(server.max_num_seqs)]
        return Serveable(args, server.max_num_seqs if batch or server.seqs_given else None,
                         top_k, False, notes)
    rel, batched = server.release, server.max_num_batched_tokens
    if server.seqs_given or batch:
        seqs = server.max_num_seqs
        ids = top_k * capture.padded_batch(seqs, batched, server.graphs)
        older = server.widest_ids(top_k)  # = ids where the release is known
        if not server.seqs_given:
            args += [flag, str(seqs)]
        if ids <= slots:
            notes.append(
                f"every layer of the per-layer split keeps >= {ids} slots: a full decode batch "
                f"of --max-num-seqs {seqs} ({server.seqs_source}) is {ids} ids (padded, x "
                f"top_k {top_k}), and serve refuses a layer narrower than that")
            return Serveable(args, seqs, max(ids, top_k), False, notes,
                             older if older > ids else None)
        safe = server.safe_max_num_seqs(slots, top_k)
        priced = ("priced above" if batch else "which this single-stream prediction does not "
                  "price")
        notes.append(
            f"at --max-num-seqs {seqs} ({server.seqs_source}) a full decode batch is {ids} ids "
            f"(padded, x top_k {top_k}), more than {slots} slots: full batches read through "
            f"the host in place ({priced}); the command carries --allow-trap, which serve "
            f"needs for that; --max-num-seqs {safe} keeps every decode step on the cache, "
            "--wide staged-install stages the wide ones")
        return Serveable(args, seqs, top_k, True, notes)
    safe = server.safe_max_num_seqs(slots, top_k)
    if safe == 0:
        notes.append(f"no --max-num-seqs keeps a decode step within {slots} slots with these "
                     "CUDA graphs: the command carries --allow-trap; --wide staged-install "
                     "stages the wide steps")
        return Serveable(args, None, top_k, True, notes)
    if server.widest_ids(top_k) <= slots:  # vLLM's default batch fits already
        return Serveable(args, None, max(server.widest_ids(top_k), top_k), False, notes)
    ids = server.widest_ids(top_k, safe)
    args += [flag, str(safe)]
    newer = ""
    on_new = capture.safe_max_num_seqs(slots, top_k, batched, server.graphs)
    if on_new > safe:
        oldest = f"{capture.OLDEST_KNOWN[0]}.{capture.OLDEST_KNOWN[1]}"
        newer = (f"; counted as vLLM {oldest} pads a batch, the most of the releases the "
                 f"plugin runs on: on vLLM {rel.name} a batch of {on_new} would stay on "
                 f"these slots (no vLLM here: --vllm-version {rel.name} plans for that "
                 "release)")
    notes.append(
        f"the command carries --max-num-seqs {safe}, the most that keeps every layer's decode "
        f"on the cache: a full batch is {ids} ids (padded, x top_k {top_k}), within the "
        f"{slots} slots and every layer of the per-layer split (none below {ids}){newer}; more "
        "sequences at once would read full decode batches through the host (the sizing "
        "trap), or serve with --wide staged-install")
    return Serveable(args, safe, max(ids, top_k), False, notes)


def older_release_note(serve: Serveable, narrowest: int, server: Server) -> str | None:
    """Where the release is assumed and the oldest pads the batch wider than a layer of
    the recommendation holds: what serve does there, and how to plan for it."""
    if serve.older_ids is None or serve.older_ids <= narrowest:
        return None
    o, a = capture.OLDEST_KNOWN, capture.APPENDS_MAX_NUM_SEQS_FROM
    return (f"planned as vLLM {server.release.name} pads a batch ({server.release.source}); "
            f"vLLM {o[0]}.{o[1]}-{a[0]}.{a[1] - 1} pad a full batch of --max-num-seqs "
            f"{serve.max_num_seqs} to {serve.older_ids} ids, more than the {narrowest} slots of "
            "the narrowest layer: serve there refuses this plan (the sizing trap); "
            f"--vllm-version {o[0]}.{o[1]} plans for those releases")


def serve_command(model: str, vram_gb: float | str | None, best: dict[str, Any],
                  plan_file: str | None, per_layer: bool, vllm_args: list[str],
                  wide: Wide = Wide.IN_PLACE, allow_trap: bool = False) -> str:
    """The `expertcache serve` line that deploys the recommendation."""
    import shlex

    vram = (" --vram GiB" if not vram_gb else f" --vram {vram_gb}" if isinstance(vram_gb, str)
            else f" --vram {vram_gb:g}")
    if wide is not Wide.IN_PLACE:
        vram += f" --wide {wide.value}"
    if allow_trap:
        vram += " --allow-trap"
    tail = f" -- {shlex.join(vllm_args)}" if vllm_args else ""
    if plan_file and per_layer:
        return f"expertcache serve {model}{vram} --plan {plan_file}{tail}"
    return (f"expertcache serve {model}{vram} --slots {best['slots']} --policy "
            f"{best['policy']}{tail}")


def card_fits(model: Any, vram: str, mode: Wide, srv: Server, batch: int | None) -> int:
    """The most slots `size` fits on the card for the server the plan's command runs.

    A staged mode's scratch comes out of the slots' room, as `size --wide` says. The batch
    is the server's: the user's ``--max-num-seqs``, a ``--batch N`` (a server of N), or, in
    place with neither, the one `sizing.plan` chooses (the widest whose decode steps stay
    on the slots: less runtime memory than vLLM's default 256 sequences), counted, where
    the release is assumed, as the release that pads most pads it, as the
    ``--max-num-seqs`` the serve command carries is (`planner.serveable`).
    """
    from ..sizing import sizing
    from ..vllm_facts.vllm_flags import plan_kwargs_from_vllm_args

    kw = plan_kwargs_from_vllm_args(srv.vllm_args) | {"graphs": srv.graphs}
    if batch and not srv.seqs_given:
        kw["max_num_seqs"] = srv.max_num_seqs
    elif not srv.seqs_given:
        kw["graphs"] = srv.safety_graphs[0]
    return sizing.plan(model, vram, wide=mode, **kw).max_slots


def read_plan(path: str | Path) -> dict[str, Any]:
    """A plan file written by `plan --save`, checked: its recommendation and per-layer list."""
    data = _read_json(path, "--plan", "`plan --save`")
    rec = data.get("recommended") if isinstance(data, dict) else None
    if not isinstance(rec, dict) or data.get("format") != PLAN_FORMAT:
        raise UserError(f"--plan {path}: not an expertcache plan file (format {PLAN_FORMAT})")
    slots = rec.get("per_layer_slots")
    if not isinstance(slots, list) or not slots or not all(
            isinstance(s, int) and s > 0 for s in slots):
        raise UserError(f"--plan {path}: per_layer_slots must be a list of positive integers")
    if rec.get("policy") not in online_names(",").split(","):
        raise UserError(f"--plan {path}: policy must be {online_names()}, got "
                        f"{rec.get('policy')!r}")
    # the wide mode the plan was priced with (plan files from before it was saved there:
    # the trace's, else in place, which is what they were priced as)
    trace = data.get("trace") if isinstance(data.get("trace"), dict) else {}
    raw = rec.get("wide", trace.get("wide")) or Wide.IN_PLACE.value
    try:
        wide = Wide.parse(str(raw))
    except ValueError as exc:
        raise UserError(f"--plan {path}: {exc}") from None
    return {**rec, "wide": wide}
