"""Errors a user can fix. The CLI prints them as one line and exits with their code."""

from __future__ import annotations


class UserError(Exception):
    """Bad input or an environment that cannot do the job: one clear line, no traceback."""

    exit_code = 2


class DeviceUnavailable(UserError):
    """A command that needs a CUDA device was run where none is usable."""
