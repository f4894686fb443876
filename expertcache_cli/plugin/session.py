"""Arming a loaded model, per worker process, and what runs around the engine steps.

`arm_model` walks the model for vLLM's `RoutedExperts` modules, asks `arming.plan_layer`
about each, builds a `SlotCache` and an `ArmedLayer` for those it may arm, and logs one
startup line plus one warning per declined layer. The `Session` it returns owns the
optional trace recorder and the statistics: `after_step` is called once per engine step
(from the worker's ``execute_model``). A periodic report (``EXPERT_CACHE_STATS``) does not
wait for the device: it starts a copy of every counter into pinned host memory behind the
step's work and logs the numbers at the first later step that finds the copy done, so
serving never stalls for it; only the final report at shutdown, the trace's drain
(``EXPERT_CACHE_TRACE``) and an explicit `Session.totals` synchronise.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from ..config import CacheConfig
from .arming import ARM, DECLINE, Decision, plan_layer, summary_line
from .runtime import ArmedLayer

#: the start of the line `Session.serving_starts` logs (benches look for it in server logs)
WARM_UP_DONE = "vLLM's warm-up done: the slots of"

log = logging.getLogger("vllm.expertcache")


def find_moe_layers(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of every `RoutedExperts` in the model, in model order."""
    out = []
    for name, module in model.named_modules():
        if type(module).__name__ == "RoutedExperts" or (
            hasattr(module, "forward_modular") and hasattr(module, "quant_method")
        ):
            out.append((getattr(module, "layer_name", None) or name, module))
    return out


