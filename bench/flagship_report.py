"""The flagship table: gpt-oss-120b's shape on emulated 24 and 32 GiB cards, from the
records `bench/run_flagship_on_device.sh` leaves (bench/small_card.py's server records,
`size --json`, `plan --save`).

Why a module: issue 29's goals are each a comparison between files of one run (the cache
at least 2x the offload floor on the 24 GiB card, the measured tok/s within 10% of `plan`'s
prediction, greedy tokens identical to the floor's) and a run whose weights or routing
were not what the bench says (the synthesized weights, the trace-driven routing: bench
hooks, `bench/synth_weights.py` and `bench/trace_routing.py`) must not pass for a result.
Both are checked here, on CPU (tests/bench/test_bench_flagship_report.py), before device minutes
are spent.

    python bench/flagship_report.py /tmp/fs              # the table and the goals
    python bench/flagship_report.py --serve-argv /tmp/fs/plan24.json   # for the runner
    python bench/flagship_report.py --rate /tmp/fs/resident.json       # for the runner
"""

from __future__ import annotations

import json
import shlex
import statistics
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
from synth_weights import DONE_LINE  # noqa: E402
from trace_routing import IN_FORCE_LINE as ROUTING_LINE  # noqa: E402

from expertcache_cli.plugin.session import WARM_UP_DONE  # noqa: E402

CARDS = (24, 32)
PLAN_GOAL = 0.10
FLOOR_GOAL = 2.0  # the cache against the offload floor on the 24 GiB card
FLOOR_GOAL_CARD = 24


def median(rec: dict | None) -> float | None:
    """The median measured run (one host hiccup moves a mean of three by 10%)."""
    runs = (rec or {}).get("tok_s") or []
    return statistics.median(runs) if runs else None


def varied(rec: dict | None) -> bool:
    """Whether the timed runs replayed different recorded requests (``--prompt-cycle``
    above 1): their rates then differ by the requests' locality, not by noise."""
    return int((rec or {}).get("prompt_cycle") or 1) > 1 and len((rec or {}).get("tok_s")
                                                                 or []) > 1


def over_runs(rec: dict | None) -> float | None:
    """Decoded tokens over decode time, summed over the timed runs: the rate `plan` prices
    (its trace's tokens over their summed time). Each run's tokens are ``run_tokens`` where
    the record has them, else equal shares of ``decode_tokens``."""
    runs = (rec or {}).get("tok_s") or []
    if not runs or not all(r > 0 for r in runs):
        return None
    tokens = (rec or {}).get("run_tokens") or [
        ((rec or {}).get("decode_tokens") or len(runs)) / len(runs)] * len(runs)
    return sum(tokens) / sum(t / r for t, r in zip(tokens, runs, strict=True))


def rate(rec: dict | None) -> float | None:
    """A server's measured tok/s: over the runs where they replayed different requests (a
    median would pick one request's locality: runs of 68, 150 and 69 tok/s decode 84 tok/s
    together), else the median run."""
    return over_runs(rec) if varied(rec) else median(rec)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def load(d: Path) -> dict:
    """Every record of a run directory: ``arms`` by name, ``size``/``plan`` by card."""
    arms = {n: r for n in ["resident", *(f"{a}{c}" for c in CARDS for a in ("floor", "cache"))]
            if (r := _read(d / f"{n}.json")) is not None}
    return {"dir": d, "arms": arms,
            "size": {c: s for c in CARDS if (s := _read(d / f"size{c}.json")) is not None},
            "plan": {c: p for c in CARDS if (p := _read(d / f"plan{c}.json")) is not None}}


def serve_argv(plan: dict | None) -> list[str] | None:
    """The `expertcache serve` arguments `plan` recommends (after the program name), as a
    user would copy them; None where no budget fit the card."""
    cmd = ((plan or {}).get("recommended") or {}).get("serve_command")
    if not cmd:
        return None
    argv = shlex.split(cmd)
    return argv[1:] if argv and argv[0] == "expertcache" else argv


def prediction(plan: dict | None) -> tuple[float, str] | None:
    """What `plan` predicts for the command it recommends: the per-layer split's rate when
    the command serves the saved plan (``--plan``), else the uniform budget's."""
    rec = (plan or {}).get("recommended")
    if not rec:
        return None
    if serves_split(plan):
        return float(rec["per_layer_predicted_tok_s"]), (
            f"{rec['policy']}, per-layer split of {rec['slots']} slots a layer")
    return float(rec["predicted_tok_s"]), f"{rec['policy']} at {rec['slots']} slots a layer"


