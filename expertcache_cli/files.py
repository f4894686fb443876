"""Output files: checked before the work that fills them, written whole or not at all.

Why: a sweep that runs for a minute and then fails on ``--csv`` pointing at a directory
has lost the user's minute; a file half-written by an interrupted run is worse than none.
So every command checks its output paths first (`check_output`) and writes through a
temporary name in the same directory that is moved into place (`atomic_write`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import UserError


def check_output(path: Path | str, option: str) -> Path:
    """``path`` as a file we can create or replace; else one line naming ``option``."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise UserError(f"{option} {path}: is a directory; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UserError(f"{option} {path}: directory {parent} is not writable")
    return path


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """A temporary path beside ``path``; moved onto it when the block ends without error."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; a result is not
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def atomic_write(path: Path | str, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp_path)`` and move the result onto ``path``; returns ``path``."""
    with atomic_path(path) as tmp:
        write(tmp)
    return Path(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