def layer_index(name: str) -> int | None:
    """'model.layers.17.mlp.experts' -> 17 (the trace's layer index)."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


class Session:
    """The armed layers of one worker process and their bookkeeping."""

    def __init__(self, cfg: CacheConfig, decisions: list[Decision], armed: list[ArmedLayer],
                 recorder: Any | None) -> None:
        self.cfg = cfg
        self.decisions = decisions
        self.armed = armed
        self.recorder = recorder
        self.layer_steps = 0
        #: the weight bytes vLLM plans around once the slots were added (`memory`)
        self.weights_bytes = 0
        #: how this vLLM sizes its KV cache (`memory.plan_mechanism`; None: not recognised)
        self.memory_mechanism: str | None = None
        self._next_report = cfg.stats_every
        self._last = (0, 0)
        self._closed = False
        #: a periodic report on its way to the host: (pinned counters, event), or None
        self._pending: tuple[Any, Any] | None = None
        self._draining = True
        #: the sweeps' summary line: when it is about, and whether it was logged
        self._sweep_when = "startup"
        self._sweep_logged = False
        #: the slots and the scratch were allocated in vLLM's sleep-mode pool (`memory`)
        self.pooled = False
        for a in armed:
            a.on_swept = self._swept

    @property
    def slot_bytes(self) -> int:
        """VRAM the slot buffers of the armed layers take (declined layers take none)."""
        return sum(a.decision.slot_bytes for a in self.armed)

    @property
    def scratch_bytes(self) -> int:
        """VRAM of the wide-step scratches (one per distinct layer shape; 0 in place)."""
        seen = {id(a.scratch): a.scratch.nbytes for a in self.armed if a.scratch is not None}
        return sum(seen.values())

    @property
    def cache_bytes(self) -> int:
        """Everything the cache adds to VRAM: what joins the weights in vLLM's plan."""
        return self.slot_bytes + self.scratch_bytes

    # -- counters ------------------------------------------------------------------
    def _counter_rows(self) -> Any:
        """Every armed layer's counters as one device tensor (one row a layer), gathered
        by one ``torch.cat`` (one launch or a few, not one a layer: a periodic report
        runs between decode steps, where launches cost the host's time)."""
        import torch

        parts = [t for a in self.armed for t in (a.cache.stats, a.read_through,
                                                  a.read_through_decode, a.staged,
                                                  a.staged_fetched)]
        return torch.cat(parts).view(len(self.armed), -1)

    def totals(self) -> dict[str, Any]:
        """Live counters summed over armed layers, and per layer (syncs)."""
        if not self.armed:
            return {"requests": 0, "installs": 0, "read_through_steps": 0,
                    "read_through_decode_steps": 0, "staged_steps": 0, "staged_fetched": 0,
                    "layers": []}
        # every layer's counters in one device->host copy
        return self._totals_from(self._counter_rows().cpu().tolist())

    def _totals_from(self, vals: list[list[int]]) -> dict[str, Any]:
        """The counters' dict from their rows, as `_counter_rows` lays them out."""
        stats = [(v[0], v[1]) for v in vals]
        rts, rtd, stg, fet = ([v[i] for v in vals] for i in range(2, 6))
        layers = [
            {"layer": a.decision.layer_name, "requests": s[0], "installs": s[1],
             "read_through_steps": r, "read_through_decode_steps": d, "staged_steps": g,
             "staged_fetched": f}
            for a, s, r, d, g, f in zip(self.armed, stats, rts, rtd, stg, fet)
        ]
        return {
            "requests": sum(s[0] for s in stats),
            "installs": sum(s[1] for s in stats),
            "read_through_steps": sum(rts),
            "read_through_decode_steps": sum(rtd),
            "staged_steps": sum(stg),
            "staged_fetched": sum(fet),
            "slots": self.armed[0].decision.num_slots,
            "slots_per_layer": [a.decision.num_slots for a in self.armed],
            "num_experts": self.armed[0].decision.num_experts,
            "policy": self.cfg.policy.name.lower(),
            "decay": self.cfg.decay,
            "layers": layers,
        }

    def report(self, final: bool = False, totals: dict[str, Any] | None = None) -> None:
        """Log the hit rate since the last report and overall (``totals``: counters already
        on the host; read now, with a sync, when not given)."""
        from ..rules.policy import Wide

        t = self.totals() if totals is None else totals
        req, ins = t["requests"], t["installs"]
        # experts a staged wide step fetched into the scratch were misses too
        miss = ins + t["staged_fetched"]
        d_req, d_miss = req - self._last[0], miss - self._last[1]
        self._last = (req, miss)
        hit = 100.0 * (1 - miss / req) if req else float("nan")
        win = 100.0 * (1 - d_miss / d_req) if d_req else float("nan")
        staged = (f" staged steps={t['staged_steps']} (fetched {t['staged_fetched']})"
                  if self.cfg.wide is not Wide.IN_PLACE else "")
        log.info(
            "expertcache: %s hit rate %.2f%% since last report, %.2f%% overall "
            "(requests=%d installs=%d read-through steps=%d (decode-width %d)%s over %d "
            "layers)",
            "final" if final else "live", win, hit, req, ins, t["read_through_steps"],
            t["read_through_decode_steps"], staged, len(self.armed),
        )

    def check_line(self) -> str:
        """What the first-call checks against the stock path found (`runtime.ArmedLayer`)."""
        from .runtime import CHECK_TOLERANCE

        parts = []
        for path in ("slots", "scratch"):
            seen = [a.checked[path] for a in self.armed if a.checked[path] is not None]
            if path == "scratch" and not seen:
                continue
            ok = [d for d in seen if d <= CHECK_TOLERANCE]
            text = f"{path} path {len(ok)} of {len(self.armed)} layers agreed"
            if ok:
                text += f" (largest relative difference {max(ok):.3g})"
            if len(seen) > len(ok):
                text += f", {len(seen) - len(ok)} differed and went back to the stock path"
            if len(seen) < len(self.armed):
                text += f", {len(self.armed) - len(seen)} not checked"
            parts.append(text)
        return "expertcache: first-call checks against the stock path: " + "; ".join(parts)

    def _swept(self, layer: ArmedLayer) -> None:
        """One layer swept (`ArmedLayer.sweep`): once every armed layer has, one line."""
        if self._sweep_logged or not all(a.sweep_result is not None or a._failed
                                         for a in self.armed):
            return
        self._sweep_logged = True
        line = self.sweep_line()
        (log.info if all(not a._failed for a in self.armed) else log.warning)("%s", line)

    def sweep_line(self) -> str:
        """What the sweeps of every expert found (`runtime.ArmedLayer.sweep`), and their
        cost: the wall time of all of them, device work included."""
        done = [a for a in self.armed if a.sweep_result is not None]
        results = [a.sweep_result for a in done]
        agreed = [r for r in results if r is not None and not r.failed]
        paths = [p for p in ("slots", "scratch")
                 if any(q.path == p for r in results if r is not None for q in r.paths)]
        worst = max((p.worst for r in agreed for p in r.paths), default=0.0)
        partial = sum(1 for r in agreed if any(p.covered < p.num_experts for p in r.paths))
        steps = sum(p.steps for r in results if r is not None for p in r.paths)
        seconds = sum(r.seconds for r in results if r is not None)
        experts = "/".join(str(e) for e in sorted({a.decision.num_experts for a in self.armed}))
        through = " and the ".join(paths or ["slots"])
        text = (f"expertcache: {self._sweep_when} check of every expert ({experts} a layer, "
                f"each through the {through} and the stock path): {len(agreed)} of "
                f"{len(self.armed)} layers agreed (largest row difference {worst:.3g})")
        if len(results) > len(agreed):
            text += f", {len(results) - len(agreed)} differed and went back to the stock path"
        others = len(self.armed) - len(results)
        if others:
            text += f", {others} went back to the stock path before it"
        if partial:
            text += (f", {partial} compared fewer than every expert (rows the stock path left "
                     "at zero)")
        return text + f"; {steps} synthetic steps in {seconds:.2f} s"

    def invalidate(self, why: str) -> None:
        """The experts behind the slots changed: empty every layer's slots (they refill
        from the new weights on the next steps), then sweep every expert of every layer
        again, here, before any step runs on the new weights (where a layer saw no call yet,
        at its first). A layer that cannot be reset (its quant method no longer builds a
        config on the slots), or whose sweep differs, goes back to the stock path: never a
        slot kept from the old weights."""
        emptied = 0
        self._sweep_when, self._sweep_logged = "new weights", False
        for a in self.armed:
            try:
                a.reset()
                emptied += 1
            except Exception as exc:
                a.disarm(f"resetting its slots after new weights failed "
                         f"({exc.__class__.__name__}: {exc})")
        if self.armed:
            log.warning("expertcache: %s: the slots of %d layer(s) emptied; they refill from "
                        "the new expert weights", why, emptied)
        # every expert proven again on the new weights before the next step (a layer whose
        # cache path is captured stops the server if it differs: `ArmedLayer._fail`)
        from .compat import workspace_open

        with workspace_open():
            for a in self.armed:
                if not a._failed:
                    a.sweep()

    def sleep_storage(self) -> set[int]:
        """Storage addresses of the slot buffers and wide-step scratch buffers, which the
        cache allocated in vLLM's sleep pool and empties after every wake of the weights:
        a sleep may discard them (0.34's ``SleepModeBackend.suspend(discardable)``).
        vLLM discards a pool allocation only where every live block in it is named."""
        out: set[int] = set()
        for a in self.armed:
            tensors = list(a.cache.slots.values())
            if a.scratch is not None:
                tensors += list(a.scratch.buffers.values())
            out.update(t.untyped_storage().data_ptr() for t in tensors)
        return out

    def empty_slots(self, why: str) -> None:
        """Empty every armed layer's table (device work only: no quant config rebuilt, no
        sweep), for a weight update that failed part-way: whatever the layer now holds, a
        step installs it afresh. The next successful update invalidates as usual."""
        for a in self.armed:
            a.cache.reset()
        if self.armed:
            log.warning("expertcache: %s: the slots of %d layer(s) emptied", why,
                        len(self.armed))

    def serving_starts(self) -> None:
        """vLLM finished its warm-up (compile sizes, graph capture, the sampler's dummy
        run): empty every armed layer's slots and zero its counters before the first
        request. Why: the warm-up's dummy steps go through the cache like real ones, and
        under LFU (no decay) the experts they routed to keep the counts those steps gave
        them, holding slots that the workload's hot experts then cannot take; `plan`
        replays the workload from empty slots, and the live hit rate should count serving,
        not the warm-up. LRU forgets them anyway; emptying costs it nothing. A routing
        trace being recorded starts again with the cache, so that it replays to the live
        counters."""
        if not self.armed:
            return
        import torch

        live = [a for a in self.armed if not a._failed]
        for a in live:
            a.start_serving()
        if self.recorder is not None:  # the trace starts where the cache does: empty
            self.recorder.restart()
        if live and torch.cuda.is_available() and live[0].cache.table.is_cuda:
            torch.cuda.synchronize()  # once, before the first request's steps
        self._pending = None
        self._last = (0, 0)
        self.layer_steps = 0
        self._next_report = self.cfg.stats_every
        log.info("expertcache: %s %d layer(s) emptied and their counters zeroed, so the "
                 "first request starts from an empty cache, not from the experts of the "
                 "warm-up's dummy steps", WARM_UP_DONE, len(live))

    def after_step(self) -> None:
        """Once per engine step (host side): periodic stats and trace draining. Neither may
        take serving down: a failure is logged once and that bookkeeping stops."""
        if not self.armed:
            return
        self.layer_steps += len(self.armed)
        if self.cfg.stats_every:
            try:
                self._poll_report()
                if self.layer_steps >= self._next_report:
                    self._next_report = self.layer_steps + self.cfg.stats_every
                    if self._pending is None:  # (one on its way already: skipped)
                        self._request_report()
            except Exception as exc:
                log.error("expertcache: periodic stats failed (%s: %s); no more periodic "
                          "reports (the final one is still logged at shutdown)",
                          exc.__class__.__name__, exc)
                self.cfg = dataclasses.replace(self.cfg, stats_every=0)
                self._pending = None
        if self.recorder is not None and self._draining:
            try:
                self.recorder.maybe_flush()
            except Exception as exc:
                log.error("expertcache: draining the routing trace failed (%s: %s); no more "
                          "draining while serving (shutdown still tries to write the trace)",
                          exc.__class__.__name__, exc)
                self._draining = False

    def _request_report(self) -> None:
        """Start the counters' copy to pinned host memory behind the queued work; the
        report is logged by `_poll_report` once it has landed (never waited for)."""
        import torch

        rows = self._counter_rows()
        if rows.device.type != "cuda":  # host counters (tests): nothing to wait for
            self.report(totals=self._totals_from(rows.tolist()))
            return
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending = (host, done)

    def _poll_report(self) -> None:
        """Log a periodic report whose counters have reached the host (no wait)."""
        if self._pending is not None and self._pending[1].query():
            host, _ = self._pending
            self._pending = None
            self.report(totals=self._totals_from(host.tolist()))

    def close(self) -> None:
        """At shutdown: final counters, and the trace file if one was asked for."""
        if self._closed or not self.armed:
            return
        self._closed = True
        self._pending = None  # the final report reads the counters as they end
        try:
            self.report(final=True)
            log.info("%s", self.check_line())
            if self.cfg.audit:
                self.audit()
            if self.recorder is not None and self.cfg.trace_path:
                path = self.recorder.save(self.cfg.trace_path, live=self.totals())
                if path is not None:
                    log.info("expertcache: routing trace written to %s", path)
        except Exception as exc:  # at exit, say what failed and carry on shutting down
            log.error("expertcache: could not finish the shutdown report (final stats, "
                      "trace, audit): %s", exc)

    def audit(self) -> bool:
        """``EXPERT_CACHE_AUDIT=1``: check every armed layer's slots and table at rest
        (`audit`) and log one line, an error when anything differs. Layers that went back
        to the stock path are audited too: their slots are what they served from."""
        from ..device.audit import audit_line

        ok, line = audit_line([(a.decision.layer_name, a.audit()) for a in self.armed])
        (log.info if ok else log.error)("%s", line)
        return ok


