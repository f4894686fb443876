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
        [--decode-only]]]

``--top-k K`` serves a recording made at a wider top-k to a model of top-``K``: each
token keeps its first ``K`` ids, which a recording keeps in its router's rank order (the
real traces do), so the routing stays the router's own choice, narrowed; the ``source``
says so. ``--streams S --steps N`` writes what the hook hands a decode of ``S`` streams
over ``N`` steps: row ``t mod T``'s first ``S x top_k`` ids at step ``t`` (the hook cycles
the trace and takes a step's width from the row's front), so that `plan` replays the very
ids a short recording drives a long served run with; ``--request-steps R`` as the hook
restarts each request of ``R`` steps at row 0, its prefill ``P`` tokens wide.
    python bench/trace_fit.py --source T.npz     # the trace's source line (the reports)
    python bench/trace_fit.py --shape T.npz      # "TOP_K EXPERTS LAYERS" (the runners: the
                                                 # checkpoint a recording is served on)
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
              decode_only: bool = False) -> tracefile.Trace:
    """The ids the hook hands ``steps`` steps of ``streams`` streams: step ``t`` is row
    ``t mod T``'s first ``streams x top_k`` ids (padding where the row is short). With
    ``request_steps`` R, each request of R steps starts the trace again (the hook's
    restart at a prefill): step ``t`` is row ``(t mod R) mod T``, and a request's first
    step, its prefill, takes ``prefill_tokens x top_k`` ids of row 0. ``decode_only``
    leaves each request's first step out: a served run's rate is timed over its decode
    steps, and `plan` leaves out of its pricing only the prefills it can tell (steps wider
    than decode: ``prefill_tokens``), so a first step written one token wide would be priced
    as decode; in place a prefill wider than the slots is read through without installing,
    so the cache it leaves is the same."""
    if streams <= 0 or steps <= 0 or (request_steps is not None and request_steps <= 0):
        raise ValueError(f"streams, steps and request steps must be positive, got "
                         f"{streams}, {steps}, {request_steps}")
    k = trace.top_k
    pos = np.arange(steps) if request_steps is None else np.arange(steps) % request_steps
    prefill = (pos == 0) & (request_steps is not None) & (prefill_tokens is not None)
    width = max(streams, prefill_tokens if request_steps and prefill_tokens else 0) * k
    ids = trace.topk_ids[pos % trace.steps]
    if ids.shape[2] >= width:
        ids = ids[:, :, :width]
    else:
        pad = np.full(ids.shape[:2] + (width - ids.shape[2],), -1, dtype=ids.dtype)
        ids = np.concatenate([ids, pad], axis=2)
    ids = np.ascontiguousarray(ids)
    ids[~prefill, :, streams * k:] = -1  # a decode step: its streams' ids only
    if decode_only and request_steps is not None:
        ids = np.ascontiguousarray(ids[pos != 0])
    valid = (ids >= 0).sum(axis=2).max(axis=1)  # ids of the widest layer a step
    what = (f"{streams} stream(s) x {steps} steps: row t mod {trace.steps}, its first "
            f"{streams * k} ids" if request_steps is None else
            f"{steps // request_steps} request(s) of {request_steps} steps, each from row 0 "
            f"(its prefill{f' of {prefill_tokens} tokens' if prefill_tokens else ''}), "
            f"{streams} stream(s){', prefills left out' if decode_only else ''}")
    return dataclasses.replace(
        trace, topk_ids=ids, step_tokens=np.maximum(1, valid // k).astype(np.int64),
        source=source_of(trace) + f" [as the hook serves {what}]")


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
        print(t.top_k, t.num_experts, t.num_layers)
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
            trace = as_served(trace, a.streams, a.steps, a.request_steps, a.prefill_tokens,
                              a.decode_only)
    except ValueError as exc:
        print(f"trace_fit: {exc}", file=sys.stderr)
        return 2
    out = tracefile.save(trace, a.out)
    print(f"{out}: {a.layers} layers; routing: {source_of(tracefile.load(out))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
