"""The server's own expert-cache counters, read from its log.

The plugin prints its counters when ``EXPERT_CACHE_STATS=N`` is set (every N layer-steps).
This is the one place that knows what those lines look like, so a change of format is
one edit here, and tests pin it.

Accepted: a line containing ``expert-cache`` or ``expert_cache`` (any case) followed
somewhere by ``stats`` and then ``key=value`` pairs, e.g.
``expert-cache stats: layer_steps=4800 hits=30112 misses=6304 hit_rate=0.8269``.
Values may carry a trailing ``%`` (kept as a percentage number). The latest such line in
the log is the server's current cumulative state.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

STATS_LINE_RE = re.compile(r"expert[-_ ]cache\b.*?\bstats\b[:\s]*(?P<body>.*)$", re.IGNORECASE)
_PAIR_RE = re.compile(r"(?P<key>[A-Za-z_][A-Za-z0-9_]*)=(?P<val>-?\d+(?:\.\d+)?(?:e[-+]?\d+)?)%?")

#: How far back from the end of a log to look; stats lines are frequent and short.
_TAIL_BYTES = 256 * 1024


def parse_stats_line(line: str) -> dict[str, float] | None:
    """The counters in one log line, or None when it is not a stats line."""
    m = STATS_LINE_RE.search(line)
    if not m:
        return None
    out: dict[str, float] = {}
    for pm in _PAIR_RE.finditer(m.group("body")):
        val = float(pm.group("val"))
        out[pm.group("key")] = int(val) if val.is_integer() and "." not in pm.group("val") else val
    return out or None


def latest_counters(log_path: str | os.PathLike[str]) -> dict[str, float] | None:
    """The last stats line's counters in a server log, or None if it printed none."""
    p = Path(log_path)
    try:
        with open(p, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - _TAIL_BYTES))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    for line in reversed(text.splitlines()):
        found = parse_stats_line(line)
        if found is not None:
            return found
    return None
