"""Subcommands. Each module defines ``register(app)``; this list is the CLI's table of contents."""

from __future__ import annotations

import importlib

import typer

#: module name -> registered by that module's ``register(app)``
COMMAND_MODULES = ["replay", "trace"]


def register_all(app: typer.Typer) -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(app)