def replica_path(path: str, ranks: dict[str, int] | None = None) -> str:
    """Each replica and stage writes its own file: trace.npz -> trace.tp1.pp1.dp2.npz.

    Tensor-parallel ranks, pipeline stages and data-parallel replicas all record; sharing
    one name, they would overwrite one another. Rank 0 of everything keeps the plain name.
    ``ranks`` defaults to the ones vLLM's process groups report here.
    """
    ranks = _vllm_ranks() if ranks is None else ranks
    tags = "".join(f".{k}{v}" for k, v in ranks.items() if v)
    return path[: -len(".npz")] + tags + ".npz" if tags else path


def _vllm_ranks() -> dict[str, int]:
    out = {"tp": 0, "pp": 0, "dp": 0}
    try:
        from vllm.distributed import parallel_state as ps
    except Exception:
        return out
    for key, getter in (("tp", "get_tp_group"), ("pp", "get_pp_group"), ("dp", "get_dp_group")):
        try:
            out[key] = int(getattr(ps, getter)().rank_in_group)
        except Exception:
            pass
    return out


def arm_model(model: Any, cfg: CacheConfig, vllm_version: str,
              max_num_seqs: int | None = None, model_name: str | None = None,
              refusal: str | None = None,
              padding: Callable[[int], Any] | None = None,
              pool: Callable[[], Any] | None = None, spec_tokens: int = 0,
              decode_rows: Callable[[int], int] | None = None) -> Session:
    """Plan, build and install the caches of one loaded model; never raises.

    ``refusal``: why no slot could be accounted for in vLLM's memory plan (`memory`);
    every layer that would be armed is declined with it, before anything is allocated.
    ``padding``: how the armed layers read a step's padded rows (`padding.mask_reader`).
    ``spec_tokens``: speculative decoding's draft tokens per sequence (a decode step
    carries ``max_num_seqs x (1 + spec_tokens)`` tokens).
    ``decode_rows``: requests -> the rows vLLM runs a decode step of them at (the plugin's
    `_decode_rows`, read from vLLM's resolved grids); None: eager, ``n x (1 +
    spec_tokens)`` rows.
    ``pool``: the allocation context of vLLM's sleep-mode pool (`memory.sleep_pool`): the
    slot buffers and the scratch are allocated inside it, so they sleep with the weights.
    """
    from ..device import binding
    from ..vllm_facts.capture import rows_for_sizes

    binding.select(cfg.lib, cfg.pdl)  # the kernels this process loads: the configuration's
    layers = find_moe_layers(model)
    decisions = [plan_layer(module, cfg, name, i) for i, (name, module) in enumerate(layers)]
    if cfg.slots_per_layer is not None and len(cfg.slots_per_layer) != len(layers):
        refusal = refusal or (
            f"EXPERT_CACHE_SLOTS lists {len(cfg.slots_per_layer)} per-layer budgets for "
            f"{len(layers)} MoE layers (a plan made for another model?)")
    for d in decisions:
        if refusal and d.action == ARM:
            d.action, d.reason = DECLINE, refusal
    marlin_refusal = _patch_marlin() if any(d.armed and d.marlin for d in decisions) else None
    for d in decisions:
        if marlin_refusal and d.armed and d.marlin:
            d.action, d.reason = DECLINE, marlin_refusal
    rows = decode_rows or rows_for_sizes([], 1 + spec_tokens)
    decode_tokens = rows(max_num_seqs) if max_num_seqs else None
    armed: list[ArmedLayer] = []
    scratches: dict[tuple, Any] = {}
    for decision, module in ((d, m) for d, (_, m) in zip(decisions, layers) if d.action == ARM):
        try:
            scratch = _scratch_for(module, decision, cfg, scratches, pool)
            armed.append(_arm_one(module, decision, cfg, len(armed), decode_tokens, scratch,
                                  padding, pool))
        except Exception as exc:
            decision.action = DECLINE
            decision.reason = f"arming failed: {exc.__class__.__name__}: {exc}"
    recorder = None
    if armed and cfg.trace_path:
        try:
            cfg = _with_trace(cfg, replica_path(cfg.trace_path))
            recorder = _make_recorder(armed, model_name, cfg.trace_path)
        except Exception as exc:
            log.error("expertcache: trace recording disabled: %s", exc)
            recorder = None
    if armed:
        _patch_tiles()
    for d in decisions:
        if d.action == DECLINE:
            log.warning("expertcache: %s not armed: %s", d.layer_name, d.reason)
    session = Session(cfg, decisions, armed, recorder)
    session.pooled = pool is not None and bool(armed)
    log.info("%s", summary_line(decisions, cfg, vllm_version, max_num_seqs,
                                session.scratch_bytes, spec_tokens, rows))
    return session