def serves_split(plan: dict | None) -> bool:
    """Whether the command `plan` recommends serves its per-layer split (``--plan`` the
    saved file) rather than the uniform budget: what `prediction` and the hit rates price."""
    rec = (plan or {}).get("recommended") or {}
    return "--plan" in (serve_argv(plan) or []) and bool(rec.get("per_layer_predicted_tok_s"))


def plan_hit_rate(plan: dict | None) -> float | None:
    """The replayed hit rate of what `prediction` prices: the per-layer split's where the
    command serves the saved plan (the uniform row's misses less the ones the split saves,
    ``per_layer_misses_saved`` over the trace's tokens), else the uniform row's."""
    rec = (plan or {}).get("recommended") or {}
    row = next((r for r in (plan or {}).get("rows") or []
                if r.get("policy") == rec.get("policy") and r.get("slots") == rec.get("slots")),
               None)
    if row is None:
        return None
    miss_rate, per_token = float(row["miss_rate"]), row.get("misses_per_token")
    tokens = ((plan or {}).get("trace") or {}).get("tokens")
    saved = rec.get("per_layer_misses_saved")
    if serves_split(plan) and tokens and per_token and miss_rate > 0 and saved is not None:
        uses_per_token = float(per_token) / miss_rate
        return 1 - (float(per_token) - float(saved) / float(tokens)) / uses_per_token
    return 1 - miss_rate


def timed_replay_hit_rate(d: Path, plan: dict | None) -> float | None:
    """The replay's hit rate over the requests the servers timed (all but the first, the
    warm-up request), each layer at the slots the command serves, from the trace `plan`
    replayed when it is in ``d`` (the runner's FS): what the live rate over the timed runs
    is held to. `plan` prices the whole trace, the untimed first request's cold misses
    included."""
    import numpy as np
    from warmup_replay import timed_hit_rate

    from expertcache_cli.rules.policy import Policy

    rec = (plan or {}).get("recommended") or {}
    path = Path(((plan or {}).get("trace") or {}).get("path") or "")
    fit = d / path.name if path.name else None
    if not fit or not fit.is_file() or not rec.get("slots"):
        return None
    try:
        z = np.load(fit, allow_pickle=True)
        ids, requests = z["topk_ids"], z["requests"]
    except Exception:  # a trace the report cannot read (not an npz, no labels): say nothing
        return None
    if len(set(requests.tolist())) < 2:
        return None
    per_layer = rec.get("per_layer_slots")
    slots = per_layer if per_layer and serves_split(plan) else [rec["slots"]] * ids.shape[1]
    none = np.zeros((0, *ids.shape[1:]), np.int32)
    return timed_hit_rate(ids, requests, none, slots, int(z["num_experts"]),
                          Policy.parse(rec["policy"]))


def live_misses_per_token(rec: dict | None) -> float | None:
    """A cache server's installs a decoded token over its measured runs (its stats lines
    around them), None where the record lacks them."""
    b, a = (rec or {}).get("counters_before"), (rec or {}).get("counters_after")
    tokens = (rec or {}).get("decode_tokens")
    if not (b and a and tokens) or b.get("installs") is None or a.get("installs") is None:
        return None
    return (a["installs"] - b["installs"]) / tokens


def with_live_misses(plan: dict | None, rec: dict | None) -> float | None:
    """`plan`'s time model (`planner.predict_ms`, its own inputs) fed the misses the
    server made instead of the replayed ones: measured over this says how much of a gap
    is the time model's, the rest being the hit rate's."""
    from expertcache_cli.planning.planner import Inputs, predict_ms

    misses = live_misses_per_token(rec)
    p = plan or {}
    model = p.get("model") or {}
    try:
        inputs = Inputs(int(model["bytes_per_expert"]), "", float(p["link_gbps"]), "",
                        float(p["resident_tok_s"]), "", float(p.get("step_us") or 0.0))
        layers = int(model["num_moe_layers"])
    except (KeyError, TypeError, ValueError):
        return None
    if misses is None:
        return None
    return 1000.0 / predict_ms(misses, inputs, layers)


def hook_problems(d: Path, arms: dict[str, dict]) -> list[str]:
    """Servers whose log does not show both bench hooks at work: weights synthesized (else
    vLLM's dummy fill, garbage MXFP4 scales) and routing replayed from the trace."""
    out = []
    for name in arms:
        try:
            text = (d / f"{name}.log").read_text(errors="replace")
        except OSError:
            out.append(f"{name}: no log here to check the bench hooks in")
            continue
        missing = [what for line, what in ((DONE_LINE, "weights NOT synthesized"),
                                           (ROUTING_LINE, "routing NOT replayed"))
                   if line not in text]
        if missing:
            out.append(f"{name}: " + ", ".join(missing))
    return out


