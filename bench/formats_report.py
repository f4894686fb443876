"""One line per weight format from `bench/run_formats_on_device.sh`'s server records.

Why a script of its own: issue 11 asks four things of every format the cache arms, each
against a number measured in the same run: greedy tokens equal to the floor's, the all-hit
arm within 5% of resident, and the missing arm within 10% of the tok/s predicted from its
live installs and the link (`1000 / (1000 / resident + installs a token x bytes an expert
/ link)`, the planner's own model). It reads `DIR/FMT-{floor,cache,trial,resident,hot}.json`
(and the A/B/A arms `FMT-hot_LABEL.json`, `FMT-resident2.json` where the runner made them)
(bench/small_card.py records), `DIR/FMT-size.json` (`expertcache size --json`) and
`DIR/FMT-probe.json` (`probe-link --only gather --model`), and says which goals held.

Issue 29 adds `plan`'s own prediction: `DIR/FMT-plan.json` (`expertcache plan --json` on the
trace that drove the cache arm's routing, fitted to the served layers by
`bench/trace_fit.py`, with the format's probe and the resident arm's rate) gives the
predicted tok/s at the cache arm's slots beside the measured one (goal 10%), and the trace's
``source``, so that every row says what routing produced it (the demo traces are
synthetic: their source says so).

    python bench/formats_report.py w8a8 /tmp/fm
    python bench/formats_report.py --armed /tmp/fm/w8a8-cache.json   # exit 0: armed
    python bench/formats_report.py --served /tmp/fm/w8a8-cache.json  # ... and served
    python bench/formats_report.py --median /tmp/fm/w8a8-resident.json  # its median tok/s
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from small_card import (  # noqa: E402
    compare_greedy,
    describe,
    live_hit_rate,
    prompts_line,
    seeded_line,
)

from expertcache_cli.baseline.counters import ARMED_RE  # noqa: E402

ALL_HIT_GOAL = 0.05
DECLINED_RE = re.compile(
    r"armed 0 of \d+ MoE layers \((?P<why>.*)\)(; serving on the stock path)?$")
CHECK_RE = re.compile(r"slots path (\d+) of (\d+) layers agreed")
PREDICTION_GOAL = 0.10


def median_tok_s(rec: dict | None) -> float | None:
    """The median run: a small model decodes a 200-token run in a third of a second, where
    one host hiccup moves a mean by 10% (H200, 8 layers: resident runs of 588-655 tok/s)."""
    import statistics

    runs = (rec or {}).get("tok_s") or []
    return statistics.median(runs) if runs else None


def _spread(rec: dict | None) -> str:
    runs = (rec or {}).get("tok_s") or []
    return f" ({min(runs):.0f}-{max(runs):.0f})" if len(runs) > 1 else ""


def _weights(rec: dict | None) -> str:
    gib = ((rec or {}).get("log") or {}).get("weights_gib")
    return "" if gib is None else f", {gib:.2f} GiB of weights in VRAM"


def installs_per_token(rec: dict | None) -> float | None:
    """Installs a decoded token over the measured runs (the stats lines around them)."""
    rec = rec or {}
    b, a, n = rec.get("counters_before"), rec.get("counters_after"), rec.get("decode_tokens")
    if not (b and a and n):
        return None
    return (a["installs"] - b["installs"]) / n


def _hits(rec: dict | None) -> str:
    h = live_hit_rate(rec)
    return "-" if h is None else f"{100 * h:.1f}%"


def predicted_tok_s(resident: float, per_token: float, bytes_per_expert: int,
                    gbps: float, step_us: float = 0.0, layers: int = 0) -> float:
    """The planner's own prediction (`planner.predict_ms`), single stream: every MoE layer
    runs the cache's step once a token (``step_us`` from the format's probe, 0 if absent)."""
    from expertcache_cli.planning.planner import Inputs, predict_ms

    inputs = Inputs(bytes_per_expert, "size", gbps, "probe", resident, "resident arm",
                    step_us)
    return 1000 / predict_ms(per_token, inputs, layers)


def plan_row(plan: dict | None, slots: int | None) -> dict | None:
    """`plan --json`'s row at ``slots`` (LRU, the policy the cache arm serves), else its only
    LRU row; None without a plan."""
    rows = [r for r in (plan or {}).get("rows") or [] if r.get("policy", "lru") == "lru"]
    if slots is not None:
        rows = [r for r in rows if int(r.get("slots", -1)) == slots] or rows[:0]
    return rows[0] if len(rows) == 1 else None


def traced(rec: dict | None) -> str | None:
    """The trace file the arm's routing hook read (its ``--env``), None when it had none."""
    return next((e.split("=", 1)[1] for e in (rec or {}).get("env") or []
                 if e.startswith("EC_BENCH_TRACE_ROUTING=")), None)


