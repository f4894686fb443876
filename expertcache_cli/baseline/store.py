"""The results file: JSON Lines, one record per event, appended and synced as it happens.

Why JSONL with an fsync per record: a baseline takes hours and crosses many server
processes; an interrupt, a crash or a full disk must never cost a measurement already
taken. Each line is self-describing (``kind``), so ``report`` and ``--resume`` need
nothing but the file.

Record kinds:
  ``meta``    the protocol (model, arms, restarts, runs, ...), first line of the file;
  ``server``  one server's fate: ``status`` ``healthy`` (with its start time) or
              ``failed`` (with ``phase``, ``reason`` and the tail of its log);
  ``warmup``  the discarded first request of a server (kept for the record);
  ``run``     one measured run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import UserError

FORMAT_VERSION = 1


class ResultsStore:
    """Append-only writer for a results file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fh = None

    def open(self) -> ResultsStore:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_tail(self.path)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        return self

    def append(self, record: dict[str, Any]) -> None:
        """Write one record and push it to the disk before returning."""
        if self._fh is None:
            self.open()
        assert self._fh is not None
        self._fh.write(json.dumps(record, sort_keys=True, allow_nan=False, default=str) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> ResultsStore:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def repair_tail(path: Path) -> None:
    """Make a file safe to append to after an interrupted write.

    A line cut short by a crash is dropped; a complete record that only lacks its
    newline gets one. Either way the next record starts on a line of its own.
    """
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - 1))
        if fh.read(1) == b"\n":
            return
        fh.seek(0)
        data = fh.read()
        cut = data.rfind(b"\n") + 1
        tail = data[cut:]
        try:
            json.loads(tail.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            fh.truncate(cut)
        else:
            fh.seek(0, os.SEEK_END)
            fh.write(b"\n")


def iter_records(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Records of a results file in order; a cut-short last line is skipped.

    A malformed line anywhere else means the file is not ours or was edited: refuse,
    naming the line, rather than summarise something half-read.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"results file not found: {p}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read results file {p}: {exc}") from None
    lines = text.split("\n")
    last = len(lines) - 1
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == last:  # the write that an interrupt cut short
                return
            raise UserError(f"{p}:{i + 1}: not a JSON record") from None
        if not isinstance(rec, dict) or "kind" not in rec:
            raise UserError(f"{p}:{i + 1}: not an expertcache baseline record")
        yield rec


def load(path: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(meta record or None, every other record) of a results file."""
    meta: dict[str, Any] | None = None
    rest: list[dict[str, Any]] = []
    for rec in iter_records(path):
        if rec["kind"] == "meta":
            if meta is None:
                meta = rec
            continue  # a resumed file repeats nothing, but tolerate a duplicate
        rest.append(rec)
    return meta, rest


#: Protocol fields that a resumed run must share with the file it continues.
RESUME_FIELDS = ("model", "arms", "runs", "max_tokens", "concurrency", "prompt")


def check_resumable(old: dict[str, Any], new: dict[str, Any]) -> None:
    """Refuse to mix measurements taken under different protocols in one file."""
    if old.get("format") != FORMAT_VERSION:
        raise UserError(f"results file has format {old.get('format')!r}, expected {FORMAT_VERSION}")
    for key in RESUME_FIELDS:
        if old.get(key) != new.get(key):
            raise UserError(
                f"--resume: {key} differs from the file ({old.get(key)!r} there, "
                f"{new.get(key)!r} now); resume with the same options or use a new --out"
            )
    if new.get("restarts", 0) < old.get("restarts", 0):
        raise UserError(
            f"--resume: --restarts {new.get('restarts')} is fewer than the file's "
            f"{old.get('restarts')}; it may grow, not shrink"
        )


def completed_blocks(records: list[dict[str, Any]], runs: int) -> set[tuple[str, int]]:
    """(arm, restart) pairs that need no more work on resume.

    A block is done when one server gave all ``runs`` runs, or when its server failed
    (that failure is a result; retrying it silently would hide it). A block cut short by
    an interrupt is run again from a fresh server: the unit of replication is the server
    process, so one block never mixes two processes; the earlier partial runs stay in the
    file and the summary uses the latest server of each block.
    """
    per_server: dict[str, int] = {}
    block_of: dict[str, tuple[str, int]] = {}
    done: set[tuple[str, int]] = set()
    for rec in records:
        key = (rec.get("arm"), rec.get("restart"))
        if rec["kind"] == "server" and rec.get("status") == "failed":
            done.add(key)  # type: ignore[arg-type]
        elif rec["kind"] == "run":
            sid = rec.get("server_id", "")
            per_server[sid] = per_server.get(sid, 0) + 1
            block_of[sid] = key  # type: ignore[assignment]
    for sid, n in per_server.items():
        if n >= runs:
            done.add(block_of[sid])
    return done
