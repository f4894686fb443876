"""The command line: a thin layer that parses options and calls the library.

Each subcommand lives in `commands/<name>.py` and imports its heavy dependencies
(torch, vllm) inside the command body, so `expertcache --help` and the CPU commands
start in well under a second.
"""

from __future__ import annotations

import importlib
import sys

import typer

from . import __version__
from .commands import register_all
from .errors import UserError

app = typer.Typer(
    name="expertcache",
    help="A VRAM cache of MoE expert slots for vLLM, and the instruments to size it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        print(f"expertcache {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="print the version and exit"),
) -> None:
    """A VRAM cache of MoE expert slots for vLLM, and the instruments to size it."""


register_all(app)


def _click_exception(name: str) -> tuple[type[BaseException], ...]:
    """Click's exception class ``name``, from click itself and from the copy that newer
    typer releases vendor (typer._click): whichever parses our command line raises it."""
    found = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if cls is not None and cls not in found:
            found.append(cls)
    return tuple(found)


_NO_ARGS = _click_exception("NoArgsIsHelpError")
_USAGE = _click_exception("UsageError")
_ABORT = _click_exception("Abort")


def usage_line(exc: BaseException) -> str:
    """A usage error as one line: the message, and which command's --help to read."""
    message = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    command = ctx.command_path if ctx is not None else "expertcache"
    return f"expertcache: error: {message} (see `{command} --help`)"


def main() -> None:
    """Console entry point: every error a user can fix is one line on stderr, exit code 2.

    Usage errors (an unknown option, a value of the wrong type) are click's; they are
    printed as one line too, instead of click's boxed usage text.
    """
    try:
        rc = app(standalone_mode=False)
    except _NO_ARGS as exc:
        exc.show()
        sys.exit(2)
    except _USAGE as exc:
        print(usage_line(exc), file=sys.stderr)
        sys.exit(2)
    except _ABORT:
        print("expertcache: interrupted", file=sys.stderr)
        sys.exit(130)
    except UserError as exc:
        print(f"expertcache: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    sys.exit(rc if isinstance(rc, int) else 0)