def routing_of(rec: dict | None, plan: dict | None) -> str:
    """What routed the cache arm: its own record decides whether a trace did (an arm with no
    trace in its environment ran on the checkpoint's routers, whatever plan file lies
    beside it); then the plan's record of that trace's ``source``, else the trace file's
    own, where the file is here."""
    path = traced(rec)
    if path is None:
        return "the checkpoint's own random routers (no trace)"
    src = ((plan or {}).get("trace") or {}).get("source")
    if src:
        return src
    try:
        from trace_fit import source_of

        from expertcache_cli.rules import trace as tracefile

        return source_of(tracefile.load(path))
    except Exception:  # noqa: BLE001 (the file stayed on the box: say which it was)
        return f"trace {path} (not readable here)"


def slots_of(rec: dict | None) -> int | None:
    """The cache arm's slots a layer: its startup line, else its ``--slots`` flag."""
    got = ((rec or {}).get("log") or {}).get("slots")
    if got:
        return int(got)
    argv = (rec or {}).get("argv") or []
    return next((int(argv[i + 1]) for i, w in enumerate(argv[:-1]) if w == "--slots"), None)


def plan_verdict(tok: float | None, plan: dict | None, rec: dict | None) -> str | None:
    """'predicted X tok/s by plan (hit rate h), measured r of it (met/NOT met)', or None
    where plan has no row for the arm's slots, the arm measured nothing, or no trace routed
    it (plan's trace would not be the arm's workload)."""
    row = plan_row(plan, slots_of(rec))
    if row is None or not tok or traced(rec) is None:
        return None
    want = float(row["predicted_tok_s"])
    ratio = tok / want
    ok = abs(1 - ratio) <= PREDICTION_GOAL
    return (f"plan predicted {want:.1f} tok/s at {row['slots']} slots (replayed hit rate "
            f"{1 - float(row['miss_rate']):.3f}), measured {ratio:.3f} of it "
            f"({'met' if ok else 'NOT met'}: {PREDICTION_GOAL:.0%})")


def is_armed(rec: dict | None) -> bool:
    """Did the server's plugin arm at least one layer (its startup line says so)?"""
    m = ARMED_RE.search(((rec or {}).get("log") or {}).get("startup_line") or "")
    return m is not None and int(m.group("armed")) > 0


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _startup(rec: dict | None) -> str:
    log = (rec or {}).get("log") or {}
    if (rec or {}).get("status") not in (None, "ok"):
        cause = ((rec or {}).get("log") or {}).get("cause")
        return f"failed ({(rec or {}).get('error')}{': ' + cause if cause else ''})"
    declined = log.get("declined") or []
    if not log.get("startup_line") and not declined and log.get("serve_line"):
        return f"cache off by serve's plan: {log['serve_line'].split(' GiB: ', 1)[-1]}"
    return log.get("startup_line") or (declined[0] if declined else "no startup line")


def slot_path_served(rec: dict | None) -> bool:
    """Did any layer serve from its slots (armed, and not every one sent back to the stock
    path by its first-call check)?"""
    if not is_armed(rec):
        return False
    m = CHECK_RE.search(((rec or {}).get("log") or {}).get("check_line") or "")
    return m is None or int(m.group(1)) > 0


