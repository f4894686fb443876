"""The vLLM plugin: a slot cache in front of every offloaded fused-MoE layer.

vLLM calls `register()` through the ``vllm.general_plugins`` entry point in every
process it starts (API server, engine core, workers), sometimes more than once, so it
is cheap, idempotent and imports nothing heavy: it validates the environment (a bad
value stops ``vllm serve`` with one line naming the variable), checks the vLLM version,
and arranges for `Worker.load_model` to be wrapped when, and only if, the process
imports vLLM's GPU worker. After the stock ``load_model`` returns (weights loaded,
processed and offloaded; nothing compiled or captured yet) the worker's model is armed
(`session.arm_model`) and the slot bytes join the weights vLLM plans its KV cache
around (`memory`); once vLLM has sized the KV cache, one line says what it chose. The
final counters line is logged when the engine's busy loop
ends (`_patch_engine_loop`) or, failing that, at worker shutdown or exit. Everything that
goes wrong after startup is logged and leaves the affected layer, or the whole model, on
vLLM's stock path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..config import FRACTION, SLOTS, CacheConfig, ConfigError, from_env
from ..vllm_facts.releases import version_refusal
from ..vllm_facts.vllm_runner import runner_ignores_offload
from . import memory, reoffload
from .compat import layout_refusal

log = logging.getLogger("vllm.expertcache")

#: the module whose `Worker` class is wrapped (same path in vLLM 0.26 .. 0.34)
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
#: Where vLLM's engine-core process runs its loop (the final counters are logged as it ends).
ENGINE_CORE_MODULE = "vllm.v1.engine.core"

#: `Worker` methods after which the experts' bytes may differ from what the slots hold
#: (read in vLLM 0.26.0's and 0.33.0's gpu_worker.py): every slot is emptied after each.
#: The weight-transfer API (start/update/finish_weight_update, what RL trainers call)
#: bypasses ``reload_weights``: chunks land in place between start and finish (a
#: layerwise reload keeps the layer's tensors on the meta device until its last chunk),
#: so the slots are emptied once the update is finished, before any step can run.
#: ``reset_weights`` (0.33) zeroes the weights in place. ``wake_up`` is handled apart
#: (`_wakes_weights`).
WEIGHT_CHANGES: tuple[tuple[str, str], ...] = (
    ("reload_weights", "vLLM reloaded the weights"),
    ("finish_weight_update", "vLLM finished a weight update (weight transfer)"),
    ("reset_weights", "vLLM reset the weights"),
)
WAKE_WHY = ("vLLM woke its weights from sleep (which may have discarded the slots and "
            "replaced the weights)")
#: `Worker` methods of the weight-transfer API whose failure may leave the weights part
#: new, part old (0.34: "Starting may already move weights; only a successful finish
#: restores them"): the slots are emptied (no sweep: the layer may be mid-update) and the
#: exception goes on to vLLM
WEIGHT_UPDATE_STEPS = ("start_weight_update", "start_draft_weight_update", "update_weights",
                       "finish_weight_update")
FAILED_UPDATE_WHY = "a weight update failed part-way (vLLM's {}): the weights may be part new"

_registered = False
_config: CacheConfig | None = None


class _PatchingLoader(importlib.abc.Loader):
    """Runs ``callback(module)`` right after the real loader executed the module."""

    def __init__(self, inner: Any, callback: Callable[[ModuleType], None]) -> None:
        self._inner = inner
        self._callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for inspect
        return getattr(self._inner, name)


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Patch a module when it is first imported, without importing it ourselves.

    Importing vLLM's GPU worker from `register()` would drag CUDA-facing code into the
    API server process; waiting for vLLM to import it costs nothing.
    """

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, self._fire)
        return spec

    def _fire(self, module: ModuleType) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self.callback(module)


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` now if ``name`` is imported, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    sys.meta_path.insert(0, _PostImportHook(name, callback))


def register() -> None:
    """vLLM's ``general_plugins`` entry point (see the module docstring)."""
    global _registered, _config
    if _registered:
        return
    _registered = True
    try:
        cfg = from_env()
    except ConfigError as exc:
        # One line, no traceback, before vLLM starts anything.
        raise SystemExit(f"expertcache: error: {exc}") from None
    _config = cfg
    if cfg.disabled:
        log.warning("expertcache: EXPERT_CACHE_DISABLE=1: no layer will be armed (stock path)")
    elif not cfg.asked:  # opt-in: installed is not asked
        log.info("expertcache: installed but not asked for (no %s or %s, which `expertcache "
                 "serve` sets): nothing is armed, vLLM serves on its stock path", SLOTS,
                 FRACTION)
        return
    try:
        import vllm

        version = getattr(vllm, "__version__", "unknown")
    except Exception:  # pragma: no cover - the entry point is only called by vLLM
        return
    why = version_refusal(version)
    if why:
        if not cfg.disabled:
            log.warning("expertcache: %s; the cache is NOT armed, serving on the stock path",
                        why)
        return
    # the control run too (EXPERT_CACHE_DISABLE=1): the floor offloads what the cache does
    when_imported(reoffload.LOADER_UTILS_MODULE, _patch_reoffload)
    if cfg.disabled:
        return
    when_imported(WORKER_MODULE, lambda m: _patch_worker(m, cfg, version))
    when_imported(ENGINE_CORE_MODULE, _patch_engine_loop)