def _scratch_for(module: Any, decision: Decision, cfg: CacheConfig,
                 scratches: dict[tuple, Any], pool: Callable[[], Any] | None = None) -> Any:
    """The wide-step scratch this layer shares with the layers shaped like it (None in
    place). One is built per shape: layers run one after another on one stream."""
    from ..rules.policy import Wide

    if cfg.wide is Wide.IN_PLACE:
        return None
    from ..device.scratch import Scratch, scratch_key

    specs = {s.name: (s.shape, s.dtype) for s in decision.specs}
    key = scratch_key(decision.num_experts, specs)
    if key not in scratches:
        # on the device of the layer's experts, as its SlotCache (in the sleep pool)
        with pool() if pool is not None else contextlib.nullcontext():
            scratches[key] = Scratch(decision.num_experts, specs,
                                     module._parameters[decision.specs[0].name].device)
    return scratches[key]


def _make_recorder(armed: list[ArmedLayer], model_name: str | None, path: str) -> Any:
    """One device ring with a row per armed layer, attached to each of them; drained rows
    spill beside ``path`` (host memory stays bounded)."""
    from .recorder import TraceRecorder

    first = armed[0].decision
    shapes = {(a.decision.num_experts, a.decision.top_k) for a in armed}
    if len(shapes) != 1:
        raise ValueError(f"armed layers differ in (experts, top_k): {sorted(shapes)}")
    names = [layer_index(a.decision.layer_name) for a in armed]
    recorder = TraceRecorder(
        len(armed), first.num_experts, first.top_k, armed[0].read_through.device,
        layer_names=names if all(n is not None for n in names) else None,
        model=model_name,
        spill=_spill_path(path),
    )
    for i, a in enumerate(armed):
        a.index, a.recorder = i, recorder
    return recorder