def summarize(fmt: str, recs: dict[str, dict], bytes_per_expert: int | None,
              gbps: float | None, step_us: float = 0.0, layers: int = 0,
              plan: dict | None = None) -> list[str]:
    """The format's lines: each arm's tok/s, and every goal with its verdict (``plan``:
    `plan --json` on the trace that routed the cache arm)."""
    floor, res, hot = recs.get("floor"), recs.get("resident"), recs.get("hot")
    f_tok, r_tok, h_tok = median_tok_s(floor), median_tok_s(res), median_tok_s(hot)
    head = (f"{fmt}: floor {_fmt(f_tok)} tok/s{_spread(floor)}{_weights(floor)}; resident "
            f"{_fmt(r_tok)}{_spread(res)}{_weights(res)}")
    for name, rec in (("floor", floor), ("resident", res)):
        if rec is not None and rec.get("status") not in (None, "ok"):
            head += f"; {name} {_startup(rec)}"  # (vLLM itself could not serve it)
    lines = [head]
    for arm in ("cache", "trial"):
        rec = recs.get(arm)
        if rec is None:
            continue
        tok = median_tok_s(rec)
        per = installs_per_token(rec)
        parts = [f"{fmt} {arm}: {_fmt(tok)} tok/s{_spread(rec)}; {_startup(rec)}"]
        check = ((rec.get("log") or {}).get("check_line")) or ""
        if check:
            parts.append(check)
        if floor and floor.get("greedy") and rec.get("greedy"):
            parts.append("greedy vs floor " + describe(compare_greedy(floor["greedy"],
                                                                      rec["greedy"])))
            if floor.get("greedy_again"):
                # a floor that does not repeat itself makes the comparison say nothing
                # (routing that depends on what ran before, a kernel's atomics)
                parts.append("the floor's second greedy request vs its first " + describe(
                    compare_greedy(floor["greedy"], floor["greedy_again"])))
        if not slot_path_served(rec):
            per = None  # nothing served from slots: no installs to predict from
        elif (hits := _hits(rec)) != "-":
            parts.append(f"hits over the timed runs {hits}")
        if per is not None and r_tok and bytes_per_expert and gbps:
            want = predicted_tok_s(r_tok, per, bytes_per_expert, gbps, step_us, layers)
            ratio = tok / want if tok else 0.0
            ok = abs(1 - ratio) <= PREDICTION_GOAL
            parts.append(f"{per:.2f} installs a token; predicted {want:.1f} tok/s, measured "
                         f"{ratio:.3f} of it ({'met' if ok else 'NOT met'}: "
                         f"{PREDICTION_GOAL:.0%})")
        if arm == "cache":
            said = plan_verdict(tok, plan, rec) if slot_path_served(rec) else None
            if said:
                parts.append(said)
            elif slot_path_served(rec) and traced(rec):
                parts.append("no plan prediction (no FMT-plan.json: the resident arm, the "
                             "size or the probe record missing, or plan failed: FMT-plan.err)")
            parts.append("routing: " + routing_of(rec, plan))
        lines.append("; ".join(parts))
    if hot is not None:
        if not slot_path_served(hot):
            lines.append(f"{fmt} all-hit: {h_tok and f'{h_tok:.1f} tok/s, '}no layer served "
                         f"from its slots ({_startup(hot)})")
        elif h_tok and r_tok:
            ratio = h_tok / r_tok
            ok = ratio >= 1 - ALL_HIT_GOAL
            final = (hot.get("log") or {}).get("final") or {}
            rate = final.get("hit_rate")
            same = _greedy_vs_resident(hot, res)
            same = f"; {same}" if same else ""
            lines.append(f"{fmt} all-hit (--hot N, N slots): {h_tok:.1f} tok/s{_spread(hot)} = "
                         f"{ratio:.3f} "
                         f"of resident ({'met' if ok else 'NOT met'}: within "
                         f"{ALL_HIT_GOAL:.0%}); hit rate "
                         f"{'-' if rate is None else f'{100 * rate:.2f}%'}{same}")
        else:
            lines.append(f"{fmt} all-hit: {_startup(hot)}")
    lines += _bracket_lines(fmt, recs)
    return lines


def _bracket_lines(fmt: str, recs: dict[str, dict]) -> list[str]:
    """The A/B/A lines (`HOT_VARIANTS`, `RESIDENT_AGAIN`): resident measured again after
    the all-hit servers, and each all-hit variant against both residents, so that a drift of
    the machine during the run shows beside the differences between arms."""
    res, again = recs.get("resident"), recs.get("resident2")
    r_tok, r2_tok = median_tok_s(res), median_tok_s(again)
    lines = []
    if again is not None:
        drift = f" = {r2_tok / r_tok:.3f} of the first" if r_tok and r2_tok else ""
        lines.append(f"{fmt} resident again, after the all-hit servers: {_fmt(r2_tok)} tok/s"
                     f"{_spread(again)}{drift}")
    for arm in ("hot", *sorted(a for a in recs if a.startswith("hot_"))):
        rec = recs[arm] if arm in recs else None
        tok = median_tok_s(rec)
        if rec is None or not tok or (arm == "hot" and again is None):
            continue
        ratios = [f"{tok / r:.3f} of {name}" for name, r in
                  (("resident", r_tok), ("resident again", r2_tok)) if r]
        lines.append(f"{fmt} all-hit [{arm}]: {tok:.1f} tok/s{_spread(rec)} = "
                     + ", ".join(ratios) + _arm_facts(rec, res))
    return lines


