"""Routing trace files (docs/design.md, The routing trace format): load, validate, save.

A trace is what the plugin records from a live server and what `replay` consumes, so
validation is strict and its errors are one readable line: a user handing us a wrong
file should learn what is wrong with it, not read a numpy traceback.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from ..files import atomic_write


class TraceError(UserError):
    """The file is not a usable routing trace."""


#: the step kinds `Trace.step_kinds` labels each step with (`engine.sweep`'s groups)
DECODE, PREFILL = 0, 1


@dataclass
class Trace:
    """Routing ids ``topk_ids[T, L, W]`` (-1 = padding) and what is known about them."""

    topk_ids: np.ndarray
    num_experts: int
    top_k: int
    expert_bytes: int | None = None
    model: str | None = None
    layers: np.ndarray | None = None
    step_tokens: np.ndarray | None = None
    source: str | None = None
    #: ``[T]``: the request each step belongs to, where the recording says so (several
    #: decode-only recordings joined in turn, whose boundaries no prefill step marks)
    requests: np.ndarray | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return int(self.topk_ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.topk_ids.shape[1])

    @property
    def width(self) -> int:
        return int(self.topk_ids.shape[2])

    @property
    def ids_per_step(self) -> int:
        """Routing ids a layer-step carries: ``width``, or for a re-batched trace (which
        keeps each step's distinct experts) its streams x top_k."""
        return int(self.extra.get("ids_per_step", self.width))

    @property
    def tokens(self) -> int:
        """Tokens the trace covers: ``step_tokens`` summed, else the valid ids / top_k
        (a re-batched trace: its streams' tokens, not the graph padding)."""
        if "real_tokens" in self.extra:
            return int(self.extra["real_tokens"])
        if self.step_tokens is not None:
            return int(np.sum(self.step_tokens))
        valid = int(np.count_nonzero(self.topk_ids[:, 0, :] >= 0))
        return max(1, valid // max(1, self.top_k))

    def step_kinds(self) -> np.ndarray | None:
        """``[T]``: `DECODE` or `PREFILL` for each step; None where the trace cannot tell.

        The one place a step is called a prefill. Why it matters: a recording starts each
        request with its prompt's prefill, one step of many tokens, whose fetches warm the
        cache for decode but are not decode's cost, so `plan` prices decode steps only. A
        decode step carries one token a stream; a step of more tokens than the trace's
        decode batch is a prefill (a prompt, a chunk of one, or a server's warm-up
        forward). The decode batch is the width most steps run at (the commonest
        ``step_tokens``, the narrowest on a tie): a recording's steps are mostly decode,
        and a synthetic or re-batched trace runs every step at its streams. Only
        ``step_tokens`` says how many tokens a step ran (a recorded prefill's row holds its
        distinct experts), so a trace without it cannot tell.
        """
        if self.step_tokens is None:
            return None
        tokens = np.asarray(self.step_tokens, dtype=np.int64)
        widths, counts = np.unique(tokens, return_counts=True)
        batch = int(widths[np.argmax(counts)])  # unique sorts: a tie goes to the narrowest
        return np.where(tokens > batch, PREFILL, DECODE).astype(np.int64)

    def request_ids(self) -> np.ndarray | None:
        """``[T]``: the request each step is in, numbered from 0 in trace order; None where
        the trace cannot tell.

        The one place a request is told apart. Why it matters: streams re-batched from one
        recording route alike while they are in the same request (`rebatch.shared_requests`),
        and a served bench request replays one recorded request. ``requests`` says it where
        the recording did; else a request starts at each prefill (`step_kinds`), and at the
        first step.
        """
        if self.requests is not None:
            raw = np.asarray(self.requests, dtype=np.int64)
            return np.cumsum(np.concatenate([[0], raw[1:] != raw[:-1]])).astype(np.int64)
        kinds = self.step_kinds()
        if kinds is None:
            return None
        starts = kinds == PREFILL
        starts[0] = False  # the first step opens request 0 whatever it is
        return np.cumsum(starts).astype(np.int64)

    def request_starts(self) -> np.ndarray | None:
        """The first step of each request (`request_ids`), or None where it cannot tell."""
        req = self.request_ids()
        if req is None:
            return None
        return np.flatnonzero(np.concatenate([[True], req[1:] != req[:-1]])).astype(np.int64)

    def layer_names(self) -> list[int]:
        if self.layers is not None:
            return [int(x) for x in self.layers]
        return list(range(self.num_layers))

    def gate_widths(self) -> np.ndarray:
        """``[T, L]``: what the plugin's shape gate saw at each layer-step
        (`policy.gate_widths`: the recorded tokens x top_k, else the valid ids)."""
        from .policy import gate_widths

        return gate_widths(self.topk_ids, self.num_experts, self.step_tokens, self.top_k)

    def validate(self) -> Trace:
        """Raise TraceError naming the first thing wrong; return self when sound."""
        ids = self.topk_ids
        if not isinstance(ids, np.ndarray) or not np.issubdtype(ids.dtype, np.integer):
            kind = getattr(ids, "dtype", type(ids))
            raise TraceError(f"topk_ids must be an integer array, got {kind}")
        if ids.ndim != 3:
            raise TraceError(f"topk_ids must be [steps, layers, ids], got shape {ids.shape}")
        if ids.size == 0 or 0 in ids.shape:
            raise TraceError(f"trace is empty (topk_ids shape {ids.shape})")
        if self.num_experts <= 0:
            raise TraceError(f"num_experts must be positive, got {self.num_experts}")
        if self.top_k <= 0:
            raise TraceError(f"top_k must be positive, got {self.top_k}")
        hi = int(ids.max())
        if hi >= self.num_experts:
            t, layer, w = (int(v) for v in np.argwhere(ids >= self.num_experts)[0])
            raise TraceError(
                f"expert id {int(ids[t, layer, w])} at step {t}, layer {layer} is >= "
                f"num_experts={self.num_experts} (only negative ids may pad)"
            )
        if not np.any(ids >= 0):
            raise TraceError("trace holds only padding (no id >= 0)")
        if self.layers is not None and len(self.layers) != ids.shape[1]:
            raise TraceError(f"layers has {len(self.layers)} entries for {ids.shape[1]} layers")
        if self.step_tokens is not None and len(self.step_tokens) != ids.shape[0]:
            raise TraceError(
                f"step_tokens has {len(self.step_tokens)} entries for {ids.shape[0]} steps"
            )
        if self.requests is not None:
            req = np.asarray(self.requests)
            if req.ndim != 1 or len(req) != ids.shape[0]:
                raise TraceError(
                    f"requests has shape {req.shape} for {ids.shape[0]} steps (one entry a step)")
            if not np.issubdtype(req.dtype, np.integer) or (req.size and int(req.min()) < 0):
                raise TraceError("requests must be non-negative integers (a request a step)")
        if self.expert_bytes is not None and self.expert_bytes <= 0:
            raise TraceError(f"expert_bytes must be positive, got {self.expert_bytes}")
        return self


def _scalar(data: Any, key: str, kind: type) -> Any:
    value = np.asarray(data[key])
    if value.ndim != 0:
        raise TraceError(f"{key} must be a scalar, got shape {value.shape}")
    if kind is int:
        if not np.issubdtype(value.dtype, np.integer):
            raise TraceError(f"{key} must be an integer, got {value.dtype}")
        return int(value)
    return str(value)


def load(path: str | Path) -> Trace:
    """Read and validate a trace; every failure is a TraceError with one line."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file")
    if p.is_dir():
        raise TraceError(f"{p}: is a directory, not a trace file")
    try:
        npz = np.load(p, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise TraceError(f"{p}: not a readable .npz trace ({exc.__class__.__name__})") from None
    if not hasattr(npz, "files"):
        raise TraceError(f"{p}: is a single .npy array, not an .npz trace")
    with npz as data:
        missing = [k for k in ("topk_ids", "num_experts", "top_k") if k not in data.files]
        if missing:
            raise TraceError(f"{p}: missing key(s) {', '.join(missing)}")
        try:
            ids = data["topk_ids"]
            trace = Trace(
                topk_ids=ids,
                num_experts=_scalar(data, "num_experts", int),
                top_k=_scalar(data, "top_k", int),
                expert_bytes=_scalar(data, "expert_bytes", int)
                if "expert_bytes" in data.files
                else None,
                model=_scalar(data, "model", str) if "model" in data.files else None,
                layers=np.asarray(data["layers"]) if "layers" in data.files else None,
                step_tokens=np.asarray(data["step_tokens"])
                if "step_tokens" in data.files
                else None,
                source=_scalar(data, "source", str) if "source" in data.files else None,
                requests=np.asarray(data["requests"]) if "requests" in data.files else None,
            )
        except ValueError as exc:  # e.g. object arrays refused with allow_pickle=False
            raise TraceError(f"{p}: unreadable field ({exc})") from None
    try:
        return trace.validate()
    except TraceError as exc:
        raise TraceError(f"{p}: {exc}") from None


def npz_path(path: str | Path) -> Path:
    """The file `save` writes for ``path``: ``.npz`` appended when it has another suffix."""
    p = Path(path).expanduser()
    return p if p.suffix == ".npz" else p.with_name(p.name + ".npz")


def save(trace: Trace, path: str | Path) -> Path:
    """Validate and write ``trace``; ids are stored in the smallest signed type that fits."""
    trace.validate()
    p = npz_path(path)
    dtype = np.int16 if trace.num_experts < 2**15 else np.int32
    payload: dict[str, Any] = {
        "topk_ids": trace.topk_ids.astype(dtype),
        "num_experts": np.int64(trace.num_experts),
        "top_k": np.int64(trace.top_k),
    }
    if trace.expert_bytes is not None:
        payload["expert_bytes"] = np.int64(trace.expert_bytes)
    if trace.model is not None:
        payload["model"] = np.str_(trace.model)
    if trace.layers is not None:
        payload["layers"] = np.asarray(trace.layers, dtype=np.int64)
    if trace.step_tokens is not None:
        payload["step_tokens"] = np.asarray(trace.step_tokens, dtype=np.int64)
    if trace.source is not None:
        payload["source"] = np.str_(trace.source)
    if trace.requests is not None:
        payload["requests"] = np.asarray(trace.requests, dtype=np.int64)
    p.parent.mkdir(parents=True, exist_ok=True)
    # whole or not at all: a reader never sees half a file (an interrupted save, or two
    # processes writing the same name, leave the previous file or the complete new one)
    return atomic_write(p, lambda tmp: np.savez_compressed(tmp, **payload))


def describe(trace: Trace) -> dict:
    """Facts about a trace that a user checks before trusting a replay of it."""
    ids = trace.topk_ids
    valid = ids >= 0
    per_step = valid.sum(axis=2)
    top = max(1, trace.num_experts // 8)
    used = np.zeros(trace.num_experts, bool)
    shares = []
    for layer in range(trace.num_layers):
        col = ids[:, layer, :]
        counts = np.bincount(col[col >= 0].ravel(), minlength=trace.num_experts)
        used |= counts > 0
        shares.append(np.sort(counts)[::-1][:top].sum() / max(1, counts.sum()))
    return {
        "steps": trace.steps,
        "layers": trace.num_layers,
        "layer_ids": trace.layer_names(),
        "width": trace.width,
        "num_experts": trace.num_experts,
        "top_k": trace.top_k,
        "tokens": trace.tokens,
        # None: the trace does not say where its requests start
        "requests": None if (req := trace.request_ids()) is None else int(req[-1]) + 1,
        "ids_per_step_min": int(per_step.min()),
        "ids_per_step_max": int(per_step.max()),
        "padding_fraction": float(1 - valid.mean()),
        "experts_used": int(np.count_nonzero(used)),
        # how concentrated routing is: the hottest 1/8 of experts' share, layer mean
        f"top_{top}_experts_share": float(np.mean(shares)),
        "expert_bytes": trace.expert_bytes,
        "model": trace.model,
        "source": trace.source,
    }
