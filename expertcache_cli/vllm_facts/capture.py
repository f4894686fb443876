"""vLLM's CUDA-graph batch padding, as the sizing trap must count it.

Why: with CUDA graphs on (vLLM's default) a decode batch of ``n`` sequences runs the
graph captured for the smallest capture size ``>= n``, so every layer sees the padded
token count. The plugin's shape gate serves a step from slots only when ``tokens x
top_k <= slots``, and it sees the padded tokens: at 84 slots and top-8, "10 sequences
x 8 = 80 ids" looks safe, but vLLM 0.26 pads 10 to 16 and 128 ids read through. So the
safe ``--max-num-seqs`` is the largest whose *padded* batch fits.

The capture sizes follow vLLM's `VllmConfig._set_cudagraph_sizes` (read in 0.26.0 and
0.33.0): without explicit sizes, ``[1, 2, 4]`` then steps of 8 below 256 and of 16
above, up to ``min(2 x max_num_seqs, 512)`` and ``max_num_batched_tokens``, plus
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
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..errors import UserError
from . import installed_vllm
from .releases import NEWEST_KNOWN, OLDEST_KNOWN, known_range  # the releases read

#: the vLLM release from which the uniform decode size (max_num_seqs) is also captured
#: (read in 0.30.0, which does not, and 0.31.0, which does)
APPENDS_MAX_NUM_SEQS_FROM = (0, 31)
_DEFAULT_MAX_GRAPH = 512
#: capture ceilings a model's vLLM config sets where the user set no capture sizes nor
#: ceiling (`vllm/model_executor/models/config.py`, read in 0.26.0 and 0.33.0)
MODEL_MAX_CAPTURE = {"GptOssForCausalLM": 1024}


@dataclass(frozen=True)
class GraphSettings:
    """What decides vLLM's capture sizes, read from a user's vLLM flags."""

    eager: bool = False
    sizes: tuple[int, ...] | None = None
    max_capture: int | None = None
    interactivity: bool = False
    appends_max_num_seqs: bool = False
    source: str = "vLLM's defaults"


def for_model(g: GraphSettings, architectures: Sequence[str]) -> GraphSettings:
    """``g`` as vLLM applies it to a model of ``architectures`` (its config.json's): the
    model's own capture ceiling where the user's flags left sizes and ceiling to vLLM."""
    if g.eager or g.sizes is not None or g.max_capture is not None:
        return g
    for arch in architectures:
        ceiling = MODEL_MAX_CAPTURE.get(arch)
        if ceiling is not None:
            return replace(g, max_capture=ceiling,
                           source=f"{arch}'s vLLM config: captured up to {ceiling} tokens")
    return g


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, g: GraphSettings) -> list[int]:
    """The batch sizes vLLM captures graphs for (empty when it runs eagerly)."""
    if g.eager:
        return []
    if g.sizes is not None:
        return sorted({s for s in g.sizes if s <= max_num_batched_tokens})
    top = g.max_capture if g.max_capture is not None else min(2 * max_num_seqs, _DEFAULT_MAX_GRAPH)
    top = min(top, max_num_batched_tokens)
    sizes = list(range(1, min(top, 32) + 1)) if g.interactivity else [
        s for s in (1, 2, 4) if s <= top]
    if top >= 8:
        sizes += range(8, min(top + 1, 256), 8)
    if top >= 256:
        sizes += range(256, top + 1, 16)
    if max_num_batched_tokens <= top:
        sizes.append(max_num_batched_tokens)
    if g.appends_max_num_seqs and g.max_capture is None and max_num_seqs <= top:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def padded(n: int, sizes: Sequence[int]) -> int:
    """The token count a batch of ``n`` runs at: the smallest capture size >= n, else n."""
    fits = [s for s in sizes if s >= n]
    return min(fits) if fits else n


def padded_batch(max_num_seqs: int, max_num_batched_tokens: int, g: GraphSettings,
                 query_len: int = 1) -> int:
    """Tokens of the widest decode step: a full batch of ``max_num_seqs``, padded.
    ``query_len``: tokens a sequence carries in a decode step, ``1 + k`` under speculative
    decoding with ``k`` draft tokens (the verify step scores them all); vLLM then sizes
    its capture list for ``max_num_seqs x query_len`` tokens."""
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


def safe_for_sizes(slots: int, top_k: int, sizes: Sequence[int], query_len: int = 1) -> int:
    """The same, for capture sizes already fixed (the plugin reads vLLM's own)."""
    q = max(int(query_len), 1)
    return _largest(slots, top_k, lambda n: padded(n * q, sizes))


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


def _ints(raw: object, what: str) -> tuple[int, ...]:
    try:
        if isinstance(raw, str):
            raw = json.loads(raw) if raw.strip().startswith("[") else raw.replace(",", " ").split()
        out = tuple(int(x) for x in raw)  # type: ignore[union-attr]
    except (ValueError, TypeError):
        raise UserError(f"vLLM argument {what} {raw!r} is not a list of batch sizes") from None
    if not out or min(out) < 1:
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


def settings_from_vllm_args(args: Sequence[str],
                            version: tuple[int, int] | None = None) -> GraphSettings:
    """The graph settings a user's vLLM flags make (``version`` default: the installed one)."""
    args = normalise_vllm_args(args)
    version = version if version is not None else installed_vllm.version()
    eager: list[str] = []
    present, value = _value(args, "--enforce-eager")
    if present and (value is None or value.lower() in ("1", "true", "yes")):
        eager.append("--enforce-eager")
    if (_value(args, "--optimization-level")[1] or "").strip() == "0":
        eager.append("-O0")
    cc = _compilation_config(args)
    if str(cc.get("cudagraph_mode", "")).strip().upper() == "NONE":
        eager.append("cudagraph_mode NONE")
    if eager:
        return GraphSettings(eager=True, source=", ".join(eager))

    why: list[str] = []
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
        if raw is None:
            continue
        try:
            max_capture = int(raw)
        except (TypeError, ValueError):
            raise UserError(f"vLLM argument {what} {raw!r} is not an integer") from None
        why.append(what)
    mode = (_value(args, "--performance-mode")[1] or "").lower()
    if mode == "interactivity":
        why.append("--performance-mode interactivity")
    if not why:
        why.append("vLLM's defaults" + (f" ({version[0]}.{version[1]})" if version
                                        else " (the 0.26-0.30 rule: no vLLM installed here)"))
    return GraphSettings(
        sizes=sizes, max_capture=max_capture, interactivity=mode == "interactivity",
        appends_max_num_seqs=version is not None and version >= APPENDS_MAX_NUM_SEQS_FROM,
        source=", ".join(why),
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
                 g: GraphSettings) -> int:
    """Tokens a decode step of ``batch`` sequences runs at on a server of
    ``max_num_seqs``: the smallest capture size >= the batch, else the batch (eager)."""
    return padded(batch, capture_sizes(max_num_seqs, max_num_batched_tokens, g))
