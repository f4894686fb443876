"""Slot memory in vLLM's memory plan: the KV cache must shrink by the slots' bytes.

How vLLM sizes its KV cache differs by release (`plan_mechanism` reads which, from
``vllm.utils.mem_utils.memory_profiling``):

- vLLM 0.26 (`WEIGHTS`): ``requested - non-KV`` where the non-KV part is the weights it
  measured while loading (``model_runner.model_memory_usage``) plus what its profile run
  adds (torch's peak increase, the non-torch increase) on top of a snapshot taken
  *after* loading: memory allocated between the two is seen by neither. Handled below.
- vLLM 0.33 (`MEASURED`): the non-KV part is the drop in free device memory
  (``mem_get_info``) since before the engine started, plus the profile's transient peak;
  ``model_memory_usage`` is passed along but no longer read. The slots, allocated before
  the profile, are in that drop: vLLM counts them itself, and nothing is added.

The 0.26 story: The plugin allocates
the slot buffers right after ``Worker.load_model`` returns, between those two
measurements, so neither sees them: at ``--gpu-memory-utilization 0.3`` the
KV cache took the same 41 GiB with 8.4 GiB of slots as without, the server overshot its
budget by the slot bytes, and on an emulated 24 GiB card it ran out of memory at start.

The fix is one addition: the slot bytes join ``model_memory_usage`` (the same attribute
in the V1 and V2 model runners of vLLM 0.26 and 0.33), so the profile's weight term
counts them and the KV cache vLLM chooses is smaller by exactly that much. The check
comes before any slot is allocated: a runner without the attribute cannot account for
slots, and arming there would silently overshoot, so the model is not armed.

`kv_line` words what vLLM then chose, logged once `determine_available_memory` returns.

A cold start costs KV too, and not because of the slots: vLLM compiles the model
(torch.compile, Inductor) during the same profile step, and a cold compile's temporary
allocations count as activations there (vLLM issue #54122, open in 0.26 and 0.33), so the
first start of a model and context gets less KV cache than a restart with the compile
cache warm. On a card sized to the last slot that can be the difference between starting
and not (the 24 GiB W8A8 card: 0.52 GiB of peak before the first MoE call in the one
server of three that compiled). `expertcache serve` therefore hands vLLM the KV size
(``--kv-cache-memory-bytes``), and the line says so; where vLLM sized it itself,
`compiled_here` tells the memory lines when a compile happened, so the user restarts
before giving up slots.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

GiB = 1024**3

#: the model runner attribute vLLM's KV sizing reads as the weights' bytes
WEIGHTS_ATTR = "model_memory_usage"

#: how vLLM sizes its KV cache (`plan_mechanism`): the weights attribute plus the
#: profile's increase (0.26), or the free-memory drop it measures (0.33)
WEIGHTS, MEASURED = "weights", "measured"


def plan_mechanism(profiling: Any = None) -> str | None:
    """`WEIGHTS` or `MEASURED`: what vLLM's ``memory_profiling`` (or ``profiling``, a
    function with its source) computes the non-KV memory from; None when neither is
    recognised (or vLLM is not importable)."""
    import inspect

    try:
        if profiling is None:
            from vllm.utils.mem_utils import memory_profiling as profiling
        src = "".join(inspect.getsource(profiling).split())
    except Exception:
        return None
    if "non_kv_cache_memory=result.total_consumed" in src:
        return MEASURED
    if "non_kv_cache_memory=(" in src and "result.weights_memory)" in src:
        return WEIGHTS
    return None


#: the tag of vLLM's sleep-mode pool the slots and the wide-step scratch are allocated
#: under: the weights' own, so they sleep, wake and are discarded exactly as the weights
SLEEP_TAG = "weights"


def sleep_pool(worker: Any) -> tuple[Any, str | None]:
    """Where the slots and the scratch are allocated under vLLM's sleep mode: (a
    zero-argument callable returning the allocation context, or None; why the cache
    cannot be armed, or None).

    Sleep mode (``--enable-sleep-mode``, vLLM 0.26 and 0.33) allocates the weights inside
    ``CuMemAllocator.use_memory_pool(tag="weights")`` and ``sleep()`` frees that pool
    (level 1 backs it up to host memory, level 2 discards it); the plugin allocates
    after the load, outside it, so ``sleep()`` would keep every slot. Allocated under the
    same tag, the slots and the scratch sleep and wake with the weights at the same
    virtual addresses (captured CUDA graphs stay valid); after a wake of the weights the
    slots are emptied (`Worker.wake_up` hook), since a level-2 sleep left them garbage.
    The cache's small state (table, counters) stays outside: it survives any sleep.
    Another sleep backend (0.33's ``--sleep-mode-backend``) is refused: what it frees is
    not known."""
    mc = getattr(getattr(worker, "vllm_config", None), "model_config", None)
    if not getattr(mc, "enable_sleep_mode", False):
        return None, None
    backend = getattr(mc, "sleep_mode_backend", "cumem") or "cumem"
    if backend != "cumem":
        return None, (f"sleep mode with the {backend!r} backend: the slots cannot be put in "
                      "what it frees, so sleep() would keep them in VRAM; serve with "
                      "--sleep-mode-backend cumem or without --enable-sleep-mode")
    try:
        from vllm.device_allocator import get_mem_allocator_instance

        allocator = get_mem_allocator_instance()
        use = allocator.use_memory_pool
    except Exception as exc:
        return None, (f"sleep mode: vLLM's sleep-mode allocator is not reachable "
                      f"({exc.__class__.__name__}: {exc}), so sleep() would keep the slots "
                      "in VRAM; serve without --enable-sleep-mode")
    kept: list[Any] = []

    @contextlib.contextmanager
    def pool() -> Iterator[None]:
        # Each ``use_memory_pool`` opens a new torch MemPool and files it as the tag's only
        # record (``allocator_and_pools[tag]``), dropping the one filed before (the weights'
        # pool from the load, or this plugin's previous one). Dropped inside the new pool's
        # context, PyTorch releases it there and aborts the process (its caching allocator
        # asserts that no pool is being allocated to). Every pool filed under the tag is
        # kept alive here, as vLLM keeps its own.
        kept.append(getattr(allocator, "allocator_and_pools", {}).get(SLEEP_TAG))
        with use(tag=SLEEP_TAG):
            yield

    return pool, None


def accounting_refusal(worker: Any, mechanism: str | None = WEIGHTS) -> str | None:
    """Why slot memory could not enter this worker's memory plan, or None (`MEASURED`:
    vLLM measures it; nothing to add, nothing to refuse)."""
    if mechanism == MEASURED:
        return None
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return "the vLLM worker has no model_runner (unknown layout)"
    if loaded_weights(worker) is None:
        return (
            f"{type(runner).__name__}.{WEIGHTS_ATTR} is not a byte count, so the slots could "
            "not be counted in vLLM's memory plan (the KV cache would take their memory)"
        )
    return None


def count_as_weights(worker: Any, slot_bytes: int) -> int:
    """Add ``slot_bytes`` to the weights vLLM plans around; returns the new weight bytes."""
    runner = worker.model_runner
    total = int(getattr(runner, WEIGHTS_ATTR)) + int(slot_bytes)
    setattr(runner, WEIGHTS_ATTR, total)
    return total


#: how much more than the plan vLLM may load before the start is warned: below it, the
#: plan's headroom (a tenth of the card) absorbs the difference
WEIGHTS_TOLERANCE = GiB // 4


def loaded_weights(worker: Any) -> int | None:
    """The bytes vLLM measured while loading the model (its ``model_memory_usage``, read
    before the slots join it), or None where the runner does not say."""
    value = getattr(getattr(worker, "model_runner", None), WEIGHTS_ATTR, None)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    return int(value)


def weights_warning(loaded: int | None, planned: int | None,
                    bytes_per_slot: int | None = None) -> str | None:
    """The warning for a start whose model took more VRAM than `expertcache serve`
    planned, or None.

    Why: the plan hands vLLM a KV cache sized from what it expects the weights to take; a
    buffer the plan does not know of (vLLM's 2.5 GiB rotary cache for Llama 4 Scout was
    one) comes out of the room left for the KV cache and the first start's compile, and
    the start then fails inside vLLM with a bare CUDA out-of-memory error. Said before
    that happens, with the difference and what to give up for it."""
    if loaded is None or planned is None or loaded - planned <= WEIGHTS_TOLERANCE:
        return None
    extra = loaded - planned
    fewer = f" or {-(-extra // bytes_per_slot)} fewer slot(s)" if bytes_per_slot else ""
    return (f"expertcache: vLLM loaded {loaded / GiB:.2f} GiB of weights where `expertcache "
            f"serve` planned {planned / GiB:.2f} GiB: the {extra / GiB:.2f} GiB more comes "
            "out of the room planned for the KV cache and the first start's compile, and "
            f"this start may run out of memory; serve with --vram {extra / GiB:.2f} GiB "
            f"lower{fewer}, and report the model: its plan misses something vLLM holds")


def explicit_kv_bytes(worker: Any) -> int | None:
    """``--kv-cache-memory-bytes`` when it was given (by the user, or by `expertcache
    serve`, which plans it): vLLM then sizes no KV cache from its profile."""
    cache_config = getattr(worker, "cache_config", None)
    value = getattr(cache_config, "kv_cache_memory_bytes", None)
    return int(value) if value else None


def kv_line(slot_bytes: int, weights_bytes: int, kv_bytes: int | None, explicit: bool,
            scratch_bytes: int = 0, mechanism: str | None = WEIGHTS) -> str:
    """The memory line after vLLM sized its KV cache: slots (and the wide-step scratch),
    how they entered vLLM's plan (``mechanism``), and the KV it chose."""
    what = f"{slot_bytes / GiB:.2f} GiB of slots"
    if scratch_bytes:
        what += f" and {scratch_bytes / GiB:.2f} GiB of wide-step scratch"
    if mechanism == MEASURED:
        head = (f"expertcache: memory plan: {what} allocated before vLLM's memory profile, "
                "which counts them (this vLLM sizes its KV cache from the free device memory "
                "it measures)")
    else:
        head = (f"expertcache: memory plan: {what} counted as weights "
                f"({weights_bytes / GiB:.2f} GiB in all)")
    if kv_bytes is None:
        return head + "; vLLM reported no KV cache size"
    if explicit:
        return (
            head + f"; --kv-cache-memory-bytes fixes the KV cache at {kv_bytes / GiB:.2f} GiB "
            "(`expertcache serve` plans it beside the weights, slots and runtime), so vLLM's "
            "profile step, a cold compile included, does not size it"
        )
    return head + f"; vLLM chose {kv_bytes / GiB:.2f} GiB of KV cache"


