"""vLLM's CUDA-graph batch padding, as the sizing trap must count it.

Why: with CUDA graphs on (vLLM's default) a decode batch of ``n`` sequences runs the
graph captured for the smallest capture size ``>= n``, so every layer sees the padded
token count. The plugin's shape gate serves a step from slots only when ``tokens x
top_k <= slots``, and it sees the padded tokens: at 84 slots and top-8, "10 sequences
x 8 = 80 ids" looks safe, but vLLM 0.26 pads 10 to 16 and 128 ids read through. So the
safe ``--max-num-seqs`` is the largest whose *padded* batch fits.

The capture sizes follow vLLM's `VllmConfig._set_cudagraph_sizes` (read in 0.26.0,
0.33.0 and 0.34.0): without explicit sizes, ``[1, 2, 4]`` then steps of 8 below 256 and
of 16 above, up to ``min(2 x max_num_seqs, 512)`` and ``max_num_batched_tokens``, plus
``max_num_batched_tokens`` itself when it fits; ``--performance-mode interactivity``
captures every size up to 32 instead of 1, 2, 4; from 0.31 ``max_num_seqs`` itself is
captured too (the uniform decode size; 0.29-0.32 read as well). Explicit sizes
(``--cudagraph-capture-sizes``, ``compilation_config.cudagraph_capture_sizes``) replace
the grid, and eager execution (``--enforce-eager``, ``-O0``, ``cudagraph_mode`` NONE)
pads nothing. A batch wider than the largest capture size runs eagerly, unpadded.
A model's own vLLM config can move the ceiling before the sizes are drawn: gpt-oss's
(`GptOssForCausalLMConfig`) sets it to 1024 where the user set neither sizes nor a
ceiling, which from 0.31 also drops the appended ``max_num_seqs`` (vLLM appends it only
to a ceiling it computed itself), so `for_model` applies it.

From 0.34 (`REQUEST_GRID_FROM`, read in 0.34.0) those sizes are only the start:
`VllmConfig._split_cudagraph_capture_sizes` (config/vllm.py:2558-2737) splits them into
prefill token sizes P and decode *request* counts R, each with its own ``-cc`` keys, and
`CudaGraphManager.dispatch` (v1/worker/gpu/cudagraph_utils.py:558-602) runs a decode
step of ``B`` requests x ``q`` tokens on the smallest decode graph of ``>= B`` requests
(``q`` rows each) where the cudagraph mode has a separate decode routine
(FULL_AND_PIECEWISE, the -O2/-O3 default; FULL_DECODE_ONLY), else on the smallest
prefill size ``>= B x q``, else eagerly (`decode_rows`). By default R is the shared sizes
rounded to whole requests, so a q = 1 step pads as 0.33 pads it; gpt-oss's config
(models/config.py:851-879) now keeps its 1024-token grid for prefill only and puts decode
on vLLM's request grid (`decode_request_grid`), and speculative decoding pads whole
requests. The plugin reads vLLM's own resolved fields instead (`rows_from_resolved`).
"""
from __future__ import annotations

import json
import math
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..errors import UserError
from . import installed_vllm
from .releases import NEWEST_KNOWN, OLDEST_KNOWN, known_range  # the releases read

