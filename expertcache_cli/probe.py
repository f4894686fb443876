"""Measure the host link the ways the cache uses it, and say what that means for a model.

Whether an expert cache pays depends first on the link between host memory and the GPU:
on PCIe the offloaded model is link-bound and a cache wins back most of the gap; on a
coherent C2C link the gap is small. This module measures, on one CUDA device:

* copy-engine transfers from pinned memory, host->device and device->host, 1 MiB..1 GiB;
* host->device from pageable memory (what an unpinned offload would get);
* the SM zero-copy read of mapped pinned memory: a device kernel reading host memory in
  place through unified virtual addressing, the path the cache's gather uses;
* the project's own gather kernel (`SlotCache`: manager + gather) at the expert slab
  size of a model, installing 1, 8 and 32 experts a step;
* the latency of one small (4 KiB) transfer, on the device and as the host sees it;
* device-memory (HBM) copy bandwidth, for the fully resident comparison.

Every figure is timed with CUDA events after a warm-up, as the median of repeats. The
process is pinned to the CPUs of the GPU's NUMA node first (where the system says which
that is), so that pinned buffers are allocated on the node next to the GPU.

torch is imported inside functions only: `expertcache --help` and the CPU tests must not
need it, and a machine without CUDA gets one clear line (`DeviceUnavailable`).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import DeviceUnavailable, UserError

MiB = 1 << 20
DEFAULT_SIZES_MIB = (1, 4, 16, 64, 256, 1024)
PAGEABLE_SIZES_MIB = (64, 256)
ZERO_COPY_MIB = 256
GATHER_COUNTS = (1, 8, 32)
SMALL_BYTES = 4096


@dataclass
class Rate:
    """One measured path at one size: the median time of a transfer and its rate."""

    path: str
    nbytes: int
    seconds: float
    gbps: float  # decimal GB/s = nbytes / seconds / 1e9
    samples: int
    spread: float  # (max - min) / median of the per-sample rates
    note: str = ""


@dataclass
class LinkReport:
    """Everything probe-link measured and concluded; ``to_json`` is the `--json` output."""

    device_index: int
    device_name: str
    pci_bus_id: str
    pcie_link: str  # what the system reports, e.g. "32.0 GT/s PCIe x16" ("" if unknown)
    numa: str  # where the process was pinned, in words
    numa_node: int
    cpus: list[int] = field(default_factory=list)  # the CPUs we pinned to ([] = not pinned)
    rates: list[Rate] = field(default_factory=list)
    gather: list[Rate] = field(default_factory=list)
    gather_impl: str = ""
    latency_us: dict[str, float] = field(default_factory=dict)
    hbm_copy_gbps: float = 0.0  # one-way device-to-device copy rate
    hbm_traffic_gbps: float = 0.0  # read + write traffic of that copy
    link_class: str = ""
    model: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    def rate(self, path: str, nbytes: int | None = None) -> Rate | None:
        """The measurement of ``path`` (at ``nbytes``, else the largest size measured)."""
        rows = [r for r in self.rates + self.gather if r.path == path]
        if nbytes is not None:
            rows = [r for r in rows if r.nbytes == nbytes]
        return max(rows, key=lambda r: r.nbytes) if rows else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- environment


def require_cuda(device: int):
    """torch, with device ``device`` usable; otherwise DeviceUnavailable with the reason."""
    try:
        import torch
    except ImportError:
        raise DeviceUnavailable(
            "probe-link needs a CUDA device: torch is not installed (pip install torch)"
        ) from None
    if not torch.cuda.is_available():
        raise DeviceUnavailable(
            "probe-link needs a CUDA device: none is visible (torch.cuda.is_available() is False)"
        )
    n = torch.cuda.device_count()
    if not 0 <= device < n:
        raise DeviceUnavailable(f"--device {device}: this machine has {n} CUDA device(s)")
    return torch


def pci_bus_id(torch, device: int) -> str:
    """The GPU's PCI address as sysfs spells it (``0000:1b:00.0``), or "" if unknown."""
    p = torch.cuda.get_device_properties(device)
    try:
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except AttributeError:
        return ""


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.replace("\n", ",").split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            cpus.extend(range(int(a), int(b) + 1))
        else:
            cpus.append(int(part))
    return cpus


def pcie_link(bdf: str, sysfs: Path = Path("/sys/bus/pci/devices")) -> str:
    """The negotiated PCIe link of the device as the kernel reports it, or ""."""
    if not bdf:
        return ""
    d = sysfs / bdf
    speed, width = _read(d / "current_link_speed"), _read(d / "current_link_width")
    if not speed:
        return ""
    mx_s, mx_w = _read(d / "max_link_speed"), _read(d / "max_link_width")
    text = f"{speed} x{width}" if width else speed
    if mx_s and (mx_s != speed or mx_w != width):
        text += f" (max {mx_s} x{mx_w})"
    return text