#: what `reoffload` moved back in this process (its line joins the arming summary)
REOFFLOADED = reoffload.Tally(lambda: log.warning(
    "expertcache: vLLM's weight processing left offloaded weights in VRAM under their "
    "offload mark (its repack rebinds them in place); moving them back to host memory, "
    "layer by layer"))


def _patch_reoffload(module: ModuleType) -> None:
    """Complete `device_loading_context`'s exit (`reoffload`); a module without it is said."""
    why = reoffload.patch_loader_utils(module, REOFFLOADED)
    if why:
        log.warning("expertcache: %s", why)


def _patch_engine_loop(module: ModuleType) -> None:
    """Log the final counters as the engine's busy loop ends, not only at worker shutdown.

    Why: after the loop vLLM restores the default SIGINT/SIGTERM handlers and then tears
    down; a Ctrl-C at a terminal signals the whole process group, so the engine's second
    signal (its API server's SIGTERM) can land in that teardown and kill it before
    `Worker.shutdown` logs the final line. Right after the loop vLLM's own handlers are
    still in place. Only a normal end or SystemExit (the shutdown path) reports; an engine
    failing with an exception is left to vLLM untouched. Sessions live in the process that
    runs the model, so where the workers are other processes this logs nothing here.
    """
    from .session import close_all

    for cls_name in ("EngineCoreProc", "DPEngineCoreProc"):
        cls = getattr(module, cls_name, None)
        orig = cls.__dict__.get("run_busy_loop") if cls is not None else None
        if orig is None or getattr(orig, "_expertcache_wrapped", False):
            continue

        def run_busy_loop(self: Any, *args: Any, _orig: Any = orig, **kwargs: Any) -> Any:
            try:
                out = _orig(self, *args, **kwargs)
            except SystemExit:
                close_all()
                raise
            close_all()
            return out

        run_busy_loop.__name__, run_busy_loop.__qualname__ = orig.__name__, orig.__qualname__
        run_busy_loop.__doc__ = orig.__doc__
        run_busy_loop._expertcache_wrapped = True  # type: ignore[attr-defined]
        cls.run_busy_loop = run_busy_loop


