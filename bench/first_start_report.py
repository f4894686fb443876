"""The first-start table: per cold start on an emulated card, what was planned and what vLLM did.

Reads the records `bench/run_first_start_on_device.sh` leaves in one folder (per start
``NAME.json`` from `bench/small_card.py` and ``NAME.size.json`` from `expertcache size
--json`) and prints one markdown table and the goals: the first start healthy, vLLM's KV
cache within ``KV_TOLERANCE_GIB`` of the plan's, every MoE layer armed with the planned
slots, and what vLLM loaded ("Model loading took") within ``KV_TOLERANCE_GIB`` of the
weights the plan holds in VRAM (the non-expert weights and vLLM's rotary cache), where the
log gives it: a plan that misses a buffer of vLLM's shows here before it costs a start.

    python bench/first_start_report.py /tmp/fs
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GiB = 1024**3
#: how far vLLM's KV cache may be from the plan's and still be "what the plan said"
KV_TOLERANCE_GIB = 0.1


def row(rec: dict, size: dict) -> dict:
    """One start's cells, and whether it met each goal."""
    lg = rec.get("log") or {}
    plan_kv = size.get("kv_cache_bytes", 0) / GiB
    kv = lg.get("kv_gib")
    plan_w = (size.get("non_expert_bytes", 0) + size.get("rope_cache_bytes", 0)) / GiB
    weights = lg.get("weights_gib")
    slots = lg.get("slots")
    healthy = rec.get("status") == "ok"
    return {
        "healthy": healthy,
        "start_s": rec.get("start_s"),
        "compile": lg.get("compile", "?"),
        "plan_slots": size.get("slots"),
        "slots": slots,
        "armed": f"{lg.get('armed_layers', 0)} of {lg.get('moe_layers') or '?'}",
        "max_num_seqs": size.get("max_num_seqs"),
        "plan_kv": plan_kv,
        "kv": kv,
        "kv_ok": kv is not None and abs(kv - plan_kv) <= KV_TOLERANCE_GIB,
        "plan_weights": plan_w if size.get("non_expert_bytes") else None,
        "weights": weights,
        "weights_ok": (weights is None or not size.get("non_expert_bytes")
                       or abs(weights - plan_w) <= KV_TOLERANCE_GIB),
        "slots_ok": slots is not None and slots == size.get("slots")
        and lg.get("armed_layers") == lg.get("moe_layers"),
        "tok_s": (rec.get("tok_s") or [None])[0],
        "why": None if healthy else (lg.get("cause") or rec.get("error")),
    }


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def report(folder: Path) -> list[str]:
    lines = ["| card | mode | context | first start | s to healthy | compile | --max-num-seqs "
             "| slots planned / armed | weights planned / vLLM (GiB) "
             "| KV planned / vLLM (GiB) | decode tok/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    goals = []
    for path in sorted(folder.glob("fs*.json")):
        if path.name.endswith(".size.json"):
            continue
        name = path.stem
        size_path = folder / f"{name}.size.json"
        if not size_path.exists():
            continue
        rec, size = json.loads(path.read_text()), json.loads(size_path.read_text())
        card, mode, ctx = name[2:].split("-", 1)[0], *name[2:].split("-", 1)[1].rsplit("-", 1)
        r = row(rec, size)
        lines.append(
            f"| {card} GiB | {mode} | {ctx} | {'healthy' if r['healthy'] else 'FAILED'} | "
            f"{_f(r['start_s'], '.0f')} | {r['compile']} | {r['max_num_seqs']} | "
            f"{r['plan_slots']} / {r['slots'] if r['slots'] is not None else '-'} "
            f"({r['armed']} layers) | {_f(r['plan_weights'])} / {_f(r['weights'])} | "
            f"{_f(r['plan_kv'])} / {_f(r['kv'])} | "
            f"{_f(r['tok_s'], '.1f')} |")
        met = r["healthy"] and r["kv_ok"] and r["slots_ok"] and r["weights_ok"]
        goals.append(f"- {name}: {'met' if met else 'NOT met'}"
                     + ("" if r["healthy"] else f" (start failed: {r['why']})")
                     + ("" if r["kv_ok"] or not r["healthy"] else
                        f" (KV {_f(r['kv'])} vs planned {_f(r['plan_kv'])} GiB)")
                     + ("" if r["slots_ok"] or not r["healthy"] else " (slots not as planned)")
                     + ("" if r["weights_ok"] else
                        f" (vLLM loaded {_f(r['weights'])} GiB, the plan holds "
                        f"{_f(r['plan_weights'])})"))
    if not goals:
        return ["no first-start records in " + str(folder)]
    return [*lines, "", f"goals (healthy on the first start, KV and the weights vLLM loaded "
            f"within {KV_TOLERANCE_GIB} GiB of the plan, every MoE layer armed with the "
            "planned slots):", *goals]


def main() -> int:
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        print("usage: python bench/first_start_report.py FOLDER", file=sys.stderr)
        return 2
    print("\n".join(report(Path(sys.argv[1]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
