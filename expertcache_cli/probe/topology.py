"""Where the GPU sits: its PCI address, the link the system reports, and pinning this
process to the CPUs next to it (so pinned buffers land in the GPU's memory node).

Reads sysfs only; the tests give it a fake tree."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ..errors import DeviceUnavailable


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
