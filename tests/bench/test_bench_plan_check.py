"""The plan check's comparison (bench/plan_check.py): `plan --json` beside a baseline
results file, row by row, on CPU, before a device run depends on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import plan_check  # noqa: E402

TRACE = ROOT / "traces" / "demo-qwen3-30b-a3b-tasks.npz"


def _baseline(path: Path, arms: dict[str, float], hit: float = 0.9,
              requests: int | None = None) -> None:
    """A results file as `baseline` writes it: meta, one run per arm, counters."""
    lines = [{"kind": "meta", "format": 1, "model": "m", "arms": list(arms), "runs": 1}]
    for arm, tok_s in arms.items():
        lines.append({"kind": "run", "arm": arm, "restart": 0, "run": 0, "tok_s": tok_s,
                      "ttft_s": 0.1, "tokens": 8, "server_id": f"s-{arm}"})
        lines.append({"kind": "counters", "arm": arm, "restart": 0,
                      "counters": {"hit_rate": hit, "requests": requests}})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_each_budget_and_the_saved_plan_beside_what_was_measured(tmp_path):
    saved = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "expertcache_cli", "plan", str(TRACE),
                        "--model", "qwen3-30b-a3b", "--link-gbps", "50", "--resident-tok-s",
                        "100", "--slots", "16,32,64", "--policy", "lru", "--save", str(saved),
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    pred = {f"cache:{row['slots']}": row["predicted_tok_s"] for row in plan["rows"]}
    # measured: 16 slots on the prediction, 32 slots 20% under it, 64 not run
    arms = {"cache:16": pred["cache:16"], "cache:32": 0.8 * pred["cache:32"]}
    per_layer = (plan["recommended"] or {}).get("per_layer_predicted_tok_s")
    if per_layer:
        arms[f"plan:{saved}"] = per_layer * 1.05
    bl = tmp_path / "bl.jsonl"
    # each server ran 100 decode steps: the trace's first 100 are replayed beside it
    _baseline(bl, arms, requests=100 * plan["trace"]["layers"] * plan["model"]["top_k"])
    plan_json = tmp_path / "p.json"
    plan_json.write_text(json.dumps(plan))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_check.py"), str(plan_json),
                          str(bl), str(saved)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    by = {line.split(": ", 1)[0]: line for line in out.stdout.splitlines()}
    assert "(1.000, met: 10%); hit rate live 0.900, replayed" in by["cache:16"]
    window = plan_check.window_hit_rate(TRACE, "lru", 16, 100)
    assert by["cache:16"].endswith(f" (over the 100 steps it served: {window:.3f})")
    whole = 1 - next(r["miss_rate"] for r in plan["rows"] if r["slots"] == 16)
    assert window != whole  # the first 100 steps are not the whole trace
    assert "(0.800, NOT met: 10%)" in by["cache:32"]
    assert by["cache:64"] == "cache:64: not measured"
    if per_layer:
        row = by[f"plan:{saved}"]
        assert "(1.050, met: 10%)" in row and ", replayed" not in row


def test_usage():
    assert plan_check.main([]) == 2


def test_served_steps_come_from_the_final_counters():
    assert plan_check.served_steps({"requests": 153792}, 24, 8) == 801
    assert plan_check.served_steps({}, 24, 8) is None
    assert plan_check.served_steps({"requests": 10}, 0, 8) is None