def _greedy_vs_resident(rec: dict, res: dict | None) -> str:
    """'greedy vs resident ...' (`describe`), or '' where either has no greedy record."""
    if not (res and res.get("greedy") and rec.get("greedy")):
        return ""
    return "greedy vs resident " + describe(compare_greedy(res["greedy"], rec["greedy"]))


def _arm_facts(rec: dict, res: dict | None) -> str:
    """What else tells one all-hit server from another: its greedy tokens against
    resident's, whether vLLM compiled the model in it or loaded the compile cache, and the
    slot audit's verdict where it ran (``EXPERT_CACHE_AUDIT=1``)."""
    log = rec.get("log") or {}
    facts = [same] if (same := _greedy_vs_resident(rec, res)) else []
    if log.get("compile"):
        facts.append(f"compile {log['compile']}")
    audit = log.get("audit_line")
    if audit:
        facts.append("slot audit " + ("FAILED" if "FAILED" in audit else "ok"))
    return "; " + "; ".join(facts) if facts else ""


TABLE_HEAD = ("| format | plugin | tokens vs the floor | floor tok/s | cache tok/s (x floor) "
              "| cache hits, timed runs | all-hit / resident | missing arm / predicted "
              "| cache / plan |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def table_row(fmt: str, recs: dict[str, dict], bytes_per_expert: int | None,
              gbps: float | None, step_us: float = 0.0, layers: int = 0,
              plan: dict | None = None) -> str:
    """The format's row of issues 11 and 29's table (bench/results/formats.md and the
    README take it as is): the arm that served from slots (the cache, else the kernel
    trial), the goals' ratios, and the cache arm against `plan`'s prediction on its trace
    (``plan``)."""
    floor, res, hot = recs.get("floor"), recs.get("resident"), recs.get("hot")
    arm = next((a for a in ("cache", "trial") if slot_path_served(recs.get(a))), None)
    rec = recs.get(arm or "cache")
    f_tok, c_tok = median_tok_s(floor), median_tok_s(rec)
    if arm:
        m = ARMED_RE.search(((rec or {}).get("log") or {}).get("startup_line") or "")
        plugin = f"armed {m.group('armed')} of {m.group('layers')}" if m else "armed"
        plugin += " (kernel trial)" if arm == "trial" else ""
    else:
        said = _startup(rec) if rec else "-"
        m = DECLINED_RE.search(said)
        plugin = f"declined: {m.group('why')}" if m else said
    same = "-"
    if floor and floor.get("greedy") and rec and rec.get("greedy"):
        c = compare_greedy(floor["greedy"], rec["greedy"])
        same = f"identical ({c['compared']})" if c["identical"] else (
            f"part at {c['first_difference']} of {c['compared']}")
    speed = "-" if c_tok is None else f"{c_tok:.1f}" + (
        f" ({c_tok / f_tok:.2f}x)" if f_tok else "")
    r_tok, h_tok = median_tok_s(res), median_tok_s(hot)
    all_hit = (f"{h_tok / r_tok:.3f} ({h_tok:.1f} / {r_tok:.1f})"
               if arm and h_tok and r_tok and slot_path_served(hot) else "-")
    per = installs_per_token(rec) if arm else None
    miss = "-"
    if per is not None and c_tok and r_tok and bytes_per_expert and gbps:
        want = predicted_tok_s(r_tok, per, bytes_per_expert, gbps, step_us, layers)
        miss = f"{c_tok / want:.3f} ({c_tok:.1f} / {want:.1f})"
    planned = "-"
    row = plan_row(plan, slots_of(rec)) if arm == "cache" and traced(rec) else None
    if row is not None and c_tok:
        want = float(row["predicted_tok_s"])
        planned = f"{c_tok / want:.3f} ({c_tok:.1f} / {want:.1f})"
    hits = _hits(rec) if arm else "-"
    return (f"| {fmt} | {plugin} | {same} | {_fmt(f_tok)} | {speed} | {hits} | {all_hit} "
            f"| {miss} | {planned} |")