def pin_near_gpu(
    bdf: str, sysfs: Path = Path("/sys/bus/pci/devices")
) -> tuple[int, str, list[int]]:
    """Pin this process to the CPUs next to the GPU; return (NUMA node, what was done, CPUs).

    Pinned host buffers allocated afterwards are first touched from those CPUs, so they
    land in the GPU's local memory node. Where the system does not say (no sysfs, node -1,
    or the CPUs are outside our allowed set) nothing is changed and the text says why.
    """
    if not bdf:
        return -1, "not pinned: the GPU's PCI address is unknown", []
    node_txt = _read(sysfs / bdf / "numa_node")
    node = int(node_txt) if node_txt.lstrip("-").isdigit() else -1
    local = parse_cpulist(_read(sysfs / bdf / "local_cpulist"))
    if node < 0 and not local:
        return -1, "not pinned: the system reports no NUMA node for the GPU (single node?)", []
    where = f"NUMA node {node}" if node >= 0 else "the GPU's local CPUs"
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return node, f"NUMA node {node}; not pinned: CPU affinity unsupported here", []
    cpus = sorted(set(local) & allowed) if local else []
    if not cpus:
        return node, f"NUMA node {node}; not pinned: none of its CPUs are available to us", []
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        return node, f"NUMA node {node}; not pinned: {exc.strerror}", []
    text = f"pinned to {where}: {len(cpus)} CPUs {_compress(cpus)}"
    if node < 0:
        text += " (the system reports no NUMA node: one node)"
    return node, text, cpus


def _compress(cpus: Sequence[int]) -> str:
    """[0,1,2,3,8] -> "0-3,8"."""
    out, start, prev = [], None, None
    for c in list(cpus) + [None]:
        if start is None:
            start = prev = c
        elif c is not None and c == prev + 1:
            prev = c
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = c
    return ",".join(out)


# --------------------------------------------------------------------------- timing


def _time_per_call(torch, fn: Callable[[], None], iters: int, repeats: int, warmup: int,
                   stream, on_warm: Callable[[], None] | None = None) -> list[float]:
    """Seconds per call of ``fn``: ``repeats`` samples of ``iters`` back-to-back calls,
    each bracketed by CUDA events on ``stream`` (the stream the calls enqueue on).
    ``on_warm`` runs once after the warm-up, before the first timed call."""
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        stream.synchronize()
        if on_warm is not None:
            on_warm()
        samples = []
        for _ in range(repeats):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record(stream)
            for _ in range(iters):
                fn()
            b.record(stream)
            b.synchronize()
            samples.append(a.elapsed_time(b) / 1e3 / iters)
    return samples


def _rate(path: str, nbytes: int, samples: list[float], note: str = "") -> Rate:
    med = statistics.median(samples)
    rates = [nbytes / s for s in samples if s > 0]
    spread = (max(rates) - min(rates)) / (nbytes / med) if rates and med > 0 else 0.0
    return Rate(path, nbytes, med, nbytes / med / 1e9 if med > 0 else 0.0, len(samples),
                spread, note)