def _patch_worker(module: ModuleType, cfg: CacheConfig, version: str) -> None:
    """Wrap `Worker.load_model` (arm), `execute_model` (stats), `shutdown` (flush) and,
    where present, the weight changes (empty the slots), `compile_or_warm_up_model` (empty
    them of the warm-up's experts) and `determine_available_memory` (the memory-plan
    line)."""
    worker_cls = getattr(module, "Worker", None)
    if worker_cls is None or getattr(worker_cls, "_expertcache_patched", False):
        return
    missing = [m for m in ("load_model", "execute_model", "shutdown") if not hasattr(worker_cls, m)]
    if missing:
        log.warning("expertcache: vLLM Worker lacks %s; the cache is NOT armed", ", ".join(missing))
        return
    orig_load = worker_cls.load_model
    orig_exec = worker_cls.execute_model
    orig_shutdown = worker_cls.shutdown

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        why = runner_ignores_offload(self, sys.modules, version)
        if why:  # vLLM's own failure follows (OOM) or the card is overshot: say why first
            log.error("expertcache: %s", why)
        out = orig_load(self, *args, **kwargs)
        moved = REOFFLOADED.line()
        if moved:
            log.info("expertcache: %s", moved)
        self._expertcache_session = _arm_worker(self, cfg, version)
        return out

    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig_exec(self, *args, **kwargs)
        session = getattr(self, "_expertcache_session", None)
        if session is not None:
            session.after_step()
        return out

    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        session = getattr(self, "_expertcache_session", None)
        if session is not None:
            session.close()
        return orig_shutdown(self, *args, **kwargs)

    pairs = [(load_model, orig_load), (execute_model, orig_exec), (shutdown, orig_shutdown)]
    for name, why in WEIGHT_CHANGES:
        orig_fn = getattr(worker_cls, name, None)
        if callable(orig_fn):
            inner = (_emptied_on_failure(orig_fn, FAILED_UPDATE_WHY.format(name))
                     if name in WEIGHT_UPDATE_STEPS else orig_fn)
            pairs.append((_invalidating(inner, why), orig_fn))
    for name in WEIGHT_UPDATE_STEPS:
        if name in dict(WEIGHT_CHANGES):
            continue  # (wrapped with the weight changes, above)
        orig_fn = getattr(worker_cls, name, None)
        if callable(orig_fn):
            pairs.append((_emptied_on_failure(orig_fn, FAILED_UPDATE_WHY.format(name)),
                          orig_fn))
    orig_sleep = getattr(worker_cls, "sleep", None)
    if callable(orig_sleep):
        pairs.append((_discarding_slots(orig_sleep), orig_sleep))
    orig_extend = getattr(worker_cls, "extend_kv_cache", None)
    if callable(orig_extend):  # 0.34's extensible KV cache: its size is final only here
        pairs.append((_then(orig_extend, _log_extended_kv, "no memory-plan line ({})"),
                      orig_extend))
    orig_wake = getattr(worker_cls, "wake_up", None)
    if callable(orig_wake):
        pairs.append((_invalidating(orig_wake, WAKE_WHY, _wakes_weights), orig_wake))
    orig_warm = getattr(worker_cls, "compile_or_warm_up_model", None)
    if callable(orig_warm):
        # a failure leaves the warm-up's experts in the slots: still right, and served
        pairs.append((_then(orig_warm, lambda w, session, out: session.serving_starts(),
                            "the slots could not be emptied after vLLM's warm-up ({}); the "
                            "first requests share them with the warm-up's experts"),
                      orig_warm))
    orig_memory = getattr(worker_cls, "determine_available_memory", None)
    if callable(orig_memory):
        # a log line must never stop vLLM starting
        pairs.append((_then(orig_memory, _log_memory_plan, "no memory-plan line ({})"),
                      orig_memory))
    for fn, orig in pairs:
        fn.__name__, fn.__qualname__, fn.__doc__ = orig.__name__, orig.__qualname__, orig.__doc__
        setattr(worker_cls, orig.__name__, fn)
    worker_cls._expertcache_patched = True


def _emptied_on_failure(orig: Callable[..., Any], why: str) -> Callable[..., Any]:
    """``orig``; where it raises, every slot of the worker's session emptied (the table
    only: nothing rebuilt, nothing swept, since the layer may hold part of an update) before
    the exception goes on. The next successful finish or reload invalidates as usual."""

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return orig(self, *args, **kwargs)
        except BaseException:
            session = getattr(self, "_expertcache_session", None)
            if session is not None:
                try:
                    session.empty_slots(why)
                except Exception as exc:  # never hide vLLM's own exception
                    log.error("expertcache: %s; emptying the slots failed too (%s)", why, exc)
            raise

    return wrapper