#: the vLLM release from which the uniform decode size (max_num_seqs) is also captured
#: (read in 0.30.0, which does not, and 0.31.0, which does)
APPENDS_MAX_NUM_SEQS_FROM = (0, 31)
#: the vLLM release from which decode CUDA graphs are keyed by request count, on a grid of
#: their own (`VllmConfig._split_cudagraph_capture_sizes`, read in 0.33.0, which has none,
#: and 0.34.0)
REQUEST_GRID_FROM = (0, 34)
#: 0.34's cudagraph modes with a separate decode routine (`CUDAGraphMode.separate_routine`):
#: only these capture decode graphs; the others pad a decode step on the prefill sizes
SEPARATE_DECODE = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")
#: 0.34's cudagraph mode by optimisation level where ``cudagraph_mode`` is not given
#: (config/vllm.py:318, 339, 360; -O2 is the default level, :465; -O0 runs eagerly)
MODE_BY_LEVEL = {"1": "PIECEWISE", "2": "FULL_AND_PIECEWISE", "3": "FULL_AND_PIECEWISE"}
_DEFAULT_MODE = "FULL_AND_PIECEWISE"
_DEFAULT_MAX_GRAPH = 512
#: capture ceilings a model's vLLM config sets where the user set no capture sizes nor
#: ceiling (`vllm/model_executor/models/config.py`, read in 0.26.0, 0.33.0 and 0.34.0,
#: which keeps the ceiling for prefill graphs only: `for_model`)
MODEL_MAX_CAPTURE = {"GptOssForCausalLM": 1024}
#: 0.34's ``-cc`` keys of the split grids (compilation-config only: the CLI has only the
#: two legacy flags, engine/arg_utils.py:1855-1859), by `GraphSettings` field
SPLIT_KEYS = {"decode_sizes": "decode_cudagraph_capture_request_sizes",
              "max_decode_requests": "max_decode_cudagraph_capture_requests",
              "max_decode_tokens": "max_decode_cudagraph_capture_tokens",
              "prefill_sizes": "prefill_cudagraph_capture_token_sizes",
              "max_prefill_tokens": "max_prefill_cudagraph_capture_tokens"}


@dataclass(frozen=True)
class GraphSettings:
    """What decides vLLM's capture sizes, read from a user's vLLM flags.

    The fields past ``source`` count from 0.34 only (``request_grid``). The rule is that of
    GPUs below SM100: on SM100 (B200, GB200) vLLM 0.34 widens its unset defaults
    (``wide_defaults``, config/vllm.py:2604-2611: a 1024-token ceiling, decode graphs on
    the request grid to ``max_num_seqs``, prefill on the 8192-token grid), which these
    settings do not model; the plugin reads the resolved grids on every card.
    """

    eager: bool = False
    sizes: tuple[int, ...] | None = None
    max_capture: int | None = None
    interactivity: bool = False
    appends_max_num_seqs: bool = False
    source: str = "vLLM's defaults"
    request_grid: bool = False  # 0.34+: decode graphs keyed by request count
    mode: str = _DEFAULT_MODE  # cudagraph_mode (-O1: PIECEWISE)
    decode_sizes: tuple[int, ...] | None = None  # decode_cudagraph_capture_request_sizes
    max_decode_requests: int | None = None  # max_decode_cudagraph_capture_requests
    max_decode_tokens: int | None = None  # max_decode_cudagraph_capture_tokens
    prefill_sizes: tuple[int, ...] | None = None  # prefill_cudagraph_capture_token_sizes
    max_prefill_tokens: int | None = None  # max_prefill_cudagraph_capture_tokens
    model_ceiling: int | None = None  # 0.34 gpt-oss: prefill on the legacy 1024 grid

    @property
    def legacy(self) -> bool:
        """0.33's sizes or ceiling are set (by the user; before 0.34 also by a model's config),
        which 0.34 calls deprecated: no uniform decode sizes are then appended."""
        return self.sizes is not None or self.max_capture is not None

    @property
    def split(self) -> bool:
        """The user set one of 0.34's own prefill/decode sizes or caps (a model's config
        then leaves the grids alone)."""
        return any(x is not None for x in (self.decode_sizes, self.max_decode_requests,
                                           self.prefill_sizes, self.max_prefill_tokens))


def for_model(g: GraphSettings, architectures: Sequence[str]) -> GraphSettings:
    """``g`` as vLLM applies it to a model of ``architectures`` (its config.json's): the
    model's own capture ceiling where the user's flags left sizes and ceiling to vLLM.
    From 0.34 it holds for prefill graphs only, and 0.34's own size keys also leave it
    out (models/config.py:851-879): `graph_grids` reads ``model_ceiling``."""
    if g.eager or g.legacy or (g.request_grid and g.split):
        return g
    for arch in architectures:
        ceiling = MODEL_MAX_CAPTURE.get(arch)
        if ceiling is None:
            continue
        if g.request_grid:  # the mode (-O1, cudagraph_mode) still counts: kept in the source
            own = (f"{arch}'s vLLM config: prefill graphs up to {ceiling} tokens, decode "
                   "graphs by request count")
            kept = "" if g.source.startswith("vLLM's defaults") else g.source + ", "
            return replace(g, model_ceiling=ceiling, source=kept + own)
        return replace(g, max_capture=ceiling,
                       source=f"{arch}'s vLLM config: captured up to {ceiling} tokens")
    return g