def served_command(rec: dict | None) -> list[str] | None:
    """A server's command with its port left out: what must be the same for the floor and
    the cache (they differ only in EXPERT_CACHE_DISABLE). The floor may come from an earlier
    session (SEED), whose `plan` chose the command; this is what holds the two together."""
    argv = (rec or {}).get("argv")
    if not argv:
        return None
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--port":
            skip = True
        elif not a.startswith("--port="):
            out.append(a)
    return out


def command_line(c: int, floor: dict | None, cache: dict | None) -> str | None:
    """Whether the card's floor and cache served one command, None where either record
    lacks its command (a comparison of two commands is no floor-vs-cache comparison)."""
    a, b = served_command(floor), served_command(cache)
    if a is None or b is None:
        return None
    if a == b:
        return f"{c} GiB: floor and cache served the same command (ports aside)"
    return (f"{c} GiB: floor and cache served DIFFERENT commands, so the x-floor ratio and "
            f"the token comparison do not hold: floor {shlex.join(a)} | cache {shlex.join(b)}")


def warm_up_line(d: Path, name: str) -> str:
    """Whether the server emptied its slots once vLLM's warm-up was done (the plugin's line
    in its log): a server that did not served from what the warm-up's steps left."""
    try:
        text = (d / f"{name}.log").read_text(errors="replace")
    except OSError:
        return "no log to tell whether the slots were emptied after vLLM's warm-up"
    if WARM_UP_DONE in text:
        return "slots emptied after vLLM's warm-up, before the first request"
    return "slots NOT emptied after vLLM's warm-up (the warm-up's experts stayed in them)"


def routing_source(run: dict) -> str:
    """The trace's ``source`` (from plan's record of it): what routing every number has."""
    for c in CARDS:
        src = ((run["plan"].get(c) or {}).get("trace") or {}).get("source")
        if src:
            return src
    return "unknown (no plan record)"


