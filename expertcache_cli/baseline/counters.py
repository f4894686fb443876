"""The server's own expert-cache counters, read from its log.

The plugin logs its counters when ``EXPERT_CACHE_STATS=N`` is set (every N layer-steps)
and once more at shutdown (`expertcache_cli/plugin/session.py`, ``Session.report``):

    expertcache: live hit rate 48.91% since last report, 49.02% overall (requests=51648
    installs=26330 read-through steps=12 (decode-width 0) over 8 layers)

(the decode-width count, read-through steps no wider than a full decode batch, is new in
the plugin's counters line since 2026-12; older lines still parse, with that count None;
with ``EXPERT_CACHE_WIDE`` staged, `` staged steps=N (fetched M)`` follows it, and the hit
rate counts the M scratch fetches as misses)

This module is the one place that knows that line's shape, so a change of format is one
edit here (tests/test_baseline_units.py pins it). The latest line in a log is the
server's cumulative state; rates are returned as fractions (0.4902), not percentages.
"""

from __future__ import annotations

import math
import os
import re

from .server import read_end

STATS_LINE_RE = re.compile(
    r"expertcache: (?P<when>live|final) hit rate (?P<window>nan|[-\d.]+)% since last report, "
    r"(?P<overall>nan|[-\d.]+)% overall \(requests=(?P<requests>\d+) installs=(?P<installs>\d+)"
    r" read-through steps=(?P<read_through>\d+)(?: \(decode-width (?P<decode>\d+)\))?"
    r"(?: staged steps=(?P<staged>\d+) \(fetched (?P<fetched>\d+)\))?"
    r" over (?P<layers>\d+) layers\)"
)

#: How far back from the end of a log to look; stats lines are frequent and short.
_TAIL_BYTES = 256 * 1024

#: the plugin's startup line (`plugin.arming.summary_line`) and its fall-back lines
#: (`plugin.runtime.ArmedLayer`): whether the cache served the whole model
ARMED_RE = re.compile(r"expertcache: vLLM \S+: armed (?P<armed>\d+) of (?P<layers>\d+) MoE layers")
FELL_BACK = "layer back on the stock path"


def _frac(text: str) -> float | None:
    v = float(text)
    return None if math.isnan(v) else v / 100.0


def parse_stats_line(line: str) -> dict[str, float | int | str | None] | None:
    """The counters in one log line, or None when it is not the plugin's stats line."""
    m = STATS_LINE_RE.search(line)
    if not m:
        return None
    return {
        "hit_rate": _frac(m.group("overall")),
        "hit_rate_window": _frac(m.group("window")),
        "requests": int(m.group("requests")),
        "installs": int(m.group("installs")),
        "read_through_steps": int(m.group("read_through")),
        "read_through_decode_steps": None if m.group("decode") is None else int(m.group("decode")),
        "staged_steps": None if m.group("staged") is None else int(m.group("staged")),
        "staged_fetched": None if m.group("fetched") is None else int(m.group("fetched")),
        "layers": int(m.group("layers")),
        "final": m.group("when") == "final",
    }


def latest_counters(log_path: str | os.PathLike[str]) -> dict | None:
    """The last stats line's counters in a server log, or None if it printed none."""
    try:
        text = read_end(log_path, _TAIL_BYTES)
    except OSError:
        return None
    for line in reversed(text.splitlines()):
        found = parse_stats_line(line)
        if found is not None:
            return found
    return None


def plugin_state(log_path: str | os.PathLike[str]) -> dict | None:
    """How much of the model the cache served, from a server log: the layers armed at
    startup (of the MoE layers) and how many went back to the stock path while serving
    (an exception on the slot path, or a first-call check that disagreed); None when the
    log has no startup line (plugin missing or disabled)."""
    try:
        with open(log_path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    starts = list(ARMED_RE.finditer(text))
    if not starts:
        return None
    m = starts[-1]  # the last server start in the log
    return {"armed": int(m.group("armed")), "moe_layers": int(m.group("layers")),
            "fell_back": text[m.end():].count(FELL_BACK)}
