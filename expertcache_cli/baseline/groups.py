"""Records of the server process groups we start, so that a later process can end exactly
those a killed run left behind, and nothing else.

A server is the leader of a process group of its own (``server.Server``); vLLM's engine and
workers join it. When the process that started it is killed without a chance to stop it
(SIGKILL, a device call's time limit), the group lives on, holding the GPU and its port.
With ``EXPERTCACHE_SERVER_GROUPS=DIR`` in the environment, each such group is recorded as
``DIR/PGID.json`` while it runs: the group, its leader's start time, and the process that
started it (its owner) with that one's start time. ``end_orphans(DIR)`` ends the recorded
groups whose owner is gone, and only them:

- a group whose owner still runs is someone's live run, and stays;
- a PID since reused by another process is told apart by its start time, and left alone
  (Linux gives a PID out again only once no process is left in the group it named);
- a process that merely looks like a server (``vllm serve`` by its user) was never
  recorded, so it is never a candidate.

Linux only (``/proc``); elsewhere nothing is recorded and nothing is ended.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

#: The environment variable naming the records' directory (unset: nothing is recorded).
ENV = "EXPERTCACHE_SERVER_GROUPS"


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first); None if no
    such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> str | None:
    """When the process started (clock ticks since boot: with the PID, it names one
    process for the machine's uptime); None if there is no such process."""
    fields = _stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def members(pgid: int) -> list[int]:
    """The live (not zombie) processes of the group ``pgid``."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields and fields[0] != "Z" and int(fields[2]) == pgid:
                out.append(int(entry))
    return out


def record_dir(environ: dict[str, str] | None = None) -> Path | None:
    env = os.environ if environ is None else environ
    d = env.get(ENV)
    return Path(d) if d else None


def record(directory: Path, pgid: int, argv: list[str], owner: int | None = None) -> Path | None:
    """Record the group ``pgid`` (its leader has that PID) as started by ``owner`` (this
    process unless given). None, with nothing written, when the leader is already gone or
    /proc is missing."""
    owner = os.getpid() if owner is None else owner
    leader, owner_start = start_time(pgid), start_time(owner)
    if leader is None or owner_start is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{pgid}.json"
    tmp = directory / f".{pgid}.json.tmp"
    tmp.write_text(json.dumps({"pgid": pgid, "leader_start": leader, "owner": owner,
                               "owner_start": owner_start, "argv": list(argv)}))
    tmp.replace(path)
    return path


def forget(directory: Path, pgid: int) -> None:
    (directory / f"{pgid}.json").unlink(missing_ok=True)


def _wait_gone(pgid: int, wait_s: float) -> bool:
    end = time.monotonic() + wait_s
    while True:
        if not members(pgid):
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.1)


def end_group(pgid: int, grace_s: float = 10.0) -> bool:
    """SIGTERM the group, SIGKILL what is left after ``grace_s``; True once none is left."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        if _wait_gone(pgid, wait_s):
            return True
    return False


def end_orphans(directory: Path, grace_s: float = 10.0) -> list[str]:
    """End every recorded group whose owner is gone; one line per record acted on."""
    lines: list[str] = []
    if not directory.is_dir():
        return lines
    for path in sorted(directory.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
            pgid, leader_start = int(rec["pgid"]), str(rec["leader_start"])
            owner, owner_start = int(rec["owner"]), str(rec["owner_start"])
            what = " ".join(rec.get("argv") or [])[:160]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            lines.append(f"groups: {path.name}: unreadable record ({exc}); left alone")
            continue
        if not members(pgid):
            path.unlink(missing_ok=True)  # it ended on its own
            continue
        now = start_time(pgid)
        if now is not None and now != leader_start:
            # the PID names another process now, so the recorded group has ended
            path.unlink(missing_ok=True)
            continue
        if start_time(owner) == owner_start:
            lines.append(f"groups: kept process group {pgid} ({what}): its run (pid {owner}) "
                         "is still going")
            continue
        if end_group(pgid, grace_s):
            path.unlink(missing_ok=True)
            lines.append(f"groups: ended process group {pgid} ({what}), left behind by a run "
                         "that is gone")
        else:
            lines.append(f"groups: process group {pgid} ({what}) would not end; left recorded")
    return lines
