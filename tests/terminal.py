"""Children started as a terminal starts them, for the tests that press Ctrl-C.

A job a non-interactive shell starts with ``&`` inherits SIGINT ignored, and Python then
installs no KeyboardInterrupt handler in it, nor in any child it starts: a suite run that
way would see the CLI ignore Ctrl-C, where a user at a terminal never does. The tests that
send SIGINT start their child with SIGINT at its default, as a terminal's shell does.
"""

from __future__ import annotations

import signal


def sigint_default() -> None:
    """``preexec_fn``: SIGINT at its default disposition in the child before it execs."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
