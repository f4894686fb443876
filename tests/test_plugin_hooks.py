"""The entry point and the worker hooks, on fake modules (no torch, no vLLM)."""

from __future__ import annotations

import sys
import types

import pytest

import expertcache_cli.plugin as plugin


@pytest.fixture()
def fresh(monkeypatch):
    """A plugin that has not registered yet, and an environment without EXPERT_CACHE_*."""
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_config", None)
    for name in list(__import__("os").environ):
        if name.startswith("EXPERT_CACHE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("EXPERT_CACHE_SLOTS", "4")  # asked for (the plugin is opt-in)
    before = list(sys.meta_path)
    yield monkeypatch
    sys.meta_path[:] = before


def _fake_vllm(monkeypatch, version: str) -> types.ModuleType:
    vllm = types.ModuleType("vllm")
    vllm.__version__ = version
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    return vllm


def _fake_worker_module(monkeypatch) -> type:
    calls: list[str] = []

    class Worker:
        def __init__(self):
            self.calls = calls

        def load_model(self, *, load_dummy_weights=False):
            calls.append("load")

        def execute_model(self, scheduler_output):
            calls.append(f"exec:{scheduler_output}")
            return "out"

        def shutdown(self):
            calls.append("shutdown")

        def determine_available_memory(self):
            calls.append("memory")
            return 7 * 2**30

        def reload_weights(self, *args, **kwargs):
            calls.append("reload")

        def wake_up(self, tags=None):
            calls.append(f"wake:{tags}")

        def compile_or_warm_up_model(self):
            calls.append("warm")
            return 12.5

    mod = types.ModuleType(plugin.WORKER_MODULE)
    mod.Worker = Worker
    monkeypatch.setitem(sys.modules, plugin.WORKER_MODULE, mod)
    return Worker


def test_bad_environment_stops_startup_with_one_line(fresh):
    fresh.setenv("EXPERT_CACHE_POLICY", "fifo")
    with pytest.raises(SystemExit) as info:
        plugin.register()
    assert str(info.value).startswith("expertcache: error: EXPERT_CACHE_POLICY='fifo'")


def test_register_is_idempotent_and_disable_arms_nothing(fresh):
    fresh.setenv("EXPERT_CACHE_DISABLE", "1")
    _fake_vllm(fresh, "0.26.0")
    worker_cls = _fake_worker_module(fresh)
    plugin.register()
    plugin.register()
    assert not getattr(worker_cls, "_expertcache_patched", False)


def test_unknown_version_leaves_vllm_alone(fresh, caplog):
    _fake_vllm(fresh, "0.40.0")
    worker_cls = _fake_worker_module(fresh)
    with caplog.at_level("WARNING", logger="vllm.expertcache"):
        plugin.register()
    assert not getattr(worker_cls, "_expertcache_patched", False)
    assert "outside the releases" in caplog.text and "NOT armed" in caplog.text


def test_worker_is_wrapped_arms_after_load_and_reports_per_step(fresh):
    _fake_vllm(fresh, "0.26.0")
    worker_cls = _fake_worker_module(fresh)
    events: list[str] = []

    class Session:
        def after_step(self):
            events.append("after_step")

        def close(self):
            events.append("close")

    def fake_arm(worker, cfg, version):
        events.append(f"arm after {worker.calls[-1]} on {version}")
        return Session()

    fresh.setattr(plugin, "_arm_worker", fake_arm)
    plugin.register()
    assert worker_cls._expertcache_patched
    w = worker_cls()
    w.load_model(load_dummy_weights=True)
    assert events == ["arm after load on 0.26.0"]
    assert w.execute_model("s1") == "out"
    w.shutdown()
    assert events[1:] == ["after_step", "close"]
    assert w.calls == ["load", "exec:s1", "shutdown"]
    assert worker_cls.load_model.__name__ == "load_model"


def test_the_kv_size_vllm_chose_is_logged_beside_the_slot_bytes(fresh, caplog):
    _fake_vllm(fresh, "0.26.0")
    worker_cls = _fake_worker_module(fresh)

    class Session:
        armed = ["a layer"]
        slot_bytes = 5 * 2**30
        weights_bytes = 6 * 2**30
        scratch_bytes = 0

    fresh.setattr(plugin, "_arm_worker", lambda worker, cfg, version: Session())
    plugin.register()
    w = worker_cls()
    w.cache_config = types.SimpleNamespace(kv_cache_memory_bytes=None)
    with caplog.at_level("INFO", logger="vllm.expertcache"):
        assert w.determine_available_memory() == 7 * 2**30  # before arming: nothing logged
        assert "memory plan" not in caplog.text
        w.load_model()
        assert w.determine_available_memory() == 7 * 2**30
    assert w.calls == ["memory", "load", "memory"]
    assert ("memory plan: 5.00 GiB of slots counted as weights (6.00 GiB in all); "
            "vLLM chose 7.00 GiB of KV cache") in caplog.text


def test_engine_loop_end_logs_the_final_counters_before_vllm_tears_down(fresh):
    # After its busy loop vLLM restores default signal handlers; a second Ctrl-C signal in
    # the teardown kills the engine, so the final line is logged as the loop ends.
    _fake_vllm(fresh, "0.26.0")
    closed: list[str] = []
    from expertcache_cli.plugin import session

    fresh.setattr(session, "close_all", lambda: closed.append("close_all"))

    class EngineCoreProc:
        def run_busy_loop(self, how="return"):
            if how == "exit":
                raise SystemExit(0)
            if how == "crash":
                raise RuntimeError("engine died")
            return "done"

    class DPEngineCoreProc(EngineCoreProc):
        def run_busy_loop(self, how="return"):
            return "dp " + super().run_busy_loop(how)

    mod = types.ModuleType(plugin.ENGINE_CORE_MODULE)
    mod.EngineCoreProc, mod.DPEngineCoreProc = EngineCoreProc, DPEngineCoreProc
    fresh.setitem(sys.modules, plugin.ENGINE_CORE_MODULE, mod)
    plugin.register()
    assert EngineCoreProc().run_busy_loop() == "done" and closed == ["close_all"]
    with pytest.raises(SystemExit):
        EngineCoreProc().run_busy_loop("exit")
    assert closed == ["close_all"] * 2
    with pytest.raises(RuntimeError):  # a failing engine is left to vLLM's own handling
        EngineCoreProc().run_busy_loop("crash")
    assert closed == ["close_all"] * 2
    assert DPEngineCoreProc().run_busy_loop() == "dp done"  # subclass and base both report
    assert closed == ["close_all"] * 4
    assert EngineCoreProc.run_busy_loop.__name__ == "run_busy_loop"
    plugin._patch_engine_loop(mod)  # a second registration does not wrap twice
    EngineCoreProc().run_busy_loop()
    assert closed == ["close_all"] * 5


def test_when_imported_waits_for_the_import(fresh, tmp_path):
    pkg = tmp_path / "ec_fake_target.py"
    pkg.write_text("VALUE = 41\n")
    fresh.syspath_prepend(str(tmp_path))
    fresh.delitem(sys.modules, "ec_fake_target", raising=False)
    seen: list[int] = []

    def bump(module):
        module.VALUE += 1
        seen.append(module.VALUE)

    plugin.when_imported("ec_fake_target", bump)
    assert seen == []  # nothing imported by us
    import ec_fake_target  # noqa: F401

    assert seen == [42] and sys.modules["ec_fake_target"].VALUE == 42
    # the loader proxy still serves inspect/linecache
    assert sys.modules["ec_fake_target"].__spec__.loader.get_source("ec_fake_target")
    # already imported: the callback runs at once
    plugin.when_imported("ec_fake_target", bump)
    assert seen == [42, 43]


def test_reloaded_or_woken_weights_empty_the_slots(fresh):
    """After vLLM reloads weights (or wakes from a sleep that may have discarded them) the
    slots would serve the old experts: the session is told, after vLLM's own call."""
    _fake_vllm(fresh, "0.26.0")
    worker_cls = _fake_worker_module(fresh)
    seen: list[str] = []

    class Session:
        def invalidate(self, why):
            seen.append(f"{w.calls[-1]} -> {why}")

    fresh.setattr(plugin, "_arm_worker", lambda worker, cfg, version: Session())
    plugin.register()
    w = worker_cls()
    w.reload_weights()  # before arming: no session, nothing to empty
    w.load_model()
    w.reload_weights("ckpt")
    w.wake_up(tags=["kv_cache"])  # the weights still asleep: nothing to empty yet
    w.wake_up(tags=["weights"])
    assert seen == ["reload -> vLLM reloaded the weights",
                    "wake:['weights'] -> vLLM woke its weights from sleep (which may have "
                    "discarded the slots and replaced the weights)"]
    assert worker_cls.wake_up.__name__ == "wake_up"


def test_the_slots_are_emptied_once_vllm_has_warmed_up(fresh, caplog):
    """After vLLM's warm-up (its dummy steps went through the slots) the session empties
    them, after vLLM's own call, whose result is handed back; a failure to do so is logged
    and the server still starts."""
    _fake_vllm(fresh, "0.26.0")
    worker_cls = _fake_worker_module(fresh)
    seen: list[str] = []

    class Session:
        def serving_starts(self):
            seen.append(w.calls[-1])

    fresh.setattr(plugin, "_arm_worker", lambda worker, cfg, version: Session())
    plugin.register()
    w = worker_cls()
    assert w.compile_or_warm_up_model() == 12.5  # not armed yet: nothing to empty
    w.load_model()
    assert w.compile_or_warm_up_model() == 12.5
    assert seen == ["warm"]
    assert worker_cls.compile_or_warm_up_model.__name__ == "compile_or_warm_up_model"

    def broken():
        raise RuntimeError("device gone")

    w._expertcache_session.serving_starts = broken
    with caplog.at_level("WARNING", logger="vllm.expertcache"):
        assert w.compile_or_warm_up_model() == 12.5
    assert "could not be emptied after vLLM's warm-up (RuntimeError: device gone)" in caplog.text


def test_a_v2_runner_that_will_not_offload_is_named_before_the_load(fresh, caplog):
    """vLLM 0.26's V2 runner ignores --cpu-offload-gb: the OOM that follows in vLLM's own
    load has its reason in the log first, and the load still runs (vLLM decides)."""
    _fake_vllm(fresh, "0.26.0")
    worker_cls = _fake_worker_module(fresh)
    v2 = "vllm.v1.worker.gpu.model_runner"
    fresh.setitem(sys.modules, v2, types.ModuleType(v2))
    fresh.setattr(plugin, "_arm_worker", lambda worker, cfg, version: None)
    plugin.register()
    w = worker_cls()
    w.model_runner = type("GPUModelRunner", (), {"__module__": v2})()
    w.vllm_config = types.SimpleNamespace(offload_config=types.SimpleNamespace(
        uva=types.SimpleNamespace(cpu_offload_gb=28)))
    with caplog.at_level("ERROR", logger="vllm.expertcache"):
        w.load_model()
    assert w.calls == ["load"]
    assert "vLLM 0.26.0's V2 model runner never installs the CPU offloader" in caplog.text
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in caplog.text


def test_installed_but_not_asked_arms_nothing_and_says_so_once(fresh, caplog):
    """Opt-in: without EXPERT_CACHE_SLOTS or EXPERT_CACHE_FRACTION (what `expertcache serve`
    and `baseline` set) the plugin leaves vLLM alone, says so once in the process, and
    does not wrap the worker; a budget asked for arms as before."""
    fresh.delenv("EXPERT_CACHE_SLOTS")
    _fake_vllm(fresh, "0.33.0")
    worker_cls = _fake_worker_module(fresh)
    with caplog.at_level("INFO", logger="vllm.expertcache"):
        plugin.register()
        plugin.register()
    assert not getattr(worker_cls, "_expertcache_patched", False)
    assert caplog.text.count("installed but not asked for") == 1
    assert "EXPERT_CACHE_SLOTS or EXPERT_CACHE_FRACTION" in caplog.text
    fresh.setattr(plugin, "_registered", False)
    fresh.setenv("EXPERT_CACHE_FRACTION", "0.3")
    plugin.register()
    assert worker_cls._expertcache_patched


def test_serve_and_baseline_environments_ask_for_the_cache():
    """The launchers' environments read back as asked (they always name a budget)."""
    from expertcache_cli.config import CacheConfig, from_env

    assert from_env(CacheConfig(slots=48).to_env()).asked
    assert from_env(CacheConfig(slots_per_layer=(4, 5)).to_env()).asked
    assert from_env(CacheConfig(fraction=0.3).to_env()).asked
    assert not from_env({}).asked


# -- vLLM 0.34 ----------------------------------------------------------------------------

class _Backend034:
    """0.34's `CuMemBackend` as the worker calls it: ``suspend(discardable)``."""

    def __init__(self):
        self.seen: list[set[int]] = []

    def suspend(self, discardable=()):
        self.seen.append(set(discardable))


class _Backend033:
    def __init__(self):
        self.seen: list[int] = []

    def suspend(self, level=1):
        self.seen.append(level)


def _worker_034(fresh, backend):
    worker_cls = _fake_worker_module(fresh)

    def sleep(self, level=1):  # 0.34 gpu_worker.py:320-337, the parameters at level 2
        self.calls.append(f"sleep:{level}")
        self.sleep_mode_backend.suspend({0xA0} if level == 2 else set())

    def extend_kv_cache(self, num_blocks):
        self.calls.append(f"extend:{num_blocks}")
        self.model_runner.extensible_kv_cache.physical_bytes = 9 * 2**30

    worker_cls.sleep, worker_cls.extend_kv_cache = sleep, extend_kv_cache
    worker_cls.sleep_mode_backend = backend
    return worker_cls


@pytest.mark.parametrize("pooled", [True, False])
def test_034_sleep_names_the_slots_discardable(fresh, pooled):
    """0.34 backs up every weights-pool allocation that is not all parameters, at every
    level, and keeps the host copy after the wake; the slots are emptied after each wake
    anyway, so the plugin names them discardable to vLLM's sleep backend (both levels)."""
    _fake_vllm(fresh, "0.33.0")  # (the gate: 0.34 is not accepted yet)
    backend = _Backend034()
    worker_cls = _worker_034(fresh, backend)

    class Session:
        def sleep_storage(self):
            return {0xB0, 0xB1}

    Session.pooled = pooled
    fresh.setattr(plugin, "_arm_worker", lambda worker, cfg, version: Session())
    plugin.register()
    w = worker_cls()
    w.load_model()
    w.sleep(level=2)
    w.sleep(level=1)
    slots = {0xB0, 0xB1} if pooled else set()
    assert backend.seen == [{0xA0} | slots, slots]
    assert worker_cls.sleep.__name__ == "sleep"


def test_033_sleep_backend_is_left_alone(fresh):
    _fake_vllm(fresh, "0.33.0")
    backend = _Backend033()
    worker_cls = _worker_034(fresh, backend)
    worker_cls.sleep = lambda self, level=1: self.sleep_mode_backend.suspend(level)
    Session = type("Session", (), {"pooled": True, "sleep_storage": lambda self: {1}})
    fresh.setattr(plugin, "_arm_worker", lambda worker, cfg, version: Session())
    plugin.register()
    w = worker_cls()
    w.load_model()
    w.sleep(2)
    assert backend.seen == [2] and "_expertcache_wrapped" not in vars(backend)


def test_034_extensible_kv_is_judged_once_committed(fresh, caplog):
    """0.34's extensible KV cache (its default unless --kv-cache-memory-bytes): the size
    ``determine_available_memory`` returns is an estimate, so no line (and no shortfall
    error) then; the committed size is logged after ``extend_kv_cache``."""
    _fake_vllm(fresh, "0.33.0")
    worker_cls = _worker_034(fresh, _Backend034())

    class Session:
        armed = ["a layer"]
        slot_bytes = 5 * 2**30
        weights_bytes = 6 * 2**30
        scratch_bytes = 0
        memory_mechanism = "measured"

    fresh.setattr(plugin, "_arm_worker", lambda worker, cfg, version: Session())
    plugin.register()
    w = worker_cls()
    w.cache_config = types.SimpleNamespace(kv_cache_memory_bytes=None,
                                           enable_extensible_kv_cache=True)
    w.model_runner = types.SimpleNamespace(extensible_kv_cache=types.SimpleNamespace())
    with caplog.at_level("INFO", logger="vllm.expertcache"):
        w.load_model()
        w.determine_available_memory()
        assert "memory plan" not in caplog.text
        w.extend_kv_cache(1234)
    assert w.calls[-1] == "extend:1234"
    assert "vLLM chose 9.00 GiB of KV cache" in caplog.text


def test_a_weight_update_failing_part_way_empties_the_slots(fresh):
    """0.34: "Starting may already move weights; only a successful finish restores them".
    A start, chunk or finish that raises leaves the slots emptied (no sweep) and vLLM's
    exception goes on; a successful finish invalidates as before."""
    _fake_vllm(fresh, "0.33.0")
    worker_cls = _fake_worker_module(fresh)
    seen: list[str] = []

    def update_weights(self, info):
        if info == "bad":
            raise RuntimeError("trainer hung up")

    def finish_weight_update(self):
        pass

    worker_cls.update_weights, worker_cls.finish_weight_update = (update_weights,
                                                                  finish_weight_update)

    class Session:
        def empty_slots(self, why):
            seen.append(f"empty: {why}")

        def invalidate(self, why):
            seen.append(f"invalidate: {why}")

    fresh.setattr(plugin, "_arm_worker", lambda worker, cfg, version: Session())
    plugin.register()
    w = worker_cls()
    w.load_model()
    w.update_weights("ok")
    with pytest.raises(RuntimeError, match="trainer hung up"):
        w.update_weights("bad")
    w.finish_weight_update()
    assert seen == ["empty: a weight update failed part-way (vLLM's update_weights): the "
                    "weights may be part new",
                    "invalidate: vLLM finished a weight update (weight transfer)"]
    assert worker_cls.update_weights.__name__ == "update_weights"


def test_the_decode_width_is_read_from_vllms_resolved_grids():
    """0.34 keys decode graphs by request count, and its cudagraph_capture_sizes is the
    union of the decode and prefill grids: gpt-oss (S=256, T=8192) runs 130 requests as
    144 rows (the request grid's next count), where the union's next size is 136. Before
    0.34 the capture sizes pad n x (1 + draft tokens); eager pads nothing."""
    from types import SimpleNamespace as NS

    from expertcache_cli.vllm_facts import capture

    def vc(mode="FULL_AND_PIECEWISE", spec=0, eager=False, **cc):
        return NS(model_config=NS(enforce_eager=eager),
                  compilation_config=NS(cudagraph_mode=NS(name=mode), **cc),
                  scheduler_config=NS(max_num_seqs=256),
                  speculative_config=NS(num_speculative_tokens=spec) if spec else None)

    old = plugin._decode_rows(vc(cudagraph_capture_sizes=[1, 2, 4, 8, 16, 24, 32]))
    assert (old(3), old(10), old(40)) == (4, 16, 40)
    assert plugin._decode_rows(vc(spec=3, cudagraph_capture_sizes=[1, 8, 16]))(3) == 16
    assert plugin._decode_rows(vc(eager=True, cudagraph_capture_sizes=[16]))(3) == 3
    assert plugin._decode_rows(vc(mode="NONE", cudagraph_capture_sizes=[16]))(3) == 3
    oss = capture.for_model(capture.settings_from_vllm_args([], version=(0, 34)),
                            ("GptOssForCausalLM",))
    prefill, requests, _ = capture.graph_grids(256, 8192, oss)
    union = capture.graph_sizes(256, 8192, oss)
    resolved = dict(cudagraph_capture_sizes=union, max_cudagraph_capture_size=max(union),
                    decode_cudagraph_capture_request_sizes=requests,
                    prefill_cudagraph_capture_token_sizes=prefill,
                    max_decode_cudagraph_capture_tokens=None)
    rows = plugin._decode_rows(vc(**resolved))
    assert rows(130) == 144 == capture.decode_rows(130, 256, 8192, oss)
    assert capture.padded(130, union) == 136  # what reading the union alone said
    # without a decode routine decode pads on the prefill sizes (the 1024 grid: 136)
    assert plugin._decode_rows(vc(mode="PIECEWISE", **resolved))(130) == 136
    # dynamic speculative decoding: each tier's rows; the most over the tiers bounds a batch
    tiered = vc(**resolved)
    tiered.uniform_decode_query_len = 3
    tiered.get_decode_cudagraph_query_lens = lambda q: {3: 8, 2: 256}
    assert plugin._decode_rows(tiered)(8) == max(
        capture.rows_from_resolved(8, 3, 256, requests, prefill, max(union), None,
                                   "FULL_AND_PIECEWISE", 8),
        capture.rows_from_resolved(8, 2, 256, requests, prefill, max(union), None,
                                   "FULL_AND_PIECEWISE", 256)) == 24
