"""One server of the small-card proof: start it, measure it, read its log.

`bench/run_small_card_on_device.sh` calls this once per arm, with the server command
(`expertcache serve ...` for the cache and floor arms on the emulated card, plain `vllm
serve` for the resident ceiling). Per arm, in one server:

1. healthy: seconds to start, and nvidia-smi's used/total memory of the GPU;
2. a discarded warm-up, then ``--runs`` single-stream greedy runs of ``--max-tokens``
   (the library's own streaming client, `expertcache_cli.baseline.client`): decode tok/s;
   every request its own prompt (`run_prompt`), the same sequence in every server;
3. the cache counters before and after the measured runs (the plugin's stats lines, with
   ``EXPERT_CACHE_STATS`` set by the caller): installs per decoded token in the runs;
4. the greedy tokens of one fixed prompt (temperature 0), twice, with each position's
   top-2 logprob margin: the cache arm must produce the floor's exactly, and where two
   servers part, `compare_greedy` says whether it was at a near-tie;
5. optionally ``--profile DIR``: one request's decode steps under vLLM's torch profiler
   (the server started with `profiler_args`; `bench/profile_report.py` reads the traces);
6. optionally ``--streams N`` concurrent streams, each its own prompt (the padding check:
   with the recommended ``--max-num-seqs`` no decode-width step may read through), with the
   counters before and after them (what padded rows cost: requests and installs);
7. stop (SIGINT, drain), then from the log: the plugin's startup line (layers armed,
   slots), its memory-plan line, vLLM's "Available KV cache memory", and the final
   counters line.

Everything lands in ``OUT/NAME.json`` (and the server log in ``OUT/NAME.log``) as soon as
the arm ends, failed or not.

``--warm-only``: a warm-up arm. The server starts, answers one short greedy request (a
few tokens, so that the first step's kernels have run) and stops; its record says
``"warm_only": true`` and has no greedy tokens, so the greedy comparisons and the reports
pass over it. The runners that compare greedy tokens across servers (the floor,
``EXPERT_CACHE_DISABLE=1``, against the cache) run one with the floor's command and
environment before the pair: vLLM's first start of a configuration compiles the model
(torch.compile with Inductor, which picks some kernel configurations by timing them) and
later starts load what it compiled, and a start that compiled is not the same computation
as one that loaded: on the H200 a cold-compiled server parted from warm ones at near-ties
within 64 tokens, and two cold compiles part from each other, while two warm servers, the
floor and the cache, agreed on every token. So neither server compared may be the
configuration's first start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from trace_routing import PROMPT_STEP  # noqa: E402

from expertcache_cli.baseline.client import RequestFailed, measure_run  # noqa: E402
from expertcache_cli.baseline.counters import (  # noqa: E402
    ARMED_RE,
    latest_counters,
    parse_stats_line,
)
from expertcache_cli.baseline.runner import failure_cause  # noqa: E402
from expertcache_cli.baseline.server import Server, ServerFailed, free_port, server_env  # noqa: E402

PROMPT = "w17 w923 w4410 w88 w5120 w3 w777 w2048 w60 w1999 w4096 w31 w8000 w12 w640 w5"
#: the words `run_prompt` draws from: w3 .. w7999, in every bench checkpoint's vocabulary
PROMPT_WORDS = 7997
#: every prompt's length in words (one word a token): one KV block (`run_prompt`)
PROMPT_TOKENS = len(PROMPT.split())
KV_RE = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
#: vLLM's line when it was handed the KV size (--kv-cache-memory-bytes): no profile sizing
KV_GIVEN_RE = re.compile(r"reserved ([\d.]+) GiB memory for KV Cache")
KV_TOKENS_RE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
WEIGHTS_RE = re.compile(r"Model loading took ([\d.]+) GiB")


#: words a prompt grows by from one request to the next when a trace of several recorded
#: requests routes the server (`run_prompt`): the hook's step, so that consecutive requests
#: replay different recorded requests
PROMPT_GROWTH = PROMPT_STEP


def prompt_tokens(i: int, cycle: int = 1) -> int:
    """Request ``i``'s prompt length in words (= tokens): `run_prompt`'s rule, which the
    runners hand `trace_fit --prompt-tokens` (``--print-prompt-tokens R``)."""
    return PROMPT_TOKENS + PROMPT_GROWTH * (i % max(1, cycle))


def run_prompt(i: int, cycle: int = 1) -> str:
    """The prompt of a server's ``i``-th measured request (0: the discarded warm-up).

    Why each request its own: a user's next request is not their last one, and a
    random-weight model's own routers route a repeated prompt as they did before. Every
    server takes the same sequence, so arms compare. Why 16 words (one token each), as
    PROMPT: a prompt of one KV block is never served from vLLM's prefix cache (it computes
    a fully cached prompt's last token again, so no block of it is reused), so every
    prefill is the 16 tokens that `bench/trace_routing.py` restarts a routing trace at and
    that the runners' fitted traces give `plan` (``trace_fit --decode-only``). No two
    share a first word (977 is coprime to `PROMPT_WORDS`), so no block of one is ever
    another's cached prefix.

    ``cycle`` R > 1 (a trace of R recorded requests routes the server): request ``i`` has
    ``16 + 8 x (i mod R)`` words, and `bench/trace_routing.py` replays recorded request
    ``(2 + i) mod R`` for it: R consecutive requests replay R different conversations, as
    ``trace_fit --prompt-tokens`` tells `plan`."""
    first = 3 + (977 * (i + 1)) % PROMPT_WORDS
    words = [first] + [3 + (first + 131 * j) % PROMPT_WORDS
                       for j in range(1, prompt_tokens(i, cycle))]
    return " ".join(f"w{w}" for w in words)


def prompts_line(recs: dict[str, dict | None]) -> str:
    """What the measured requests of these arms (by name) sent: a report says it beside
    the routing, since records from before `run_prompt` sent one fixed prompt throughout."""
    measured = {n: r for n, r in recs.items() if r and r.get("tok_s")}
    own = sorted(n for n, r in measured.items() if r.get("prompt_tokens"))
    fixed = sorted(n for n in measured if n not in own)
    if not measured:
        return "no measured runs"
    cycles = {int(r.get("prompt_cycle") or 1) for r in measured.values()}
    if not fixed and len(cycles) == 1 and max(cycles) > 1:
        c = max(cycles)
        return (f"every request its own prompt of {PROMPT_TOKENS}-"
                f"{PROMPT_TOKENS + PROMPT_GROWTH * (c - 1)} words, growing by "
                f"{PROMPT_GROWTH} a request over {c} lengths, so that consecutive requests "
                f"replay the trace's {c} recorded requests in turn (the warm-up, each run, "
                "each stream), the same sequence in every server; the greedy check one fixed "
                "prompt")
    if not fixed:
        return ("every request its own 16-word prompt (the warm-up, each run, each stream), "
                "the same sequence in every server; the greedy check one fixed prompt")
    if not own:
        return "one fixed 16-word prompt for every request"
    return (f"its own 16-word prompt a request in {', '.join(own)}; one fixed prompt for "
            f"every request in {', '.join(fixed)}")


def smi_memory() -> dict | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits",
             "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
            capture_output=True, text=True, timeout=20, check=True).stdout
        used, total = (float(x) for x in out.split(",")[:2])
        return {"used_mib": used, "total_mib": total}
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def greedy_ids(base_url: str, model_id: str, max_tokens: int) -> dict:
    """The greedy completion of PROMPT, as its tokens (word-level tokenizer: one word
    each), with each position's margin: the chosen token's logprob minus the runner-up's.
    Two servers of the same weights can still part at a near-tie (vLLM is not batch
    invariant by default); the margins say whether a divergence is such a tie."""
    import httpx

    body = {"model": model_id, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 2}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
    chosen, margins = [], []
    for top in tops:
        ranked = sorted((top or {}).values(), reverse=True)
        chosen.append(ranked[0] if ranked else None)
        margins.append(ranked[0] - ranked[1] if len(ranked) > 1 else None)
    return {"tokens": choice["text"].split(), "logprob": chosen, "margin": margins}


def live_hit_rate(rec: dict | None) -> float | None:
    """A cache server's hit rate over its measured runs, from the stats lines its record
    keeps around them (the routing's share of its tok/s, which a row has to say); None
    where the record has no such counters or counted no uses."""
    b, a = (rec or {}).get("counters_before"), (rec or {}).get("counters_after")
    if not (b and a) or b.get("requests") is None or a.get("requests") is None:
        return None
    uses = a["requests"] - b["requests"]
    return 1 - (a["installs"] - b["installs"]) / uses if uses > 0 else None


def seeded_line(d: Path, keep: Callable[[str], bool] = lambda name: True) -> list[str]:
    """The records in ``d`` that an earlier session measured (a runner's SEED, listed in
    ``d/seeded.txt``) and ``keep`` accepts, as the one line a report prints under its table:
    the arms of its rows then come from two starts of the machine. Empty where none."""
    try:
        names = sorted(set((d / "seeded.txt").read_text().split()))
    except OSError:
        return []
    names = [n for n in names if keep(n)]
    return [f"from an earlier session, not measured in this one: {', '.join(names)}"] \
        if names else []


def compare_greedy(a: dict, b: dict) -> dict:
    """Where two arms' greedy completions part, and whether that is a near-tie: the first
    differing position, each arm's margin there, and the largest difference of the chosen
    token's logprob over the shared prefix (0.0 when the two servers computed the same
    numbers up to the split)."""
    a, b = ({"tokens": x} if isinstance(x, list) else x for x in (a, b))  # older files: ids only
    ta, tb = a["tokens"], b["tokens"]
    n = min(len(ta), len(tb))
    split = next((i for i in range(n) if ta[i] != tb[i]), None)
    upto = n if split is None else split
    la, lb = a.get("logprob") or [], b.get("logprob") or []
    diffs = [abs(x - y) for x, y in zip(la[:upto], lb[:upto]) if x is not None and y is not None]

    def margin(arm: dict) -> float | None:
        m = arm.get("margin") or []
        return m[split] if split is not None and split < len(m) else None

    return {"identical": split is None and len(ta) == len(tb), "first_difference": split,
            "compared": n, "margin_a": margin(a), "margin_b": margin(b),
            "max_logprob_diff_before": max(diffs) if diffs else None}


#: decode steps one profile records, after skipping the first two engine steps (the
#: prefill, which reads the host through in a cache arm, and the first decode step)
PROFILE_STEPS = 32
PROFILE_SKIP = 2


def profiler_args(trace_dir: str) -> list[str]:
    """vLLM's flags for a server `profile_decode` can record (vLLM 0.26's ProfilerConfig):
    the torch profiler, no Python stacks (they would dominate the host side), the first
    `PROFILE_SKIP` steps after /start_profile skipped and `PROFILE_STEPS` recorded."""
    cfg = {"profiler": "torch", "torch_profiler_dir": trace_dir,
           "torch_profiler_with_stack": False, "delay_iterations": PROFILE_SKIP,
           "max_iterations": PROFILE_STEPS}
    return ["--profiler-config", json.dumps(cfg)]


def profile_decode(base_url: str, model_id: str, trace_dir: Path, wait_s: float = 180) -> dict:
    """One greedy request long enough to cover the profiled steps, between /start_profile
    and /stop_profile; waits until the trace files appear in ``trace_dir``."""
    import httpx

    before = set(trace_dir.rglob("*")) if trace_dir.exists() else set()
    with httpx.Client(base_url=base_url, timeout=300) as c:
        c.post("/start_profile").raise_for_status()
        run = measure_run(base_url, model_id, PROMPT, PROFILE_SKIP + PROFILE_STEPS + 16)
        c.post("/stop_profile").raise_for_status()
    t0 = time.time()
    files: list[str] = []
    while time.time() - t0 < wait_s:
        files = sorted(str(p) for p in set(trace_dir.rglob("*.json*")) - before)
        if files:
            break
        time.sleep(2)
    return {"dir": str(trace_dir), "files": files, "tok_s": run.tok_s,
            "steps_requested": PROFILE_STEPS}


def counters_now(log: Path) -> dict | None:
    """The server's latest counters line, once a last report had time to reach the log."""
    time.sleep(0.5)
    return latest_counters(log)


