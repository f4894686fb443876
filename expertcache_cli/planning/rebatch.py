"""What ``n`` users would cost: a single-stream routing trace re-batched into ``n``
interleaved streams (`replay --batch`, `plan --batch`).

Why here and not with the trace format: a re-batched step is presented to the shape gate
at the tokens vLLM pads the batch to, which is a fact of the installed vLLM (`capture`),
and planning is the first section that may know both the rules and vLLM.
"""

from __future__ import annotations

import numpy as np

from ..errors import UserError
from ..rules.trace import Trace


def default_padded(n: int) -> int:
    """The tokens a decode batch of ``n`` runs at under vLLM's default capture sizes
    (`capture.capture_sizes` without flags, a large max_num_seqs)."""
    from ..vllm_facts.capture import GraphSettings, capture_sizes, padded

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
    from ..rules.policy import gate_widths

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
    # requests are known only where the recording marked them (`Trace.request_ids`)
    req = trace.request_ids()
    shared = shared_requests(req[single], offsets, n) if req is not None else None
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
    from ..rules.engine import union_layer

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


def shared_requests(req: np.ndarray, starts, streams: int | None = None) -> dict:
    """How many distinct requests `rebatch`'s streams are in at once.

    Why: the streams are copies of one recording, so two streams inside the same request
    route alike and share its experts, and a re-batch of a trace that is mostly one
    request prices ``n`` users as one (24 layers: a one-request trace re-batched to 16 streams
    predicted 180 tok/s in place; 16 users with their own prompts ran 41;
    bench/results/wide-steps.md). ``req``: ``[T]``, the request of each of the trace's
    decode steps (`Trace.request_ids`, non-decreasing); ``starts``: each stream's first
    decode step (streams starting together are in one request: counted once); ``streams``:
    how many there are (default: one a start). Returns ``requests`` (in the decode steps),
    and the fewest and the median distinct requests at one step.
    """
    req = np.asarray(req, dtype=np.int64)
    t, offsets = len(req), np.unique(np.asarray(starts, dtype=np.int64))
    distinct = np.empty(t, dtype=np.int64)
    block = max(1, (1 << 22) // len(offsets))  # [steps, starts] ~32 MiB at a time
    for lo in range(0, t, block):
        steps = np.arange(lo, min(t, lo + block))
        at = np.sort(req[(steps[:, None] + offsets[None, :]) % t], axis=1)
        distinct[steps] = 1 + np.count_nonzero(np.diff(at, axis=1), axis=1)
    return {"requests": len(np.unique(req)),
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
