"""Output files: checked before the work that fills them, written whole or not at all.

Why: a sweep that runs for a minute and then fails on ``--csv`` pointing at a directory
has lost the user's minute; a file half-written by an interrupted run is worse than none.
So every command checks its output paths first (`check_output`) and writes through a
temporary name in the same directory that is moved into place (`atomic_write`). Both say
what went wrong in one line naming the path (a `UserError`), never a traceback.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import UserError


def check_output(path: Path | str, option: str, make_parents: bool = False) -> Path:
    """``path`` as a file we can create or replace; else one line naming ``option``.

    The directory is tried for real (a temporary file created and removed), so a read-only
    file system, ``/proc`` or a directory that root may not write either are caught here,
    before the work, not after it. ``make_parents``: missing directories are fine (the
    writer creates them) when the nearest existing one is writable.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise UserError(f"{option} {path}: is a directory; give a file name")
    if _in_place(path):  # /dev/null, a fifo, a link: written through, never replaced
        if not os.access(path, os.W_OK):
            raise UserError(f"{option} {path}: not writable")
        return path
    parent = path.parent if str(path.parent) else Path(".")
    if make_parents:
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise UserError(f"{option} {path}: {parent} is not a directory")
    if not parent.is_dir():
        raise UserError(f"{option} {path}: directory {parent} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", dir=parent)
    except OSError as exc:
        raise UserError(f"{option} {path}: cannot create a file in {parent} "
                        f"({exc.strerror or exc})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return path


def _in_place(path: Path) -> bool:
    """Whether ``path`` is written through rather than replaced: a symbolic link (replacing
    it would replace the link, e.g. ``/dev/stdout``) or something that is not a regular file
    (``/dev/null``, a fifo)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    return stat.S_ISLNK(mode) or not stat.S_ISREG(mode)


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """A temporary path beside ``path``; moved onto it when the block ends without error.
    A link or a non-regular file (`_in_place`) is written directly instead."""
    path = Path(path)
    if _in_place(path):
        yield path
        return
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
    """Call ``write(tmp_path)`` and move the result onto ``path``; returns ``path``. A write
    that fails anyway (the disk filled, the directory went away since `check_output`) is
    one line naming the path; the previous file, if any, is left as it was."""
    try:
        with atomic_path(path) as tmp:
            write(tmp)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    return Path(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
