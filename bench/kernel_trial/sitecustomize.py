"""BENCH ONLY (also EC_BENCH_NO_CHECK, EC_BENCH_MEM below): with EC_BENCH_TRY_KERNELS
set (comma-separated experts-kernel class names,
e.g. ``BatchedMarlinExperts``) and this folder on PYTHONPATH, the plugin in every process of the
benchmark treats those kernels as known to index weights by expert id, so a device run
can try arming a kernel before it is added to `plugin.compat.KNOWN_EXPERTS`. The layer's
first eager call is still checked against the stock path (plugin.runtime), and every other
arming rule still applies. Without the variable it does nothing. It shadows any other
sitecustomize on the path: bench use only, never in a user's environment."""

import os
from pathlib import Path

_names = {n.strip() for n in os.environ.get("EC_BENCH_TRY_KERNELS", "").split(",") if n.strip()}
if _names:
    from expertcache_cli.plugin import arming, compat

    compat.KNOWN_EXPERTS = compat.KNOWN_EXPERTS | _names
    arming.KNOWN_EXPERTS = compat.KNOWN_EXPERTS

# EC_BENCH_NO_CHECK=1: no first-call check against the stock path, and no sweep of every
# expert (to measure what the checks themselves allocate at startup; a user never runs
# without them).
if os.environ.get("EC_BENCH_NO_CHECK") == "1":
    from expertcache_cli.plugin import runtime as _runtime

    _runtime.CHECK_ATTEMPTS = 0
    _runtime.SWEEP = False