def _grid(top: int, max_num_batched_tokens: int, interactivity: bool) -> list[int]:
    """vLLM's token grid up to ``top`` (already within the batched tokens): 1, 2, 4 (every
    size to 32 under interactivity), steps of 8 below 256 and 16 above, and the batched
    tokens themselves where they fit."""
    sizes = list(range(1, min(top, 32) + 1)) if interactivity else [
        s for s in (1, 2, 4) if s <= top]
    if top >= 8:
        sizes += range(8, min(top + 1, 256), 8)
    if top >= 256:
        sizes += range(256, top + 1, 16)
    if max_num_batched_tokens <= top:
        sizes.append(max_num_batched_tokens)
    return sizes


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, g: GraphSettings) -> list[int]:
    """The batch sizes vLLM captures graphs for (empty when it runs eagerly)."""
    if g.eager:
        return []
    if g.sizes is not None:
        return sorted({s for s in g.sizes if s <= max_num_batched_tokens})
    top = g.max_capture if g.max_capture is not None else min(2 * max_num_seqs, _DEFAULT_MAX_GRAPH)
    top = min(top, max_num_batched_tokens)
    sizes = _grid(top, max_num_batched_tokens, g.interactivity)
    if g.appends_max_num_seqs and g.max_capture is None and max_num_seqs <= top:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def _request_counts(max_requests: int) -> list[int]:
    """0.34's request counts whose ``n x q`` tokens a speculative decode captures: 1, 2, 4,
    steps of 8 below 256 and 16 above, and the most itself (config/vllm.py:2425-2431)."""
    m = min(max_requests, _DEFAULT_MAX_GRAPH)
    return sorted({*(n for n in (1, 2, 4) if n <= m), *range(8, min(m + 1, 256), 8),
                   *range(256, m + 1, 16), m})


def token_sizes(max_num_seqs: int, max_num_batched_tokens: int, g: GraphSettings,
                query_len: int = 1) -> list[int]:
    """0.34's shared token sizes (`_set_cudagraph_sizes`, config/vllm.py:2370-2556), the
    base its split grids start from: ceiling ``min(2 x S x q, 512)``, the grid, and the
    uniform decode sizes, S itself at q = 1 (`capture_sizes` from 0.31), ``n x q`` over
    `_request_counts` at q > 1, so that a speculative step has a whole-request size."""
    if g.eager:
        return []
    if g.legacy:  # explicit sizes or ceiling: no uniform decode sizes appended (:2398)
        return capture_sizes(max_num_seqs, max_num_batched_tokens, g)
    q = max(int(query_len), 1)
    ceiling = min(2 * max_num_seqs * q, _DEFAULT_MAX_GRAPH)
    top = min(ceiling, max_num_batched_tokens)
    uniform = [max_num_seqs] if q == 1 else [n * q for n in _request_counts(max_num_seqs)]
    return sorted({*_grid(top, max_num_batched_tokens, g.interactivity),
                   *(s for s in uniform if s <= top)})