def _iters_for(nbytes: int, target: int = 128 * MiB) -> int:
    """Back-to-back calls per sample so each sample moves ~128 MiB (amortises event cost)."""
    return max(1, min(256, target // max(1, nbytes)))


class _CudaView:
    """A ``__cuda_array_interface__`` over pinned host memory: with unified virtual
    addressing the host address is valid on the device, so torch kernels given this view
    read host memory in place (what vLLM's offloader and our gather do)."""

    def __init__(self, ptr: int, nbytes: int, typestr: str = "<i4", itemsize: int = 4):
        self.__cuda_array_interface__ = {
            "shape": (nbytes // itemsize,),
            "typestr": typestr,
            "data": (ptr, False),
            "version": 2,
        }


def device_view(torch, host, device: int):
    """A CUDA int32 tensor aliasing the pinned host tensor ``host`` (no copy)."""
    view = torch.as_tensor(_CudaView(host.data_ptr(), host.numel() * host.element_size()),
                           device=f"cuda:{device}")
    if view.data_ptr() != host.data_ptr():
        raise RuntimeError("torch copied the host buffer instead of viewing it in place")
    return view


# --------------------------------------------------------------------------- measurements


def measure_copies(torch, device: int, sizes_mib: Sequence[int], repeats: int, warmup: int,
                   pageable_mib: Sequence[int] = PAGEABLE_SIZES_MIB) -> list[Rate]:
    """Copy-engine rates: pinned H2D and D2H at each size, pageable H2D at a few."""
    dev = torch.device("cuda", device)
    stream = torch.cuda.Stream(dev)
    biggest = max(list(sizes_mib) + list(pageable_mib)) * MiB
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
    pageable = torch.empty(max(pageable_mib) * MiB, dtype=torch.uint8)
    pageable.fill_(1)
    for mib in pageable_mib:
        n = mib * MiB
        p, d = pageable[:n], dbuf[:n]
        out.append(_rate("h2d_pageable", n, _time_per_call(
            torch, lambda p=p, d=d: d.copy_(p, non_blocking=True), 1, max(3, repeats // 2),
            1, stream), note="staged through a driver buffer; host-synchronous"))
    del host, dbuf, pageable
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
        from .slotcache import SlotCache

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
    impl = "FALLBACK: torch index_select over a UVA view (not the project's kernel)"
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


# --------------------------------------------------------------------------- conclusions


def classify_link(h2d_gbps: float, integrated: bool = False) -> str:
    """Name the host link from the large-transfer pinned host->device rate.

    Practical x16 rates: Gen3 ~12-13, Gen4 ~25-27, Gen5 ~50-57 GB/s; NVLink-C2C (Grace)
    moves hundreds of GB/s. A link below its class usually means fewer lanes or a switch.
    """
    if integrated:
        return "integrated GPU: host memory is device memory"
    if h2d_gbps >= 120:
        return "coherent C2C link (Grace-class NVLink-C2C)"
    if h2d_gbps >= 70:
        return "faster than PCIe Gen5 x16 (PCIe Gen6 x16 or a coherent link)"
    if h2d_gbps >= 36:
        return "PCIe Gen5 x16"
    if h2d_gbps >= 18:
        return "PCIe Gen4 x16 (or Gen5 x8)"
    if h2d_gbps >= 9:
        return "PCIe Gen3 x16 (or Gen4 x8)"
    return "narrower than PCIe Gen3 x16 (x8/x4, or a shared switch)"


def decode_ceilings(model, gather_gbps: float, hbm_gbps: float) -> dict[str, Any]:
    """Single-stream decode ceilings from bandwidth alone (weights only, no compute, no KV).

    Resident: every weight byte a token touches (non-expert + top_k experts in each MoE
    layer) read from HBM. Offloaded, no cache: the experts' bytes cross the link at the
    measured gather rate. With a cache hitting a fraction h, (1 - h) of them do. These are
    upper bounds to compare paths with, not predictions of vLLM's tokens per second.
    """
    host = model.top_k * model.bytes_per_slot
    resident_bytes = model.non_expert_bytes + host
    t_res = resident_bytes / (hbm_gbps * 1e9)
    t_non = model.non_expert_bytes / (hbm_gbps * 1e9)

    def tok_s(hit: float) -> float:
        t = t_non + host * hit / (hbm_gbps * 1e9) + host * (1 - hit) / (gather_gbps * 1e9)
        return 1.0 / t

    off = tok_s(0.0)
    res = 1.0 / t_res
    return {
        "host_bytes_per_token": host,
        "resident_bytes_per_token": resident_bytes,
        "resident_tok_s": res,
        "offload_tok_s": off,
        "offload_penalty": res / off,
        "cache_tok_s": {f"{h:.2f}": tok_s(h) for h in (0.5, 0.8, 0.9, 0.95, 0.99)},
        "gather_gbps": gather_gbps,
        "hbm_gbps": hbm_gbps,
        "basis": "bandwidth ceilings, batch 1, weights only: upper bounds, not vLLM tok/s",
    }


def probe_link(
    device: int = 0,
    model: str | None = None,
    quant: str | None = None,
    sizes_mib: Sequence[int] = DEFAULT_SIZES_MIB,
    repeats: int = 7,
    warmup: int = 2,
    pin: bool = True,
    zero_copy_mib: int = ZERO_COPY_MIB,
    pageable_mib: Sequence[int] = PAGEABLE_SIZES_MIB,
) -> LinkReport:
    """Run every measurement on ``device`` and conclude (see the module docstring).

    A measurement that fails is recorded in ``errors`` and the rest still run: a probe
    that dies on its sixth figure tells the user nothing about the first five.
    """
    from .model_size import load_model

    if repeats < 1 or warmup < 0:
        raise UserError("--repeats must be >= 1")
    if not sizes_mib or min(sizes_mib) < 1:
        raise UserError("--sizes must be positive MiB counts")
    m = load_model(model, quant)  # before the device: a bad --model is a user error
    torch = require_cuda(device)
    bdf = pci_bus_id(torch, device)
    node, numa, cpus = pin_near_gpu(bdf) if pin else (-1, "not pinned (--no-pin)", [])
    props = torch.cuda.get_device_properties(device)
    torch.cuda.set_device(device)
    rep = LinkReport(
        device_index=device,
        device_name=props.name,
        pci_bus_id=bdf,
        pcie_link=pcie_link(bdf),
        numa=numa,
        numa_node=node,
        cpus=cpus,
        settings={"sizes_mib": list(sizes_mib), "repeats": repeats, "warmup": warmup,
                  "zero_copy_mib": zero_copy_mib, "pageable_mib": list(pageable_mib),
                  "torch": torch.__version__, "cuda": torch.version.cuda},
    )

    def attempt(what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # record and go on: see the docstring
            rep.errors.append(f"{what}: {type(exc).__name__}: {exc}")
            return None

    rates = attempt("copies", lambda: measure_copies(torch, device, sizes_mib, repeats, warmup,
                                                     pageable_mib))
    rep.rates.extend(rates or [])
    zc = attempt("zero-copy read", lambda: measure_zero_copy(torch, device, zero_copy_mib,
                                                             repeats, warmup))
    if zc:
        rep.rates.append(zc)
    hbm = attempt("device copy", lambda: measure_hbm(torch, device, 1024, repeats, warmup))
    if hbm:
        rep.rates.append(hbm)
        rep.hbm_copy_gbps = hbm.gbps
        rep.hbm_traffic_gbps = 2 * hbm.gbps
    lat = attempt("latency", lambda: measure_latency(torch, device))
    rep.latency_us = lat or {}
    tensors = [(t.name, t.nbytes) for t in m.expert_tensors]
    g = attempt("gather", lambda: measure_gather(torch, device, tensors, m.num_experts,
                                                 repeats, warmup))
    if g:
        rep.gather, rep.gather_impl, errs = g
        rep.errors.extend(errs)

    big = [r for r in rep.rates if r.path == "h2d_pinned" and r.nbytes >= 64 * MiB]
    h2d = max((r.gbps for r in big), default=0.0)
    if h2d:
        rep.link_class = classify_link(h2d, bool(getattr(props, "is_integrated", False)))
    rep.model = {
        "name": m.name,
        "quant": m.quant,
        "num_experts": m.num_experts,
        "top_k": m.top_k,
        "num_moe_layers": m.num_moe_layers,
        "bytes_per_expert": m.bytes_per_expert,
        "bytes_per_slot": m.bytes_per_slot,
        "non_expert_bytes": m.non_expert_bytes,
    }
    if rep.gather and rep.hbm_traffic_gbps:
        best = min(rep.gather, key=lambda r: abs(int(r.path.split("_")[1]) - m.top_k))
        rep.decode = decode_ceilings(m, best.gbps, rep.hbm_traffic_gbps)
        rep.decode["gather_row"] = best.path
    return rep


def summary_lines(rep: LinkReport) -> list[str]:
    """The verdict in a few sentences (used by the CLI and the bench log)."""
    lines = []
    h2d = rep.rate("h2d_pinned")
    if rep.link_class and h2d:
        lines.append(f"link: {rep.link_class} (pinned host->device {h2d.gbps:.1f} GB/s"
                     + (f"; system reports {rep.pcie_link}" if rep.pcie_link else "") + ")")
    d = rep.decode
    if d:
        m = rep.model
        lines.append(
            f"{m['name']} decode ceilings (batch 1, weights only): fully resident "
            f"{d['resident_tok_s']:.0f} tok/s ({d['resident_bytes_per_token'] / 1e9:.2f} GB a "
            f"token over HBM at {d['hbm_gbps']:.0f} GB/s, read+write copy traffic); experts "
            f"offloaded, no cache {d['offload_tok_s']:.1f} tok/s "
            f"({d['host_bytes_per_token'] / 1e9:.2f} GB a token over the link at "
            f"{d['gather_gbps']:.1f} GB/s)"
        )
        c = d["cache_tok_s"]
        lines.append(
            f"offload penalty {d['offload_penalty']:.1f}x: a cache hitting 80% would reach "
            f"{c['0.80']:.0f} tok/s, 90% {c['0.90']:.0f}, 95% {c['0.95']:.0f}, 99% {c['0.99']:.0f}"
        )
        if d["offload_penalty"] < 1.3:
            lines.append("offload is already cheap on this link: a cache has little to win")
        elif d["offload_penalty"] > 3:
            lines.append("offload is expensive on this link: a cache has much to win back")
    if rep.errors:
        lines.append(f"{len(rep.errors)} measurement(s) failed: " + "; ".join(rep.errors))
    return lines


def fmt_bytes(n: int) -> str:
    """1048576 -> "1 MiB"; 4732928 -> "4.51 MiB"."""
    if n >= MiB:
        v = n / MiB
        return f"{v:.0f} MiB" if v == int(v) else f"{v:.2f} MiB"
    if n >= 1024:
        return f"{n / 1024:.0f} KiB"
    return f"{n} B"
