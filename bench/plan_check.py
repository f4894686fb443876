"""`plan`'s predictions beside `baseline`'s measurements, one line per budget (issue 14).

Why a module and not the runner's inline script: this comparison is what the device run
exists for, and it is checked on CPU (tests/bench/test_bench_plan_check.py) before device minutes
are spent on it. Rows: each uniform budget `plan --json` predicted (arm ``cache:S``) and,
where `plan --save` split the best budget per layer, the saved plan (arm ``plan:FILE``);
each beside the matching arm's mean tok/s, their ratio, the live hit rate and the replayed
one. The issue's bar: within 10% on every row.

    python bench/plan_check.py PLAN.json BASELINE.jsonl SAVED_PLAN.json
"""

from __future__ import annotations

import json
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


def served_steps(counters: dict, layers: int, top_k: int) -> int | None:
    """Decode steps a server ran its cache for, from its final counters (requests are
    routed ids: layers x top_k a single-stream step)."""
    req = (counters or {}).get("requests")
    return int(round(req / (layers * top_k))) if req and layers and top_k else None


def compare(plan: dict, arms: dict, saved_plan: str) -> list[str]:
    """``plan``: `plan --json`'s output; ``arms``: measured arms by name (`ArmSummary`)."""
    rows = [(_arm_name(r), r["predicted_tok_s"], r) for r in plan.get("rows", [])]
    rec = plan.get("recommended") or {}
    if rec.get("per_layer_predicted_tok_s"):
        rows.append((f"plan:{saved_plan}", rec["per_layer_predicted_tok_s"], None))
    out = []
    for name, pred, row in rows:
        arm = arms.get(name)
        if arm is None or not arm.restarts:
            out.append(f"{name}: not measured")
            continue
        ratio = arm.mean_tok_s / pred
        live = (arm.counters or {}).get("hit_rate")
        replayed = f", replayed {1 - row['miss_rate']:.3f}" if row else ""
        trace = (plan.get("trace") or {})
        steps = served_steps(arm.counters, trace.get("layers"),
                             (plan.get("model") or {}).get("top_k"))
        if row and steps and trace.get("path") and Path(trace["path"]).exists():
            hit = window_hit_rate(trace["path"], row.get("policy", "lru"), row["slots"], steps)
            replayed += f" (over the {steps} steps it served: {hit:.3f})"
        verdict = "met" if abs(1 - ratio) <= GOAL else "NOT met"
        out.append(f"{name}: predicted {pred:.1f} tok/s, measured {arm.mean_tok_s:.1f} "
                   f"({ratio:.3f}, {verdict}: {GOAL:.0%}); hit rate live "
                   f"{'-' if live is None else f'{live:.3f}'}{replayed}")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: plan_check.py PLAN.json BASELINE.jsonl SAVED_PLAN.json", file=sys.stderr)
        return 2
    from expertcache_cli.baseline.runner import load_summary

    plan = json.loads(Path(argv[0]).read_text())
    summary, _ = load_summary(argv[1])
    print("\n".join(compare(plan, {a.arm: a for a in summary.arms}, argv[2])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