def read_log(log: Path) -> dict:
    text = log.read_text(errors="replace")
    out: dict = {"startup_line": None, "memory_line": None, "check_line": None,
                 "final": None, "kv_gib": None,
                 "weights_gib": None, "declined": [], "trap": None}
    lines = text.splitlines()
    for i, line in enumerate(lines):  # `serve`'s headline, wrapped by the terminal
        if line.startswith("expertcache serve:"):
            rest = [ln.strip() for ln in lines[i + 1:i + 8]]
            end = next((j for j, ln in enumerate(rest) if not ln or ln.startswith(
                ("note:", "running:"))), len(rest))
            out["serve_line"] = " ".join([line.strip(), *rest[:end]])
            break
    for line in lines:
        if "expertcache: vLLM" in line and "armed" in line:
            out["startup_line"] = line[line.index("expertcache:"):]
            m = ARMED_RE.search(line)
            s = re.search(r"(\d+) of (\d+) experts/layer as slots", line)
            out["armed_layers"] = int(m.group("armed")) if m else 0
            out["moe_layers"] = int(m.group("layers")) if m else None
            out["slots"] = int(s.group(1)) if s else None
            if "TRAP:" in line:
                out["trap"] = line[line.index("TRAP:"):]
        elif "expertcache: memory plan" in line:
            out["memory_line"] = line[line.index("expertcache:"):]
        elif "expertcache: first-call checks" in line:
            out["check_line"] = line[line.index("expertcache:"):]
        elif "expertcache: slot audit" in line:  # EXPERT_CACHE_AUDIT=1, at shutdown
            out["audit_line"] = line[line.index("expertcache:"):]
        elif "not armed:" in line and "expertcache:" in line:
            out["declined"].append(line[line.index("expertcache:"):])
        # vLLM's own words for a cold compile and for a compile cache that served it
        if "Compiling a graph for compile range" in line:
            out["compile"] = "cold"
        elif "Directly load the compiled graph" in line:
            out.setdefault("compile", "warm")
        if (m := KV_RE.search(line) or KV_GIVEN_RE.search(line)):
            out["kv_gib"] = float(m.group(1))
            out["kv_handed"] = bool(KV_GIVEN_RE.search(line))
        if (m := KV_TOKENS_RE.search(line)):
            out["kv_tokens"] = int(m.group(1).replace(",", ""))
        if (m := WEIGHTS_RE.search(line)):
            out["weights_gib"] = float(m.group(1))
        got = parse_stats_line(line)
        if got and got["final"]:
            out["final"] = got
    if "Traceback" in text or "Error" in text:
        errs = [ln for ln in text.splitlines() if "Error" in ln or "error:" in ln]
        out["errors"] = errs[-5:]
        out["cause"] = failure_cause(text)  # the root one, not vLLM's wrapper around it
    return out


