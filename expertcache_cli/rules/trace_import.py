"""Routing traces recorded by other engines, converted to this project's trace format.

Why: a cache is judged by the routing it serves, and a real model's routing (what it
decodes, not what a generator makes up) is the one input `replay` and `plan` cannot
invent. Engines other than vLLM already record it; converting their files lets a user (and
the bundled demo traces, `traces/README.md`) use those recordings as they are.

One format is read: the ``route_trace v1`` CSV written by llama.cpp-based engines that log
every routing (``--route-trace``): comment lines ``# route_trace v1``, ``# model=...
arch=... n_layer=N n_expert=E n_expert_used=K``, one ``# layer=I expert_bytes=B ...`` a
MoE layer, then rows ``turn,phase,step,layer,slot,expert,...`` with ``phase`` 0 for a
prefill (one batch over the prompt's positions) and 1 for a decode step (one token),
``step`` the token's position and ``slot`` the router's rank. Each decode token becomes one
trace step; each prefill becomes one step of all its positions (``step_tokens`` says how
many), so the shape gate sees the width the engine ran.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from .trace import Trace, TraceError

#: the first line of the format, and the columns a row must have (more may follow)
MAGIC = "# route_trace v1"
COLUMNS = ("turn", "phase", "step", "layer", "slot", "expert")
PREFILL, DECODE = 0, 1


@dataclass
class RouteCsv:
    """What a ``route_trace v1`` file holds: its header facts and its routings, one row each
    (``rows[:, i]`` is the column ``COLUMNS[i]``)."""

    model: str
    arch: str
    num_experts: int
    top_k: int
    layer_bytes: dict[int, int] = field(default_factory=dict)
    rows: np.ndarray = field(default_factory=lambda: np.zeros((0, len(COLUMNS)), np.int64))


def _header_fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", line))


def read_route_csv(path: str | Path) -> RouteCsv:
    """Parse a ``route_trace v1`` file, streamed (a long recording is not held as text);
    every failure is a TraceError naming the file and, where there is one, the line."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: no such file")
    try:
        with p.open(encoding="utf-8", newline="") as f:
            return _parse(p, f)
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{p}: not a readable text file ({exc.__class__.__name__})") from None


def _parse(p: Path, f: TextIO) -> RouteCsv:
    if f.readline().strip() != MAGIC:
        raise TraceError(f"{p}: not a route trace (its first line is not {MAGIC!r})")
    head: dict[str, str] = {}
    layer_bytes: dict[int, int] = {}
    n, line = 1, f.readline()
    while line.startswith("#"):
        n += 1
        fields = _header_fields(line)
        if "layer" in fields and "expert_bytes" in fields:
            try:
                layer_bytes[int(fields["layer"])] = int(fields["expert_bytes"])
            except ValueError:
                raise TraceError(f"{p}:{n}: unreadable layer line") from None
        else:
            head.update(fields)
        line = f.readline()
    try:
        num_experts, top_k = int(head["n_expert"]), int(head["n_expert_used"])
    except (KeyError, ValueError):
        raise TraceError(f"{p}: the header gives no n_expert and n_expert_used") from None
    if num_experts <= 0 or not 0 < top_k <= num_experts:
        raise TraceError(f"{p}: n_expert={num_experts} n_expert_used={top_k} is not a router")
    columns = next(csv.reader([line]), None) if line.strip() else None
    if columns is None or any(c not in columns for c in COLUMNS):
        raise TraceError(f"{p}:{n + 1}: the column line must name {', '.join(COLUMNS)}")
    pick = [columns.index(c) for c in COLUMNS]
    rows = []
    for at, row in enumerate(csv.reader(f), start=n + 2):
        if not row:
            continue
        try:
            rows.append([int(row[i]) for i in pick])
        except (ValueError, IndexError):
            raise TraceError(f"{p}:{at}: expected integers in {', '.join(COLUMNS)}") from None
    if not rows:
        raise TraceError(f"{p}: no routings after the header")
    return RouteCsv(model=head.get("model", ""), arch=head.get("arch", ""),
                    num_experts=num_experts, top_k=top_k, layer_bytes=layer_bytes,
                    rows=np.asarray(rows, dtype=np.int64))