def routing_lines(runs: dict[str, tuple]) -> list[str]:
    """Under the table: what routed each format's floor and cache arms (a throughput number
    says what routing produced it)."""
    return [f"- {fmt}: {routing_of(run[0].get('cache'), run[5])}" for fmt, run in runs.items()]


def prompt_lines(runs: dict[str, tuple]) -> list[str]:
    """Under the table: what each format's measured requests sent (`prompts_line`)."""
    return ["Prompts of the measured runs:",
            *(f"- {fmt}: {prompts_line(run[0])}" for fmt, run in runs.items())]


def seeded_lines(d: Path, formats: list[str]) -> list[str]:
    """The records of these formats that an earlier session measured (the runner's SEED),
    said under the report: the arms of one row then come from two starts of the machine."""
    return seeded_line(d, lambda n: any(  # "gptq-act-floor.json" is gptq-act's, not gptq's
        n.startswith(f"{f}-") and "-" not in n[len(f) + 1:] for f in formats))


def load_run(fmt: str, d: Path) -> tuple[dict[str, dict], int | None, float | None, float,
                                         int, dict | None]:
    """A format's server records, its bytes an expert and MoE layers (`size --json`), its
    probe's gather rate and cache step, and `plan --json` on its routing trace, from a run
    directory (missing: None or 0)."""
    recs = {}
    for arm in ("floor", "cache", "trial", "resident", "hot", "resident2"):
        p = d / f"{fmt}-{arm}.json"
        if p.exists():
            recs[arm] = json.loads(p.read_text())
    for p in sorted(d.glob(f"{fmt}-hot_*.json")):  # HOT_VARIANTS
        recs[p.stem[len(fmt) + 1:]] = json.loads(p.read_text())
    bytes_per_expert = gbps = None
    step_us, layers = 0.0, 0
    try:
        size = json.loads((d / f"{fmt}-size.json").read_text())
        bytes_per_expert = int(size["bytes_per_expert"])
        layers = int(size.get("num_moe_layers") or 0)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        from expertcache_cli.errors import UserError
        from expertcache_cli.planning.planner import read_probe

        gbps, _, step = read_probe(d / f"{fmt}-probe.json")
        step_us = step[0] if step else 0.0
    except (OSError, UserError):
        pass
    plan = None
    try:
        plan = json.loads((d / f"{fmt}-plan.json").read_text())
    except (OSError, ValueError):
        pass
    return recs, bytes_per_expert, gbps, step_us, layers, plan


def not_a_folder(d: Path, mode: str, usage: str) -> int:
    """One line for a records folder that is not one (the arguments swapped, most likely),
    and the usage error's exit code."""
    print(f"formats_report.py{' ' + mode if mode else ''}: {d} is not a folder of records "
          f"({usage})", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] in ("--armed", "--served"):  # exit 0: that server armed
        test = is_armed if argv[0] == "--armed" else slot_path_served  # (and served) a layer
        try:
            return 0 if test(json.loads(Path(argv[1]).read_text())) else 1
        except (OSError, ValueError):
            return 1
    if len(argv) == 2 and argv[0] == "--median":  # the runner's resident rate for `plan`
        try:
            tok = median_tok_s(json.loads(Path(argv[1]).read_text()))
        except (OSError, ValueError):
            tok = None
        if not tok:
            return 1
        print(f"{tok:.3f}")
        return 0
    if argv[:1] == ["--table"] and len(argv) >= 3:  # --table DIR FMT...
        d = Path(argv[1])
        if not d.is_dir():
            return not_a_folder(d, "--table", "--table DIR FORMAT...")
        runs = {f: load_run(f, d) for f in argv[2:]}
        print("\n".join([TABLE_HEAD, *(table_row(f, *run) for f, run in runs.items()), "",
                         "Routing of the floor and cache arms:", *routing_lines(runs),
                         *prompt_lines(runs),
                         *seeded_lines(d, list(runs))]))
        return 0
    if len(argv) != 2:
        print("usage: formats_report.py FORMAT DIR | --table DIR FORMAT... | "
              "--armed/--served/--median RECORD", file=sys.stderr)
        return 2
    fmt, d = argv[0], Path(argv[1])
    if not d.is_dir():
        return not_a_folder(d, "", "FORMAT DIR: the format first")
    run = load_run(fmt, d)
    print("\n".join([*summarize(fmt, *run), f"{fmt} prompts: {prompts_line(run[0])}",
                     *seeded_lines(d, [fmt])]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
