"""The measurements probe-link makes, as a registry: each has a key (``--only``), a title,
the labels of the rows it adds, and one ``run`` that measures and records into the report.

Like nvbandwidth's testcases, a measurement is one class: the orchestrator (`probe_link`)
loops over the registry, so a new figure is one class here and nothing else changes, and a
caller that needs one figure (``plan`` needs the gather) runs only that one. The timed
bodies are plain functions (``measure_*``) that take torch and return `Rate` records.
"""

from __future__ import annotations

import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..sizing.formats import gather_slabs
from .report import FALLBACK, LinkReport, MiB, Rate
from .timing import _iters_for, _rate, _time_per_call, device_view

DEFAULT_SIZES_MIB = (1, 4, 16, 64, 256, 1024)
PAGEABLE_SIZES_MIB = (64, 256)
ZERO_COPY_MIB = 256
HBM_COPY_MIB = 1024
GATHER_COUNTS = (1, 8, 32)
SMALL_BYTES = 4096


def measure_pinned_copies(torch, device: int, sizes_mib: Sequence[int], repeats: int,
                          warmup: int) -> list[Rate]:
    """Copy-engine rates from and to pinned host memory, host->device and device->host."""
    dev = torch.device("cuda", device)
    stream = torch.cuda.Stream(dev)
    biggest = max(sizes_mib) * MiB
    host = torch.empty(biggest, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dbuf = torch.empty(biggest, dtype=torch.uint8, device=dev)
    out: list[Rate] = []
    for mib in sizes_mib:
        n = mib * MiB
        h, d = host[:n], dbuf[:n]
        it = _iters_for(n)
        out.append(_rate("h2d_pinned", n, _time_per_call(
            torch, lambda h=h, d=d: d.copy_(h, non_blocking=True), it, repeats, warmup, stream)))
        out.append(_rate("d2h_pinned", n, _time_per_call(
            torch, lambda h=h, d=d: h.copy_(d, non_blocking=True), it, repeats, warmup, stream)))
    del host, dbuf
    return out


def measure_pageable(torch, device: int, sizes_mib: Sequence[int], repeats: int) -> list[Rate]:
    """Host->device from pageable memory: what an offload that never pinned would get."""
    dev = torch.device("cuda", device)
    stream = torch.cuda.Stream(dev)
    pageable = torch.empty(max(sizes_mib) * MiB, dtype=torch.uint8)
    pageable.fill_(1)
    dbuf = torch.empty(max(sizes_mib) * MiB, dtype=torch.uint8, device=dev)
    out: list[Rate] = []
    for mib in sizes_mib:
        n = mib * MiB
        p, d = pageable[:n], dbuf[:n]
        out.append(_rate("h2d_pageable", n, _time_per_call(
            torch, lambda p=p, d=d: d.copy_(p, non_blocking=True), 1, max(3, repeats // 2),
            1, stream), note="staged through a driver buffer; host-synchronous"))
    del pageable, dbuf
    return out


def measure_zero_copy(torch, device: int, mib: int, repeats: int, warmup: int) -> Rate:
    """SM read of mapped pinned memory: an elementwise kernel over a device view of host
    memory (16-byte vector loads), writing the result to device memory."""
    dev = torch.device("cuda", device)
    stream = torch.cuda.Stream(dev)
    n = mib * MiB
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host.fill_(3)
    view = device_view(torch, host, device)
    dst = torch.empty_like(view)
    samples = _time_per_call(torch, lambda: torch.bitwise_not(view, out=dst), 1, repeats,
                             warmup, stream)
    ok = bool((dst[:16] == ~torch.full((16,), 0x03030303, dtype=torch.int32, device=dev))
              .all().item())
    r = _rate("zero_copy_read", n, samples, note="torch elementwise kernel over a UVA view")
    if not ok:
        r.note += "; WRONG DATA READ"
    return r


def measure_hbm(torch, device: int, mib: int, repeats: int, warmup: int) -> Rate:
    """Device-to-device copy: the resident case's yardstick."""
    dev = torch.device("cuda", device)
    stream = torch.cuda.Stream(dev)
    n = mib * MiB
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty(n, dtype=torch.uint8, device=dev)
    samples = _time_per_call(torch, lambda: b.copy_(a, non_blocking=True), 4, repeats, warmup,
                             stream)
    return _rate("d2d_copy", n, samples, note="one way; traffic is twice this")


def measure_latency(torch, device: int, repeats: int = 101) -> dict[str, float]:
    """One 4 KiB pinned host->device copy: device time (back-to-back) and host round trip
    (enqueue + synchronise, what a host-synchronous fetch would pay)."""
    dev = torch.device("cuda", device)
    stream = torch.cuda.Stream(dev)
    h = torch.empty(SMALL_BYTES, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(SMALL_BYTES, dtype=torch.uint8, device=dev)
    dev_t = _time_per_call(torch, lambda: d.copy_(h, non_blocking=True), 200, 5, 10, stream)
    rt = []
    with torch.cuda.stream(stream):
        for _ in range(10):
            d.copy_(h, non_blocking=True)
        stream.synchronize()
        for _ in range(repeats):
            t0 = time.perf_counter()
            d.copy_(h, non_blocking=True)
            stream.synchronize()
            rt.append(time.perf_counter() - t0)
    return {
        "h2d_4KiB_device_us": statistics.median(dev_t) * 1e6,
        "h2d_4KiB_roundtrip_us": statistics.median(rt) * 1e6,
    }


def gather_counts(num_experts: int) -> tuple[int, int, list[int]]:
    """(experts in the probe layer, slots, experts installed per step) for a model.

    The layer holds at most 64 experts (the rate does not depend on E, and pinned memory
    is not free); slots = half of them up to 32, and installs per step are 1, 8 and 32
    capped at the slots. With E >= 2 x slots, rotating through the ids makes every
    routed expert a miss under LRU, so every step moves exactly n slabs.
    """
    e = min(num_experts, 64)
    s = max(1, min(32, e // 2))
    ns = sorted({min(n, s) for n in GATHER_COUNTS})
    return e, s, ns


def measure_gather(torch, device: int, tensors: Sequence[tuple[str, int]], num_experts: int,
                   repeats: int, warmup: int) -> tuple[list[Rate], str, list[str]]:
    """The project's gather at the model's per-expert slabs: rates for 1/8/32 misses a step.

    Sources are pinned host tensors ``[E, slab]`` per per-expert tensor (as vLLM's
    offloader leaves them). Each timed step is a full `SlotCache.step` (manager + gather),
    so the rate is what the cache achieves per step. The installs counter is checked so a
    step that hit instead of missing cannot inflate the figure. If the cache cannot be
    built (e.g. no kernels), an index_select over a UVA view stands in, labelled as such.
    """
    dev = torch.device("cuda", device)
    stream = torch.cuda.Stream(dev)
    e, s, ns = gather_counts(num_experts)
    errors: list[str] = []
    srcs = {}
    for name, nbytes in tensors:
        t = torch.empty((e, nbytes), dtype=torch.uint8, pin_memory=True)
        t.view(-1)[: min(t.numel(), 1 << 20)].fill_(7)
        srcs[name] = t
    per_expert = sum(n for _, n in tensors)
    out: list[Rate] = []
    try:
        from ..device.slotcache import SlotCache

        specs = {k: ((v.shape[1],), torch.uint8) for k, v in srcs.items()}
        impl = ""

        def make_step(cache, n: int, steps: int):
            ids = torch.tensor([[(t * n + j) % e for j in range(n)] for t in range(steps)],
                               dtype=torch.int32, device=dev)
            state = {"t": 0}

            def step() -> None:
                cache.step(ids[state["t"] % steps], srcs)
                state["t"] += 1

            return step

        for n in ns:
            # a fresh cache per count: experts left resident by the previous count would
            # turn the first steps into hits
            with torch.cuda.device(dev):
                cache = SlotCache(e, s, specs, policy="lru", device=dev, name="probe")
            impl = ("expertcache SlotCache.step (manager + gather, "
                    f"{cache.backend.split(' (')[0]})")
            it = _iters_for(n * per_expert, 256 * MiB)
            steps = e * max(2, -(-it // e))  # a whole number of turns through the ids
            fn = make_step(cache, n, steps)
            before: list[int] = []
            samples = _time_per_call(torch, fn, it, repeats, warmup, stream,
                                     on_warm=lambda c=cache, b=before: b.extend(c.stats.tolist()))
            after = cache.stats.tolist()
            calls = it * repeats  # the timed calls only: installs are counted after warm-up
            installed = after[1] - before[1]
            r = _rate(f"gather_{n}", n * per_expert, samples,
                      note=f"{n} expert(s) x {per_expert:,} B a step")
            if installed != calls * n:
                r.note += f"; INSTALLS {installed} != {calls * n}: not every id missed"
                errors.append(f"gather_{n}: {installed} installs for {calls * n} misses")
            out.append(r)
        return out, impl, errors
    except Exception as exc:  # no kernels here: measure a stand-in, and say so loudly
        errors.append(f"SlotCache unavailable ({type(exc).__name__}: {exc}); "
                      "gather measured with a torch index_select fallback")
    impl = f"{FALLBACK}: torch index_select over a UVA view (not the project's kernel)"
    views = {k: device_view(torch, v, device).view(e, -1) for k, v in srcs.items()}
    for n in ns:
        dsts = {k: torch.empty((n, v.shape[1]), dtype=v.dtype, device=dev)
                for k, v in views.items()}
        ids = torch.arange(n, dtype=torch.int64, device=dev)

        def fn(ids=ids, dsts=dsts) -> None:
            for k, v in views.items():
                torch.index_select(v, 0, ids, out=dsts[k])

        it = _iters_for(n * per_expert, 256 * MiB)
        out.append(_rate(f"gather_{n}", n * per_expert,
                         _time_per_call(torch, fn, it, repeats, warmup, stream),
                         note=f"fallback; {n} expert(s) x {per_expert:,} B"))
    return out, impl, errors


def stage_setup(torch, dev, tensors: Sequence[tuple[str, int]], num_experts: int,
                copier: Any = None) -> tuple[Any, Any, int]:
    """``(stage, check, hits)`` for `measure_stage`: a scratch of the layer's experts, slots
    holding ``hits`` experts of random bytes and a stage routing exactly those; ``check()``
    raises unless the last stage copied every hit's bytes from its slot and fetched nothing
    from host. ``copier``: the scratch's (default the CUDA kernels; the CPU test passes
    `scratch.torch_copiers`)."""
    from ..device.scratch import Scratch

    e, s, _ = gather_counts(num_experts)
    specs = {name: ((nbytes,), torch.uint8) for name, nbytes in tensors}
    scratch = Scratch(e, specs, dev, copier=copier)
    g = torch.Generator(device=dev).manual_seed(0)
    slots = {k: torch.randint(0, 256, (s, n), dtype=torch.uint8, device=dev, generator=g)
             for k, n in tensors}
    pinned = torch.device(dev).type == "cuda"
    sources = {k: torch.zeros((e, n), dtype=torch.uint8, pin_memory=pinned)
               for k, n in tensors}
    table = torch.full((e,), -1, dtype=torch.int32, device=dev)
    table[:s] = torch.arange(s, dtype=torch.int32, device=dev)
    ids = torch.arange(s, dtype=torch.int32, device=dev)  # every slot's expert: all hits

    def stage() -> None:
        scratch.stage(ids, table, slots, sources)

    def check() -> None:
        if scratch.counts.tolist() != [s, 0] or not all(
                torch.equal(scratch.buffers[k][:s], slots[k]) for k in slots):
            raise RuntimeError(f"the stage did not copy its {s} hits from the slots "
                               f"(counts {scratch.counts.tolist()})")

    return stage, check, s


def measure_stage(torch, device: int, tensors: Sequence[tuple[str, int]], num_experts: int,
                  repeats: int, warmup: int) -> Rate:
    """A staged wide step's hits at the model's per-expert slabs: the layer's slots hold H
    experts and a stage routes exactly those, so each is copied from its slot into the
    scratch by the cache's gather kernel over device memory and nothing crosses the link.
    `plan` prices a staged step's hits at this rate (`planner.read_hit_copy`): with a real
    model's routing a wide decode step is mostly hits, and their copies are most of it.
    The scratch's counts and bytes are checked after the timed stages, so a stage that
    fetched from host (or copied nothing) cannot pass for the device copy."""
    dev = torch.device("cuda", device)
    stream = torch.cuda.Stream(dev)
    with torch.cuda.device(dev):
        stage, check, hits = stage_setup(torch, dev, tensors, num_experts)
    per_expert = sum(n for _, n in tensors)
    it = _iters_for(hits * per_expert, 256 * MiB)
    samples = _time_per_call(torch, stage, it, repeats, warmup, stream)
    torch.cuda.synchronize(dev)
    check()
    return _rate("stage_hits", hits * per_expert, samples,
                 note=f"{hits} hit(s) x {per_expert:,} B a stage, slots -> scratch")


STEP_LAYERS = 48  # layers in the timed graph: a decode graph of a deep MoE model
STEP_SLAB = 256  # bytes per expert per tensor: a step that hits copies none of them


def evict_bytes(torch, device: int) -> int:
    """What to write before each layer to evict the cache's state from L2: twice the L2
    (a served decode step's other layers write far more between two calls of one layer)."""
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
    return 2 * l2 if l2 > 0 else 128 * MiB


def measure_step(torch, device: int, n_tensors: int, num_experts: int, top_k: int,
                 repeats: int, cold: bool = False) -> float:
    """Microseconds one MoE layer's cache step adds to a decode token when every routed
    expert is a hit: the manager (with the fused remap) and a gather that finds nothing
    to copy, for a CUDA graph of `STEP_LAYERS` such steps replayed back to back, as
    vLLM's decode graphs run them. `plan` adds it per MoE layer to the resident time: it
    is what a cache costs even when it never misses (resident time has no such step).

    The slabs are tiny (a no-miss step reads none of them); what the step's cost depends
    on is kept: the expert count, a top_k of routing ids, and the number of per-expert
    tensors the gather walks. Raises when the kernels are not available or a timed step
    installed an expert (it would not be the all-hit step).

    ``cold``: before each layer's step a kernel writes `evict_bytes` of other memory, as a
    served decode step's attention and other layers do, so the step finds its state out of
    L2 (served, the manager took 3.56 us a call against ~2.4 us warm:
    bench/results/all-hit.md); the same
    graph without the steps is timed too and taken off."""
    from ..device.slotcache import SlotCache

    dev = torch.device("cuda", device)
    e = num_experts
    slots = max(top_k, min(e // 2, 64))
    names = [f"t{i}" for i in range(n_tensors)]
    srcs = {n: torch.zeros((e, STEP_SLAB), dtype=torch.uint8, pin_memory=True) for n in names}
    specs = {n: ((STEP_SLAB,), torch.uint8) for n in names}
    with torch.cuda.device(dev):
        caches = [SlotCache(e, slots, specs, policy="lru", device=dev, name=f"step{i}")
                  for i in range(STEP_LAYERS)]
        ids = torch.arange(top_k, dtype=torch.int32, device=dev).reshape(1, top_k)
        # as served on vLLM's V1 runner: the manager reads the count of real rows (one)
        real = torch.ones(1, dtype=torch.int32, device=dev)
        for c in caches:
            c.step(ids, srcs)  # installs this step's experts: every later step hits
        torch.cuda.synchronize(dev)
        installs = sum(int(c.stats[1]) for c in caches)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        evict = torch.empty(evict_bytes(torch, dev) if cold else 0, dtype=torch.uint8,
                            device=dev)
        outs: list[Any] = []

        def timed(with_steps: bool) -> float:
            """Median seconds a replay: 50 back-to-back replays a sample, one warm-up."""
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
                for c in caches:
                    if cold:
                        evict.fill_(1)
                    if with_steps:
                        outs.append(c.step(ids, srcs, real_rows=real))
            samples = _time_per_call(torch, graph.replay, 50, max(3, repeats), 1, side)
            del graph
            return statistics.median(samples)

        seconds = timed(True) - (timed(False) if cold else 0.0)
        if sum(int(c.stats[1]) for c in caches) != installs:
            raise RuntimeError("a timed step installed an expert: not the all-hit step")
    return seconds * 1e6 / STEP_LAYERS


# --------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Settings:
    """What every measurement may read: the device, the sizes and the model whose expert
    slab the gather moves (a `model_size.ModelSize`)."""

    device: int
    sizes_mib: tuple[int, ...] = DEFAULT_SIZES_MIB
    repeats: int = 7
    warmup: int = 2
    zero_copy_mib: int = ZERO_COPY_MIB
    pageable_mib: tuple[int, ...] = PAGEABLE_SIZES_MIB
    model: Any = None


class Measurement(ABC):
    """One figure (or family of rows) probe-link measures."""

    key: ClassVar[str]  # the name --only takes
    title: ClassVar[str]  # what a failure is reported as
    about: ClassVar[str]  # one line for --list
    rows: ClassVar[dict[str, str]] = {}  # Rate.path -> the label the table shows

    def wanted(self, s: Settings) -> bool:
        """False when the settings ask for nothing of this measurement (an empty size list)."""
        return True

    @abstractmethod
    def run(self, torch, s: Settings, rep: LinkReport) -> None:
        """Measure on ``s.device`` and record into ``rep`` (rates, errors, fields)."""


MEASUREMENTS: dict[str, Measurement] = {}


def register(cls: type[Measurement]) -> type[Measurement]:
    if cls.key in MEASUREMENTS:
        raise ValueError(f"two probe measurements named {cls.key!r}")
    MEASUREMENTS[cls.key] = cls()
    return cls


@register
class PinnedCopies(Measurement):
    key = "pinned"
    about = "copy engine from/to pinned host memory, both directions, at --sizes"
    title = "pinned copies"
    rows = {"h2d_pinned": "host->device, pinned (copy engine)",
            "d2h_pinned": "device->host, pinned (copy engine)"}

    def wanted(self, s: Settings) -> bool:
        return bool(s.sizes_mib)

    def run(self, torch, s: Settings, rep: LinkReport) -> None:
        rep.rates.extend(measure_pinned_copies(torch, s.device, s.sizes_mib, s.repeats, s.warmup))


@register
class PageableCopies(Measurement):
    key = "pageable"
    about = "copy engine from pageable host memory (an offload that never pinned)"
    title = "pageable copies"
    rows = {"h2d_pageable": "host->device, pageable (copy engine)"}

    def wanted(self, s: Settings) -> bool:
        return bool(s.pageable_mib)

    def run(self, torch, s: Settings, rep: LinkReport) -> None:
        rep.rates.extend(measure_pageable(torch, s.device, s.pageable_mib, s.repeats))


@register
class ZeroCopyRead(Measurement):
    key = "zero-copy"
    about = "SM kernel reading mapped pinned memory in place (the gather's path)"
    title = "zero-copy read"
    rows = {"zero_copy_read": "SM zero-copy read of mapped pinned memory"}

    def run(self, torch, s: Settings, rep: LinkReport) -> None:
        rep.rates.append(measure_zero_copy(torch, s.device, s.zero_copy_mib, s.repeats,
                                           s.warmup))


@register
class DeviceCopy(Measurement):
    key = "hbm"
    about = "device-to-device copy: the resident model's yardstick"
    title = "device copy"
    rows = {"d2d_copy": "device->device copy (HBM, one way)"}

    def run(self, torch, s: Settings, rep: LinkReport) -> None:
        r = measure_hbm(torch, s.device, HBM_COPY_MIB, s.repeats, s.warmup)
        rep.rates.append(r)
        rep.hbm_copy_gbps = r.gbps
        rep.hbm_traffic_gbps = 2 * r.gbps


@register
class Latency(Measurement):
    key = "latency"
    about = "one 4 KiB host->device copy: device time and host round trip"
    title = "latency"

    def run(self, torch, s: Settings, rep: LinkReport) -> None:
        rep.latency_us = measure_latency(torch, s.device)


class ModelMeasurement(Measurement):
    """A figure of the cache's own kernels at a model's shape: wanted only with a model."""

    def wanted(self, s: Settings) -> bool:
        return s.model is not None


@register
class Gather(ModelMeasurement):
    key = "gather"
    about = "the cache's SlotCache.step at --model's expert slab, 1/8/32 misses a step"
    title = "gather"

    def run(self, torch, s: Settings, rep: LinkReport) -> None:
        m = s.model
        # the side row is read from device memory when served, from pinned host memory
        # here like the other slabs: its 16 bytes an expert do not move the rate
        tensors = gather_slabs(list(m.expert_tensors))
        rep.gather, rep.gather_impl, errs = measure_gather(torch, s.device, tensors,
                                                           m.num_experts, s.repeats, s.warmup)
        rep.errors.extend(errs)


@register
class Step(ModelMeasurement):
    key = "step"
    about = "the cache's per-layer step when every expert hits (what plan adds per layer)"
    title = "cache step"

    def run(self, torch, s: Settings, rep: LinkReport) -> None:
        m = s.model
        slabs = len(gather_slabs(list(m.expert_tensors)))
        args = (torch, s.device, slabs, m.num_experts, m.top_k, s.repeats)
        rep.step_us = measure_step(*args)
        rep.step_cold_us = measure_step(*args, cold=True)


@register
class Stage(ModelMeasurement):
    key = "stage"
    about = "a staged wide step's hits copied slots -> scratch at --model's expert slab"
    title = "staged hits"
    rows = {"stage_hits": "staged hits, slots -> scratch (device)"}

    def run(self, torch, s: Settings, rep: LinkReport) -> None:
        m = s.model
        r = measure_stage(torch, s.device, gather_slabs(list(m.expert_tensors)),
                          m.num_experts, s.repeats, s.warmup)
        rep.rates.append(r)
        rep.stage_gbps = r.gbps


def row_label(path: str) -> str:
    """The label a measured row is shown with (the path itself for rows nobody labelled)."""
    for m in MEASUREMENTS.values():
        if path in m.rows:
            return m.rows[path]
    return path


def select(only: Sequence[str] | None) -> list[Measurement]:
    """The measurements to run, in registry order; unknown keys raise ValueError naming the
    known ones (the CLI turns it into one line)."""
    if not only:
        return list(MEASUREMENTS.values())
    unknown = [k for k in only if k not in MEASUREMENTS]
    if unknown:
        raise ValueError(f"unknown measurement(s) {', '.join(unknown)}; "
                         f"known: {', '.join(MEASUREMENTS)}")
    return [m for k, m in MEASUREMENTS.items() if k in only]