def _tok(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _greedy(a: dict | None, b: dict | None) -> dict | None:
    if not (a and b and a.get("greedy") and b.get("greedy")):
        return None
    return compare_greedy(a["greedy"], b["greedy"])


def _status(rec: dict | None) -> str | None:
    """'failed (...)' for a server that did not serve, else None."""
    if rec is None or rec.get("status") == "ok":
        return None
    cause = (rec.get("log") or {}).get("cause")
    return f"failed ({rec.get('error')}{': ' + cause if cause else ''})"


TABLE_HEAD = ("| card | size says | plan: serve | floor tok/s | cache tok/s (x floor) | "
              "resident tok/s (whole GPU) | cache / plan | greedy: cache vs floor |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- |")


def card_row(c: int, run: dict) -> str:
    arms, size, plan = run["arms"], run["size"].get(c), run["plan"].get(c)
    floor, cache, res = arms.get(f"floor{c}"), arms.get(f"cache{c}"), arms.get("resident")
    f_tok, c_tok, r_tok = rate(floor), rate(cache), rate(res)
    says = (size or {}).get("verdict_text") or "-"
    pred = prediction(plan)
    planned = "no budget fits" if plan and not pred else "-" if not pred else (
        f"{pred[1]}: {pred[0]:.1f} tok/s")
    speed = _status(cache) or (_tok(c_tok) + (f" ({c_tok / f_tok:.2f}x)" if c_tok and f_tok
                                              else ""))
    ratio = f"{c_tok / pred[0]:.3f}" if c_tok and pred else "-"
    g = _greedy(floor, cache)
    same = "-" if g is None else (f"identical ({g['compared']})" if g["identical"]
                                  else f"part at {g['first_difference']} of {g['compared']}")
    return (f"| {c} GiB | {says} | {planned} | {_status(floor) or _tok(f_tok)} | {speed} | "
            f"{_status(res) or _tok(r_tok)} | {ratio} | {same} |")


def goals(run: dict) -> list[str]:
    """Each of issue 29's flagship goals, met or not, with the numbers behind it."""
    arms = run["arms"]
    lines = [f"routing of every server: {routing_source(run)}",
             f"prompts: {prompts_line(arms)}"]
    bad = hook_problems(run["dir"], arms)
    lines.append("bench hooks: weights synthesized and routing replayed in every server"
                 if not bad else "bench hooks NOT in force, these numbers do not count: "
                 + "; ".join(bad))
    for c in CARDS:
        floor, cache = arms.get(f"floor{c}"), arms.get(f"cache{c}")
        f_tok, c_tok = rate(floor), rate(cache)
        if cache is None:
            continue
        start = (cache.get("log") or {}).get("startup_line") or "no startup line"
        lines.append(f"{c} GiB cache server: {start}")
        same = command_line(c, floor, cache)
        if same:
            lines.append(same)
        lines.append(f"{c} GiB cache server: " + warm_up_line(run["dir"], f"cache{c}"))
        if varied(cache) and c_tok:
            each = "/".join(f"{r:.1f}" for r in cache["tok_s"])
            lines.append(f"{c} GiB cache: runs of {each} tok/s, each a different recorded "
                         f"request; {c_tok:.1f} over the runs (their median "
                         f"{median(cache):.1f}), the rate compared below")
        pred = prediction(run["plan"].get(c))
        if c_tok and pred:
            r = c_tok / pred[0]
            hit, live = plan_hit_rate(run["plan"].get(c)), live_hit_rate(cache)
            timed_hit = timed_replay_hit_rate(run["dir"], run["plan"].get(c))
            rates = (f"; hit rate replayed {hit:.3f}" if hit is not None else "") + (
                f" (the timed requests alone {timed_hit:.3f})" if timed_hit is not None
                else "") + (f", live {live:.3f}" if live is not None else "")
            timed = with_live_misses(run["plan"].get(c), cache)
            if timed:
                rates += (f"; plan's time model with the live misses: {timed:.1f} tok/s "
                          f"(measured {c_tok / timed:.3f} of it)")
            lines.append(f"{c} GiB: measured {c_tok:.1f} tok/s = {r:.3f} of plan's "
                         f"{pred[0]:.1f} ({pred[1]}) "
                         f"({'met' if abs(1 - r) <= PLAN_GOAL else 'NOT met'}: "
                         f"{PLAN_GOAL:.0%}){rates}")
        if c == FLOOR_GOAL_CARD and c_tok and f_tok:
            x = c_tok / f_tok
            lines.append(f"{c} GiB: cache {x:.2f}x the offload floor "
                         f"({'met' if x >= FLOOR_GOAL else 'NOT met'}: at least "
                         f"{FLOOR_GOAL:g}x)")
        mem = memory_line(c, run)
        if mem:
            lines.append(mem)
        for other, name in ((floor, "floor"), (arms.get("resident"), "resident")):
            g = _greedy(other, cache)
            if g is not None:
                lines.append(f"{c} GiB greedy, cache vs {name}: {describe(g)}")
    return lines


def memory_line(c: int, run: dict) -> str | None:
    """What the card's floor and cache servers held at healthy, against the plan's budget.

    nvidia-smi counts the ballast too, so a server's share is its reading less what the
    ballast left in use (``ballastN.json``: the free memory it measured once it held its
    part); the cache's share less the floor's is then what the slots cost in VRAM, beside
    the slots' own size. None where the card lacks the ballast record or both readings."""
    ballast = _read(run["dir"] / f"ballast{c}.json")
    size = run["size"].get(c) or {}
    arms = run["arms"]
    if not ballast or ballast.get("smi_free_gib") is None:
        return None

    def held(rec: dict | None) -> float | None:
        smi = (rec or {}).get("smi_healthy") or {}
        if smi.get("used_mib") is None or smi.get("total_mib") is None:
            return None
        return smi["used_mib"] / 1024 - (smi["total_mib"] / 1024 - ballast["smi_free_gib"])

    floor, cache = held(arms.get(f"floor{c}")), held(arms.get(f"cache{c}"))
    if cache is None:
        return None
    line = f"{c} GiB memory at healthy: the cache server {cache:.2f} GiB of the card's " \
           f"{ballast['smi_free_gib']:.2f} free"
    if size.get("budget_bytes"):
        line += f" (the plan's budget {size['budget_bytes'] / 2**30:.2f} GiB)"
    if floor is not None:
        line += f"; the floor {floor:.2f} GiB, {cache - floor:.2f} GiB less"
        plan_slots = ((run["plan"].get(c) or {}).get("recommended") or {}).get("slots")
        if plan_slots and size.get("bytes_per_slot"):
            line += f" (the slots: {plan_slots * size['bytes_per_slot'] / 2**30:.2f} GiB)"
    return line


def seeded(d: Path) -> list[str]:
    """The records an earlier session measured (the runner's SEED), said under the table:
    the resident rate then comes from another start of the machine than the cards."""
    return seeded_line(d)


def report(d: Path) -> list[str]:
    run = load(d)
    return [TABLE_HEAD, *(card_row(c, run) for c in CARDS), "", *goals(run), *seeded(d)]


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--serve-argv":
        got = serve_argv(_read(Path(argv[1])))
        if not got:
            return 1
        print("\n".join(got))
        return 0
    if len(argv) == 2 and argv[0] == "--rate":  # plan's resident rate: the report's own
        tok = rate(_read(Path(argv[1])))
        if not tok:
            return 1
        print(f"{tok:.3f}")
        return 0
    if len(argv) != 1:
        print("usage: flagship_report.py DIR | --serve-argv PLAN.json | --rate RECORD",
              file=sys.stderr)
        return 2
    print("\n".join(report(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