def compiled_here() -> int:
    """Graphs this process compiled from scratch with Inductor so far: nonzero on a cold
    start, 0 on a warm one or where nothing says.

    vLLM's own counter (``num_inductor_compiles``) is not enough: it also counts graphs that
    vLLM's cache missed but Inductor's FX-graph cache served (vLLM 0.26: 46 of a
    warm start's 49 graphs, loaded in 1.9 s, with +0.13 GiB above allocated at the first
    MoE call against a cold start's +0.52). Inductor's cache counters say which graphs it
    generated code for: misses are cold compiles; hits and no misses, a warm start. Only
    where Inductor's cache saw nothing (caches off) does vLLM's count stand."""
    try:
        from torch._dynamo.utils import counters
    except Exception:
        counters = {}
    inductor = counters.get("inductor", {})
    aot = counters.get("aot_autograd", {})
    misses = _count(inductor.get("fxgraph_cache_miss", 0))
    if misses:
        return misses
    if _count(inductor.get("fxgraph_cache_hit", 0)) or _count(aot.get("autograd_cache_hit", 0)):
        return 0
    try:
        from vllm.compilation.counter import compilation_counter
    except Exception:
        return 0
    return _count(getattr(compilation_counter, "num_inductor_compiles", 0))


def _count(value: object) -> int:
    """``value`` if it is a count (an int, not a bool), else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def cold_compile_note(compiled: int) -> str:
    """What a cold compile inside vLLM's profile step means for the KV cache ('' if none)."""
    if compiled <= 0:
        return ""
    return (f"; this start compiled {compiled} graph(s) inside vLLM's memory profile, which "
            "counts a cold compile's temporaries as activations (vLLM issue #54122): a "
            "restart with the compile cache now warm may get more KV cache")


