"""Issue 15's tables from one wide-steps run: TTFT against the link bound, decode by streams.

Why a module: the run exists to fill these tables and judge their goals, and a device run
is no place to find a bug in an inline script; this one is tested on CPU
(tests/bench/test_bench_wide_report.py). Reads the arm records `bench/wide_steps.py` wrote
(``floor``, ``inplace``, ``staged``, ``resident``), `expertcache size --json` for the
model (MoE layers, experts, bytes an expert, the step's token budget) and the run's
`probe-link --save` (the gather rate):

    python bench/wide_report.py DIR --size SIZE.json --probe PROBE.json --slots 64

The link bound of a prefill of N tokens: the resident TTFT plus, in each of its chunks
(``max_num_batched_tokens`` tokens a step) and each MoE layer, the step's routed experts
that are not already in slots, at the gather rate. A chunk of 512 tokens or more routes
every expert of a layer (512 x top-8 draws over 128 experts miss one with odds ~e^-32), and
slots are full after the first steps, so that is ``E - S`` experts a layer and chunk.
Goals (issue 15): staged within 15% of the bound at 2,048 and 8,192 tokens, never slower
than in place at 512; staged decode >= 1.5x the floor at 16 streams, no regression at one
stream; greedy texts identical between in place and staged.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

ARMS = ("floor", "inplace", "staged", "resident")
# staged without installing misses (EXPERT_CACHE_WIDE=staged, the runner's step staged0):
# a column of its own when the run has it, to decide between the two staged modes
NO_INSTALL = "staged0"
BOUND_GOAL = 0.15  # staged TTFT within 15% of the bound
BOUND_AT = ("2048", "8192")
NOT_SLOWER_AT = "512"
FLOOR_GOAL, FLOOR_AT = 1.5, "16"  # staged decode >= 1.5x the floor at 16 streams
ONE_STREAM_SLACK = 0.05  # "no regression at one stream": within run-to-run noise


def load_arms(d: Path) -> dict[str, dict]:
    arms = {}
    for name in (*ARMS, NO_INSTALL):
        p = d / f"{name}.json"
        if p.exists():
            rec = json.loads(p.read_text())
            if rec.get("status") == "ok" or rec.get("ttft") or rec.get("decode"):
                arms[name] = rec
    return arms


def ttft_ms(rec: dict | None, n: str) -> float | None:
    v = ((rec or {}).get("ttft") or {}).get(n) or {}
    return 1000 * v["median_s"] if v.get("median_s") else None


def decode(rec: dict | None, s: str) -> float | None:
    v = ((rec or {}).get("decode") or {}).get(s) or {}
    return v.get("tok_s")


def bound_ms(resident_ms: float, tokens: int, size: dict, slots: int, gbps: float) -> float:
    """The link bound of one prefill (module docstring)."""
    chunk = int(size.get("max_num_batched_tokens") or tokens)
    chunks = math.ceil(tokens / chunk)
    missing = max(0, int(size["num_experts"]) - slots)
    layers = int(size.get("num_moe_layers") or size["num_layers"])
    return resident_ms + chunks * layers * missing * size["bytes_per_expert"] / (gbps * 1e9) * 1e3


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _no_install_column(arms: dict, title: str, value: Callable[[dict, str], float | None]
                       ) -> tuple[str, str, Callable[[str], str]]:
    """The staged-without-installs column (`NO_INSTALL`): its header, its separator, and
    its cell for a row's key (``value(record, key)``); empty where the run has no such arm."""
    rec = arms.get(NO_INSTALL)
    if rec is None:
        return "", "", lambda _key: ""
    return f" {title} |", " --- |", lambda key: f" {_f(value(rec, key))} |"