Measure = Callable[[Server, Path, dict, Callable[[], None]], None]


def arm_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options every one-server bench arm takes (its name, where results go, the
    server's extra environment, how long it may take to start); the bench adds its own."""
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("--out", required=True)
    ap.add_argument("--env", action="append", default=[], help="K=V for the server")
    ap.add_argument("--start-timeout", type=float, default=480)
    return ap


def parse_arm_argv(ap: argparse.ArgumentParser,
                   argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options before ``--``, the server command after it (as ``.argv``):
    the server's own options must never be parsed as the bench's."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        ap.error("give the server command after --")
    cut = argv.index("--")
    a = ap.parse_args(argv[:cut])
    a.argv = argv[cut + 1:]
    return a


def serve_arm(a: argparse.Namespace, measure: Measure,
              failures: tuple[type[BaseException], ...], fields: dict | None = None) -> dict:
    """One arm's server, start to stop, for every bench of this shape: start ``a.argv``
    (``{port}`` filled in) with ``a.env``, and once healthy call ``measure(server, log,
    rec, save)`` to fill ``rec`` (``save`` writes it so far; ``fields`` are in it from the
    start, a failed arm's too). A failure of the kinds in ``failures`` is recorded, not
    raised; the server is always stopped, its log read, and ``OUT/NAME.json`` written."""
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [x.replace("{port}", str(port)) for x in a.argv]
    env = server_env({k: v for k, v in (e.split("=", 1) for e in a.env)})
    log = out_dir / f"{a.name}.log"
    log.unlink(missing_ok=True)
    rec: dict = {"arm": a.name, "argv": argv, "env": a.env, "status": "started",
                 **(fields or {})}
    server = Server(argv=argv, env=env, log_path=log, host="127.0.0.1", port=port)
    t0 = time.time()

    def save() -> None:
        (out_dir / f"{a.name}.json").write_text(json.dumps(rec, indent=1))

    try:
        server.start()
        rec["start_s"] = server.wait_healthy(a.start_timeout)
        rec["smi_healthy"] = smi_memory()
        measure(server, log, rec, save)
        rec["status"] = "ok"
    except failures as exc:
        rec["status"] = "failed"
        rec["error"] = str(exc)
        rec["error_type"] = type(exc).__name__
    finally:
        server.stop(grace_s=30)
        rec["wall_s"] = time.time() - t0
        if log.exists():
            rec["log"] = read_log(log)
        save()
    return rec


#: a warm-up arm's one request: enough tokens that a decode step has run after the prefill
WARM_TOKENS = 4


def warm_arm(a: argparse.Namespace) -> dict:
    """``--warm-only``: start, one short greedy request, stop (the module's docstring says
    why). The record is marked ``warm_only`` and holds no greedy tokens."""
    def measure(server: Server, log: Path, rec: dict, save: Callable[[], None]) -> None:
        run = measure_run(server.base_url, server.model_id or "model", PROMPT, WARM_TOKENS)
        rec["warm_tokens"] = run.tokens

    return serve_arm(a, measure, (ServerFailed, RequestFailed, OSError), {"warm_only": True})


def run_arm(a: argparse.Namespace) -> dict:
    if getattr(a, "warm_only", False):
        return warm_arm(a)

    def measure(server: Server, log: Path, rec: dict, save: Callable[[], None]) -> None:
        mid = server.model_id or "model"
        cycle = a.prompt_cycle
        measure_run(server.base_url, mid, run_prompt(0, cycle), a.max_tokens)  # warm-up
        before = counters_now(log)
        runs = [measure_run(server.base_url, mid, run_prompt(i, cycle), a.max_tokens)
                for i in range(1, a.runs + 1)]
        after = counters_now(log)
        rec["prompt_tokens"] = [len(run_prompt(i, cycle).split()) for i in range(1, a.runs + 1)]
        rec["prompt_cycle"] = cycle
        rec["tok_s"] = [r.tok_s for r in runs]
        rec["run_tokens"] = [r.tokens - 1 for r in runs]
        rec["decode_tokens"] = sum(rec["run_tokens"])
        rec["counters_before"], rec["counters_after"] = before, after
        rec["smi_after_runs"] = smi_memory()
        rec["greedy"] = greedy_ids(server.base_url, mid, a.greedy_tokens)
        rec["greedy_again"] = greedy_ids(server.base_url, mid, a.greedy_tokens)
        if a.profile:
            rec["profile"] = profile_decode(server.base_url, mid, Path(a.profile))
            save()
        if a.streams:
            s_before = counters_now(log)
            first = a.runs + 1
            res = measure_run(server.base_url, mid,
                              [run_prompt(first + i, cycle) for i in range(a.streams)],
                              a.max_tokens // 2, a.streams)
            rec["streams"] = {"n": a.streams, "tok_s": res.tok_s, "tokens": res.tokens,
                              "counters_before": s_before,
                              "counters_after": counters_now(log)}

    return serve_arm(a, measure, (ServerFailed, RequestFailed, OSError))


def served_model(argv: list[str] | None) -> str | None:
    """The model a server command serves (the word after ``serve``); None when unknown."""
    argv = argv or []
    return next((argv[i + 1] for i, w in enumerate(argv[:-1]) if w == "serve"), None)


def greedy_report(paths: list[Path]) -> list[str]:
    """One line per pair of arms serving the same model (and per arm against its own
    second run): identical, or where they part and with what margins. Arms of different
    checkpoints are not compared: their tokens have no reason to agree."""
    arms = {}
    for p in paths:
        rec = json.loads(p.read_text())
        g = rec.get("greedy")
        # this bench's single completion (ids, or ids with margins); not another bench's
        # list of concurrent streams
        if isinstance(g, dict) or (isinstance(g, list) and g and isinstance(g[0], str)):
            arms[rec.get("arm", p.stem)] = rec
    lines = []
    for name, rec in arms.items():
        if rec.get("greedy_again"):
            c = compare_greedy(rec["greedy"], rec["greedy_again"])
            lines.append(f"{name} vs its own second run: " + describe(c))
    names = sorted(arms)
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            if served_model(arms[x].get("argv")) != served_model(arms[y].get("argv")):
                continue
            lines.append(f"{x} vs {y}: " + describe(compare_greedy(arms[x]["greedy"],
                                                                    arms[y]["greedy"])))
    return lines


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def describe(c: dict) -> str:
    if c["identical"]:
        return f"identical ({c['compared']} tokens)"
    fmt = _num
    return (f"part at token {c['first_difference']} of {c['compared']}, margins there "
            f"{fmt(c['margin_a'])} / {fmt(c['margin_b'])}, largest chosen-logprob "
            f"difference before {fmt(c['max_logprob_diff_before'])}")


def main() -> int:
    if sys.argv[1:2] == ["--greedy-report"]:
        print("\n".join(greedy_report([Path(p) for p in sys.argv[2:]])))
        return 0
    ap = arm_parser(__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=0)
    ap.add_argument("--prompt-cycle", type=int, default=1,
                    help="R > 1: request i's prompt has 16 + 8 x (i mod R) words, so that a "
                         "routing trace of R recorded requests replays them in turn")
    ap.add_argument("--warm-only", action="store_true",
                    help="a warm-up arm: start, one short greedy request, stop (no "
                         "measurements, no greedy tokens)")
    ap.add_argument("--profile", default=None,
                    help="trace directory: profile one request's decode steps (the server "
                         "must carry `profiler_args(DIR)`; `--print-profiler-config DIR`)")
    if sys.argv[1:2] == ["--print-prompt-tokens"]:  # for the runners: R requests' lengths
        r = int(sys.argv[2])
        print(",".join(str(prompt_tokens(q, r)) for q in range(r)))
        return 0
    if sys.argv[1:2] == ["--print-profiler-config"]:  # for the runners: --profiler-config "$(...)"
        print(profiler_args(sys.argv[2])[1])
        return 0
    rec = run_arm(parse_arm_argv(ap))
    brief = {k: rec.get(k) for k in ("arm", "status", "start_s", "tok_s", "error")}
    if rec.get("warm_only"):
        brief["warm_only"] = True
    lg = rec.get("log") or {}
    brief.update({k: lg.get(k) for k in ("kv_gib", "slots", "armed_layers", "memory_line",
                                         "final", "trap")})
    print(json.dumps(brief, indent=1))
    return 0 if rec["status"] == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
