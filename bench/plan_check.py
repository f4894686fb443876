"""`plan`'s predictions beside `baseline`'s measurements, one line per budget (issue 14).

Why a module and not the runner's inline script: this comparison is what the device run
exists for, and it is checked on CPU (tests/bench/test_bench_plan_check.py) before device minutes
are spent on it. Rows: each uniform budget `plan --json` predicted (arm ``cache:S``) and,
where `plan --save` split the best budget per layer, the saved plan (arm ``plan:FILE``);
each beside the matching arm's mean tok/s, their ratio, the live hit rate and the replayed
one. The issue's bar: within 10% on every row.

Where `plan` was given the ids as served (bench/trace_fit.py ``--streams 1 --steps
(RUNS+1)*T --request-steps T``: a warm-up and RUNS requests of T tokens, each from the
trace's row 0), a row also says what plan's own formula gives over the steps the client
timed: `baseline` discards the warm-up, and a run's decode rate is timed from its first
token to its last, so its prefill is not in it. `plan` leaves the prefills (16 tokens, wider
than a decode step) out of its pricing itself, but prices the warm-up request's decode
steps, whose cold misses the timed steps never pay: on the Qwen3 recording at 24 layers and
64 of 128 slots (bf16 experts, a 50 GB/s link, 490 tok/s resident, a warm-up and 3 runs of
200 tokens), plan's formula over the timed steps gives 1.10x the tok/s plan gives (1.00x at
16 slots; 1.40x and 1.01x when plan priced the prefills too). Both are printed, each with
its ratio; the timed one is the like-for-like comparison.

    python bench/plan_check.py PLAN.json BASELINE.jsonl SAVED_PLAN.json
    python bench/plan_check.py --table [--command CMD] PLAN.json BASELINE.jsonl SAVED.json ...
        # one markdown table over several traces, each row saying the trace's routing source

A baseline with an ``offload`` arm (the runner's ``OFFLOAD_ARM=1``) also gets the floor's
rate on the same routing, and each cache arm's multiple of it: not judged, as `plan` does
not predict the floor.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

GOAL = 0.10


def _arm_name(row: dict) -> str:
    """The `baseline` arm that serves a plan row: ``cache:S`` for LRU (the default),
    ``cache:S:POLICY`` for another policy."""
    policy = row.get("policy", "lru")
    return f"cache:{row['slots']}" + ("" if policy == "lru" else f":{policy}")


def window_hit_rate(trace_path: str | Path, policy: str, slots: int, steps: int) -> float:
    """The hit rate of the trace's first ``steps`` steps replayed at ``slots`` under
    ``policy``: what a server fed the trace from its start saw in ``steps`` decode steps.
    `plan` replays the whole trace; a server sees its first few hundred steps, and LFU
    without decay is still filling its counts there (bench/results/plan-check.md: the
    whole trace's LFU rates at 16/32/64 slots above its first 801 steps' and the served
    ones)."""
    import dataclasses

    from expertcache_cli.rules import trace as tracefile
    from expertcache_cli.rules.policy import Policy
    from expertcache_cli.rules.replay import replay

    tr = tracefile.load(trace_path)
    # the replay `plan` runs, on the trace's first steps (the same miss count and rate)
    head = dataclasses.replace(
        tr, topk_ids=tr.topk_ids[:steps],
        step_tokens=None if tr.step_tokens is None else tr.step_tokens[:steps])
    row = replay(head, [Policy[policy.upper()]], [slots]).results.iloc[0]
    return 1 - float(row["miss_rate"])


def counted_hit_rate(trace_path: str | Path, policy: str, slots: int) -> float:
    """The whole served trace's hit rate as the cache's own counter counts it: `plan`'s
    replay prices decode steps only, but a prefill step no wider than the slots (tokens x
    top-k, the plugin's gate: 16 tokens at top-2 are 32 ids, served from 32 slots) goes
    through the cache and its counter, while a wider one is read through and counted
    nowhere. The live hit rate is to be set beside this, not beside the decode-only rate."""
    from expertcache_cli.rules import trace as tracefile
    from expertcache_cli.rules.policy import Policy
    from expertcache_cli.rules.replay import live_hit_rate, replay

    row = replay(tracefile.load(trace_path), [Policy[policy.upper()]],
                 [slots]).results.iloc[0]
    return live_hit_rate(int(row["installs"]), int(row["requests"]),
                         int(row["read_through_ids"]))


def served_steps(counters: dict, layers: int, top_k: int) -> int | None:
    """Decode steps a server ran its cache for, from its final counters (requests are
    routed ids: layers x top_k a single-stream step)."""
    req = (counters or {}).get("requests")
    return int(round(req / (layers * top_k))) if req and layers and top_k else None


def timed_steps(trace_steps: int, runs: int | None, max_tokens: int | None
                ) -> list[tuple[int, int]] | None:
    """The steps of a served trace that the measured runs timed, as ``[start, end)``
    ranges: the trace is a warm-up and ``runs`` requests of ``max_tokens`` steps each (its
    prefill, then a step a token); the warm-up is discarded and a run is timed from its
    first token to its last (steps 1 to ``max_tokens - 1`` of it). None where the trace is
    not that (a synthetic trace, replayed whole)."""
    if not runs or not max_tokens or max_tokens < 2 or trace_steps != (runs + 1) * max_tokens:
        return None
    return [(r * max_tokens + 1, (r + 1) * max_tokens) for r in range(1, runs + 1)]


def timed_prediction(plan: dict, row: dict, runs: int | None, max_tokens: int | None
                     ) -> tuple[float, float, int] | None:
    """(predicted tok/s, hit rate, decode steps) over the steps the runs timed, by plan's
    own formula (`planner.predict_ms`) and inputs (its expert bytes, link, step cost and
    resident rate), the cache state carried in from everything served before them (the
    warm-up, the earlier runs, the prefills): one replay of the whole served trace with the
    timed steps counted apart (`replay`'s step groups). None where plan's trace is not a
    served one."""
    import numpy as np

    from expertcache_cli.planning import planner
    from expertcache_cli.rules import trace as tracefile
    from expertcache_cli.rules.policy import Policy
    from expertcache_cli.rules.replay import replay

    trace = plan.get("trace") or {}
    path = trace.get("path")
    if not path or not Path(path).exists() or timed_steps(
            int(trace.get("steps") or 0), runs, max_tokens) is None:
        return None
    tr = tracefile.load(path)
    windows = timed_steps(tr.steps, runs, max_tokens)
    if windows is None:
        return None
    policy = row.get("policy", "lru")
    timed = np.zeros(tr.steps, np.int64)  # group 1: the steps the runs timed
    for a, b in windows:
        timed[a:b] = 1
    rep = replay(tr, [Policy[policy.upper()]], [int(row["slots"])], groups=timed)
    missed = float(rep.group(1)["misses"].iloc[0])
    ids = sum(int((tr.topk_ids[a:b] >= 0).sum()) for a, b in windows)
    steps = sum(b - a for a, b in windows)
    model = plan.get("model") or {}
    inputs = planner.Inputs(int(model["bytes_per_expert"]), "plan", float(plan["link_gbps"]),
                            "plan", float(plan["resident_tok_s"]), "plan",
                            step_us=float(plan.get("step_us") or 0.0))
    # a decode step is one token, and every layer runs the cache's step once a step
    ms = planner.predict_ms(missed / steps, inputs, float(tr.num_layers))
    return 1000.0 / ms, 1 - missed / ids, steps


def _verdict(ratio: float) -> str:
    return "met" if abs(1 - ratio) <= GOAL else "NOT met"


def rows_of(plan: dict, arms: dict, saved_plan: str, meta: dict | None = None
            ) -> list[dict]:
    """One dict per predicted arm: its name, plan's prediction, the arm (None: not
    measured), live and replayed hit rates, and over the timed steps (``timed``: predicted
    tok/s, hit rate, steps) where plan's trace is the served one."""
    rows = [(_arm_name(r), r["predicted_tok_s"], r) for r in plan.get("rows", [])]
    rec = plan.get("recommended") or {}
    if rec.get("per_layer_predicted_tok_s"):
        rows.append((f"plan:{saved_plan}", rec["per_layer_predicted_tok_s"], None))
    out = []
    for name, pred, row in rows:
        arm = arms.get(name)
        got = {"name": name, "predicted": pred, "row": row, "timed": None, "window": None,
               "arm": arm if arm is not None and arm.restarts else None}
        out.append(got)
        if got["arm"] is None:
            continue
        got["live"] = (arm.counters or {}).get("hit_rate")
        if row is None:
            continue
        got["timed"] = timed_prediction(plan, row, (meta or {}).get("runs"),
                                        (meta or {}).get("max_tokens"))
        trace = (plan.get("trace") or {})
        if trace.get("prefill_steps") and trace.get("path") and Path(trace["path"]).exists():
            got["counted"] = counted_hit_rate(trace["path"], row.get("policy", "lru"),
                                              row["slots"])
        steps = served_steps(arm.counters, trace.get("layers"),
                             (plan.get("model") or {}).get("top_k"))
        if got["timed"] is None and steps and trace.get("path") and \
                Path(trace["path"]).exists():
            got["window"] = (steps, window_hit_rate(trace["path"], row.get("policy", "lru"),
                                                    row["slots"], steps))
    return out


FLOOR = "offload"


def floor_rate(arms: dict) -> float | None:
    """The offload floor's rate where the baseline served one (the runner's
    ``OFFLOAD_ARM=1``): what each cache arm's gain on this routing is a multiple of."""
    floor = arms.get(FLOOR)
    if floor is None or not floor.restarts or not floor.mean_tok_s:
        return None
    return floor.mean_tok_s


def floor_line(arms: dict) -> str | None:
    """The floor's rate and each cache arm's multiple of it: the cache's gain on this
    routing, which `plan` does not predict and no row judges."""
    floor = floor_rate(arms)
    if floor is None:
        return None
    multiples = ", ".join(f"{name} {a.mean_tok_s / floor:.2f}x"
                          for name, a in arms.items()
                          if name.startswith("cache:") and a.restarts and a.mean_tok_s)
    return (f"{FLOOR} (the floor, same routing): {floor:.1f} tok/s"
            + (f"; {multiples}" if multiples else ""))


def compare(plan: dict, arms: dict, saved_plan: str, meta: dict | None = None) -> list[str]:
    """``plan``: `plan --json`'s output; ``arms``: measured arms by name (`ArmSummary`);
    ``meta``: the baseline file's protocol (its runs and tokens a run: the timed steps)."""
    out = []
    for r in rows_of(plan, arms, saved_plan, meta):
        name, pred, row, arm = r["name"], r["predicted"], r["row"], r["arm"]
        if arm is None:
            out.append(f"{name}: not measured")
            continue
        ratio = arm.mean_tok_s / pred
        live = r.get("live")
        replayed = f", replayed {1 - row['miss_rate']:.3f}" if row else ""
        if r["window"]:
            replayed += f" (over the {r['window'][0]} steps it served: {r['window'][1]:.3f})"
        counted = r.get("counted")
        if row and counted is not None and abs(counted - (1 - row["miss_rate"])) >= 5e-4:
            replayed += (f" (decode steps; with the prefills the cache served, as its "
                         f"counter counts them: {counted:.3f})")
        timed = ""
        if r["timed"]:
            t_pred, t_hit, t_steps = r["timed"]
            t_ratio = arm.mean_tok_s / t_pred
            # a token's time beyond the formula's: a fixed cost shows as the same gap at
            # every budget, a mispriced gather as one that grows with the misses
            gap_ms = 1e3 / arm.mean_tok_s - 1e3 / t_pred
            timed = (f"; over the {t_steps} decode steps the runs timed (after the warm-up): "
                     f"predicted {t_pred:.1f} ({t_ratio:.3f}, {_verdict(t_ratio)}: "
                     f"{GOAL:.0%}; {gap_ms:+.3f} ms a token against it), hit rate replayed "
                     f"{t_hit:.3f}")
        out.append(f"{name}: predicted {pred:.1f} tok/s, measured {arm.mean_tok_s:.1f} "
                   f"({ratio:.3f}, {_verdict(ratio)}: {GOAL:.0%}); hit rate live "
                   f"{'-' if live is None else f'{live:.3f}'}{replayed}{timed}")
    line = floor_line(arms)
    return out + ([line] if line else [])


TABLE_HEAD = (
    "| trace | routing (the trace's source) | arm | plan: predicted tok/s | measured tok/s "
    "| measured / predicted | plan's formula over the timed steps: predicted tok/s "
    "(measured / it) | hit rate live / replayed (timed steps) | of resident | x floor |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def measured_on(plan: dict) -> str:
    """What ``plan`` was given, on which GPU: a table over runs from several machines (links
    that differ twofold) is read row by row against its own link and resident rate."""
    probed = (re.match(r"probe-link on (.+?) \(", plan.get(key) or "")
              for key in ("link_source", "step_source"))
    where = next((m.group(1) for m in probed if m), None)
    parts = [where] if where else []
    if plan.get("link_gbps"):
        parts.append(f"gather {plan['link_gbps']:.1f} GB/s")
    if plan.get("resident_tok_s"):
        parts.append(f"resident {plan['resident_tok_s']:.1f} tok/s")
    return f" [plan given: {', '.join(parts)}]" if parts else ""


def gains(tok_s: float, resident: float | None, floor: float | None) -> str:
    """A row's last two cells: its rate as a share of the resident rate `plan` was given
    (what the cache recovers of all-in-VRAM) and as a multiple of the floor on the same
    routing (what it adds over offloading alone), ``-`` where that rate is missing."""
    return (f"{tok_s / resident:.3f} | " if resident else "- | ") + (
        f"{tok_s / floor:.2f} |" if floor else "- |")


def table(runs: list[tuple[dict, dict, str, dict | None]], command: str | None = None
          ) -> list[str]:
    """The markdown table over several traces (each ``(plan, arms, saved_plan, meta)``),
    with the command that reproduces it; the routing column says each trace's ``source``
    (recorded or synthetic: what routing produced the row) and, on its first row, what
    ``plan`` was given (``measured_on``)."""
    lines = [f"Reproduce: `{command}`", ""] if command else []
    lines.append(TABLE_HEAD)
    met = total = 0
    for plan, arms, saved, meta in runs:
        resident, floor = plan.get("resident_tok_s"), floor_rate(arms)
        trace = plan.get("trace") or {}
        label = Path(trace.get("path") or "?").name.removesuffix(".npz")
        source = trace.get("source") or "no source recorded"
        for i, r in enumerate(rows_of(plan, arms, saved, meta)):
            routing = source + measured_on(plan) if i == 0 else "(as above)"
            arm, pred = r["arm"], r["predicted"]
            name = r["name"] if not r["name"].startswith("plan:") else "`plan:` per-layer split"
            if arm is None:
                lines.append(f"| {label} | {routing} | {name} | {pred:.1f} | not measured "
                             "| - | - | - | - | - |")
                continue
            ratio = arm.mean_tok_s / pred
            timed, hit = "-", "-"
            judged = ratio
            if r["timed"]:
                t_pred, t_hit, _ = r["timed"]
                judged = arm.mean_tok_s / t_pred
                timed, hit = f"{t_pred:.1f} ({judged:.3f})", f"{t_hit:.3f}"
            elif r["row"]:
                hit = f"{1 - r['row']['miss_rate']:.3f}"
            live = r.get("live")
            total += 1
            met += abs(1 - judged) <= GOAL
            lines.append(f"| {label} | {routing} | `{name}` | {pred:.1f} | "
                         f"{arm.mean_tok_s:.1f} | {ratio:.3f} | {timed} | "
                         f"{'-' if live is None else f'{live:.3f}'} / {hit} | "
                         f"{gains(arm.mean_tok_s, resident, floor)}")
        if floor:
            lines.append(f"| {label} | (as above) | `{FLOOR}` (the floor, not predicted) | - | "
                         f"{floor:.1f} | - | - | - | {gains(floor, resident, floor)}")
    lines += ["", f"{met} of {total} measured rows within {GOAL:.0%} (over the timed steps "
              "where plan was given the served trace, else plan's own prediction)"]
    return lines


def _load(plan_json: str, baseline: str) -> tuple[dict, dict, dict | None]:
    from expertcache_cli.baseline import store
    from expertcache_cli.baseline.runner import load_summary

    plan = json.loads(Path(plan_json).read_text())
    trace = plan.get("trace") or {}
    beside = Path(plan_json).parent / Path(trace.get("path") or "-").name
    if trace.get("path") and not Path(trace["path"]).exists() and beside.exists():
        # the run's files copied off the box: plan's trace travels beside its JSON
        trace["path"] = str(beside)
    summary, _ = load_summary(baseline)
    meta, _ = store.load(baseline)
    return plan, {a.arm: a for a in summary.arms}, meta


USAGE = ("usage: plan_check.py PLAN.json BASELINE.jsonl SAVED_PLAN.json | --table [--command "
         "CMD] (PLAN.json BASELINE.jsonl SAVED.json)...")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--table"]:
        argv, command = argv[1:], None
        if argv[:1] == ["--command"] and len(argv) >= 2:
            command, argv = argv[1], argv[2:]
        if not argv or len(argv) % 3:
            print(USAGE, file=sys.stderr)
            return 2
        runs = []
        for i in range(0, len(argv), 3):
            plan, arms, meta = _load(argv[i], argv[i + 1])
            runs.append((plan, arms, argv[i + 2], meta))
        print("\n".join(table(runs, command)))
        return 0
    if len(argv) != 3:
        print(USAGE, file=sys.stderr)
        return 2
    plan, arms, meta = _load(argv[0], argv[1])
    print("\n".join(compare(plan, arms, argv[2], meta)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