# EC_BENCH_MEM=1: log the CUDA memory around the first calls of every armed layer, to find
# which part of a step raises the peak vLLM's profile run measures: layers 0 and 1 always
# (allocated before, the allocator's peak before and after), any other layer only when its
# call raised the peak; and inside a call, the first-call check's reference call (the stock
# path on the full weights) when it raised the peak, so a rise is pinned to one layer and
# to the check or the path.
if os.environ.get("EC_BENCH_MEM") == "1":
    import logging

    from expertcache_cli.plugin import runtime as _rt

    _orig_forward = _rt.ArmedLayer.forward_modular
    _orig_checked = _rt.ArmedLayer._checked_call
    _seen: dict[int, int] = {}
    _log = logging.getLogger("vllm.expertcache")
    _GIB = 2**30
    _recording = {"on": False}  # the allocator's history, from arming to layer 0's 1st call

    def _measuring() -> bool:
        import torch

        return not torch.cuda.is_current_stream_capturing()

    def _forward(self, x, topk_weights, topk_ids, *args, **kwargs):
        import torch

        n = _seen.get(self.index, 0)
        if n >= 3 or not _measuring():
            return _orig_forward(self, x, topk_weights, topk_ids, *args, **kwargs)
        _seen[self.index] = n + 1
        if _recording["on"] and self.index == 0:
            _history_report()
        torch.cuda.synchronize()
        # after the arming history: each measured call records its own, reported below
        # when the call raised the peak (a warm staged 8,192-token profile step peaked up
        # to 0.82 GiB above in place's, and not in layers 0-1: bench/results/wide-steps.md)
        own = not _recording["on"] and _history(True)
        alloc, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        # non-torch memory: what the device has in use beyond torch's reserved pool
        free0, total = torch.cuda.mem_get_info()
        other0 = total - free0 - torch.cuda.memory_reserved()
        out = _orig_forward(self, x, topk_weights, topk_ids, *args, **kwargs)
        torch.cuda.synchronize()
        free1, _ = torch.cuda.mem_get_info()
        other1 = total - free1 - torch.cuda.memory_reserved()
        after = torch.cuda.max_memory_allocated()
        if self.index <= 1 or after > peak:
            _log.warning("EC_BENCH_MEM layer %d call %d: %d ids (wide %s): allocated %.3f GiB, "
                         "peak %.3f -> %.3f GiB (+%.3f above allocated); non-torch %.3f -> "
                         "%.3f GiB", self.index, n, topk_ids.numel(),
                         not self.cache.fits(topk_ids.numel()), alloc / _GIB, peak / _GIB,
                         after / _GIB, (after - alloc) / _GIB, other0 / _GIB, other1 / _GIB)
        if own:
            snap = _history(False)
            if after > peak and snap is not None:
                for line in big_allocations(snap, _BIG // 2, limit=8):
                    _log.warning("EC_BENCH_MEM layer %d call %d made: %s", self.index, n, line)
        return out

    def _history(on: bool, entries: int = 50000):
        """Start the allocator's history (True), or stop it and return its snapshot."""
        import torch

        try:
            if on:
                torch.cuda.memory._record_memory_history(max_entries=entries, stacks="python")
                return True
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            return snap
        except Exception as exc:  # a bench probe never stops the server
            _log.warning("EC_BENCH_MEM: no allocation history (%s)", exc)
            return None

    def _checked(self, path, stock, x, topk_ids, pad, run):
        # the ``stock`` handed to the check serves only its reference call (the path's own
        # call goes through ``run``'s closure): measured here, apart from the path (a layer
        # checks a few times at most, so every check is measured)
        if not _measuring():
            return _orig_checked(self, path, stock, x, topk_ids, pad, run)

        def reference(*a, **k):
            import torch

            torch.cuda.synchronize()
            alloc, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
            out = stock(*a, **k)
            torch.cuda.synchronize()
            after = torch.cuda.max_memory_allocated()
            if after > peak:
                _log.warning("EC_BENCH_MEM layer %d %s path, the check's reference call: %d "
                             "ids: allocated %.3f GiB, peak %.3f -> %.3f GiB (+%.3f above "
                             "allocated)", self.index, path, topk_ids.numel(), alloc / _GIB,
                             peak / _GIB, after / _GIB, (after - alloc) / _GIB)
            return out

        return _orig_checked(self, path, reference, x, topk_ids, pad, run)

    _rt.ArmedLayer.forward_modular = _forward
    _rt.ArmedLayer._checked_call = _checked

    # Who raised the peak before the first MoE call (a cold in-place start was 0.52 GiB
    # above allocated already at layer 0's first call of the profile step, staged not;
    # bench/results/memory.md):
    # the allocator's history is recorded from the end of arming to layer 0's first call,
    # and its big allocations are logged with the Python frames that made them.
    from expertcache_cli.plugin import session as _session

    _orig_arm = _session.arm_model
    _BIG = 64 * 2**20

    def _arm(*a, **k):
        out = _orig_arm(*a, **k)
        _recording["on"] = bool(_history(True, entries=200000))
        return out

    def _history_report() -> None:
        _recording["on"] = False
        snap = _history(False)
        for line in big_allocations(snap, _BIG) if snap is not None else ():
            _log.warning("EC_BENCH_MEM history: %s", line)

    _session.arm_model = _arm


def big_allocations(snapshot: dict, min_bytes: int, limit: int = 16) -> list[str]:
    """One line per allocation of at least ``min_bytes`` in a `torch.cuda.memory._snapshot()`
    history (device 0): its size, whether it was freed before the snapshot, and the
    innermost Python frames outside torch that made it (bench only: EC_BENCH_MEM)."""
    trace = (snapshot.get("device_traces") or [[]])[0]
    lines: list[str] = []
    for i, ev in enumerate(trace):
        if ev.get("action") != "alloc" or ev.get("size", 0) < min_bytes:
            continue
        addr = ev.get("addr")
        freed_later = any(e.get("addr") == addr and e.get("action") in
                          ("free_requested", "free_completed") for e in trace[i + 1:])
        frames = ev.get("frames") or []
        ours = [f for f in frames if "/torch/" not in f.get("filename", "")] or frames
        where = " <- ".join(f"{Path(f.get('filename', '?')).name}:{f.get('line', 0)} "
                            f"{f.get('name', '?')}" for f in ours[:5])
        lines.append(f"{ev['size'] / 2**20:.0f} MiB {'freed' if freed_later else 'held'} "
                     f"at {where or '(no frames)'}")
        if len(lines) >= limit:
            break
    return lines