def _patch_tiles() -> None:
    """Slot-bound fused-MoE calls use the tiles tuned for the real expert count."""
    import importlib

    from .runtime import TRITON_EXPERTS_MODULE, patch_tile_lookup

    try:
        ok = patch_tile_lookup(importlib.import_module(TRITON_EXPERTS_MODULE))
    except ImportError:
        ok = False
    if not ok:
        log.info("expertcache: no Triton tile lookup to patch; slot-bound calls use "
                 "vLLM's tiles for the slot count")


def _patch_marlin(module: Any = None) -> str | None:
    """Install the expert-order block remap in vLLM's Marlin MoE module (`marlin`); why
    Marlin layers cannot be armed, or None. Without it a slot-bound Marlin call would index
    slot buffers with expert ids: Marlin layers are then declined, never armed."""
    import importlib
    import inspect

    from . import marlin

    try:
        module = module or importlib.import_module(marlin.MARLIN_MODULE)
        source = inspect.getsource(module.fused_marlin_moe)
    except Exception as exc:
        return f"vLLM's Marlin MoE module is not the one read ({exc.__class__.__name__}: {exc})"
    if "moe_align_block_size(" not in source or not marlin.patch_block_order(module):
        return ("vLLM's fused_marlin_moe does not build its blocks with moe_align_block_size "
                "(unknown Marlin layout): its block list cannot be remapped to slots")
    return None


