"""Measure the host link the ways the cache uses it, and say what that means for a model.

Whether an expert cache pays depends first on the link between host memory and the GPU:
on PCIe the offloaded model is link-bound and a cache wins back most of the gap; on a
coherent C2C link the gap is small. On one CUDA device this package measures
(`measurements.MEASUREMENTS`, each selectable with ``only``):

* ``pinned``: copy-engine transfers from and to pinned memory, 1 MiB..1 GiB;
* ``pageable``: host->device from pageable memory (what an unpinned offload would get);
* ``zero-copy``: the SM read of mapped pinned memory, a device kernel reading host memory in
  place through unified virtual addressing, the path the cache's gather uses;
* ``hbm``: device-memory copy bandwidth, for the fully resident comparison;
* ``latency``: one small (4 KiB) transfer, on the device and as the host sees it;
* ``gather``: the project's own gather kernel (`SlotCache`: manager + gather) at the expert
  slab size of a model, installing 1, 8 and 32 experts a step.

Every figure is timed with CUDA events after a warm-up, as the median of repeats
(`timing`). The process is pinned to the CPUs of the GPU's NUMA node first (`topology`),
so that pinned buffers are allocated on the node next to the GPU. `report` holds the
records and the conclusions.

torch is imported inside functions only: `expertcache --help` and the CPU tests must not
need it, and a machine without CUDA gets one clear line (`DeviceUnavailable`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import UserError
from .measurements import (
    DEFAULT_SIZES_MIB,
    MEASUREMENTS,
    PAGEABLE_SIZES_MIB,
    STEP_LAYERS,
    ZERO_COPY_MIB,
    Measurement,
    Settings,
    gather_counts,
    row_label,
    select,
)
from .report import (
    LinkReport,
    MiB,
    Rate,
    classify_link,
    conclude,
    decode_ceilings,
    fmt_bytes,
    gather_row,
    is_stand_in,
    summary_lines,
)
from .topology import (
    _compress,
    _read,
    parse_cpulist,
    pci_bus_id,
    pcie_link,
    pin_near_gpu,
    require_cuda,
)

__all__ = [
    "DEFAULT_SIZES_MIB", "MEASUREMENTS", "PAGEABLE_SIZES_MIB", "STEP_LAYERS", "ZERO_COPY_MIB",
    "LinkReport",
    "Measurement", "MiB", "Rate", "Settings", "classify_link", "conclude", "decode_ceilings",
    "fmt_bytes", "gather_counts", "gather_row", "is_stand_in", "parse_cpulist", "pci_bus_id",
    "pcie_link", "pin_near_gpu", "probe_link", "require_cuda", "row_label", "select",
    "summary_lines", "_compress", "_read",
]


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
    only: Sequence[str] | None = None,
) -> LinkReport:
    """Run the measurements (all, or those named in ``only``) on ``device`` and conclude.

    A measurement that fails is recorded in ``errors`` and the rest still run: a probe
    that dies on its sixth figure tells the user nothing about the first five.
    """
    from ..sizing.model_size import load_model

    if repeats < 1 or warmup < 0:
        raise UserError("--repeats must be >= 1")
    if min(sizes_mib, default=1) < 1 or min(pageable_mib, default=1) < 1:
        raise UserError("--sizes must be positive MiB counts")
    try:
        chosen = select(only)
    except ValueError as exc:
        raise UserError(f"--only: {exc}") from None
    m = load_model(model, quant)  # before the device: a bad --model is a user error
    settings = Settings(device=device, sizes_mib=tuple(sizes_mib), repeats=repeats,
                        warmup=warmup, zero_copy_mib=zero_copy_mib,
                        pageable_mib=tuple(pageable_mib), model=m)
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
                  "measurements": [x.key for x in chosen],
                  "torch": torch.__version__, "cuda": torch.version.cuda},
    )
    for meas in chosen:
        if not meas.wanted(settings):
            continue
        try:
            meas.run(torch, settings, rep)
        except Exception as exc:  # record and go on: see the docstring
            rep.errors.append(f"{meas.title}: {type(exc).__name__}: {exc}")
    conclude(rep, m, bool(getattr(props, "is_integrated", False)))
    return rep
