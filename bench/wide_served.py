"""BENCH ONLY: `plan`'s time model on the ids the hook handed a wide-steps server, beside its
measured N-stream decode (`bench/run_wide_on_device.sh` with ``TRACE=``, step ``predict``).

Why not `plan --batch N` on a recording of one stream: under the hook
(`bench/trace_routing.py`) every request of a one-request recording replays it from its
first row, so a stream recorded over K requests holds the same rows K times, and
re-batching it prices N users as one (on the Qwen3 recording at 24 layers and 64 slots it
predicted 1,500 tok/s staged-install at 16 streams where the server decoded 881). Nor the
recording re-batched as it is: the hook spaces a decode step's streams
``T // EC_BENCH_TRACE_STREAMS`` rows apart whatever the step's streams, and each round
restarts at the recording's first row.

So this drives the hook itself (`TraceRouting`, on CPU) through the forwards a server of
`bench/wide_steps.py` runs, in its order: the warm-up request, the TTFT prompts, then for
each stream count a warm-up round and the timed round, each a prefill of the streams'
prompts in one step and a decode step a token. A prefill hands the hook the router's own
ids, which on the bench's random-weight checkpoint spread over the layer's experts: written
here as every expert (past 128 tokens at top-6 of 128 an expert is left out with odds
below 0.3%). One replay (`replay`'s step groups) counts each timed round's misses in the
cache state every earlier forward left, and `planner.predict_ms` prices them with the
probe's link, step cost and staged hit-copy rate (its ``stage``, else `plan`'s constant)
and resident's rate at that stream count, as `plan` prices a trace. A last pair of columns
prices the staged steps' hits at zero, as `plan` did before it priced them, to show what
that term is worth.

    python bench/wide_served.py FIT.npz WSD --slots 64 [--hook-streams 32] [--tokens 64]
        [--streams 1 4 8 16 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from trace_fit import source_of  # noqa: E402
from wide_steps import (  # noqa: E402  (the server's order: one word, one token)
    STREAM_WORDS,
    TTFT_PROMPTS,
    TTFT_RUNS,
    WARM_ROUND_TOKENS,
    WARMUP_TOKENS,
    WARMUP_WORDS,
)

from expertcache_cli.errors import UserError  # noqa: E402
from expertcache_cli.rules import trace as tracefile  # noqa: E402

#: the arms whose N-stream decode is predicted, by wide-step mode
ARMS = {"in-place": "inplace", "staged-install": "staged", "staged": "staged0"}


def schedule(streams: list[int], tokens: int) -> list[tuple[int, int]]:
    """``(tokens, group)`` of every forward, in order: group ``g`` > 0 marks the decode
    steps of ``streams[g - 1]``'s timed round (its rate is timed from each stream's first
    token, which the prefill makes, to its last), 0 everything else."""
    out = [(WARMUP_WORDS, 0)] + [(1, 0)] * (WARMUP_TOKENS - 1)
    out += [(p, 0) for p in TTFT_PROMPTS for _ in range(TTFT_RUNS)]
    for g, n in enumerate(streams, 1):
        out += [(n * STREAM_WORDS, 0)] + [(n, 0)] * (WARM_ROUND_TOKENS - 1)
        out += [(n * STREAM_WORDS, 0)] + [(n, g)] * (tokens - 1)
    return out


def served(trace: tracefile.Trace, plan: list[tuple[int, int]], hook_streams: int
           ) -> tracefile.Trace:
    """The trace of what the hook handed ``plan``'s forwards, each step's distinct experts a
    layer (the cache rules see which experts a step routes, and the gate its tokens, which
    ``step_tokens`` keeps)."""
    import logging

    import torch
    from trace_routing import TraceRouting, log, one_stream

    log.setLevel(logging.ERROR)  # its "in force" line is for a server's log, not this table

    k, e, n_layers = trace.top_k, trace.num_experts, trace.num_layers
    routing = TraceRouting(trace.topk_ids, k, hook_streams, True, trace.request_starts(),
                           one_stream(trace))
    layers = [object() for _ in range(n_layers)]  # one router a layer, in model order
    ids = np.full((len(plan), n_layers, e), -1, np.int32)
    for t, (tokens, _) in enumerate(plan):
        own = (torch.arange(tokens * k) % e).reshape(tokens, k)  # the router's: every expert
        for li, router in enumerate(layers):
            got = routing.substitute(router, own)
            u = torch.unique(got[(got >= 0) & (got < e)]).numpy()
            ids[t, li, : len(u)] = u
    width = max(1, int((ids >= 0).sum(axis=2).max()))
    return dataclasses.replace(
        trace, topk_ids=np.ascontiguousarray(ids[:, :, :width]),
        step_tokens=np.array([p for p, _ in plan], np.int64), requests=None,
        source=source_of(trace) + f" [as the hook served a wide-steps server, set for "
        f"{hook_streams} streams]")


def predict(trace: tracefile.Trace, groups: np.ndarray, streams: list[int], slots: int,
            wide: str, inputs_at: Callable[[int], Any]) -> list[dict]:
    """Each stream count's timed round: misses, staged hits and plan's formula, with the
    `planner.Inputs` ``inputs_at(n)`` gives (resident's rate at ``n`` streams)."""
    from expertcache_cli.planning import planner
    from expertcache_cli.rules.policy import Policy
    from expertcache_cli.rules.replay import replay

    rep = replay(trace, [Policy.LRU], [slots], wide=wide, groups=groups)
    rows = []
    for g, n in enumerate(streams, 1):
        inputs = inputs_at(n)
        if inputs is None:
            continue
        c = rep.group(g).iloc[0]
        steps = int((groups == g).sum())
        per_token, layer_steps = steps * n, steps * trace.num_layers
        misses, hits = float(c["misses"]), float(c["staged_hits"])
        args = (misses / per_token, inputs, trace.num_layers / n)
        rows.append({"streams": n, "mode": wide, "steps": steps,
                     "misses_per_step_layer": misses / layer_steps,
                     "staged_hits_per_step_layer": hits / layer_steps,
                     "predicted_tok_s": 1000.0 / planner.predict_ms(*args, hits / per_token),
                     "hits_free_tok_s": 1000.0 / planner.predict_ms(*args)})
    return rows


def table(rows: list[dict], measured: dict[tuple[str, int], float]) -> str:
    """The rows beside the measured rates, markdown."""
    head = ("| streams | mode | misses a layer-step | staged hits a layer-step | measured tok/s "
            "| plan's formula tok/s | measured / predicted | hits at zero tok/s "
            "| measured / predicted |")
    out = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        m = measured.get((r["mode"], r["streams"]))
        p, z = r["predicted_tok_s"], r["hits_free_tok_s"]
        cells = [str(r["streams"]), r["mode"], f"{r['misses_per_step_layer']:.2f}",
                 f"{r['staged_hits_per_step_layer']:.1f}", f"{m:.1f}" if m else "-",
                 f"{p:.1f}", f"{m / p:.3f}" if m else "-",
                 f"{z:.1f}", f"{m / z:.3f}" if m else "-"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, help="the recording fitted to the served layers")
    ap.add_argument("wsd", type=Path, help="the run's records: size.json, probe.json, the "
                    "arms' JSON")
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--hook-streams", type=int, default=32, help="EC_BENCH_TRACE_STREAMS")
    ap.add_argument("--tokens", type=int, default=64, help="a timed round's tokens a stream")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    a = ap.parse_args(argv)
    from expertcache_cli.planning import inputs as plan_inputs
    from expertcache_cli.planning import planner

    try:
        trace = tracefile.load(a.trace)
        size = json.loads((a.wsd / "size.json").read_text())
        link, link_src, step = planner.read_probe(a.wsd / "probe.json")
        hit_copy = planner.read_hit_copy(a.wsd / "probe.json")
        arms = {m: json.loads((a.wsd / f"{arm}.json").read_text())
                for m, arm in ARMS.items() if (a.wsd / f"{arm}.json").exists()}
        res = json.loads((a.wsd / "resident.json").read_text())["decode"]
    except (OSError, ValueError, KeyError, UserError) as exc:
        print(f"wide_served: {exc}", file=sys.stderr)
        return 2
    plan = schedule(a.streams, a.tokens)
    st = served(trace, plan, a.hook_streams)
    groups = np.array([g for _, g in plan], np.int64)
    resident = {int(n): float(v["tok_s"]) for n, v in res.items()}
    measured = {(m, int(n)): float(v["tok_s"]) for m, r in arms.items()
                for n, v in (r.get("decode") or {}).items()}

    def inputs_at(n: int) -> planner.Inputs | None:
        if n not in resident:
            return None
        return plan_inputs.prediction_inputs(
            (int(size["bytes_per_expert"]), "size.json"), (link, link_src, step),
            (resident[n], f"resident.json, {n} stream(s)"), hit_copy)

    rows = [r for mode in arms for r in predict(st, groups, a.streams, a.slots, mode,
                                                inputs_at)]
    some = inputs_at(next(iter(resident))) if resident else None
    print(f"routing: {st.source}")
    if some is not None:
        print(f"staged hits copied at {some.hit_copy_gbps:,.0f} GB/s: {some.hit_copy_source}")
    print(table(rows, measured))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
