"""Subcommands. Each module defines ``register(app)``; this list is the CLI's table of contents."""

from __future__ import annotations

import importlib
from pathlib import Path

import typer

from ..errors import UserError

#: module name -> registered by that module's ``register(app)``
COMMAND_MODULES = ["replay", "trace", "baseline", "size", "build_kernels", "probe_link", "serve"]

#: the bundled trace `expertcache replay` uses when given none (see traces/README.md)
DEMO_TRACE = "demo-qwen3-30b-a3b-tasks.npz"


def register_all(app: typer.Typer) -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(app)


def demo_trace_path(name: str = DEMO_TRACE) -> Path:
    """Where the bundled demo traces live (shipped inside the package as ``traces/``)."""
    path = Path(__file__).resolve().parent.parent / "traces" / name
    if not path.exists():
        raise UserError(f"bundled demo trace {name} is missing from {path.parent}; pass a TRACE")
    return path


def parse_int_list(text: str, option: str) -> list[int]:
    """'16,32,64' -> [16, 32, 64]; anything else is a usage error naming the option."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{option} wants comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise UserError(f"{option} wants positive integers, got {text!r}")
    return list(dict.fromkeys(values))
