"""Subcommands. Each module defines ``register(app)``; this list is the CLI's table of contents."""

from __future__ import annotations

import importlib
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import typer

from ..errors import UserError

#: module name -> registered by that module's ``register(app)``
COMMAND_MODULES = ["replay", "trace", "plan", "baseline", "size", "build_kernels", "probe_link",
                   "serve"]

#: ``--vram`` wherever a card is planned for (`cards.parse_vram` reads it)
VRAM_HELP = ("the card: GiB of VRAM (24), or its name (rtx-4090, l4, a10g, rtx-3090, rtx-5090, "
             "a6000, l40s, ...: the memory it reports)")

#: the bundled trace `expertcache replay` uses when given none (see traces/README.md)
DEMO_TRACE = "real-qwen3-30b-a3b-k6.npz"


def register_all(app: typer.Typer) -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(app)


def demo_trace_path(name: str = DEMO_TRACE) -> Path:
    """Where the bundled demo traces live (shipped inside the package as ``traces/``)."""
    path = Path(__file__).resolve().parent.parent / "traces" / name
    if not path.exists():
        raise UserError(f"bundled demo trace {name} is missing from {path.parent}; pass a TRACE")
    return path


def parse_int_list(text: str, option: str) -> list[int]:
    """'16,32,64' -> [16, 32, 64]; anything else is a usage error naming the option."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{option} wants comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise UserError(f"{option} wants positive integers, got {text!r}")
    return list(dict.fromkeys(values))


def parse_budgets(text: str | None, num_experts: int, top_k: int = 0) -> list[int]:
    """``--slots`` for a trace of ``num_experts``: positive and each below E
    (`budget.budgets_below`); None: `budget.default_budgets`."""
    from ..rules.budget import budgets_below, default_budgets

    if text is None:
        return default_budgets(num_experts, top_k)
    budgets = parse_int_list(text, "--slots")
    try:
        return budgets_below(budgets, num_experts, "the trace's ")
    except ValueError as exc:
        raise UserError(f"--slots {exc}") from None


def finite(obj: Any) -> Any:
    """``obj`` with every float that is not finite (NaN, inf: a percentile of nothing, a
    ratio to zero) as None, numpy scalars as Python ones, recursively."""
    if hasattr(obj, "item") and not hasattr(obj, "__len__"):
        obj = obj.item()  # a numpy scalar
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def json_text(obj: Any) -> str:
    """What every ``--json`` prints and every saved JSON holds: strict JSON (RFC 8259 has no
    NaN; Python's default writes it, and `jq`, browsers and strict parsers refuse the
    file), undefined numbers as null (`finite`)."""
    return json.dumps(finite(obj), indent=2, allow_nan=False)


def _before_dashes(extra: list[str], argv: Sequence[str] | None) -> list[str]:
    """The words of click's leftover ``extra`` that came before ``--`` on the command line
    (``argv``, default the process's): the rest are vLLM's."""
    argv = list(sys.argv[1:] if argv is None else argv)
    after = argv[argv.index("--") + 1:] if "--" in argv else []
    return extra[: max(0, len(extra) - len(after))]


def passthrough_args(extra: Sequence[str], argv: Sequence[str] | None = None) -> list[str]:
    """The arguments for vLLM: the ones after ``--``. Anything else left over is a word we
    do not know before the ``--``, most likely a typo of one of our own options: refused
    in one line instead of silently passed on (or, for `size`, silently ignored). A
    ``--revision`` among them is the one vLLM loads a Hub id at, so the sizing reads that
    revision's config too (`hub.REVISION`)."""
    extra = list(extra)
    stray = _before_dashes(extra, argv)
    if stray:
        raise UserError(
            f"unknown option or argument {stray[0]!r} (vLLM's flags go after --, e.g. "
            f"`-- {stray[0]} ...`)"
        )
    from ..sizing import hub  # here, not at start-up: only vLLM's flags need them
    from ..vllm_facts import vllm_flags

    revision = vllm_flags.vllm_flag_value(extra, "--revision")
    if revision:
        hub.REVISION.set(revision)
    return extra


def model_word(extra: Sequence[str], argv: Sequence[str] | None = None
               ) -> tuple[str | None, list[str]]:
    """A model named as the first word (`size Qwen/Qwen3-30B-A3B`), the way `serve MODEL`
    and `vllm serve MODEL` take it, and the rest of ``extra``. Only a word before ``--``
    counts: everything after it is vLLM's."""
    extra = list(extra)
    before = _before_dashes(extra, argv)
    if before and not before[0].startswith("-"):
        return before[0], extra[1:]
    return None, extra


def trace_argument(path: Path | None, extra: Sequence[str], model_goes: str
                   ) -> tuple[Path | None, list[str]]:
    """`replay`'s and `plan`'s optional TRACE and click's leftover words. With no TRACE,
    click takes the first vLLM flag after ``--`` for it: that flag goes back to the words.
    A TRACE that is no file and reads like a model id means the user gave the model where
    the trace goes, so the line says where each belongs (``model_goes``) instead of only
    'no such file'."""
    extra = list(extra)
    if path is not None and str(path).startswith("-"):
        return None, [str(path), *extra]
    if path is None or path.exists() or path.suffix in (".npz", ".csv", ".jsonl"):
        return path, extra
    raise UserError(
        f"{path}: no such trace file (TRACE is a routing trace .npz: the bundled demo when "
        f"left out, or one `expertcache trace` makes or imports; {model_goes})"
    )


#: the help both `replay` and `plan` give their wide-step options
WIDE_HELP = ("what a step wider than the slots does: in-place (the plugin's default), staged "
             "(hits from slots, misses fetched once into a scratch) or staged-install")
BATCH_HELP = ("re-batch the trace's decode steps into N interleaved streams (what N users "
              "would cost), each step padded as the server pads it (--max-num-seqs, the "
              "vLLM flags after --, --vllm-version); default: the trace as recorded")
MAX_NUM_SEQS_HELP = ("the server's --max-num-seqs, which decides how --batch is padded (wins "
                     "over the flag after --); default: the flag after --, else the batch")
VLLM_VERSION_HELP = ("the vLLM release the server runs (X.Y, 0.26-0.34): 0.31+ capture a "
                     "full batch of --max-num-seqs unpadded, 0.34 pads decode steps by "
                     "request count; default: the installed one, else the newest known")


def wide_option(text: str):
    """The ``--wide`` option as a `Wide`, or one line naming the choices: the command line
    is where the mode is parsed, everything below takes the type."""
    from ..rules.policy import Wide

    try:
        return Wide.parse(text)
    except ValueError as exc:
        raise UserError(f"--wide: {exc}") from None


def workload(trace, wide: str, batch: int | None, batch_tokens: int | None = None):
    """The trace as the user asked to model it, and the wide-step mode, from the options
    `replay` and `plan` share (one line on a bad value). ``batch_tokens``: what a step of
    the batch runs at on the server (`serving.Server.batch_tokens`)."""
    from ..planning.rebatch import rebatch

    mode = wide_option(wide)
    if batch is not None:
        trace = rebatch(trace, batch, batch_tokens)
    return trace, mode


def select_kernels() -> None:
    """Hand the device binding the environment's choice of kernels (``EXPERT_CACHE_LIB``,
    ``EXPERT_CACHE_PDL``) before a command loads them: the binding reads no environment,
    so the command, which runs on the user's, says it."""
    from ..config import kernel_source
    from ..device import binding

    binding.select(*kernel_source())
