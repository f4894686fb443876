"""Routing traces recorded by other engines, converted to this project's trace format.

Why: a cache is judged by the routing it serves, and a real model's routing (what it
decodes, not what a generator makes up) is the one input `replay` and `plan` cannot
invent. Engines other than vLLM already record it; converting their files lets a user (and
the bundled demo traces, `traces/README.md`) use those recordings as they are.

Two formats are read, told apart by their first line:

- the ``route_trace v1`` CSV written by llama.cpp-based engines that log every routing
  (``--route-trace``): comment lines ``# route_trace v1``, ``# model=... arch=... n_layer=N
  n_expert=E n_expert_used=K``, one ``# layer=I expert_bytes=B ...`` a MoE layer, then rows
  ``turn,phase,step,layer,slot,expert,...`` with ``phase`` 0 for a prefill (one batch over
  the prompt's positions) and 1 for a decode step (one token), ``step`` the token's
  position and ``slot`` the router's rank. Each decode token becomes one trace step; each
  prefill becomes one step of all its positions (``step_tokens`` says how many), so the
  shape gate sees the width the engine ran.
- the routing JSONL written by ``capture_routing.py`` (a transformers forward hook on every
  router, greedy decode; github.com/pjordanandrsn/grouped-nf4-gemm,
  ``bench/cold-engine/routing-trace/``): a first line ``{"meta": {"model", "prompt",
  "steps", "layers", "top_k", "n_experts", ...}}``, then one line a decode token,
  ``{"step": s, "token": t, "routed": {"<router index>": [expert ids]}}``. It records
  decode only (the prompt's prefill is run, not recorded) and each token's ids sorted, not
  in the router's rank order. Each line becomes one decode step of one token.

- the token-pairs JSONL of nvmoe's llama.cpp collector (``llama-nvmoe-trace``, then
  ``sim/trace_post.py --decode-only``; github.com/BrianBoitano/nvmoe, ``traces/``): one line
  a decode token, a JSON array of ``[layer, expert]`` pairs, the layers in order and each
  layer's ids in the router's rank order. The file names neither the model's expert count
  (``--experts`` gives it) nor where one prompt's decode ends and the next begins (split the
  file and import the parts in turn). Each line becomes one decode step of one token.

Several recordings of one model (``trace import A B C OUT``) become one trace, one after
another in the order given: requests served in turn by one stream.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO, TypeVar

import numpy as np

from .trace import Trace, TraceError

#: the first line of the format, and the columns a row must have (more may follow)
MAGIC = "# route_trace v1"
COLUMNS = ("turn", "phase", "step", "layer", "slot", "expert")
PREFILL, DECODE = 0, 1
T = TypeVar("T")
#: the formats `read_recording` tells apart, as `import`'s default source names them
CSV_KIND, JSONL_KIND, PAIRS_KIND = "route_trace v1", "routing JSONL", "token-pairs JSONL"


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
    return _read_text(Path(path), _parse, newline="")


def _read_text(p: Path, parse: Callable[[Path, TextIO], T], newline: str | None = None) -> T:
    """``parse(p, f)`` over the file opened as UTF-8 text: a missing file, or one the OS or
    the decoder refuses at any point of the parse, is one TraceError naming it (the
    readers' common refusals; each parser names its own)."""
    if not p.is_file():
        raise TraceError(f"{p}: no such file")
    try:
        with p.open(encoding="utf-8", newline=newline) as f:
            return parse(p, f)
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


@dataclass
class RouteJsonl:
    """What a routing JSONL file holds: its meta facts and ``ids[T, L, top_k]``, one decode
    token a row, the layers in ``layers`` (the recording's router indices) order."""

    model: str
    prompt: str
    num_experts: int
    top_k: int
    layers: np.ndarray
    ids: np.ndarray
    top_k_native: int | None = None
    #: which of the JSON formats it was read from (`default_source` names it)
    kind: str = JSONL_KIND


def _count(value: object) -> int | None:
    """``value`` as a JSON integer (not a bool, not a float), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_route_jsonl(path: str | Path) -> RouteJsonl:
    """Parse a routing JSONL file line by line; every failure is a TraceError naming the
    file and, where there is one, the line. Refused: a meta line without ``top_k`` and
    ``n_experts``, a line that is not a decode token's routing, a step out of order, a
    layer missing or extra, a token whose ids are not ``top_k`` distinct experts, and a
    file shorter or wider than its meta line says (a truncated recording)."""
    return _read_text(Path(path), _parse_jsonl)


def _json_value(p: Path, n: int, line: str) -> object:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: arrays nested past the C stack
        raise TraceError(f"{p}:{n}: not a JSON line") from None


def _json_line(p: Path, n: int, line: str) -> dict:
    obj = _json_value(p, n, line)
    if not isinstance(obj, dict):
        raise TraceError(f"{p}:{n}: not a JSON object")
    return obj


def _parse_jsonl(p: Path, f: TextIO) -> RouteJsonl:
    meta = _json_line(p, 1, f.readline()).get("meta")
    if not isinstance(meta, dict):
        raise TraceError(f'{p}:1: the first line is not a {{"meta": {{...}}}} object')
    num_experts, top_k = _count(meta.get("n_experts")), _count(meta.get("top_k"))
    if num_experts is None or top_k is None:
        raise TraceError(f"{p}:1: the meta line gives no n_experts and top_k")
    if num_experts <= 0 or not 0 < top_k <= num_experts:
        raise TraceError(f"{p}:1: n_experts={num_experts} top_k={top_k} is not a router")
    if meta.get("decode") is False:
        raise TraceError(f"{p}:1: the meta line says decode=false: not a decode recording")
    keys: list[str] | None = None
    rows: list[list[list[int]]] = []
    for n, line in enumerate(f, start=2):
        if not line.strip():
            continue
        rec = _json_line(p, n, line)
        routed = rec.get("routed")
        if _count(rec.get("step")) != len(rows) or not isinstance(routed, dict):
            raise TraceError(f'{p}:{n}: expected {{"step": {len(rows)}, "routed": '
                             '{layer: [experts]}}')
        if keys is None:
            keys = sorted(routed, key=lambda k: (len(k), k))
            # "0", "1", ...: no sign, no leading zero, no other script's digits
            if not keys or any(not (k.isascii() and k.isdigit() and k == str(int(k)))
                               for k in keys):
                raise TraceError(f"{p}:{n}: the routed layers must be named by integers")
        elif set(routed) != set(keys):
            missing, extra = sorted(set(keys) - set(routed)), sorted(set(routed) - set(keys))
            raise TraceError(f"{p}:{n}: not the first step's layers (missing "
                             f"{', '.join(missing[:4]) or 'none'}, extra "
                             f"{', '.join(map(str, extra[:4])) or 'none'})")
        step = []
        for k in keys:
            ids = routed[k]
            if (not isinstance(ids, list) or len(ids) != top_k
                    or any(_count(e) is None or not 0 <= e < num_experts for e in ids)
                    or len(set(ids)) != top_k):
                shown = repr(ids) if len(repr(ids)) <= 60 else repr(ids)[:57] + "..."
                raise TraceError(f"{p}:{n}: layer {k} routes {shown}, not {top_k} distinct "
                                 f"experts in 0..{num_experts - 1}")
            step.append(ids)
        rows.append(step)
    if not rows or keys is None:
        raise TraceError(f"{p}: no steps after the meta line")
    said = _count(meta.get("steps"))
    if said is not None and said != len(rows):
        raise TraceError(f"{p}: the meta line says {said} steps and the file holds "
                         f"{len(rows)} (a truncated recording?)")
    said = _count(meta.get("layers"))
    if said is not None and said != len(keys):
        raise TraceError(f"{p}: the meta line says {said} layers and the steps route "
                         f"{len(keys)}")
    return RouteJsonl(model=str(meta.get("model") or ""), prompt=str(meta.get("prompt") or ""),
                      num_experts=num_experts, top_k=top_k,
                      layers=np.asarray([int(k) for k in keys], dtype=np.int64),
                      ids=np.asarray(rows, dtype=np.int32),
                      top_k_native=_count(meta.get("top_k_native")))


def jsonl_to_trace(rj: RouteJsonl, *, expert_bytes: int | None = None,
                   model: str | None = None, source: str | None = None) -> Trace:
    """The recording as a `Trace`: one decode step of one token a line, in file order."""
    return Trace(topk_ids=rj.ids.copy(), num_experts=rj.num_experts, top_k=rj.top_k,
                 expert_bytes=expert_bytes, model=model or rj.model or None,
                 layers=rj.layers.copy(), step_tokens=np.ones(len(rj.ids), np.int64),
                 source=source).validate()


def read_token_pairs(path: str | Path, num_experts: int | None) -> RouteJsonl:
    """Parse a token-pairs JSONL file (see the module docstring) at ``num_experts`` experts
    a layer, which the file does not say. Refused, naming the file and line: no
    ``num_experts``, a line that is not ``[layer, expert]`` pairs, a token whose layers are
    not the first token's in the same order, a layer whose ids are not the first layer's
    count of distinct experts in range, an empty file."""
    p = Path(path)
    if num_experts is None:
        raise TraceError(f"{p}: a token-pairs JSONL does not say how many experts a layer "
                         "has: give --experts N")
    if num_experts <= 0:
        raise TraceError(f"{p}: --experts {num_experts} is not a router")
    return _read_text(p, lambda p, f: _parse_pairs(p, f, num_experts))


def _parse_pairs(p: Path, f: TextIO, num_experts: int) -> RouteJsonl:
    layers: list[int] | None = None
    top_k = 0
    rows: list[list[list[int]]] = []
    for n, line in enumerate(f, start=1):
        if not line.strip():
            continue
        pairs = _json_value(p, n, line)
        if (not isinstance(pairs, list) or not pairs
                or any(not isinstance(q, list) or len(q) != 2
                       or any(_count(v) is None for v in q) for q in pairs)):
            raise TraceError(f"{p}:{n}: not a JSON array of [layer, expert] pairs")
        step: dict[int, list[int]] = {}
        order: list[int] = []
        for layer, expert in pairs:
            if layer not in step:
                if order and layer < order[-1]:
                    raise TraceError(f"{p}:{n}: layer {layer} after layer {order[-1]}: "
                                     "the layers are not in order")
                step[layer] = []
                order.append(layer)
            elif order[-1] != layer:
                raise TraceError(f"{p}:{n}: layer {layer}'s pairs are not together")
            step[layer].append(expert)
        if layers is None:
            layers, top_k = order, len(step[order[0]])
        elif order != layers:
            raise TraceError(f"{p}:{n}: routes layers {order[0]}..{order[-1]} "
                             f"({len(order)}), not the first token's {layers[0]}.."
                             f"{layers[-1]} ({len(layers)})")
        for layer in order:
            ids = step[layer]
            if (len(ids) != top_k or len(set(ids)) != top_k
                    or any(not 0 <= e < num_experts for e in ids)):
                raise TraceError(f"{p}:{n}: layer {layer} routes {ids[:8]}, not {top_k} "
                                 f"distinct experts in 0..{num_experts - 1}")
        rows.append([step[layer] for layer in order])
    if not rows or layers is None:
        raise TraceError(f"{p}: no tokens")
    return RouteJsonl(model="", prompt="", num_experts=num_experts, top_k=top_k,
                      layers=np.asarray(layers, dtype=np.int64),
                      ids=np.asarray(rows, dtype=np.int32), kind=PAIRS_KIND)


def read_recording(path: str | Path, num_experts: int | None = None) -> RouteCsv | RouteJsonl:
    """A recording in any of the three formats, told apart by its first line (``#
    route_trace v1``; a JSON object: the routing JSONL's meta line; a JSON array: a
    token-pairs line, read at ``num_experts``)."""
    p = Path(path)
    first = _read_text(p, lambda _, f: f.readline(), newline="")
    if first.strip() == MAGIC:
        return read_route_csv(p)
    if first.lstrip().startswith("{"):
        return read_route_jsonl(p)
    if first.lstrip().startswith("["):
        return read_token_pairs(p, num_experts)
    raise TraceError(f"{p}: not a route trace (its first line is neither {MAGIC!r}, a "
                     "routing JSONL meta line nor a token's [layer, expert] pairs)")


def recording_trace(rec: RouteCsv | RouteJsonl, *, prefill: bool = True) -> Trace:
    """One recording as a `Trace` (no labels: `join` gives them)."""
    if isinstance(rec, RouteJsonl):
        return jsonl_to_trace(rec)
    return to_trace(rec, prefill=prefill)


def join(traces: list[Trace], names: list[str], *, expert_bytes: int | None = None,
         model: str | None = None, source: str | None = None) -> Trace:
    """Recordings of one model as one trace: their steps one after another, in the order
    given (requests served in turn), ids padded to the widest step. ``names`` label the
    recordings in errors. Refused: recordings of different shapes (experts, top_k, layers).
    ``expert_bytes`` and ``model`` default to the first recording's that has one."""
    first = traces[0]
    for tr, name in zip(traces[1:], names[1:]):
        if ((tr.num_experts, tr.top_k) != (first.num_experts, first.top_k)
                or tr.layer_names() != first.layer_names()):
            raise TraceError(
                f"{name}: top-{tr.top_k} of {tr.num_experts} over {tr.num_layers} layers, and "
                f"{names[0]} top-{first.top_k} of {first.num_experts} over {first.num_layers}: "
                "not recordings of one model")
    width = max(tr.width for tr in traces)
    ids = np.concatenate([np.pad(tr.topk_ids, ((0, 0), (0, 0), (0, width - tr.width)),
                                 constant_values=-1) for tr in traces])
    tokens = np.concatenate([tr.step_tokens for tr in traces])
    # each recording's requests (one, or one a prefill it marks), numbered on from the last
    parts, base = [], 0
    for tr in traces:
        own = tr.request_ids()
        own = np.zeros(tr.steps, np.int64) if own is None else own
        parts.append(own + base)
        base += int(own[-1]) + 1
    requests = np.concatenate(parts)
    if expert_bytes is None:
        expert_bytes = next((tr.expert_bytes for tr in traces if tr.expert_bytes), None)
    if model is None:
        model = next((tr.model for tr in traces if tr.model), None)
    return Trace(topk_ids=ids, num_experts=first.num_experts, top_k=first.top_k,
                 expert_bytes=expert_bytes, model=model, layers=first.layers,
                 step_tokens=tokens, source=source,
                 requests=requests if len(traces) > 1 else None).validate()


def default_source(recs: list[RouteCsv | RouteJsonl], names: list[str]) -> str:
    """What `trace import` stores as ``source`` when not told: the files and their format
    (a JSONL readout at another top_k than the model routed says so)."""
    files = ", ".join(names)
    rec = recs[0]
    if isinstance(rec, RouteCsv):
        return f"recorded: {files} ({CSV_KIND}, {rec.arch or '?'})"
    note = ""
    if rec.top_k_native is not None and rec.top_k_native != rec.top_k:
        note = (f"; ids read at top-{rec.top_k} of a router that routed "
                f"{rec.top_k_native}: not what the model ran")
    return f"recorded: {files} ({rec.kind}, {rec.model or '?'}{note})"