def _discarding_slots(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``Worker.sleep``, with the slots and the scratch named discardable to vLLM's sleep
    backend, where it takes such a list (0.34: ``SleepModeBackend.suspend(discardable)``,
    "the storage addresses of the tensors the caller rewrites after resume, so they need no
    backup"). Without it 0.34 backs them up to host memory at every level and keeps that
    copy for the process's life; the plugin empties them after every wake of the weights
    anyway. On 0.26-0.33 (``suspend(level)``) nothing changes."""

    def sleep(self: Any, *args: Any, **kwargs: Any) -> Any:
        session = getattr(self, "_expertcache_session", None)
        if session is not None and getattr(session, "pooled", False):
            try:
                _name_discardable(self.sleep_mode_backend, session.sleep_storage)
            except Exception as exc:
                log.warning("expertcache: the slots are backed up to host memory by this "
                            "sleep (%s: %s)", exc.__class__.__name__, exc)
        return orig(self, *args, **kwargs)

    return sleep


def _name_discardable(backend: Any, storage: Callable[[], set[int]]) -> None:
    """Wrap ``backend.suspend`` (this worker's instance only) to add ``storage()`` to the
    addresses it may discard; once (`compat.wrap_once`); nothing where it takes no
    ``discardable``."""
    import inspect

    from .compat import wrap_once

    suspend = getattr(backend, "suspend", None)
    if suspend is None or "discardable" not in inspect.signature(suspend).parameters:
        return  # 0.26-0.33: suspend(level); level 2 discards the whole pool anyway

    def adding(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(discardable: Any = (), *args: Any, **kwargs: Any) -> Any:
            return orig(set(discardable) | storage(), *args, **kwargs)

        return wrapped

    wrap_once(backend, "suspend", adding)


def extensible_kv(worker: Any) -> bool:
    """vLLM 0.34's extensible KV cache is on: ``determine_available_memory`` returns an
    estimate; the size is measured after warm-up and committed in ``extend_kv_cache``."""
    return getattr(getattr(worker, "cache_config", None), "enable_extensible_kv_cache",
                   False) is True


def _log_extended_kv(worker: Any, session: Any, out: Any) -> None:
    """The KV size an extensible KV cache committed (its final one), beside the slots."""
    if not session.armed:
        return
    kv = getattr(getattr(worker.model_runner, "extensible_kv_cache", None),
                 "physical_bytes", None)
    log.info("%s", memory.kv_line(session.slot_bytes, session.weights_bytes,
                                  kv if isinstance(kv, int) else None, False,
                                  session.scratch_bytes,
                                  getattr(session, "memory_mechanism", memory.WEIGHTS)))


def _then(orig: Callable[..., Any], act: Callable[[Any, Any, Any], None],
          failed: str) -> Callable[..., Any]:
    """``orig``, then ``act(worker, session, its result)`` where the worker has a session;
    ``act`` failing is logged (``failed``, its ``{}`` the exception) and vLLM goes on with
    ``orig``'s result."""

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        session = getattr(self, "_expertcache_session", None)
        if session is not None:
            try:
                act(self, session, out)
            except Exception as exc:
                log.warning("expertcache: " + failed.format(
                    f"{exc.__class__.__name__}: {exc}"))
        return out

    return wrapper


def _arm_worker(worker: Any, cfg: CacheConfig, version: str) -> Any:
    """Arm the worker's freshly loaded model; on any failure log it and arm nothing."""
    from .session import arm_model, register_session

    try:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        try:
            from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
        except ImportError:
            FusedMoEKernel = None  # noqa: N806
        why = layout_refusal(RoutedExperts, FusedMoEKernel)
    except ImportError as exc:
        why = f"vLLM {version} has no RoutedExperts ({exc})"
    if why:
        log.warning("expertcache: %s; the cache is NOT armed, serving on the stock path", why)
        return None
    try:
        vc = worker.vllm_config
        model = worker.model_runner.get_model()
        pool, sleep_refusal = memory.sleep_pool(worker)
        mechanism = memory.plan_mechanism()
        session = arm_model(
            model, cfg, version,
            max_num_seqs=getattr(vc.scheduler_config, "max_num_seqs", None),
            model_name=str(getattr(vc.model_config, "model", "")) or None,
            decode_rows=_decode_rows(vc),
            spec_tokens=speculative_tokens(vc),
            refusal=(sleep_refusal or pipeline_refusal(cfg, vc)
                     or memory.accounting_refusal(worker, mechanism)),
            padding=_padding_reader(worker),
            pool=pool,
        )
    except Exception as exc:
        log.exception("expertcache: arming failed (%s); serving on the stock path", exc)
        return None
    session.memory_mechanism = mechanism
    if session.armed:
        per_slot = session.slot_bytes // cfg.slots if cfg.slots else None
        warning = memory.weights_warning(memory.loaded_weights(worker), cfg.planned_weights,
                                         per_slot)
        if warning:
            log.warning(warning)
    if session.armed and mechanism != memory.MEASURED:
        # (0.26, or not recognised: where model_memory_usage is not read, adding is inert;
        # refused accounting declined every layer: nothing to count)
        session.weights_bytes = memory.count_as_weights(worker, session.cache_bytes)
    register_session(session)
    return session


def _wakes_weights(*args: Any, **kwargs: Any) -> bool:
    """Whether ``Worker.wake_up(tags)`` brings the weights back: ``tags`` None (all) or
    naming "weights". A wake of the KV cache alone leaves the weights (and the slots,
    which sleep with them: `memory.sleep_pool`) unmapped; touching them then would fault."""
    tags = kwargs.get("tags", args[0] if args else None)
    return tags is None or "weights" in tags


def _invalidating(orig: Callable[..., Any], why: str,
                  when: Callable[..., bool] | None = None) -> Callable[..., Any]:
    """``orig``, then every slot of the worker's session emptied: the weights changed
    (``when(*args, **kwargs)``: only for the calls it says)."""

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        session = getattr(self, "_expertcache_session", None)
        if session is not None and (when is None or when(*args, **kwargs)):
            session.invalidate(why)
        return out

    return wrapper


def _padding_reader(worker: Any) -> Any:
    """How armed layers tell CUDA-graph padding rows (`padding`), said once in the log."""
    from . import padding

    count, why = padding.v1_token_count(worker)
    if count is not None:
        sc = getattr(getattr(worker, "vllm_config", None), "scheduler_config", None)
        max_tokens = int(getattr(sc, "max_num_batched_tokens", 0) or 0)
        log.info("expertcache: CUDA-graph padding rows are kept out of the cache (%s)", why)
        return padding.mask_reader(count, max_tokens)
    log.debug("expertcache: padding rows from vLLM's V2 marks only (%s)", why)
    return padding.mask_reader()


def pipeline_refusal(cfg: CacheConfig, vc: Any) -> str | None:
    """Why a per-layer plan cannot be armed on a pipeline stage, or None. The budgets
    (``EXPERT_CACHE_SLOTS=S1,S2,...``) are one per MoE layer of the whole model; a stage
    holds some of them and cannot tell which MoE layers (dense layers interleave) the other
    stages hold, so indexing by its own layers would give each layer another's budget."""
    pp = int(getattr(getattr(vc, "parallel_config", None), "pipeline_parallel_size", 1) or 1)
    if pp <= 1 or cfg.slots_per_layer is None:
        return None
    return (f"pipeline parallel ({pp} stages) with a per-layer plan (EXPERT_CACHE_SLOTS lists "
            f"{len(cfg.slots_per_layer)} budgets for the whole model): a stage cannot tell "
            "which budgets are its own; give one budget for every layer "
            "(EXPERT_CACHE_SLOTS=S or EXPERT_CACHE_FRACTION) or serve without pipeline "
            "parallel")


def speculative_tokens(vc: Any) -> int:
    """Draft tokens each sequence carries into a verify step (vLLM's speculative config,
    ``num_speculative_tokens``, 0.26 and 0.33; 0 without speculative decoding): a decode
    step is then ``max_num_seqs x (1 + k)`` tokens, which the TRAP and the decode-width
    counter must count."""
    spec = getattr(vc, "speculative_config", None)
    n = getattr(spec, "num_speculative_tokens", None) if spec is not None else None
    return int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def _decode_rows(vc: Any) -> Callable[[int], int]:
    """Rows (tokens) a decode step of ``n`` requests runs at, from vLLM's resolved config:
    what the shape gate sees, so what the TRAP and the decode-width counter count.

    0.34 keys decode graphs by request count (``decode_cudagraph_capture_request_sizes``,
    `capture.rows_from_resolved`), and its ``cudagraph_capture_sizes`` is then the union of
    the decode and prefill grids, which under-states the padding (gpt-oss: 130 of 256
    requests run as 144, the union's next size is 136). Before 0.34: ``n x (1 + draft
    tokens)`` padded to the next capture size; eager: unpadded. The mode read is the one
    resolved at load time (the runner may still downgrade it when it builds its graphs).
    """
    from ..vllm_facts import capture

    q = 1 + speculative_tokens(vc)
    cc = getattr(vc, "compilation_config", None)
    mode = str(getattr(getattr(cc, "cudagraph_mode", None), "name", "")).upper()
    if getattr(getattr(vc, "model_config", None), "enforce_eager", False) or mode == "NONE":
        return lambda n: n * q
    requests = getattr(cc, "decode_cudagraph_capture_request_sizes", None)
    if requests is None:  # before 0.34
        return capture.rows_for_sizes(
            [int(s) for s in (getattr(cc, "cudagraph_capture_sizes", None) or [])], q)
    q_len = getattr(vc, "uniform_decode_query_len", q)
    q = q_len if isinstance(q_len, int) and not isinstance(q_len, bool) else q
    seqs = int(vc.scheduler_config.max_num_seqs)
    tiers = _decode_tiers(vc, q, seqs)
    fields = (seqs, [int(s) for s in requests],
              [int(s) for s in (getattr(cc, "prefill_cudagraph_capture_token_sizes", None) or [])],
              getattr(cc, "max_cudagraph_capture_size", None),
              getattr(cc, "max_decode_cudagraph_capture_tokens", None), mode)
    return lambda n: max(capture.rows_from_resolved(min(n, most), tier_q, *fields, most)
                         for tier_q, most in tiers.items())


def _decode_tiers(vc: Any, q: int, max_num_seqs: int) -> dict[int, int]:
    """{query length: most requests a decode batch of it has}: one entry, except under
    0.34's dynamic speculative decoding, whose draft width follows the batch size
    (`VllmConfig.get_decode_cudagraph_query_lens`); a batch runs at the rows of its own
    tier, so the most over the tiers bounds it."""
    lens = getattr(vc, "get_decode_cudagraph_query_lens", None)
    try:
        tiers = lens(q) if callable(lens) else None
    except ValueError:  # an invalid schedule: vLLM keeps the one static width too
        tiers = None
    if not isinstance(tiers, dict) or not tiers:
        return {q: max_num_seqs}
    return {int(k): min(int(v), max_num_seqs) for k, v in tiers.items()}


def _log_memory_plan(worker: Any, session: Any, kv_bytes: Any) -> None:
    """Once vLLM sized its KV cache: the slot GiB it planned around and the KV it chose."""
    if not session.armed or extensible_kv(worker):
        return  # 0.34's extensible KV cache: said in `_log_extended_kv`, once it is final
    explicit = memory.explicit_kv_bytes(worker)
    kv = kv_bytes if isinstance(kv_bytes, int) and not isinstance(kv_bytes, bool) else None
    if kv is None:
        kv = getattr(worker, "available_kv_cache_memory_bytes", None)
    cold = memory.cold_compile_note(memory.compiled_here()) if not explicit else ""
    log.info("%s%s", memory.kv_line(session.slot_bytes, session.weights_bytes, kv,
                                    bool(explicit), session.scratch_bytes,
                                    getattr(session, "memory_mechanism", memory.WEIGHTS)),
             cold)
    if kv is None or explicit:
        return
    try:
        need = memory.one_sequence_kv_bytes(worker)
        max_len = int(worker.vllm_config.model_config.max_model_len)
    except Exception:  # a vLLM that words its KV specs otherwise: vLLM's own error remains
        return
    slots = [a.decision.num_slots for a in session.armed]
    row = sum(a.decision.bytes_per_slot for a in session.armed)  # one slot fewer everywhere
    line = memory.kv_shortfall_line(kv, need, max_len, row, slots) if need else None
    if line:
        log.error("%s%s", line, cold)
