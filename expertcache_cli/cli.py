"""The command line: a thin layer that parses options and calls the library.

Each subcommand lives in `commands/<name>.py` and imports its heavy dependencies
(torch, vllm) inside the command body, so `expertcache --help` and the CPU commands
start in well under a second.
"""

from __future__ import annotations

import sys

import typer

from .commands import register_all
from .errors import UserError

app = typer.Typer(
    name="expertcache",
    help="A VRAM cache of MoE expert slots for vLLM, and the instruments to size it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
register_all(app)


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit code 2.

    Usage errors (unknown option, bad value) are handled by typer itself and exit with 2.
    """
    try:
        app()
    except UserError as exc:
        print(f"expertcache: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
