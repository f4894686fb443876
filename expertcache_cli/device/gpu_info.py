"""The GPU vLLM will run on, as far as `serve` and `baseline` need to know it.

Why: vLLM's ``--gpu-memory-utilization`` is a fraction of the whole GPU. When the card a
user sizes for (``--vram``) is a share of a bigger GPU (another tenant holds the rest,
or a small card is emulated on a big one), 0.9 of the GPU is not 0.9 of the card, and
the plan must pass vLLM the card's share instead. ``nvidia-smi`` answers without
importing torch or creating a CUDA context. The total it reports includes memory the
driver reserves; vLLM sees ``total - reserved`` (what ``cudaMemGetInfo`` reports: 139.8
GiB on an H200 whose nvidia-smi total is 140.4), so that is what is returned.
"""

from __future__ import annotations

import os
import shutil
import subprocess

MiB = 1024**2


def _query(fields: str, device: str) -> list[str] | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
             "-i", device],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return [x.strip() for x in out.stdout.strip().splitlines()[0].split(",")]


def device_total_gib(environ: dict[str, str] | None = None) -> float | None:
    """GiB of the first GPU vLLM would use (``CUDA_VISIBLE_DEVICES`` order); None if unknown."""
    env = os.environ if environ is None else environ
    if shutil.which("nvidia-smi") is None:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        first = visible.split(",")[0].strip()
        if not first or first == "-1":
            return None
    else:
        first = "0"
    row = _query("memory.total,memory.reserved", first)
    if row is None:
        row = _query("memory.total", first)  # a driver without the reserved field
    try:
        total = float(row[0]) if row else None
        reserved = float(row[1]) if row and len(row) > 1 else 0.0
    except ValueError:
        return None
    if total is None or total <= 0:
        return None
    return (total - reserved) * MiB / 1024**3
