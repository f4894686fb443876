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

from .errors import UserError
from .files import atomic_write


class TraceError(UserError):
    """The file is not a usable routing trace."""


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
    p.parent.mkdir(parents=True, exist_ok=True)
    # whole or not at all: a reader never sees half a file (an interrupted save, or two
    # processes writing the same name, leave the previous file or the complete new one)
    return atomic_write(p, lambda tmp: np.savez_compressed(tmp, **payload))


def default_padded(n: int) -> int:
    """The tokens a decode batch of ``n`` runs at under vLLM's default capture sizes
    (`capture.capture_sizes` without flags, a large max_num_seqs)."""
    from .capture import GraphSettings, capture_sizes, padded

    return padded(n, capture_sizes(max(n, 256), 8192, GraphSettings()))


def rebatch(trace: Trace, n: int, padded_tokens: int | None = None) -> Trace:
    """What ``n`` users would cost: ``n`` interleaved copies of a single-stream trace.

    Only the trace's single-token (decode) steps are used: prefills do not batch like
    decode. Stream ``i`` starts ``i x T / n`` steps into them and wraps around, so the
    streams are at different points of the workload at any step (a trace of several
    requests puts them in different requests), and every step carries all ``n`` (a
    saturated server). The batched step is presented to the shape gate at
    ``padded_tokens`` tokens (default: vLLM's default graph padding of ``n``). This is a
    what-if from one user's routing, not a recording of ``n`` users: real users' routing
    is less alike, so it errs towards hits.

    Each batched step holds its distinct experts, not ``n x top_k`` ids: the cache rules
    see only which experts a step routes (`policy`, rule 2) and the gate its width, which
    ``step_tokens`` carries, so every count is the same, and the trace is ``[T, L, at most
    E]`` whatever ``n`` (the plugin records steps wider than E ids the same way). ``n``
    past ``T`` adds streams that start where another does (copies): they cost nothing more.
    """
    if n < 1:
        raise UserError(f"--batch must be >= 1, got {n}")
    ids = trace.topk_ids
    from .policy import gate_widths

    valid = gate_widths(ids, trace.num_experts).max(axis=1)  # valid ids of each step
    if trace.step_tokens is not None:
        single = np.asarray(trace.step_tokens) == 1
    else:
        single = valid <= trace.top_k
    if not single.any():
        most = int(np.max(trace.step_tokens)) if trace.step_tokens is not None else 0
        raise UserError(
            "--batch re-batches a single-stream trace, and this one has no single-token "
            f"(decode) step{f' (steps of up to {most} tokens)' if most else ''}: record one "
            "stream, or synthesise with `trace synth --batch`")
    dec = ids[single]
    t = dec.shape[0]
    # where each stream starts; streams starting at the same step are copies (n > t)
    # (n >= t: every step starts one, the rest are copies; never an array of n)
    offsets = (np.arange(t, dtype=np.int64) if n >= t
               else np.unique((np.arange(n, dtype=np.int64) * t) // n))
    # requests are known only where the recording marked its prefills (step_tokens)
    shared = shared_requests(single, offsets, n) if trace.step_tokens is not None else None
    width = max(1, int(valid[single].max()))
    dec = np.where((dec >= 0) & (dec < trace.num_experts), dec, -1).astype(np.int32)
    out = _stream_union(dec, offsets, trace.num_experts, width)
    tokens = default_padded(n) if padded_tokens is None else int(padded_tokens)
    in_requests = f" in {shared['requests']} request(s)" if shared else ""
    copies = (f" ({n - len(offsets)} of them copies: the trace has {t} steps to start at)"
              if len(offsets) < n else "")
    src = f"{trace.source or 'a trace'}, re-batched: {n} interleaved streams{copies} of its " \
          f"{t} decode steps{in_requests}, gate at {tokens} tokens"
    return Trace(
        topk_ids=out, num_experts=trace.num_experts, top_k=trace.top_k,
        expert_bytes=trace.expert_bytes, model=trace.model, layers=trace.layers,
        step_tokens=np.full(t, tokens, dtype=np.int64), source=src,
        extra={"batch": n, "real_tokens": n * t, "shared": shared, "ids_per_step": n * width},
    ).validate()


def _stream_union(dec: np.ndarray, offsets: np.ndarray, num_experts: int,
                  width: int) -> np.ndarray:
    """``out[s, l]``: the distinct experts of rows ``(s + o) % T`` of ``dec[T, L, W]`` over
    the streams' ``offsets``, -1 padded: ``[T, L, at most E]`` int32, built a layer at a time
    (`engine.union_layer`), never the ``[T, L, n x W]`` of the streams side by side."""
    from .engine import union_layer

    t, n_layers, _ = dec.shape
    used = [np.unique(dec[:, layer][dec[:, layer] >= 0]) for layer in range(n_layers)]
    cap = max(1, min(max(len(u) for u in used), len(offsets) * width))
    out = np.full((t, n_layers, cap), -1, np.int32)
    for layer in range(n_layers):
        seq = np.ascontiguousarray(dec[:, layer, :])
        part = np.full((t, cap), -1, np.int32)
        union_layer(seq, offsets, num_experts, len(used[layer]), part)
        out[:, layer, :] = part
    return out


def shared_requests(single: np.ndarray, starts, streams: int | None = None) -> dict:
    """How many distinct requests `rebatch`'s streams are in at once.

    Why: the streams are copies of one recording, so two streams inside the same request
    route alike and share its experts, and a re-batch of a trace that is mostly one
    request prices ``n`` users as one (24 layers: a one-request trace re-batched to 16 streams
    predicted 180 tok/s in place; 16 users with their own prompts ran 41;
    bench/results/wide-steps.md). A
    request is a run of decode steps between two steps that are not (a prefill starts
    each). ``single``: ``[T]`` bool, the trace's decode steps; ``starts``: each stream's
    first decode step (streams starting together are in one request: counted once);
    ``streams``: how many there are (default: one a start). Returns ``requests`` (in the
    decode steps), and the fewest and the median distinct requests at one step.
    """
    req = np.cumsum(np.concatenate([[True], ~single[:-1]])[single])  # +1 after a prefill
    t, offsets = len(req), np.unique(np.asarray(starts, dtype=np.int64))
    distinct = np.empty(t, dtype=np.int64)
    block = max(1, (1 << 22) // len(offsets))  # [steps, starts] ~32 MiB at a time
    for lo in range(0, t, block):
        steps = np.arange(lo, min(t, lo + block))
        at = np.sort(req[(steps[:, None] + offsets[None, :]) % t], axis=1)
        distinct[steps] = 1 + np.count_nonzero(np.diff(at, axis=1), axis=1)
    return {"requests": int(req[-1]),
            "streams": len(offsets) if streams is None else int(streams),
            "fewest": int(distinct.min()), "median": float(np.median(distinct))}


def shared_note(trace: Trace) -> str | None:
    """The warning a re-batched trace carries when its streams share requests (else None)."""
    sh = trace.extra.get("shared")
    if not sh or sh["fewest"] >= sh["streams"]:
        return None
    n = sh["streams"]
    return (f"the trace holds {sh['requests']} request(s), so the {n} re-batched streams are in "
            f"as few as {sh['fewest']} distinct requests at a step (median {sh['median']:g}); "
            f"streams in one request route alike and share its experts, which prices {n} "
            f"users as fewer: record at least {n} requests (one stream serving {n} or more "
            "prompts in turn) for a what-if of that many users")


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