def to_trace(rc: RouteCsv, *, prefill: bool = True, expert_bytes: int | None = None,
             model: str | None = None, source: str | None = None) -> Trace:
    """The routings as a `Trace`: steps in the order the engine ran them (per turn, its
    prefill and then its decode tokens), MoE layers as the file names them, each token's
    ids in its place within the step (a prefill's position rank x top_k + slot; a layer that
    routed fewer positions, as llama.cpp's last layer routes only the last one, is padded).

    ``prefill=False`` keeps the decode steps only. ``expert_bytes`` defaults to the mean of
    the file's per-layer expert sizes (what one expert costs averaged over the layers, so
    that a fetch of every layer's expert sums right; ``None`` if the file gives none).
    Raises TraceError where the file is not a router's output: an id outside the experts,
    a rank past ``n_expert_used``, a token routed to one expert twice, a routing given twice.
    """
    turn, phase, step, layer, slot, expert = rc.rows.T
    bad = (expert < 0) | (expert >= rc.num_experts)
    if bad.any():
        i = int(np.argmax(bad))
        raise TraceError(f"expert {int(expert[i])} at step {int(step[i])}, layer "
                         f"{int(layer[i])} is outside 0..{rc.num_experts - 1}")
    bad = (slot < 0) | (slot >= rc.top_k)
    if bad.any():
        raise TraceError(f"slot {int(slot[np.argmax(bad)])} is outside 0..{rc.top_k - 1} "
                         f"(n_expert_used={rc.top_k})")
    if not np.isin(phase, (PREFILL, DECODE)).all():
        raise TraceError(f"phase {int(phase[~np.isin(phase, (PREFILL, DECODE))][0])} is "
                         "neither 0 (prefill) nor 1 (decode)")
    keep = np.ones(len(phase), bool) if prefill else phase == DECODE
    if not keep.any():
        raise TraceError("the file holds no decode step")
    turn, phase, step, layer, slot, expert = (c[keep] for c in (turn, phase, step, layer,
                                                                 slot, expert))
    cell = np.stack([turn, phase, step, layer, slot], axis=1)
    if len(np.unique(cell, axis=0)) != len(cell):
        raise TraceError("a (turn, phase, step, layer, slot) routing is given twice")
    tok = np.stack([turn, phase, step, layer, expert], axis=1)
    if len(np.unique(tok, axis=0)) != len(tok):
        raise TraceError("a token is routed to the same expert twice in one layer")
    layers = np.unique(layer)
    col = np.searchsorted(layers, layer)
    # a trace step: a decode token, or a whole prefill (all its positions at once)
    key = np.stack([turn, phase, np.where(phase == DECODE, step, -1)], axis=1)
    steps, row_step = np.unique(key, axis=0, return_inverse=True)
    row_step = row_step.ravel()
    # position of each routing within its layer-step: token rank x top_k + slot
    tokens = np.ones(len(steps), np.int64)
    pos = np.zeros(len(step), np.int64)
    for s in np.flatnonzero(steps[:, 1] == PREFILL):
        mine = row_step == s
        uniq, inv = np.unique(step[mine], return_inverse=True)
        tokens[s] = len(uniq)
        pos[mine] = inv.ravel()
    width = int(tokens.max()) * rc.top_k
    ids = np.full((len(steps), len(layers), width), -1, np.int32)
    ids[row_step, col, pos * rc.top_k + slot] = expert
    if expert_bytes is None and rc.layer_bytes:
        expert_bytes = round(float(np.mean([rc.layer_bytes[int(x)] for x in layers
                                            if int(x) in rc.layer_bytes] or [0]))) or None
    return Trace(topk_ids=ids, num_experts=rc.num_experts, top_k=rc.top_k,
                 expert_bytes=expert_bytes, model=model or rc.model or None,
                 layers=layers.astype(np.int64), step_tokens=tokens,
                 source=source).validate()