def ttft_table(arms: dict, size: dict, slots: int, gbps: float) -> list[str]:
    sizes = sorted({n for r in arms.values() for n in (r.get("ttft") or {})}, key=int)
    head, sep, cell = _no_install_column(arms, "staged, no install ms", ttft_ms)
    out = ["| prompt tokens | in place ms | staged ms | resident ms | link bound ms | "
           "staged / bound | staged / in place |" + head,
           "| --- | --- | --- | --- | --- | --- | --- |" + sep]
    goals = []
    for n in sizes:
        inp, stg, res = (ttft_ms(arms.get(a), n) for a in ("inplace", "staged", "resident"))
        bnd = bound_ms(res, int(n), size, slots, gbps) if res is not None else None
        sb = stg / bnd if stg and bnd else None
        si = stg / inp if stg and inp else None
        out.append(f"| {n} | {_f(inp)} | {_f(stg)} | {_f(res)} | {_f(bnd)} | {_f(sb, 3)} | "
                   f"{_f(si, 3)} |" + cell(n))
        if n in BOUND_AT:
            ok = sb is not None and sb <= 1 + BOUND_GOAL
            goals.append(f"TTFT {n}: staged {_f(sb, 3)} of the link bound "
                         f"({'met' if ok else 'NOT met'}: within {BOUND_GOAL:.0%})")
        if n == NOT_SLOWER_AT:
            ok = si is not None and si <= 1.0
            goals.append(f"TTFT {n}: staged {_f(si, 3)} of in place "
                         f"({'met' if ok else 'NOT met'}: never slower)")
    return out + [""] + goals


def decode_table(arms: dict) -> list[str]:
    streams = sorted({s for r in arms.values() for s in (r.get("decode") or {})}, key=int)
    head, sep, cell = _no_install_column(arms, "staged, no install", decode)
    out = ["| streams | floor tok/s | in place | staged | resident | staged / floor | "
           "staged / in place |" + head, "| --- | --- | --- | --- | --- | --- | --- |" + sep]
    goals = []
    for s in streams:
        flo, inp, stg, res = (decode(arms.get(a), s) for a in ARMS)
        sf = stg / flo if stg and flo else None
        si = stg / inp if stg and inp else None
        out.append(f"| {s} | {_f(flo)} | {_f(inp)} | {_f(stg)} | {_f(res)} | {_f(sf, 2)} | "
                   f"{_f(si, 3)} |" + cell(s))
        if s == FLOOR_AT and flo is None:  # a run without the floor arm judges nothing
            goals.append(f"decode {s} streams: no floor arm in this run (goal: staged >= "
                         f"{FLOOR_GOAL}x the floor; staged {_f(si, 3)} of in place)")
        elif s == FLOOR_AT:
            ok = sf is not None and sf >= FLOOR_GOAL
            goals.append(f"decode {s} streams: staged {_f(sf, 2)}x the floor "
                         f"({'met' if ok else 'NOT met'}: >= {FLOOR_GOAL}x)")
        if s == "1":
            ok = si is not None and si >= 1 - ONE_STREAM_SLACK
            goals.append(f"decode 1 stream: staged {_f(si, 3)} of in place "
                         f"({'met' if ok else 'NOT met'}: no regression, within "
                         f"{ONE_STREAM_SLACK:.0%})")
    return out + [""] + goals


def greedy_line(arms: dict) -> str:
    a, b = (arms.get(x, {}).get("greedy") for x in ("inplace", "staged"))
    if not a or not b:
        return "greedy texts: not compared (an arm has none)"
    same = sum(x == y for x, y in zip(a, b, strict=False))
    verdict = "identical" if a == b else "NOT identical"
    return (f"greedy texts, {len(a)} streams at once: in place vs staged {verdict} "
            f"({same} of {len(a)} streams equal)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--size", type=Path, required=True)
    ap.add_argument("--probe", type=Path, required=True)
    ap.add_argument("--slots", type=int, required=True)
    args = ap.parse_args(argv)
    from expertcache_cli.errors import UserError
    from expertcache_cli.planning.planner import read_probe

    try:
        size = json.loads(args.size.read_text())
        gbps, src, _ = read_probe(args.probe)
    except (OSError, ValueError, UserError) as exc:
        print(f"wide_report: {exc}", file=sys.stderr)
        return 2
    arms = load_arms(args.dir)
    if not arms:
        print(f"wide_report: no arm records ({', '.join(ARMS)}) in {args.dir}", file=sys.stderr)
        return 2
    print(f"link: {gbps:.1f} GB/s ({src}); {size.get('num_moe_layers')} MoE layers x "
          f"{size['num_experts']} experts of {size['bytes_per_expert'] / 1e6:.2f} MB, "
          f"{args.slots} slots, {size.get('max_num_batched_tokens')} tokens a step\n")
    print("\n".join(ttft_table(arms, size, args.slots, gbps)))
    print()
    print("\n".join(decode_table(arms)))
    print()
    print(greedy_line(arms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
