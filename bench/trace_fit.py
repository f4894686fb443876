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
    python bench/trace_fit.py --source T.npz     # the trace's source line (the reports)
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

from expertcache_cli import trace as tracefile  # noqa: E402


def source_of(trace: tracefile.Trace) -> str:
    """What produced the routing, in one line: the trace's ``source`` (its model label when
    it has none), never empty, so that a table can always say what routing it measured."""
    return trace.source or (f"no source recorded (model: {trace.model})" if trace.model
                            else "no source recorded")


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, required=True, help="the served model's MoE layers")
    ap.add_argument("--expert-bytes", type=int, default=None)
    ap.add_argument("--size", type=Path, default=None,
                    help="a `size --json` file: its bytes_per_expert")
    a = ap.parse_args(argv)
    per = a.expert_bytes
    if per is None and a.size is not None:
        try:
            per = int(json.loads(a.size.read_text())["bytes_per_expert"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # a plan on the trace's own expert bytes (bf16's, for the demo) would predict
            # another format: no fitted trace rather than a wrong prediction
            print(f"trace_fit: {a.size}: no bytes_per_expert ({exc!r})", file=sys.stderr)
            return 2
    out = tracefile.save(fit(tracefile.load(a.trace), a.layers, per), a.out)
    print(f"{out}: {a.layers} layers; routing: {source_of(tracefile.load(out))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
