"""BENCH ONLY: drive a served model's routing from a trace file, so an end-to-end run sees a
workload's real locality instead of random routers.

Why: a random-weight checkpoint routes with no memory of its own, so measured tok/s says
nothing about what `expertcache plan` predicts for a real workload's trace. With
``EC_BENCH_TRACE_ROUTING=trace.npz`` set, every MoE router's ``select_experts`` returns,
for a step no wider than the trace's rows, the trace's ids for that layer at the layer's
next step (cycling), with the router's own weights; wider steps keep the router's ids. Each
request starts the trace again: a step of more tokens than ``EC_BENCH_TRACE_STREAMS``
(default 1) is its prefill and takes the first row of one of the trace's recorded requests
(`Trace.request_starts`; row 0 for a trace of one request), its decode steps the rows
after it. Which one: the prefill's tokens // `PROMPT_STEP`, modulo the requests, so that
served prompts whose lengths differ by `PROMPT_STEP` tokens replay different recorded
requests while one prompt always replays the same one (two servers given it compare).
A decode step of several streams on a trace recorded one stream at a time gives stream
``i`` the row ``i x (T // S)`` after the first stream's, ``S`` being
``EC_BENCH_TRACE_STREAMS``: each stream at another point of the recording, in another
request where it holds them. At ``S`` streams that is where `rebatch` places them; a step
of fewer streams keeps the spacing (16 streams of a hook set for 32 are ``T // 32`` rows
apart), which `trace_fit.as_served` writes with ``hook_streams``.
The substitution is device work on a device step counter per layer, so it is
captured in CUDA graphs like the rest of the step. Every process that imports vLLM's
router gets it (``bench/trace_hook/sitecustomize.py`` imports this module at startup when
the variable is set); it logs one line saying routing is replayed from a file, and it is
never part of the package.

    EC_BENCH_TRACE_ROUTING=traces/demo-qwen3-30b-a3b-tasks.npz \\
    PYTHONPATH=bench/trace_hook:$PYTHONPATH expertcache baseline ...
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

ENV = "EC_BENCH_TRACE_ROUTING"
#: the streams a bench server decodes at once (default 1): a wider step is a prefill
STREAMS_ENV = "EC_BENCH_TRACE_STREAMS"
#: "0": one counter across requests, no restart at a prefill (a long synthetic trace that
#: `plan` replays whole, as the plan check's synthetic rows were measured)
RESTART_ENV = "EC_BENCH_TRACE_RESTART"
#: a prefill of P tokens replays recorded request (P // PROMPT_STEP) mod R: vLLM pads a
#: step to its CUDA-graph sizes, multiples of 8 past 8 tokens, so prompts 8 tokens apart
#: are told apart whether their prefill is padded or not
PROMPT_STEP = 8
ROUTER_MODULE = "vllm.model_executor.layers.fused_moe.router.fused_moe_router"
ROUTER_CLASS = "FusedMoERouter"

log = logging.getLogger("vllm.expertcache.bench")
#: logged once per process at the first step the trace routes (not when the class is
#: patched: a router class that overrides select_experts would never reach the patch), so a
#: report can require it in every server's log
IN_FORCE_LINE = "BENCH: trace routing in force"


class TraceRouting:
    """The trace on the device and one step counter per router (= per MoE layer)."""

    def __init__(self, topk_ids: Any, top_k: int, streams: int = 1,
                 restart: bool = True, starts: Any = None,
                 one_stream: bool = False) -> None:
        self.ids = topk_ids  # numpy [T, L, W]
        self.top_k = int(top_k)
        #: decode steps are at most this many tokens; a wider step is a prefill
        self.streams = max(1, int(streams))
        self.restart = restart
        #: the first row of each recorded request (a prefill restarts at one of them)
        self.starts = [0] if starts is None or len(starts) == 0 else [int(x) for x in starts]
        #: the trace was recorded one stream at a time (its decode rows hold top_k ids):
        #: a step of several streams takes one row a stream
        self.one_stream = bool(one_stream)
        self.logged = False
        self.layers: dict[int, int] = {}  # id(router) -> layer ordinal, in first-call order
        self.dev: dict[Any, tuple[Any, Any]] = {}  # (device, layer) -> (rows, counter)

    def layer_of(self, router: Any) -> int:
        key = id(router)
        if key not in self.layers:
            self.layers[key] = len(self.layers) % self.ids.shape[1]
        return self.layers[key]

    def substitute(self, router: Any, topk_ids: Any) -> Any:
        """The trace's ids for this layer's next step, shaped like ``topk_ids``; the
        router's own ids when the step is wider than the trace's rows.

        A step of more tokens than ``streams`` is a request's prefill: the layer's counter
        starts again at the first row of the recorded request `request_for` picks (a
        recording's prefill), so that every request replays the trace from a request's
        start whatever ran before it (vLLM's warm-up, the other arm's extra calls, an
        earlier request): two servers, or two requests, given one prompt see the same
        routing, and their greedy tokens can be compared."""
        import torch

        tokens, k = topk_ids.shape
        width = tokens * k
        if k != self.top_k:
            return topk_ids
        layer = self.layer_of(router)
        key = (topk_ids.device, layer)
        if key not in self.dev:
            rows = torch.from_numpy(self.ids[:, layer, :].astype("int64")).to(topk_ids.device)
            self.dev[key] = (rows, torch.zeros(1, dtype=torch.int64, device=topk_ids.device))
        rows, counter = self.dev[key]
        prefill = self.restart and tokens > self.streams
        if prefill:
            counter.fill_(self.starts[self.request_for(tokens)])
        if self.one_stream and 1 < tokens <= self.streams:
            return self._streams(layer, rows, counter, topk_ids)
        if width > self.ids.shape[2]:
            if prefill:
                counter.add_(1)  # the prefill used row 0's place, with the router's own ids
            return topk_ids
        if not self.logged:
            self.logged = True
            log.warning("%s: layer %d's steps of %d ids take the trace's ids (%d steps x %d "
                        "layers; a step of more than %d token(s) restarts a layer at row 0)",
                        IN_FORCE_LINE, layer, width, self.ids.shape[0], self.ids.shape[1],
                        self.streams)
        at = torch.remainder(counter, rows.shape[0])
        row = rows.index_select(0, at)[:, :width].reshape(tokens, k).to(topk_ids.dtype)
        counter.add_(1)
        # a trace row shorter than this step (padding -1): keep the router's ids there
        return torch.where(row >= 0, row, topk_ids)

    def request_for(self, tokens: int) -> int:
        """The recorded request a prefill of ``tokens`` tokens replays (module docstring)."""
        return (int(tokens) // PROMPT_STEP) % len(self.starts)

    def _streams(self, layer: int, rows: Any, counter: Any, topk_ids: Any) -> Any:
        """A decode step of several streams on a one-stream recording: stream ``i`` takes
        row ``counter + i x T / streams`` (mod T), its first top_k ids."""
        import torch

        tokens, k = topk_ids.shape
        t = rows.shape[0]
        offsets = torch.arange(tokens, device=topk_ids.device, dtype=torch.int64)
        offsets = offsets * (t // self.streams)
        at = torch.remainder(counter + offsets, t)
        row = rows.index_select(0, at)[:, :k].to(topk_ids.dtype)
        counter.add_(1)
        if not self.logged:
            self.logged = True
            log.warning("%s: layer %d's steps of %d streams take one recorded row a stream "
                        "(%d steps x %d layers)", IN_FORCE_LINE, layer, tokens,
                        self.ids.shape[0], self.ids.shape[1])
        return torch.where(row >= 0, row, topk_ids)


def one_stream(trace: Any) -> bool:
    """Whether ``trace`` was recorded one stream at a time: its decode steps ran one token
    (a recording's `step_tokens`), or, without them, no row holds more than top_k ids."""
    kinds = trace.step_kinds()
    if kinds is not None:
        decode = kinds == 0
        return bool(decode.any()) and bool((trace.step_tokens[decode] == 1).all())
    return bool(((trace.topk_ids >= 0).sum(axis=2) <= trace.top_k).all())


def patch_router_class(cls: Any, routing: TraceRouting) -> None:
    """Wrap ``cls.select_experts`` (once) to return the trace's ids."""
    orig = cls.__dict__.get("select_experts")
    if orig is None or getattr(orig, "_ec_trace_routing", False):
        return

    def select_experts(self: Any, *args: Any, **kwargs: Any) -> Any:
        weights, ids = orig(self, *args, **kwargs)
        return weights, routing.substitute(self, ids)

    select_experts._ec_trace_routing = True  # type: ignore[attr-defined]
    cls.select_experts = select_experts


def install(path: str | None = None) -> TraceRouting | None:
    """Arrange the patch for when vLLM's router module is imported (no-op without a path)."""
    path = path or os.environ.get(ENV)
    if not path:
        return None
    from expertcache_cli.plugin import when_imported
    from expertcache_cli.rules.trace import load

    trace = load(path)
    routing = TraceRouting(trace.topk_ids, trace.top_k,
                           int(os.environ.get(STREAMS_ENV, "1") or 1),
                           os.environ.get(RESTART_ENV, "1") != "0",
                           starts=trace.request_starts(), one_stream=one_stream(trace))

    def patch(module: Any) -> None:
        cls = getattr(module, ROUTER_CLASS, None)
        if cls is None:
            log.error("BENCH: %s has no %s: routing NOT replayed", ROUTER_MODULE, ROUTER_CLASS)
            return
        patch_router_class(cls, routing)
        log.warning("BENCH: MoE routing replayed from %s (%d steps x %d layers): %s is set",
                    path, trace.steps, trace.num_layers, ENV)

    when_imported(ROUTER_MODULE, patch)
    return routing
