"""Errors a user can fix. The CLI prints them as one line and exits with their code."""

from __future__ import annotations


class UserError(Exception):
    """Bad input or an environment that cannot do the job: one clear line, no traceback."""

    exit_code = 2


class DeviceUnavailable(UserError):
    """A command that needs a CUDA device was run where none is usable."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or a SIGTERM a command treats alike) with the one line the CLI prints for it:
    what was kept and how to go on. Still a KeyboardInterrupt for code that catches one."""
