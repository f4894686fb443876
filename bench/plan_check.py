"""`plan`'s predictions beside `baseline`'s measurements, one line per budget (issue 14).

Why a module and not the runner's inline script: this comparison is what the device run
exists for, and it is checked on CPU (tests/test_bench_plan_check.py) before device minutes
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
