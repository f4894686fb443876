"""BENCH ONLY: a routing trace fitted to the served model's MoE layers, for `plan`.

Why: the bench's trace-driven hook (`bench/trace_routing.py`) routes model layer ``i``
from trace layer ``i mod L``, so a 48-layer trace drives a 24-layer checkpoint from its
first 24 layers, and a 16-layer recording drives 36 layers by repeating itself. `plan`
counts every layer of the trace it is given (misses a token, cache steps a token): handed
the 48-layer file for a 24-layer model it would predict twice the misses the server sees.
This writes the trace the server actually replays, layer for layer, with the expert bytes
of the served format (`size --json`'s ``bytes_per_expert``: 4-bit experts are a quarter
of bf16's), and keeps the original ``source`` (what routing it is, recorded or synthetic)
with the fitting said after it.

    python bench/trace_fit.py IN.npz OUT.npz --layers 24 [--expert-bytes N | --size S.json]
        [--top-k K] [--streams S --steps N [--request-steps R [--prefill-tokens P]
        [--decode-only]] [--hook-streams H]]

``--top-k K`` serves a recording made at a wider top-k to a model of top-``K``: each
token keeps its first ``K`` ids, which a recording keeps in its router's rank order (the
real traces do), so the routing stays the router's own choice, narrowed; the ``source``
says so. ``--streams S --steps N`` writes what the hook hands a decode of ``S`` streams
over ``N`` steps: row ``t mod T``'s first ``S x top_k`` ids at step ``t`` (the hook cycles
the trace and takes a step's width from the row's front), so that `plan` replays the very
ids a short recording drives a long served run with; ``--request-steps R`` as the hook
restarts each request of ``R`` steps at row 0, its prefill ``P`` tokens wide (or, with
``--prompt-tokens P1,P2,...`` on a trace of several recorded requests, at the first row of
the one each served prompt replays).
    python bench/trace_fit.py --source T.npz     # the trace's source line (the reports)
    python bench/trace_fit.py --shape T.npz      # "TOP_K EXPERTS LAYERS REQUESTS" (the
                                                 # runners: the checkpoint a recording is
                                                 # served on, the prompts it needs)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from expertcache_cli.rules import trace as tracefile  # noqa: E402


def source_of(trace: tracefile.Trace) -> str:
    """What produced the routing, in one line: the trace's ``source`` (its model label when
    it has none), never empty, so that a table can always say what routing it measured."""
    return trace.source or (f"no source recorded (model: {trace.model})" if trace.model
                            else "no source recorded")


def narrow(trace: tracefile.Trace, top_k: int) -> tracefile.Trace:
    """Each token's first ``top_k`` ids of the trace's wider top-k (rank order kept)."""
    have = trace.top_k
    if not 0 < top_k <= have:
        raise ValueError(f"top-k {top_k} is not between 1 and the trace's {have}")
    if top_k == have:
        return trace
    steps, layers, width = trace.topk_ids.shape
    tokens = width // have
    ids = trace.topk_ids[:, :, : tokens * have].reshape(steps, layers, tokens, have)
    return dataclasses.replace(
        trace, topk_ids=np.ascontiguousarray(ids[..., :top_k].reshape(steps, layers, -1)),
        top_k=top_k,
        source=source_of(trace) + f" [each token's first {top_k} of its top-{have}, by the "
        "router's rank]")


def as_served(trace: tracefile.Trace, streams: int, steps: int,
              request_steps: int | None = None, prefill_tokens: int | None = None,
              decode_only: bool = False,
              prompt_tokens: list[int] | None = None,
              hook_streams: int | None = None) -> tracefile.Trace:
    """The ids the hook (`bench/trace_routing.py`) hands ``steps`` steps of ``streams``
    streams: step ``t`` is row ``t mod T``'s first ``streams x top_k`` ids (padding where
    the row is short), or, on a trace recorded one stream at a time, stream ``i``'s top_k
    ids from row ``t + i x (T // H)`` (mod T), where ``H`` is ``hook_streams``, the hook's
    ``EC_BENCH_TRACE_STREAMS`` (default ``streams``): the hook spaces the streams of every
    decode step by the most it was told to expect, so a server set for 32 streams decoding
    16 puts them ``T // 32`` rows apart, not ``T // 16``. With ``request_steps`` R, each
    request of R steps starts again at the first row of the recorded request its prefill picks (the
    hook's rule: request q's prompt of ``prompt_tokens[q mod len]`` tokens replays
    recorded request (tokens // 8) mod the trace's requests; row 0 without prompts or for
    a trace of one request), and that first step, its prefill, takes ``prefill_tokens x
    top_k`` ids of the row. ``decode_only`` leaves each request's first step out: a served
    run's rate is timed over its decode steps, and `plan` leaves out of its pricing only
    the prefills it can tell (steps wider than decode: ``prefill_tokens``), so a first step
    written one token wide would be priced as decode; in place a prefill wider than the
    slots is read through without installing, so the cache it leaves is the same."""
    if streams <= 0 or steps <= 0 or (request_steps is not None and request_steps <= 0):
        raise ValueError(f"streams, steps and request steps must be positive, got "
                         f"{streams}, {steps}, {request_steps}")
    spacing = streams if hook_streams is None else hook_streams
    if spacing < streams:
        raise ValueError(f"the hook's streams ({spacing}) are fewer than the {streams} a step "
                         "decodes: the hook would take such a step for a prefill")
    if prompt_tokens is not None and (not prompt_tokens or min(prompt_tokens) <= 0):
        raise ValueError(f"prompt tokens must be positive, got {prompt_tokens}")
    k, t_rows = trace.top_k, trace.steps
    t = np.arange(steps)
    pos = t if request_steps is None else t % request_steps
    base = np.zeros(steps, dtype=np.int64)
    starts = trace.request_starts()
    several = (request_steps is not None and bool(prompt_tokens) and starts is not None
               and len(starts) > 1)
    if several or streams > 1:
        from trace_routing import PROMPT_STEP, one_stream  # the hook's own rules
    if several:
        q = t // request_steps
        lengths = np.asarray(prompt_tokens, dtype=np.int64)[q % len(prompt_tokens)]
        base = starts[(lengths // PROMPT_STEP) % len(starts)]
    at = base + pos  # the row the first stream takes at each step
    prefill = (pos == 0) & (request_steps is not None) & (prefill_tokens is not None)
    width = max(streams, prefill_tokens if request_steps and prefill_tokens else 0) * k
    if streams > 1 and one_stream(trace):
        # one row a stream, `TraceRouting._streams`; a prefill as the hook takes it
        rows = trace.topk_ids[:, :, :k]
        offsets = np.arange(streams, dtype=np.int64) * (t_rows // spacing)
        ids = np.full((steps, trace.num_layers, width), -1, dtype=trace.topk_ids.dtype)
        per = rows[(at[:, None] + offsets[None, :]) % t_rows]  # [steps, streams, L, k]
        ids[:, :, : streams * k] = per.transpose(0, 2, 1, 3).reshape(steps, trace.num_layers, -1)
        wide = trace.topk_ids[at % t_rows]
        cut = min(width, wide.shape[2])
        ids[prefill] = -1
        ids[prefill, :, :cut] = wide[prefill, :, :cut]
    else:
        ids = trace.topk_ids[at % t_rows]
        if ids.shape[2] >= width:
            ids = ids[:, :, :width]
        else:
            pad = np.full(ids.shape[:2] + (width - ids.shape[2],), -1, dtype=ids.dtype)
            ids = np.concatenate([ids, pad], axis=2)
        ids = np.ascontiguousarray(ids)
        ids[~prefill, :, streams * k:] = -1  # a decode step: its streams' ids only
    keep = np.ones(steps, bool)
    if decode_only and request_steps is not None:
        keep = pos != 0
        ids = np.ascontiguousarray(ids[keep])
    valid = (ids >= 0).sum(axis=2).max(axis=1)  # ids of the widest layer a step
    picked = ""
    if several:
        replays = (np.asarray(prompt_tokens) // PROMPT_STEP) % len(starts)
        picked = (f", prompts of {'/'.join(str(p) for p in prompt_tokens)} tokens replaying "
                  f"recorded requests {'/'.join(str(int(r)) for r in replays)}")
    what = (f"{streams} stream(s) x {steps} steps: row t mod {trace.steps}, its first "
            f"{streams * k} ids" if request_steps is None else
            f"{steps // request_steps} request(s) of {request_steps} steps, each from "
            f"{'row 0' if not picked else 'a recorded request' + chr(39) + 's first row'} "
            f"(its prefill"
            f"{f' of {prefill_tokens} tokens' if prefill_tokens else ''}){picked}, "
            f"{streams} stream(s){', prefills left out' if decode_only else ''}")
    if streams > 1 and spacing != streams:
        what += f", {t_rows // spacing} rows apart (the hook set for {spacing} streams)"
    served_req = None if request_steps is None else (t // request_steps)[keep]
    # a prefill ran its prompt's tokens whatever ids its row holds (a decode-only recording's
    # first row holds one token's): `plan` tells it apart by them and does not price it
    tokens = np.maximum(1, valid // k).astype(np.int64)
    if prefill_tokens:
        tokens[prefill[keep]] = prefill_tokens
    return dataclasses.replace(
        trace, topk_ids=ids, step_tokens=tokens,
        requests=served_req, source=source_of(trace) + f" [as the hook serves {what}]")


def fit(trace: tracefile.Trace, layers: int, expert_bytes: int | None = None
        ) -> tracefile.Trace:
    """``trace`` as the hook replays it on a model of ``layers`` MoE layers: layer ``i``
    is trace layer ``i mod L`` (the hook's own rule), steps and widths unchanged."""
    if layers <= 0:
        raise ValueError(f"layers must be positive, got {layers}")
    have = trace.num_layers
    pick = np.arange(layers) % have
    note = ("" if layers == have else
            f" [layers fitted to the served model's {layers}: model layer i routes as trace "
            f"layer i mod {have}]")
    return dataclasses.replace(
        trace, topk_ids=np.ascontiguousarray(trace.topk_ids[:, pick, :]),
        layers=np.arange(layers, dtype=np.int64),
        expert_bytes=expert_bytes if expert_bytes else trace.expert_bytes,
        source=source_of(trace) + note)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--source"] and len(argv) == 2:
        print(source_of(tracefile.load(argv[1])))
        return 0
    if argv[:1] == ["--shape"] and len(argv) == 2:
        try:
            t = tracefile.load(argv[1])
        except Exception as exc:  # noqa: BLE001 - any unreadable file: one line, exit 2
            why = (str(exc).splitlines() or [type(exc).__name__])[0]
            print(f"trace_fit: {argv[1]}: not a routing trace ({why})", file=sys.stderr)
            return 2
        starts = t.request_starts()
        print(t.top_k, t.num_experts, t.num_layers, 1 if starts is None else len(starts))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, required=True, help="the served model's MoE layers")
    ap.add_argument("--expert-bytes", type=int, default=None)
    ap.add_argument("--size", type=Path, default=None,
                    help="a `size --json` file: its bytes_per_expert")
    ap.add_argument("--top-k", type=int, default=None,
                    help="narrow a wider recording to the model's top-k (rank order)")
    ap.add_argument("--streams", type=int, default=None,
                    help="with --steps: the ids the hook serves this many streams")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--request-steps", type=int, default=None,
                    help="with --streams: requests of this many steps, each from row 0")
    ap.add_argument("--prefill-tokens", type=int, default=None,
                    help="with --request-steps: a request's prefill, in tokens")
    ap.add_argument("--decode-only", action="store_true",
                    help="with --request-steps: leave each request's prefill step out")
    ap.add_argument("--prompt-tokens", default=None,
                    help="with --request-steps: the served requests' prompts, in tokens, "
                    "comma-separated, in the order sent (cycled): which recorded request each "
                    "replays")
    ap.add_argument("--hook-streams", type=int, default=None,
                    help="with --streams: the hook's EC_BENCH_TRACE_STREAMS, which spaces the "
                    "streams (default: --streams)")
    a = ap.parse_args(argv)
    if (a.streams is None) != (a.steps is None):
        print("trace_fit: --streams and --steps go together", file=sys.stderr)
        return 2
    per = a.expert_bytes
    if per is None and a.size is not None:
        try:
            per = int(json.loads(a.size.read_text())["bytes_per_expert"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # a plan on the trace's own expert bytes (bf16's, for the demo) would predict
            # another format: no fitted trace rather than a wrong prediction
            print(f"trace_fit: {a.size}: no bytes_per_expert ({exc!r})", file=sys.stderr)
            return 2
    trace = tracefile.load(a.trace)
    try:
        if a.top_k is not None:
            trace = narrow(trace, a.top_k)
        trace = fit(trace, a.layers, per)
        if a.streams is not None:
            prompts = ([int(x) for x in a.prompt_tokens.split(",")]
                       if a.prompt_tokens else None)
            trace = as_served(trace, a.streams, a.steps, a.request_steps, a.prefill_tokens,
                              a.decode_only, prompts, a.hook_streams)
    except ValueError as exc:
        print(f"trace_fit: {exc}", file=sys.stderr)
        return 2
    out = tracefile.save(trace, a.out)
    print(f"{out}: {a.layers} layers; routing: {source_of(tracefile.load(out))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
