"""The headline small-card table: floor, cache at the planned slots and resident on the
emulated 24 and 16 GiB cards, from the records `bench/run_headline_on_device.sh` leaves
(bench/small_card.py's server records and logs, `size --json`, the routing it wrote).

Why a module: a published number must say what routing produced it, and a server whose
routing was not the trace's (the bench hook not in force) must not pass for a real-routing
result; both are decided here, on CPU (tests/bench/test_bench_headline_runner.py), before
device minutes are spent. The width is printed beside the source: the bundled Qwen3
recording ran the model at 6 experts a token, and the checkpoint is routed at that width.

    python bench/headline_report.py /tmp/hl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from flagship_report import _greedy, _status, live_hit_rate, rate, seeded, varied  # noqa: E402
from formats_report import plan_row, plan_verdict, slots_of  # noqa: E402
from small_card import describe, prompts_line  # noqa: E402
from trace_routing import IN_FORCE_LINE  # noqa: E402

CARDS = (24, 16)
#: Qwen3-30B-A3B's experts a token, as its config says
MODEL_TOP_K = 8


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def load(d: Path) -> dict:
    """Every record of a run directory: the arms by name, ``size`` by card, the routing
    line, the trace given (``none``: the checkpoint's routers) and the checkpoint's top-k."""
    arms = {n: r for n in ["resident", *(f"{a}{c}" for c in CARDS for a in ("floor", "cache"))]
            if (r := _read(d / f"{n}.json")) is not None}
    model = _text(d / "model.path")
    cfg = _read(Path(model) / "config.json") if model else None
    return {"dir": d, "arms": arms, "routing": _text(d / "routing.txt"),
            "trace": _text(d / "trace.src"), "model": model,
            "top_k": (cfg or {}).get("num_experts_per_tok"), "gpu": _text(d / "gpu.txt"),
            "size": {c: s for c in CARDS if (s := _read(d / f"size{c}.json")) is not None},
            "plan": {c: p for c in CARDS if (p := _read(d / f"plan{c}.json")) is not None},
            "probe_gpu": (_read(d / "probe.json") or {}).get("device_name")}


def probe_mismatch(run: dict) -> str | None:
    """Why plan's predictions do not count, where its link probe ran on another GPU model
    than the servers (a seeded probe): a prediction prices this GPU's link and kernels."""
    gpu, probed = run.get("gpu"), run.get("probe_gpu")
    if gpu and probed and gpu.strip() != probed.strip():
        return f"plan's probe ran on {probed}, the servers on {gpu}: no prediction shown"
    return None


def routed(run: dict) -> bool:
    return bool(run["trace"]) and run["trace"] != "none"


def routing_lines(run: dict) -> list[str]:
    """What routing every number has: the trace's source and the width it was served at,
    and whether the hook was in force in every server."""
    lines = [f"Routing of every server: {run['routing'] or 'unknown (no routing record)'}"]
    k = run["top_k"]
    if routed(run):
        width = f"top-{k}" if k else "an unknown top-k"
        note = (" (the model's own width)" if k == MODEL_TOP_K else
                f": the width the recording ran the model at (Qwen3-30B-A3B's config says "
                f"{MODEL_TOP_K}), so each token's experts are exactly the recorded ones, "
                "not a narrowing of them")
        lines.append(f"Width: the checkpoint routes {width} of 128 experts{note}.")
        bad = []
        for name in run["arms"]:
            try:
                text = (run["dir"] / f"{name}.log").read_text(errors="replace")
            except OSError:
                bad.append(f"{name} (no log to check)")
                continue
            if IN_FORCE_LINE not in text:
                bad.append(name)
        lines.append("Trace routing in force in every server." if not bad else
                     "Trace routing NOT in force, these numbers do not count: " + ", ".join(bad))
    else:
        lines.append(f"Width: top-{k or '?'} of 128, the checkpoint's own routers.")
    return [*lines, f"Prompts: {prompts_line(run['arms'])}."]


def _runs(rec: dict | None, tok: float | None) -> str:
    """The server's rate ``tok`` (`rate`, as the row's ratios use it) and its runs' spread;
    runs that replayed different recorded requests are said to be taken together (their
    median would be one request's)."""
    runs = (rec or {}).get("tok_s") or []
    if not runs or tok is None:
        return "-"
    spread = f"{min(runs):.2f}-{max(runs):.2f}" if len(runs) > 1 else f"{runs[0]:.2f}"
    return f"{tok:.2f} {'over the runs' if varied(rec) else 'median'} ({spread})"


TABLE_HEAD = ("| card | arm | slots: size planned / armed | decode tok/s (runs' range) | "
              "x floor | of resident | live hit rate over the runs | plan predicted "
              "(measured / predicted) |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- |")


def _predicted(run: dict, card: int, rec: dict | None, tok: float | None) -> str:
    """The plan column of a cache row: plan's tok/s at the slots the arm armed, and the
    measured rate over it; '-' where no plan was made for the card."""
    row = plan_row(run["plan"].get(card), slots_of(rec))
    if row is None or probe_mismatch(run):
        return "-"
    want = float(row["predicted_tok_s"])
    return f"{want:.1f} ({tok / want:.3f})" if tok else f"{want:.1f}"


def table(run: dict) -> list[str]:
    arms = run["arms"]
    res = rate(arms.get("resident"))
    rows = [TABLE_HEAD]
    for c in CARDS:
        floor, cache = arms.get(f"floor{c}"), arms.get(f"cache{c}")
        f_tok = rate(floor)
        for name, rec, what in ((f"floor{c}", floor, "floor: experts offloaded, no cache"),
                                (f"cache{c}", cache, "cache at the planned slots")):
            if rec is None:
                continue
            tok = rate(rec)
            slots = "-"
            if name.startswith("cache"):
                lg = rec.get("log") or {}
                planned = (run["size"].get(c) or {}).get("slots")
                armed = (f"{lg.get('slots')} ({lg.get('armed_layers')} of "
                         f"{lg.get('moe_layers')} layers armed)" if lg.get("slots") else
                         "not armed")
                slots = f"{planned if planned is not None else '?'} / {armed}"
            live = live_hit_rate(rec) if name.startswith("cache") else None
            plan = _predicted(run, c, rec, tok) if name.startswith("cache") else "-"
            rows.append(
                f"| {c} GiB | {what} | {slots} | {_status(rec) or _runs(rec, tok)} | "
                f"{f'{tok / f_tok:.2f}' if tok and f_tok else '-'} | "
                f"{f'{tok / res:.3f}' if tok and res else '-'} | "
                f"{'-' if live is None else f'{live:.2%}'} | {plan} |")
    if arms.get("resident") is not None:
        rec = arms["resident"]
        rows.append(f"| whole {run['gpu'] or 'GPU'} | resident: every expert in VRAM | - | "
                    f"{_status(rec) or _runs(rec, res)} | - | {'1.000' if res else '-'} | - | - |")
    return rows


def findings(run: dict) -> list[str]:
    arms, res = run["arms"], rate(run["arms"].get("resident"))
    out = []
    for c in CARDS:
        floor, cache = arms.get(f"floor{c}"), arms.get(f"cache{c}")
        f_tok, c_tok = rate(floor), rate(cache)
        if c_tok and f_tok:
            gap = (f"; the gap to resident recovered: {(c_tok - f_tok) / (res - f_tok):.1%}"
                   if res and res > f_tok else "")
            out.append(f"- {c} GiB: cache {c_tok / f_tok:.2f}x the offload floor{gap}")
        said, mismatch = plan_verdict(c_tok, run["plan"].get(c), cache), probe_mismatch(run)
        if said and mismatch:
            out.append(f"- {c} GiB: {mismatch}")
        elif said:
            out.append(f"- {c} GiB: {said}")
        elif c_tok:
            out.append(f"- {c} GiB: no plan prediction (no plan{c}.json: the probe or plan "
                       "step not run, or no trace routed the servers)")
        for other, name in ((floor, "floor"), (arms.get("resident"), "resident")):
            g = _greedy(other, cache)
            if g is not None:
                out.append(f"- {c} GiB greedy tokens, cache vs {name}: {describe(g)}")
    for name, rec in arms.items():
        if rec.get("greedy") and rec.get("greedy_again"):
            g = _greedy({"greedy": rec["greedy"]}, {"greedy": rec["greedy_again"]})
            if g is not None and not g["identical"]:
                out.append(f"- {name} vs its own second request: {describe(g)}")
    return out


def _shown(trace: str) -> str:
    """A trace path as the command is typed in the checkout (traces/NAME.npz)."""
    for path in (Path(trace), Path(trace).resolve()):
        try:
            return str(path.relative_to(HERE.parent))
        except ValueError:
            continue
    return trace


def report(d: Path) -> list[str]:
    run = load(d)
    trace = _shown(run["trace"]) if routed(run) else "none"
    gpu = (f"GPU: {run['gpu']}; the small cards emulated on it (bench/ballast.py holds the "
           "rest of its memory), so their compute and host link are its own.")
    return [gpu if run["gpu"] else "GPU: not recorded (no gpu.txt).", *routing_lines(run), "",
            f"Reproduce: `TRACE={trace} bash bench/run_headline_on_device.sh`", "",
            *table(run), "", *findings(run), *seeded(d)]


def served(record: Path) -> str | None:
    """'SLOTS RUNS' of a cache arm's record (the slots it armed, its measured runs): what
    the runner's plan step replays; None where it armed nothing or measured nothing."""
    rec = _read(record)
    slots, runs = slots_of(rec), len((rec or {}).get("tok_s") or [])
    return f"{slots} {runs}" if slots and runs else None


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--served":
        got = served(Path(argv[1]))
        if got is None:
            print(f"{argv[1]}: no armed slots or no measured runs", file=sys.stderr)
            return 1
        print(got)
        return 0
    if len(argv) != 1:
        print("usage: headline_report.py DIR | --served CACHE.json", file=sys.stderr)
        return 2
    print("\n".join(report(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
