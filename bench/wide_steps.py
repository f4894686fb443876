"""One server of the wide-step proof: prefill (TTFT) and batched decode, measured.

`bench/run_wide_on_device.sh` calls this once per arm (resident, the offload floor, the
cache reading wide steps in place, the cache staging them), with the server command
after ``--``. In one server:

1. TTFT at each ``--prompt-tokens`` length (default 512, 2048, 8192), ``--ttft-runs``
   times, each a fresh prompt of random words (the bench checkpoints' word-level
   tokenizer: one word, one token) so that vLLM's prefix cache never serves it; one token
   generated, the time to it is the prefill;
2. decode at each ``--streams`` count (default 1, 4, 8, 16, 32): that many distinct
   prompts sent together, ``--max-tokens`` each (ignore_eos); the aggregate rate is the
   sum over streams of (tokens - 1) / (last token - first token), the decode window of
   each (prefill excluded), after one discarded warm-up round;
3. the greedy texts of ``--greedy-streams`` distinct prompts sent together (temperature
   0): arms at the same batch must agree token for token;
4. ``--requests K``: K requests one after another on one stream, each a fresh prompt of
   the decode rounds' shape (32 words, ``--max-tokens`` tokens): what a recording for
   `plan --batch` must hold, since re-batched streams inside one request share its
   experts (H200, 24 layers: one 1,024-token request re-batched to 16 streams priced 16
   users at 180 tok/s in place; 16 users with their own prompts ran 41);
5. stop, then the plugin's startup, memory-plan and final counters lines from the log.

Everything lands in ``OUT/NAME.json`` when the arm ends, failed or not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from small_card import arm_parser, parse_arm_argv, serve_arm  # noqa: E402

from expertcache_cli.baseline.server import Server  # noqa: E402

#: the prompt of every decoded stream: the decode rounds', the greedy texts' and the
#: ``--requests`` recording's, which must be of one shape for `plan --batch` to price them
STREAM_WORDS = 32
#: the server's first request, discarded (a prompt of WARMUP_WORDS words, WARMUP_TOKENS
#: tokens), the TTFT prompts' default lengths and runs, and the tokens a stream of each
#: decode round's discarded warm-up round: `bench/wide_served.py` replays this order
WARMUP_WORDS, WARMUP_TOKENS = 64, 8
TTFT_PROMPTS, TTFT_RUNS = (512, 2048, 8192), 3
WARM_ROUND_TOKENS = 16


def prompt(rng: random.Random, words: int, vocab: int) -> str:
    """``words`` random words of the word-level tokenizer: a prompt no cache has seen."""
    return " ".join(f"w{rng.randrange(16, vocab)}" for _ in range(words))


async def _stream(client, url: str, body: dict) -> dict:
    """One streaming completion: send time, token arrival times, text."""
    t0 = time.perf_counter()
    times: list[float] = []
    text: list[str] = []
    usage = None
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                if c.get("text"):
                    times.append(time.perf_counter())
                    text.append(c["text"])
    return {"t0": t0, "times": times, "text": "".join(text), "usage": usage}


async def _together(base: str, model: str, prompts: list[str], max_tokens: int,
                    timeout: float) -> list[dict]:
    import httpx

    url = base + "/v1/completions"
    limits = httpx.Limits(max_connections=len(prompts) + 1)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        return await asyncio.gather(*(_stream(client, url, {
            "model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }) for p in prompts))


def together(base: str, model: str, prompts: list[str], max_tokens: int,
             timeout: float = 900) -> list[dict]:
    return asyncio.run(_together(base, model, prompts, max_tokens, timeout))


def decode_rate(results: list[dict]) -> float:
    """Aggregate decode tok/s: each stream's tokens after its first, over its own window."""
    total = 0.0
    for r in results:
        t = r["times"]
        if len(t) >= 2 and t[-1] > t[0]:
            total += (len(t) - 1) / (t[-1] - t[0])
    return total


def run_arm(a: argparse.Namespace) -> dict:
    rng = random.Random(a.seed)

    def measure(server: Server, log: Path, rec: dict, save: Callable[[], None]) -> None:
        base, mid = server.base_url, server.model_id or "model"
        together(base, mid, [prompt(rng, WARMUP_WORDS, a.vocab)], WARMUP_TOKENS)  # discarded
        rec["ttft"] = {}
        for n in a.prompt_tokens:
            runs = []
            for _ in range(a.ttft_runs):
                (r,) = together(base, mid, [prompt(rng, n, a.vocab)], 1)
                runs.append({"ttft_s": r["times"][0] - r["t0"] if r["times"] else None,
                             "prompt_tokens": (r["usage"] or {}).get("prompt_tokens")})
            good = [x["ttft_s"] for x in runs if x["ttft_s"] is not None]
            rec["ttft"][str(n)] = {"runs": runs,
                                   "median_s": statistics.median(good) if good else None}
            save()
        rec["decode"] = {}
        for s in a.streams:
            # warm-up, discarded
            together(base, mid, [prompt(rng, STREAM_WORDS, a.vocab) for _ in range(s)],
                     WARM_ROUND_TOKENS)
            res = together(base, mid, [prompt(rng, STREAM_WORDS, a.vocab) for _ in range(s)],
                           a.max_tokens)
            rec["decode"][str(s)] = {"tok_s": decode_rate(res),
                                     "tokens": [len(r["times"]) for r in res]}
            save()
        if a.greedy_streams:
            greedy_rng = random.Random(1234)  # the same prompts in every arm
            res = together(base, mid, [prompt(greedy_rng, STREAM_WORDS, a.vocab)
                                       for _ in range(a.greedy_streams)], a.greedy_tokens)
            rec["greedy"] = [r["text"].split() for r in res]
        if a.requests:
            rates = []
            for _ in range(a.requests):
                (r,) = together(base, mid, [prompt(rng, STREAM_WORDS, a.vocab)], a.max_tokens)
                rates.append(decode_rate([r]))
            rec["requests"] = {"count": a.requests, "tokens": a.max_tokens,
                               "median_tok_s": statistics.median(rates)}
            save()

    # any failure is recorded: what was measured before it is kept
    return serve_arm(a, measure, (Exception,))


def main() -> int:
    ap = arm_parser(__doc__)
    ap.add_argument("--prompt-tokens", type=int, nargs="*", default=list(TTFT_PROMPTS))
    ap.add_argument("--ttft-runs", type=int, default=TTFT_RUNS)
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 4, 8, 16, 32])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--greedy-streams", type=int, default=16)
    ap.add_argument("--greedy-tokens", type=int, default=48)
    ap.add_argument("--requests", type=int, default=0,
                    help="then this many requests in turn on one stream (a trace for --batch)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--seed", type=int, default=0)
    rec = run_arm(parse_arm_argv(ap))
    brief = {k: rec.get(k) for k in ("arm", "status", "start_s", "error")}
    brief["ttft_ms"] = {n: round(1000 * v["median_s"], 1) if v.get("median_s") else None
                        for n, v in (rec.get("ttft") or {}).items()}
    brief["decode_tok_s"] = {n: round(v["tok_s"], 1) for n, v in (rec.get("decode") or {}).items()}
    lg = rec.get("log") or {}
    brief.update({k: lg.get(k) for k in ("slots", "armed_layers", "memory_line", "final")})
    print(json.dumps(brief, indent=1))
    return 0 if rec["status"] == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
