"""The command line: a thin layer that parses options and calls the library.

Each subcommand lives in `commands/<name>.py` and imports its heavy dependencies
(torch, vllm) inside the command body, so `expertcache --help` and the CPU commands
start in well under a second.

Importing this module imports nothing else: the app is built inside `main` (and on first
use of `app`), so that Ctrl-C while the commands load is handled like Ctrl-C anywhere.
"""

from __future__ import annotations

import importlib
import signal
import sys
from typing import Any

_APP: Any = None

#: what a Ctrl-C prints (after "expertcache: ") when the command had nothing to add
INTERRUPTED = "interrupted"


def _build() -> Any:
    """The typer app with every command registered (built once)."""
    global _APP
    if _APP is not None:
        return _APP
    import typer
    from typer.core import TyperGroup

    from . import __version__
    from .commands import register_all

    class _Root(TyperGroup):
        """Ctrl-C inside a command leaves it as `_Stop`, with the command's own line where
        it has one (`errors.Interrupted`), instead of the silent exit 130 typer makes of it."""

        def invoke(self, ctx: Any) -> Any:
            try:
                return super().invoke(ctx)
            except KeyboardInterrupt as exc:
                raise _Stop(str(exc) or INTERRUPTED) from None

    app = typer.Typer(
        name="expertcache",
        cls=_Root,
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
    _APP = app
    return app


def __getattr__(name: str) -> Any:
    if name == "app":  # `from expertcache_cli.cli import app` (tests, embedding)
        return _build()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Stop(Exception):
    """A Ctrl-C caught inside a command, carried past click and typer to `main`."""


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


def usage_line(exc: BaseException) -> str:
    """A usage error as one line: the message, and which command's --help to read."""
    message = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    command = ctx.command_path if ctx is not None else "expertcache"
    return f"expertcache: error: {message} (see `{command} --help`)"


def _interrupted(line: str = INTERRUPTED) -> None:
    """Ctrl-C: one line and exit code 130. A second Ctrl-C while Python shuts down (worker
    threads finishing their job) ends the process at once, without a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    print(f"expertcache: {line}", file=sys.stderr)
    # A Ctrl-C (or SIGTERM) that landed while exec() ran a string (dataclasses and
    # namedtuple build their methods so, when a module loads) leaves CPython's mark of an
    # unhandled KeyboardInterrupt set although it was handled here, and under `python -m`
    # CPython then ends the process by SIGINT after this exit instead of with 130. Any
    # string run through exec() clears the mark.
    exec("")
    sys.exit(130)


def main() -> None:
    """Console entry point: every error a user can fix is one line on stderr, exit code 2;
    Ctrl-C (during any command, or while the commands load) is one line and exit code 130.

    Usage errors (an unknown option, a value of the wrong type) are click's; they are
    printed as one line too, instead of click's boxed usage text.
    """
    try:
        _main()
    except KeyboardInterrupt as exc:
        _interrupted(str(exc) or INTERRUPTED)


def _main() -> None:
    from .errors import UserError

    app = _build()
    no_args, usage, abort = (_click_exception(n) for n in ("NoArgsIsHelpError", "UsageError",
                                                             "Abort"))
    try:
        rc = app(standalone_mode=False)
    except no_args as exc:
        exc.show()
        sys.exit(2)
    except usage as exc:
        print(usage_line(exc), file=sys.stderr)
        sys.exit(2)
    except abort:  # typer releases that run click's own main turn Ctrl-C into Abort
        _interrupted()
    except _Stop as exc:
        _interrupted(str(exc))
    except UserError as exc:
        print(f"expertcache: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    if rc == 130:  # typer's own exit for a Ctrl-C outside a command (parsing, help)
        _interrupted()
    sys.exit(rc if isinstance(rc, int) else 0)