def one_sequence_kv_bytes(worker: Any) -> int:
    """KV bytes vLLM needs to hold one ``--max-model-len`` sequence (its own check's sum
    over the attention layers' specs); raises where this vLLM words its specs otherwise."""
    specs = worker.get_kv_cache_spec()
    config = worker.vllm_config
    return int(sum(spec.max_memory_usage_bytes(config) for spec in specs.values()))


def kv_shortfall_line(kv_bytes: int, need_bytes: int, max_model_len: int,
                      slot_row_bytes: int, slots: list[int]) -> str | None:
    """The line that says why vLLM is about to refuse to start, and how to fix it, when
    its KV cache after the slots cannot hold one ``max_model_len`` sequence; None when it
    can. ``slot_row_bytes``: what one slot fewer in every armed layer frees; ``slots``:
    each armed layer's slot count."""
    if kv_bytes >= need_bytes:
        return None
    short = need_bytes - kv_bytes
    fewer = math.ceil(short / slot_row_bytes) if slot_row_bytes > 0 else 0
    fits = max(0, int(max_model_len * kv_bytes / need_bytes))
    if 0 < fewer < min(slots):
        uniform = len(set(slots)) == 1
        to = slots[0] - fewer
        how = (f" (EXPERT_CACHE_SLOTS={to}, or `expertcache serve --slots {to}`)" if uniform
               else " (each entry of the per-layer plan)")
        fix = f"serve with {fewer} fewer slots a layer{how} or --max-model-len at most about {fits}"
    else:
        fix = f"lower --max-model-len to about {fits}"
    return (f"expertcache: after the slots, vLLM's KV cache ({kv_bytes / GiB:.2f} GiB) cannot "
            f"hold one --max-model-len {max_model_len} sequence ({need_bytes / GiB:.2f} GiB), "
            f"so vLLM will refuse to start; {fix}")
