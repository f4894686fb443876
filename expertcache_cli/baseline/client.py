"""The measuring client: streaming completions over vLLM's OpenAI-compatible API.

Greedy, a fixed prompt, ``ignore_eos`` and a fixed ``max_tokens``: every run of every arm
asks for exactly the same work, so any difference is the server's. Decode speed is
measured between the first and the last streamed token, which keeps prefill (and
TTFT's queueing) out of the number the cache is meant to move.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

#: Two token events closer than this arrived together (diagnostic: some servers flush
#: several tokens at once as a matter of course, so this alone proves nothing).
COALESCED_GAP_S = 0.0002
#: A run whose first-to-last-token window is under this share of the whole request, with
#: the rest spent waiting for the first token, received its tokens in one burst: the
#: server's API process (or this client) was starved, and the decode rate timed delivery.
BURST_WINDOW_SHARE = 0.2


class RequestFailed(Exception):
    """A request that errored, was cut short, or returned fewer tokens than asked."""


@dataclass
class StreamResult:
    """One streamed request, timed on the client's monotonic clock (seconds)."""

    tokens: int
    chunks: int
    t_sent: float
    t_first: float
    t_last: float
    finish_reason: str | None
    coalesced: int = 0  # gaps between consecutive token events below COALESCED_GAP_S

    @property
    def ttft_s(self) -> float:
        return self.t_first - self.t_sent


@dataclass
class RunResult:
    """One run: ``concurrency`` requests sent together (one prompt, or one a stream).

    ``tok_s`` is aggregate decode throughput: tokens after each stream's first, over the
    time from the earliest first token to the latest last token. With one stream it is
    exactly (tokens - 1) / (t_last - t_first).
    """

    tok_s: float
    ttft_s: float
    tokens: int
    decode_s: float
    wall_s: float
    chunks: int
    streams: int
    coalesced_share: float = 0.0

    e2e_s: float = 0.0  # first request sent to last token received

    @property
    def e2e_tok_s(self) -> float:
        """Tokens over the whole request, prefill included: immune to burst delivery."""
        return self.tokens / self.e2e_s if self.e2e_s > 0 else float("nan")

    @property
    def bursty(self) -> bool:
        """The tokens arrived in one burst after a long wait: the decode window is too
        short to be a decode. The summary leaves such runs out, and says so."""
        return self.e2e_s > 0 and self.decode_s < BURST_WINDOW_SHARE * self.e2e_s


def request_body(model_id: str, prompt: str, max_tokens: int) -> dict[str, object]:
    return {
        "model": model_id,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _stream_one(client, url: str, body: dict[str, object]) -> StreamResult:
    import httpx

    t_sent = time.perf_counter()
    t_first = t_last = None
    chunks = 0
    usage_tokens = None
    finish = None
    done = False
    coalesced = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", errors="replace")
                raise RequestFailed(f"HTTP {resp.status_code}: {text[:300]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                try:
                    event = json.loads(payload)
                except json.JSONDecodeError:
                    raise RequestFailed(f"bad stream event: {payload[:200]}") from None
                if "error" in event:
                    raise RequestFailed(f"server error in stream: {str(event['error'])[:300]}")
                usage = event.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                # Every event with a choice carries a token (its text may be empty, e.g. a
                # special token); the closing usage event has no choices.
                for choice in event.get("choices") or []:
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
                    chunks += 1
                    if t_first is None:
                        t_first = now
                    elif now - t_last < COALESCED_GAP_S:
                        coalesced += 1
                    t_last = now
    except httpx.HTTPError as exc:
        raise RequestFailed(f"{type(exc).__name__}: {exc}") from None
    if not done:
        raise RequestFailed(f"the stream ended without [DONE] after {chunks} token(s)")
    if t_first is None or t_last is None:
        raise RequestFailed("the stream carried no tokens")
    return StreamResult(
        tokens=usage_tokens if usage_tokens is not None else chunks,
        chunks=chunks,
        t_sent=t_sent,
        t_first=t_first,
        t_last=t_last,
        finish_reason=finish,
        coalesced=coalesced,
    )


async def _run(base_url: str, bodies: list[dict[str, object]], timeout_s: float):
    import httpx

    limits = httpx.Limits(max_connections=len(bodies) + 1)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        url = base_url + "/v1/completions"
        return await asyncio.gather(*(_stream_one(client, url, body) for body in bodies))


def measure_run(
    base_url: str,
    model_id: str,
    prompt: str | Sequence[str],
    max_tokens: int,
    concurrency: int = 1,
    timeout_s: float = 600.0,
) -> RunResult:
    """Send ``concurrency`` streaming requests at once and time them: each the one
    ``prompt``, or, given several, stream ``i`` prompt ``i`` (cycled)."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    bodies = [request_body(model_id, prompts[i % len(prompts)], max_tokens)
              for i in range(concurrency)]
    t0 = time.perf_counter()
    streams: list[StreamResult] = asyncio.run(_run(base_url, bodies, timeout_s))
    wall = time.perf_counter() - t0
    for s in streams:
        if s.tokens < max_tokens:
            raise RequestFailed(
                f"got {s.tokens} of {max_tokens} tokens (finish_reason={s.finish_reason}): "
                "the prompt plus --max-tokens may exceed the server's --max-model-len, or it "
                "ignored ignore_eos; runs of different lengths would not be comparable"
            )
    return summarise_streams(streams, wall)


def summarise_streams(streams: list[StreamResult], wall_s: float) -> RunResult:
    """Aggregate decode throughput of streams that ran together (see RunResult)."""
    first = min(s.t_first for s in streams)
    last = max(s.t_last for s in streams)
    decode_tokens = sum(max(0, s.tokens - 1) for s in streams)
    decode_s = last - first
    gaps = sum(max(0, s.chunks - 1) for s in streams)
    coalesced = sum(s.coalesced for s in streams)
    tok_s = decode_tokens / decode_s if decode_s > 0 else float("nan")
    return RunResult(
        tok_s=tok_s,
        ttft_s=sum(s.ttft_s for s in streams) / len(streams),
        tokens=sum(s.tokens for s in streams),
        decode_s=decode_s,
        wall_s=wall_s,
        chunks=sum(s.chunks for s in streams),
        streams=len(streams),
        coalesced_share=coalesced / gaps if gaps else 0.0,
        e2e_s=last - min(s.t_sent for s in streams),
    )