def _walk_grid(limit: int, step: Callable[[int], float]) -> list[int]:
    """Sizes 1, ..., ``limit``, each the next multiple of the largest power of two not above
    ``step(size)`` (0.34's `_walk_grid`, config/compilation.py:78-86)."""
    grid, size = [], 1
    while size < limit:
        grid.append(size)
        stride = 1 << max(0, math.floor(math.log2(max(1.0, step(size)))))
        size = (size // stride + 1) * stride
    return [*grid, limit] if limit else []


def decode_request_grid(max_requests: int) -> list[int]:
    """0.34's request-count grid (`decode_cudagraph_capture_grid`, compilation.py:122-126):
    every count to 6, then strides growing as ``n^(2/3)``; gpt-oss and
    ``max_decode_cudagraph_capture_requests`` put decode graphs on it."""
    return _walk_grid(max_requests, lambda n: 0.65 * n ** (2 / 3))


def prefill_token_grid(max_tokens: int, dense_head: bool = False) -> list[int]:
    """0.34's token-count grid (`prefill_cudagraph_capture_grid`, compilation.py:89-99),
    drawn for ``max_prefill_cudagraph_capture_tokens``; ``dense_head``: interactivity."""
    grid = _walk_grid(max_tokens, lambda t: min(t, max(8, t / 4), 0.07 * max(t, 4096)))
    if dense_head:
        grid = sorted({*grid, *(t for t in range(1, 33) if t < max_tokens)})
    return grid


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _prefill_grid(max_num_batched_tokens: int, g: GraphSettings,
                  shared: list[int]) -> list[int]:
    """P: the prefill (token-keyed) sizes (config/vllm.py:2627-2645; gpt-oss's legacy
    1024-token sizes, models/config.py:872-876)."""
    if g.model_ceiling is not None:
        top = min(max_num_batched_tokens, g.model_ceiling)
        legacy = (1, 2, 4, *range(8, 256, 8), *range(256, g.model_ceiling, 16))
        return sorted({s for s in legacy if s < top} | {top})
    if g.prefill_sizes is not None:
        return sorted({s for s in g.prefill_sizes if 1 <= s <= max_num_batched_tokens})
    if g.max_prefill_tokens is not None:
        return prefill_token_grid(min(g.max_prefill_tokens, max_num_batched_tokens),
                                  g.interactivity)
    return shared


def _request_grid(max_num_seqs: int, g: GraphSettings, shared: list[int], q: int) -> list[int]:
    """R: the decode request counts (config/vllm.py:2647-2671; gpt-oss's cap of ``1024 //
    q`` requests, models/config.py:877-879). By default the shared sizes rounded up to
    whole requests, kept where that stays within the largest shared size."""
    if g.decode_sizes is not None:
        return sorted({s for s in g.decode_sizes if 1 <= s <= max_num_seqs})
    cap = (g.model_ceiling // q if g.model_ceiling is not None else g.max_decode_requests)
    if cap is not None:
        return decode_request_grid(min(cap, max_num_seqs))
    top = max(shared, default=0)
    return sorted({min(_cdiv(s, q), max_num_seqs) for s in shared if _cdiv(s, q) * q <= top})


def graph_grids(max_num_seqs: int, max_num_batched_tokens: int, g: GraphSettings,
                query_len: int = 1) -> tuple[list[int], list[int], int]:
    """(P, R, L) of a 0.34 server: the prefill token sizes, the decode request counts
    (`_split_cudagraph_capture_sizes`) and the most requests a decode graph holds, ``L =
    min(S, decode token budget // q)`` (`decode_cudagraph_capture_shapes`, compilation.py
    54-75; the budget ``max_decode_cudagraph_capture_tokens``, else the batched tokens)."""
    q = max(int(query_len), 1)
    shared = token_sizes(max_num_seqs, max_num_batched_tokens, g, q)
    budget = min(max_num_batched_tokens, g.max_decode_tokens or max_num_batched_tokens)
    return (_prefill_grid(max_num_batched_tokens, g, shared),
            _request_grid(max_num_seqs, g, shared, q), min(max_num_seqs, budget // q))


def _decode_graphs(requests: Sequence[int], limit: int) -> list[int]:
    """The request counts decode graphs are captured at: each count up to the first at or
    past ``limit``, that one taken at the limit (the rest are unreachable)."""
    if limit < 1:
        return []
    r = sorted(set(requests))
    return sorted({min(n, limit) for n in r[:bisect_left(r, limit) + 1]})


def _smallest(sizes: Sequence[int], n: int) -> int | None:
    fits = [s for s in sizes if s >= n]
    return min(fits) if fits else None


def _dispatch(batch: int, q: int, decode_graphs: Sequence[int], prefill: Sequence[int],
              mode: str) -> int:
    """Rows `CudaGraphManager.dispatch` runs a uniform decode step of ``batch`` requests
    x ``q`` at (cudagraph_utils.py:558-602): the smallest decode graph holding the batch,
    ``q`` rows a request, where the mode has decode graphs; else the smallest token-keyed
    graph (none under FULL_DECODE_ONLY, :357-381); else eager, unpadded."""
    if mode == "NONE":
        return batch * q
    if mode in SEPARATE_DECODE:
        n = _smallest(decode_graphs, batch)
        if n is not None:
            return n * q
    if mode != "FULL_DECODE_ONLY":
        p = _smallest(prefill, batch * q)
        if p is not None:
            return p
    return batch * q


def decode_rows(batch: int, max_num_seqs: int, max_num_batched_tokens: int, g: GraphSettings,
                query_len: int = 1) -> int:
    """Rows (tokens) a 0.34 decode step of ``batch`` requests x ``query_len`` runs at on a
    server of ``max_num_seqs`` (what every MoE layer sees)."""
    q = max(int(query_len), 1)
    if g.eager:
        return batch * q
    prefill, requests, limit = graph_grids(max_num_seqs, max_num_batched_tokens, g, q)
    return _dispatch(batch, q, _decode_graphs(requests, limit), prefill, g.mode)


def rows_from_resolved(batch: int, q: int, max_num_seqs: int, decode_sizes: Sequence[int],
                       prefill_sizes: Sequence[int], max_capture: int | None,
                       max_decode_tokens: int | None, mode: str,
                       max_reqs: int | None = None) -> int:
    """`decode_rows` from the fields vLLM 0.34 resolved into its CompilationConfig, which
    the plugin reads in the worker (any card, any model config): the decode request sizes,
    the prefill token sizes, ``max_cudagraph_capture_size`` and
    ``max_decode_cudagraph_capture_tokens`` (their min is the decode token budget,
    `decode_cudagraph_capture_max_tokens`), the mode's name; ``max_reqs``: the requests
    `get_decode_cudagraph_query_lens` maps ``q`` to (default ``max_num_seqs``)."""
    q = max(int(q), 1)
    top = int(max_capture or 0)
    budget = min(top, max_decode_tokens or top)
    limit = min(max_num_seqs, max_reqs or max_num_seqs, budget // q)
    return _dispatch(batch, q, _decode_graphs(decode_sizes, limit), sorted(prefill_sizes),
                     str(mode).upper())


def graph_sizes(max_num_seqs: int, max_num_batched_tokens: int, g: GraphSettings,
                query_len: int = 1) -> list[int]:
    """The token sizes vLLM records as captured (``cudagraph_capture_sizes``), what the
    runtime's graph memory is counted by: `capture_sizes` before 0.34; from 0.34 the decode
    graphs' ``n x q`` with the prefill sizes, the decode ones alone under
    FULL_DECODE_ONLY (config/vllm.py:2681-2731). At q = 1 on vLLM's defaults both count
    the same sizes."""
    if g.eager or not g.request_grid:
        return capture_sizes(max_num_seqs, max_num_batched_tokens, g)
    q = max(int(query_len), 1)
    prefill, requests, limit = graph_grids(max_num_seqs, max_num_batched_tokens, g, q)
    decode = {n * q for n in _decode_graphs(requests, limit)}
    if g.legacy and g.split:  # vLLM keeps the sizes it recorded (:2717-2731)
        return token_sizes(max_num_seqs, max_num_batched_tokens, g, q)
    if g.mode == "FULL_DECODE_ONLY" and not g.legacy:
        return sorted(decode)
    return sorted(decode | set(prefill))


def padded(n: int, sizes: Sequence[int]) -> int:
    """The token count a batch of ``n`` runs at: the smallest capture size >= n, else n."""
    fits = [s for s in sizes if s >= n]
    return min(fits) if fits else n


def padded_batch(max_num_seqs: int, max_num_batched_tokens: int, g: GraphSettings,
                 query_len: int = 1) -> int:
    """Tokens of the widest decode step: a full batch of ``max_num_seqs``, padded.
    ``query_len``: tokens a sequence carries in a decode step, ``1 + k`` under speculative
    decoding with ``k`` draft tokens (the verify step scores them all); vLLM then sizes
    its capture list for ``max_num_seqs x query_len`` tokens (from 0.34: `decode_rows`)."""
    if g.request_grid:
        return decode_rows(max_num_seqs, max_num_seqs, max_num_batched_tokens, g, query_len)
    tokens = max_num_seqs * max(int(query_len), 1)
    return padded(tokens, capture_sizes(tokens, max_num_batched_tokens, g))


def safe_max_num_seqs(slots: int, top_k: int, max_num_batched_tokens: int,
                      g: GraphSettings, query_len: int = 1) -> int:
    """The largest ``--max-num-seqs`` whose padded full batch stays within the slots.

    Monotone in the batch (a smaller batch never pads wider), so checking the full
    batch of each candidate is enough; the capture sizes themselves depend on it.
    """
    return _largest(slots, top_k,
                    lambda n: padded_batch(n, max_num_batched_tokens, g, query_len))


def rows_for_sizes(sizes: Sequence[int], query_len: int = 1) -> Callable[[int], int]:
    """Requests -> rows on capture sizes already fixed (0.26-0.33: vLLM's own, which the
    plugin reads): ``n x q`` tokens padded to the next size."""
    q = max(int(query_len), 1)
    fixed = list(sizes)
    return lambda n: padded(n * q, fixed)


def safe_for_sizes(slots: int, top_k: int, sizes: Sequence[int], query_len: int = 1) -> int:
    """The same, for capture sizes already fixed (the plugin reads vLLM's own)."""
    return safe_for_rows(slots, top_k, rows_for_sizes(sizes, query_len))


def safe_for_rows(slots: int, top_k: int, rows_of: Callable[[int], int]) -> int:
    """The largest batch whose decode step, ``rows_of(n)`` rows (the plugin's: vLLM's
    resolved grids, `rows_from_resolved`), stays within the slots."""
    return _largest(slots, top_k, rows_of)


def _largest(slots: int, top_k: int, padded_of: Callable[[int], int]) -> int:
    for n in range(slots // max(top_k, 1), 0, -1):
        if padded_of(n) * top_k <= slots:
            return n
    return 0


def normalise_vllm_args(args: Sequence[str]) -> list[str]:
    """The spellings vLLM's own parser accepts, reduced to one: ``--a_b`` -> ``--a-b``
    (before any ``.``), ``-O3`` / ``-O=3`` / ``-O 3`` -> ``--optimization-level 3``,
    ``-cc`` -> ``--compilation-config`` (dotted keys kept)."""
    out: list[str] = []
    for i, a in enumerate(args):
        if a.startswith("--"):
            key, sep, val = a.partition("=")
            head, dot, tail = key.partition(".")
            out.append(head.replace("_", "-") + dot + tail + sep + val)
        elif a.startswith("-cc"):
            out.append("--compilation-config" + a[3:])
        elif a.startswith("-O") and a != "-O":
            out += ["--optimization-level", a[3:] if a[2:3] == "=" else a[2:]]
        elif a == "-O" and i + 1 < len(args) and args[i + 1] in ("0", "1", "2", "3"):
            out.append("--optimization-level")
        else:
            out.append(a)
    return out


def _value(args: Sequence[str], name: str) -> tuple[bool, str | None]:
    """(present, value) of the last ``name V`` / ``name=V`` in normalised ``args``."""
    present, value = False, None
    for i, a in enumerate(args):
        if a == name:
            nxt = args[i + 1] if i + 1 < len(args) else None
            present, value = True, nxt if nxt is not None and not nxt.startswith("-") else None
        elif a.startswith(name + "="):
            present, value = True, a.split("=", 1)[1]
    return present, value


def _ints(raw: object, what: str, empty_ok: bool = False) -> tuple[int, ...]:
    """A list of sizes as a flag or a JSON key gives it (``empty_ok``: 0.34's split sizes,
    where an empty list means no graphs of that kind)."""
    try:
        if isinstance(raw, str):
            raw = json.loads(raw) if raw.strip().startswith("[") else raw.replace(",", " ").split()
        out = tuple(int(x) for x in raw)  # type: ignore[union-attr]
    except (ValueError, TypeError):
        raise UserError(f"vLLM argument {what} {raw!r} is not a list of batch sizes") from None
    if (not out and not empty_ok) or (out and min(out) < 1):
        raise UserError(f"vLLM argument {what} {raw!r} needs positive batch sizes")
    return out


def _list_after(args: Sequence[str], name: str) -> str | None:
    """``name 1 2 4`` (nargs='+') or ``name=[1,2,4]``: the values, joined."""
    out = None
    for i, a in enumerate(args):
        if a == name:
            vals = []
            for b in args[i + 1:]:
                if b.startswith("-"):
                    break
                vals.append(b)
            out = " ".join(vals)
        elif a.startswith(name + "="):
            out = a.split("=", 1)[1]
    return out


def _compilation_config(args: Sequence[str]) -> dict:
    """``--compilation-config JSON`` merged with its dotted ``--compilation-config.k=v``."""
    cc: dict = {}
    text = _value(args, "--compilation-config")[1]
    if text:
        try:
            cc = json.loads(text)
        except ValueError:
            raise UserError(f"vLLM argument --compilation-config {text!r} is not JSON") from None
        if not isinstance(cc, dict):
            raise UserError("vLLM argument --compilation-config must be a JSON object")
    for a in args:
        if a.startswith("--compilation-config.") and "=" in a:
            key, val = a[len("--compilation-config."):].split("=", 1)
            cc[key.replace("-", "_")] = val
    return cc


def _int(raw: object, what: str) -> int:
    try:
        return int(raw)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise UserError(f"vLLM argument {what} {raw!r} is not an integer") from None


def _eager(args: Sequence[str], cc: dict) -> list[str]:
    """The flags that make vLLM run without CUDA graphs, as the user spelled them."""
    eager: list[str] = []
    present, value = _value(args, "--enforce-eager")
    if present and (value is None or value.lower() in ("1", "true", "yes")):
        eager.append("--enforce-eager")
    if (_value(args, "--optimization-level")[1] or "").strip() == "0":
        eager.append("-O0")
    if str(cc.get("cudagraph_mode", "")).strip().upper() == "NONE":
        eager.append("cudagraph_mode NONE")
    return eager


def _legacy(args: Sequence[str], cc: dict,
            why: list[str]) -> tuple[tuple[int, ...] | None, int | None]:
    """(sizes, ceiling): the capture sizes and ceiling every release reads."""
    sizes = max_capture = None
    if cc.get("cudagraph_capture_sizes") is not None:
        sizes = _ints(cc["cudagraph_capture_sizes"], "compilation_config.cudagraph_capture_sizes")
        why.append("compilation_config.cudagraph_capture_sizes")
    listed = _list_after(args, "--cudagraph-capture-sizes")
    if listed is not None:
        sizes = _ints(listed, "--cudagraph-capture-sizes")
        why.append("--cudagraph-capture-sizes")
    for raw, what in ((cc.get("max_cudagraph_capture_size"), "max_cudagraph_capture_size"),
                      (_value(args, "--max-cudagraph-capture-size")[1],
                       "--max-cudagraph-capture-size")):
        if raw is not None:
            max_capture = _int(raw, what)
            why.append(what)
    return sizes, max_capture


def _mode(args: Sequence[str], cc: dict) -> tuple[str, str | None]:
    """(0.34's cudagraph mode, how the flags chose it; None: the default): ``cudagraph_mode``
    where given, else the optimisation level's (`MODE_BY_LEVEL`)."""
    given = str(cc.get("cudagraph_mode") or "").strip().upper()
    if given:
        return given, None if given == _DEFAULT_MODE else f"cudagraph_mode {given}"
    level = (_value(args, "--optimization-level")[1] or "").strip()
    mode = MODE_BY_LEVEL.get(level, _DEFAULT_MODE)
    return mode, None if mode == _DEFAULT_MODE else f"-O{level} (cudagraph_mode {mode})"


def _split(cc: dict, why: list[str]) -> dict:
    """0.34's own prefill/decode sizes and caps (`SPLIT_KEYS`), as `GraphSettings` fields."""
    out: dict = {}
    for field, key in SPLIT_KEYS.items():
        raw = cc.get(key)
        if raw is None:
            continue
        what = f"compilation_config.{key}"
        out[field] = (_ints(raw, what, empty_ok=True) if field.endswith("_sizes")
                      else _int(raw, what))
        why.append(key)
    return out


def settings_from_vllm_args(args: Sequence[str],
                            version: tuple[int, int] | None = None) -> GraphSettings:
    """The graph settings a user's vLLM flags make (``version`` default: the installed one).
    The cudagraph mode and 0.34's own size keys are read for 0.34 on (`REQUEST_GRID_FROM`);
    the releases before it take neither into their padding."""
    args = normalise_vllm_args(args)
    version = version if version is not None else installed_vllm.version()
    cc = _compilation_config(args)
    eager = _eager(args, cc)
    if eager:
        return GraphSettings(eager=True, source=", ".join(eager))

    why: list[str] = []
    sizes, max_capture = _legacy(args, cc, why)
    perf = (_value(args, "--performance-mode")[1] or "").lower()
    if perf == "interactivity":
        why.append("--performance-mode interactivity")
    request_grid = version is not None and version >= REQUEST_GRID_FROM
    mode, mode_why = _mode(args, cc)
    split = _split(cc, why) if request_grid else {}
    if request_grid and mode_why:
        why.append(mode_why)
    if split and (sizes is not None or max_capture is not None):
        raise UserError(
            "vLLM 0.34 refuses cudagraph_capture_sizes / max_cudagraph_capture_size together "
            f"with {', '.join(SPLIT_KEYS[k] for k in split)}: set only the latter "
            "(config/vllm.py:2717-2730)")
    if not why:
        why.append("vLLM's defaults" + (f" ({version[0]}.{version[1]})" if version
                                        else " (the 0.26-0.30 rule: no vLLM installed here)"))
    return GraphSettings(
        sizes=sizes, max_capture=max_capture, interactivity=perf == "interactivity",
        appends_max_num_seqs=version is not None and version >= APPENDS_MAX_NUM_SEQS_FROM,
        source=", ".join(why), request_grid=request_grid, mode=mode, **split,
    )


@dataclass(frozen=True)
class Release:
    """The vLLM release a plan pads batches for, and where that came from."""

    version: tuple[int, int]
    source: str
    known: bool  # given, or installed here; False: assumed (the newest known)

    @property
    def name(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"


def serving_release(given: str | None = None,
                    installed: tuple[int, int] | None | bool = True) -> Release:
    """The release to pad for: ``given`` (``--vllm-version``, "0.31" or "0.31.0"), else
    the one installed here, else the newest whose rule was read (stated as assumed).
    ``installed``: the installed version (tests), True to read it."""
    if given is not None:
        parts = given.strip().lstrip("v").split(".")
        try:
            version = (int(parts[0]), int(parts[1]))
            if len(parts) > 3 or any(int(p) < 0 for p in parts):
                raise ValueError
        except (ValueError, IndexError):
            raise UserError(f"--vllm-version wants a release like 0.31, got {given!r}") from None
        if not OLDEST_KNOWN <= version <= NEWEST_KNOWN:
            raise UserError(
                f"--vllm-version {given}: the plugin runs on vLLM {known_range()}")
        return Release(version, "given (--vllm-version)", True)
    here = installed_vllm.version() if installed is True else installed
    if here and OLDEST_KNOWN <= here <= NEWEST_KNOWN:
        return Release(here, "installed here", True)
    if here:  # a release whose rule was not read: padded as the most any known one pads
        return Release(here, f"installed here, outside the releases read ({known_range()})",
                       False)
    return Release(NEWEST_KNOWN, "none here: the newest known; --vllm-version X.Y for "
                   "another", False)


def batch_tokens(batch: int, max_num_seqs: int, max_num_batched_tokens: int,
                 g: GraphSettings, query_len: int = 1) -> int:
    """Tokens a decode step of ``batch`` sequences (``query_len`` tokens each) runs at on a
    server of ``max_num_seqs``: the smallest capture size >= its tokens, else its tokens
    (eager); from 0.34 the decode graph of whole requests that holds it (`decode_rows`)."""
    if g.request_grid:
        return decode_rows(batch, max_num_seqs, max_num_batched_tokens, g, query_len)
    q = max(int(query_len), 1)
    return padded(batch * q, capture_sizes(max_num_seqs * q, max_num_batched_tokens, g))