def _spill_path(path: str) -> str:
    """Hidden, beside the trace, unique to this process (a stale one is never appended to)."""
    import os
    from pathlib import Path

    p = Path(path).expanduser()
    spill = p.with_name(f".{p.name}.{os.getpid()}.spill")
    for stale in (spill, spill.with_name(spill.name + ".tokens")):
        stale.unlink(missing_ok=True)
    return str(spill)


def _with_trace(cfg: CacheConfig, path: str) -> CacheConfig:
    import dataclasses

    return dataclasses.replace(cfg, trace_path=path)


def _arm_one(module: Any, decision: Decision, cfg: CacheConfig, index: int,
             decode_tokens: int | None = None, scratch: Any | None = None,
             padding: Callable[[int], Any] | None = None,
             pool: Callable[[], Any] | None = None) -> ArmedLayer:
    from ..device.slotcache import SlotCache

    # wide steps install up to the mode's cap (`Wide.insert_cap`; the SlotCache bounds it
    # by its own cap): nothing staged, the cache's cap staged-install
    wide_inserts = None if scratch is None else cfg.wide.insert_cap(decision.num_slots)

    device = module._parameters[decision.specs[0].name].device
    specs = {s.name: (s.shape, s.dtype) for s in decision.specs}
    small = _small_for(module, decision, device)
    spread = None
    if small is not None:  # the packed side row is one more slab of the cache
        import torch

        from .small import SMALL_ROW

        specs[SMALL_ROW] = ((small.row_bytes,), torch.uint8)
        # and its installs fill the compact copies the kernel reads (no copy per step),
        # where the row's words allow it (`SmallTensors.spread_targets`)
        targets = small.spread_targets() if cfg.spread else None
        if targets is not None:
            spread = {SMALL_ROW: targets}
    # a bare "cuda" device (no index) is resolved to the current one by SlotCache
    cache = SlotCache(
        decision.num_experts,
        decision.num_slots,
        specs,
        policy=cfg.policy,
        decay=cfg.decay,
        device=device,
        name=decision.layer_name,
        wide_inserts=wide_inserts,
        pool=pool,
        spread=spread,
    )
    block_order = None
    if decision.marlin:
        from .marlin import BlockOrder

        block_order = BlockOrder(decision.num_experts)
    armed = ArmedLayer(module, decision, cache, index=index, decode_tokens=decode_tokens,
                       scratch=scratch, padding=padding, small=small,
                       block_order=block_order)
    armed.install()
    return armed


def _small_for(module: Any, decision: Decision, device: Any) -> Any:
    """The layer's packed side row for its ragged per-expert tensors (`small`), filled from
    the layer's own tensors; None when it has none."""
    if not decision.small:
        return None
    from .small import SmallTensors

    small = SmallTensors([(s.name, s.shape, s.dtype, s.bytes_per_expert)
                          for s in decision.small],
                         decision.num_experts, decision.num_slots, device)
    small.refresh({s.name: module._parameters[s.name] for s in decision.small})
    return small


_SESSIONS: list[Session] = []


def sessions() -> list[Session]:
    """The sessions armed in this process (one per worker; read by in-process benches)."""
    return list(_SESSIONS)


def close_all() -> None:
    """Final stats line and trace file of every session (atexit; idempotent)."""
    for s in _SESSIONS:
        s.close()


def register_session(session: Session) -> None:
    if not _SESSIONS:
        atexit.register(close_all)
    _SESSIONS.append(session)

