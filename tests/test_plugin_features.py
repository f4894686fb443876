"""The plugin under vLLM features that change what the slots stand for: weight updates,
sleep mode, substituted experts. CPU torch, the reference slot cache, and worker and
layer stand-ins that do what vLLM 0.26.0's and 0.33.0's do (read in their sources).
Skipped without torch."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="no torch: the plugin feature tests need torch")

from armed_standins import Experts, H, fake_vllm_layout, routing  # noqa: E402
from ref_slotcache import RefSlotCache  # noqa: E402

import expertcache_cli.plugin as plugin  # noqa: E402
from expertcache_cli.config import CacheConfig  # noqa: E402


class _Model(torch.nn.Module):
    """Two MoE layers (``model.layers.{0,1}.mlp.experts``), deterministic per seed."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for i in range(2):
            block = torch.nn.Module()
            block.experts = Experts(seed=seed + i)
            block.experts.layer_name = f"model.layers.{i}.mlp.experts"
            self.layers.append(block)

    def step(self, x, w, ids):
        for block in self.layers:
            x = x + block.experts.forward_modular(x=x, topk_weights=w, topk_ids=ids)
        return x


def _copy_in_place(model, named):
    """What vLLM's reload paths leave: the processed values copied into the tensors the
    layer already holds (layerwise reload's ``_copy_and_restore_kernel_tensors``,
    ``param.data.copy_``), so every pointer (and every captured CUDA graph) stays."""
    with torch.no_grad():
        for name, value in named:
            model.get_parameter(name).data.copy_(value)


class Worker026:
    """vLLM 0.26.0's `Worker` as far as weights go: ``reload_weights`` (in place),
    ``wake_up(tags)``, and the weight-transfer API, whose chunks land between
    ``start_weight_update`` and ``finish_weight_update`` and bypass ``reload_weights``."""

    def __init__(self, model):
        self.model = model
        self.model_runner = SimpleNamespace(get_model=lambda: model, model_memory_usage=1000)
        self.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=2),
                                           model_config=SimpleNamespace(model="tiny"))
        self.cache_config = SimpleNamespace(kv_cache_memory_bytes=None)
        self._weight_update_active = False

    def load_model(self):
        pass

    def execute_model(self, scheduler_output):
        return None

    def shutdown(self):
        pass

    def reload_weights(self, weights_iterator=None, is_checkpoint_format=True):
        _copy_in_place(self.model, weights_iterator)

    def wake_up(self, tags=None):
        pass

    def start_weight_update(self):
        assert not self._weight_update_active
        self._weight_update_active = True

    def update_weights(self, update_info):
        assert self._weight_update_active, "start_weight_update must be called first"
        _copy_in_place(self.model, update_info["weights"])

    def finish_weight_update(self):
        assert self._weight_update_active
        self._weight_update_active = False


class Worker033(Worker026):
    """0.33.0 adds ``reset_weights`` (``zero_weights``: every weight zeroed in place) and
    ``discard(tags)``."""

    def reset_weights(self):
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()

    def discard(self, tags):
        pass


class FakeCuMem:
    """vLLM's `CuMemAllocator` as its sleep mode uses it (cumem.py, 0.26.0 and 0.33.0):
    a tensor allocated inside ``use_memory_pool(tag)`` carries the tag; ``sleep`` backs up
    the allocations of ``offload_tags`` and frees the rest (their bytes are lost: here
    overwritten with garbage); ``wake_up(tags)`` maps back those of ``tags`` (None: all;
    0.33 also every tag that is not "weights" or "kv_cache") at the same addresses and
    restores what was backed up."""

    def __init__(self, version):
        self.version = version
        self.tag = None
        self.allocs: list[list] = []  # [tag, tensor, backup or None, asleep]
        #: as vLLM's: the tag's one pool record, replaced by each use_memory_pool
        self.allocator_and_pools: dict[str, object] = {}
        self.inside = 0
        #: pools released inside another pool's context (PyTorch aborts the process there)
        self.released_inside: list[str] = []

    def use_memory_pool(self, tag=None):
        import contextlib

        allocator = self

        class Pool:  # torch's MemPool: released when its last reference goes
            def __del__(self):
                if allocator.inside:
                    allocator.released_inside.append(tag)

        @contextlib.contextmanager
        def ctx():
            # as cumem.py: the new pool is filed inside its own context, dropping the last
            # one filed under the tag there unless somebody else keeps it
            self.inside += 1
            self.allocator_and_pools[tag or "default"] = Pool()
            made = {n: getattr(torch, n) for n in ("zeros", "full", "empty")}

            def record(fn):
                def alloc(*a, **k):
                    t = fn(*a, **k)
                    self.allocs.append([tag or "default", t, None, False])
                    return t
                return alloc

            for n, fn in made.items():
                setattr(torch, n, record(fn))
            try:
                yield
            finally:
                self.inside -= 1
                for n, fn in made.items():
                    setattr(torch, n, fn)

        return ctx()

    def bytes(self, tag, awake=True):
        return sum(t.numel() * t.element_size() for g, t, _, asleep in self.allocs
                   if g == tag and asleep != awake)

    def sleep(self, offload_tags=()):
        for a in self.allocs:
            tag, t, _, asleep = a
            if asleep:
                continue
            a[2] = t.clone() if tag in offload_tags else None
            t.fill_(float("nan") if t.is_floating_point() else -7)  # unmapped: garbage
            a[3] = True

    def wake_up(self, tags=None):
        for a in self.allocs:
            tag, t, backup, asleep = a
            deferrable = tag in ("weights", "kv_cache") or self.version == "0.26.0"
            if asleep and (tags is None or tag in tags or not deferrable):
                if backup is not None:
                    t.copy_(backup)
                a[2], a[3] = None, False


def _sleeping(base):
    """A worker class with vLLM's cumem sleep backend (`CuMemBackend`: level 1 offloads the
    weights (0.33: and its runtime tags), level 2 discards them)."""

    class Sleeping(base):
        def sleep(self, level=1):
            from vllm.device_allocator import get_mem_allocator_instance

            get_mem_allocator_instance().sleep(offload_tags=("weights",) if level == 1
                                               else ())

        def wake_up(self, tags=None):
            from vllm.device_allocator import get_mem_allocator_instance

            get_mem_allocator_instance().wake_up(tags)

    return Sleeping


@pytest.fixture()
def armed_worker(monkeypatch):
    """A worker class of each version patched by the plugin, and a function that arms a
    fresh worker on a model (the real `_arm_worker`, the reference slot cache)."""
    import expertcache_cli.device.slotcache as slotcache_mod
    from expertcache_cli.plugin import session as session_mod

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    monkeypatch.setattr(session_mod, "_SESSIONS", [])
    fake_vllm_layout(monkeypatch)

    def make(version, sleep_mode=False):
        base = {"0.26.0": Worker026, "0.33.0": Worker033}[version]
        base = _sleeping(base) if sleep_mode else base
        cls = type("Worker", (base,), {})  # a fresh class: patched once, per test
        mod = types.ModuleType(plugin.WORKER_MODULE)
        mod.Worker = cls
        plugin._patch_worker(mod, CacheConfig(slots=6), version)
        assert cls._expertcache_patched

        def arm(model, **model_config):
            w = cls(model)
            w.vllm_config.model_config.__dict__.update(model_config)
            w.load_model()
            assert w._expertcache_session is not None
            assert len(w._expertcache_session.armed) == 2
            return w

        return arm

    return make


def _serve(model, stock, steps, rng, tokens=1):
    """``steps`` decode steps through both models; asserts they agree bit for bit and
    returns the last output."""
    out = None
    for _ in range(steps):
        x = torch.randn(tokens, H)
        ids, w = routing(rng, tokens)
        got, want = model.step(x, w, ids), stock.step(x, w, ids)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        out = got
    return out


def _new_weights(model, seed):
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()
            if n.endswith(("w13_weight", "w2_weight", "w13_bias", "w2_bias"))]


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0"])
def test_every_weight_update_path_refreshes_the_slots_as_the_stock_path(armed_worker,
                                                                        version, caplog):
    """Through each path that changes weights in place (reload_weights; the weight-transfer
    API start/update/finish_weight_update; 0.33's reset_weights; wake_up of the weights),
    the armed layers' outputs change exactly as the stock layers' do: the slots never
    serve the old experts. A wake of the KV cache alone empties nothing."""
    arm = armed_worker(version)
    model, stock = _Model(seed=10), _Model(seed=10)
    worker = arm(model)
    rng = np.random.default_rng(3)
    caplog.set_level("WARNING", logger="vllm.expertcache")
    before = _serve(model, stock, 8, rng)

    new = _new_weights(model, 1)  # the weight-transfer API: chunks, then finish
    worker.start_weight_update()
    worker.update_weights({"weights": new[:4]})
    worker.update_weights({"weights": new[4:]})
    worker.finish_weight_update()
    _copy_in_place(stock, new)
    assert "finished a weight update" in caplog.text
    x = torch.randn(1, H)
    ids, w = routing(rng, 1)
    assert not torch.equal(model.step(x, w, ids), before)
    _serve(model, stock, 8, rng)

    new = _new_weights(model, 2)
    worker.reload_weights(weights_iterator=iter(new))
    _copy_in_place(stock, new)
    _serve(model, stock, 8, rng)

    caplog.clear()
    worker.wake_up(tags=["kv_cache"])  # weights still asleep: nothing touched
    assert "emptied" not in caplog.text
    new = _new_weights(model, 3)  # a level-2 sleep: new weights land, then they wake
    _copy_in_place(model, new)
    _copy_in_place(stock, new)
    worker.wake_up(tags=["weights"])
    assert "woke its weights" in caplog.text
    _serve(model, stock, 8, rng)

    if version == "0.33.0":
        worker.reset_weights()
        stock_worker = Worker033(stock)
        stock_worker.reset_weights()
        assert "reset the weights" in caplog.text
        assert float(_serve(model, stock, 4, rng).abs().sum()) > 0  # residual stream only
    sess = worker._expertcache_session
    assert all(not a._failed for a in sess.armed)


def test_a_layer_whose_slots_cannot_be_reset_goes_back_to_the_stock_path(armed_worker,
                                                                        caplog):
    """Resetting rebuilds the slot-bound quant config; a quant method that no longer builds
    one on the slots puts its layer on the stock path, with the reason, never stale."""
    arm = armed_worker("0.26.0")
    model, stock = _Model(seed=20), _Model(seed=20)
    worker = arm(model)
    rng = np.random.default_rng(4)
    _serve(model, stock, 4, rng)
    method = model.layers[0].experts.quant_method
    method.get_fused_moe_quant_config = lambda layer: (_ for _ in ()).throw(
        RuntimeError("kernel rebuilt for another layout"))
    caplog.set_level("ERROR", logger="vllm.expertcache")
    new = _new_weights(model, 5)
    worker.reload_weights(weights_iterator=iter(new))
    _copy_in_place(stock, new)
    assert "resetting its slots after new weights failed" in caplog.text
    assert "kernel rebuilt for another layout" in caplog.text
    a0, a1 = worker._expertcache_session.armed
    assert a0._failed and "forward_modular" not in model.layers[0].experts.__dict__
    assert not a1._failed
    _serve(model, stock, 6, rng)


def test_the_weight_changing_worker_methods_are_the_ones_vllm_has():
    """The names wrapped are vLLM 0.26's and 0.33's (a rename would leave slots stale
    silently: the list is the contract the stand-ins above are built on)."""
    names = [n for n, _ in plugin.WEIGHT_CHANGES]
    assert names == ["reload_weights", "finish_weight_update", "reset_weights"]
    assert plugin._wakes_weights() and plugin._wakes_weights(None)
    assert plugin._wakes_weights(tags=["weights"]) and plugin._wakes_weights(["weights", "x"])
    assert not plugin._wakes_weights(tags=["kv_cache"])
    assert sys.modules[plugin.__name__] is plugin


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0"])
def test_sleep_frees_the_slots_with_the_weights_and_a_wake_serves_the_stock_tokens(
        armed_worker, monkeypatch, version):
    """--enable-sleep-mode: the slot buffers are allocated in vLLM's sleep pool under the
    weights' tag (and nothing else of the cache: its table and counters survive), so
    sleep() frees them; after a level-2 sleep (slots discarded, new weights loaded) and
    after a level-1 sleep (slots backed up), a wake of the weights serves exactly what the
    stock path serves."""
    allocator = FakeCuMem(version)
    mod = types.ModuleType("vllm.device_allocator")
    mod.get_mem_allocator_instance = lambda: allocator
    monkeypatch.setitem(sys.modules, "vllm.device_allocator", mod)
    arm = armed_worker(version, sleep_mode=True)
    model, stock = _Model(seed=30), _Model(seed=30)
    with allocator.use_memory_pool(tag="weights"):  # vLLM's load files the weights' pool
        pass
    worker = arm(model, enable_sleep_mode=True, sleep_mode_backend="cumem")
    sess = worker._expertcache_session
    # no pool (the weights', or one the cache opened before) released inside another's
    # context, where PyTorch aborts the process
    assert allocator.released_inside == []
    slot_bytes = sum(b.numel() * b.element_size() for a in sess.armed
                     for b in a.cache.slots.values())
    assert allocator.bytes("weights") == slot_bytes == sess.slot_bytes > 0
    assert {g for g, *_ in allocator.allocs} == {"weights"}
    rng = np.random.default_rng(6)
    _serve(model, stock, 6, rng)

    worker.sleep(level=2)
    assert allocator.bytes("weights") == 0  # freed: nothing of the cache left mapped
    new = _new_weights(model, 7)  # the trainer's new weights land while asleep
    _copy_in_place(model, new)
    _copy_in_place(stock, new)
    worker.wake_up(tags=["kv_cache"])
    assert allocator.bytes("weights") == 0  # still asleep; nothing touched them
    worker.wake_up(tags=["weights"])
    assert allocator.bytes("weights") == slot_bytes
    _serve(model, stock, 6, rng)

    worker.sleep(level=1)
    worker.wake_up()
    _serve(model, stock, 6, rng)
    assert all(not a._failed for a in sess.armed)


def test_sleep_mode_with_another_backend_arms_nothing_and_says_why(armed_worker, caplog):
    """0.33's pluggable sleep backends: only cumem's pool is known; with another one the
    slots could not sleep, so nothing is armed (one line names the fix)."""
    from expertcache_cli.plugin import memory

    worker = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(
        enable_sleep_mode=True, sleep_mode_backend="cuda_checkpoint")))
    pool, why = memory.sleep_pool(worker)
    assert pool is None and "'cuda_checkpoint' backend" in why
    assert "--sleep-mode-backend cumem or without --enable-sleep-mode" in why
    worker.vllm_config.model_config.enable_sleep_mode = False
    assert memory.sleep_pool(worker) == (None, None)


def test_a_per_layer_plan_on_a_pipeline_stage_arms_nothing_and_says_why(armed_worker,
                                                                       monkeypatch, caplog):
    """A stage of a pipeline holds some MoE layers; a per-layer plan is for the whole model,
    so no layer is armed, with one line naming the feature and the fix. One budget for
    every layer still arms the stage."""
    import expertcache_cli.device.slotcache as slotcache_mod
    from expertcache_cli.config import from_env

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    fake_vllm_layout(monkeypatch)
    caplog.set_level("WARNING", logger="vllm.expertcache")
    worker = Worker026(_Model(seed=40))
    worker.vllm_config.parallel_config = SimpleNamespace(pipeline_parallel_size=2)
    sess = plugin._arm_worker(worker, from_env({"EXPERT_CACHE_SLOTS": "6,5,4,6"}), "0.26.0")
    assert not sess.armed
    assert "pipeline parallel (2 stages) with a per-layer plan" in caplog.text
    assert "EXPERT_CACHE_SLOTS=S or EXPERT_CACHE_FRACTION" in caplog.text
    uniform = plugin._arm_worker(Worker026(_Model(seed=41)), CacheConfig(slots=6), "0.26.0")
    assert len(uniform.armed) == 2


def test_a_model_that_loads_more_than_the_plan_is_warned_before_its_kv_cache(monkeypatch,
                                                                            caplog):
    """`serve` passes what its plan holds beside the slots; vLLM measuring more at load
    (a buffer the plan does not know, such as Llama 4's rotary cache) is said with the
    difference and the slots to give up, before vLLM allocates the KV cache. Within the
    tolerance, or without a plan, nothing is said."""
    import expertcache_cli.device.slotcache as slotcache_mod
    from expertcache_cli.plugin import memory

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    fake_vllm_layout(monkeypatch)
    caplog.set_level("WARNING", logger="vllm.expertcache")
    GiB = 2**30
    for planned, loaded, warned in ((int(6.67 * GiB), int(9.17 * GiB), True),
                                    (int(9.10 * GiB), int(9.17 * GiB), False),
                                    (None, int(9.17 * GiB), False)):
        caplog.clear()
        worker = Worker026(_Model(seed=42))
        worker.model_runner.model_memory_usage = loaded
        sess = plugin._arm_worker(worker, CacheConfig(slots=6, planned_weights=planned),
                                  "0.26.0")
        assert len(sess.armed) == 2
        assert ("vLLM loaded 9.17 GiB of weights where `expertcache serve` planned 6.67 GiB"
                in caplog.text) == warned
        # counted after the check: the slots join vLLM's own record as before
        assert worker.model_runner.model_memory_usage == loaded + sess.cache_bytes
    per_slot = 2 * GiB
    text = memory.weights_warning(int(9.17 * GiB), int(6.67 * GiB), per_slot)
    assert "the 2.50 GiB more" in text and "--vram 2.50 GiB lower or 2 fewer slot(s)" in text


# The non-KV lines of vLLM's `memory_profiling` (vllm/utils/mem_utils.py), as released.
def memory_profiling_026(result, non_torch_memory, peak_activation_memory):
    result.non_kv_cache_memory = (
        non_torch_memory + peak_activation_memory + result.weights_memory
    )


def memory_profiling_033(result):
    result.total_consumed = (
        result.before_create.free_memory - result.after_profile.free_memory
    )
    result.non_kv_cache_memory = result.total_consumed + result.transient_peak_headroom


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0"])
def test_the_memory_plan_line_says_what_each_vllm_does(armed_worker, monkeypatch, version,
                                                       caplog):
    """0.26 sizes KV from model_memory_usage + the profile's increase: the slot bytes are
    added to it and the line says "counted as weights". 0.33 sizes KV from the free-memory
    drop it measures (model_memory_usage unread): the slots, allocated before the profile,
    are measured; nothing is added and the line says so."""
    from expertcache_cli.plugin import memory

    fn = {"0.26.0": memory_profiling_026, "0.33.0": memory_profiling_033}[version]
    expect = {"0.26.0": memory.WEIGHTS, "0.33.0": memory.MEASURED}[version]
    assert memory.plan_mechanism(fn) == expect
    assert memory.plan_mechanism(lambda: None) is None
    monkeypatch.setattr(memory, "plan_mechanism", lambda profiling=None: expect)
    worker = armed_worker(version)(_Model(seed=50))
    sess = worker._expertcache_session
    caplog.set_level("INFO", logger="vllm.expertcache")
    plugin._log_memory_plan(worker, sess, 3 * 2**30)
    if version == "0.26.0":
        assert worker.model_runner.model_memory_usage == 1000 + sess.slot_bytes
        assert "GiB of slots counted as weights" in caplog.text
    else:
        assert worker.model_runner.model_memory_usage == 1000  # vLLM's own record, kept
        assert "allocated before vLLM's memory profile, which counts them" in caplog.text
        # and a runner without the attribute is no reason to decline there
        assert memory.accounting_refusal(SimpleNamespace(), memory.MEASURED) is None
    assert "vLLM chose 3.00 GiB of KV cache" in caplog.text


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0"])
@pytest.mark.parametrize("captured", [False, True])
def test_new_weights_are_swept_before_the_next_step_and_a_captured_layer_that_differs_stops(
        armed_worker, monkeypatch, caplog, version, captured):
    """After a weight transfer (the path RL trainers call) every expert of every armed
    layer is swept again inside ``finish_weight_update``, before any step runs on the new
    weights. A layer whose slot path now differs goes back to the stock path where vLLM
    runs eagerly; where its cache path is in a captured CUDA graph, the update's call
    ends the engine (a SystemExit, which both releases' engine loops let through) with one
    line, instead of replaying a path known to be wrong."""
    from expertcache_cli.plugin import runtime

    arm = armed_worker(version)
    model, stock = _Model(seed=30), _Model(seed=30)
    worker = arm(model)
    rng = np.random.default_rng(30)
    caplog.set_level("INFO", logger="vllm.expertcache")
    _serve(model, stock, 2, rng)  # the first calls: each layer swept
    sess = worker._expertcache_session
    assert [a.sweep_result.paths[0].covered for a in sess.armed] == [16, 16]
    assert caplog.text.count("startup check of every expert") == 1
    if captured:
        monkeypatch.setattr(runtime, "_capturing", lambda: True)
        _serve(model, stock, 1, rng)
        monkeypatch.setattr(runtime, "_capturing", lambda: False)
        assert all(a.captured for a in sess.armed)
    a0 = sess.armed[0]
    stock_forward = a0._stock

    def wrong_on_slots(**kw):  # the new weights' kernel reads something the slots lack
        out = stock_forward(**kw)
        return out * 1.5 if model.layers[0].experts.w13_weight.shape[0] != 16 else out

    new = _new_weights(model, 31)
    worker.start_weight_update()
    worker.update_weights({"weights": new})
    _copy_in_place(stock, new)
    a0._stock = wrong_on_slots
    if captured:
        with pytest.raises(SystemExit, match="the server stops rather than serve it"):
            worker.finish_weight_update()
        assert "model.layers.0.mlp.experts: the slots path's output differs" in caplog.text
        return
    worker.finish_weight_update()
    assert a0._failed and not sess.armed[1]._failed
    assert sess.armed[1].sweep_result is not None  # swept at once, not at a later call
    assert "new weights check of every expert" in caplog.text
    assert "1 of 2 layers agreed" in caplog.text
    _serve(model, stock, 4, rng)


def test_the_sweep_after_new_weights_opens_vllms_locked_workspace_and_locks_it_again(
        armed_worker, monkeypatch):
    """vLLM locks its workspace manager after capturing (0.26 and 0.33: a kernel asking
    for a scratch key it did not ask for while warming up raises). The sweep after new
    weights runs from the worker's call, not a forward: the manager is open while it runs
    and locked again after; a sweep at a first call, unlocked, leaves it so."""
    from expertcache_cli.plugin import compat

    class Manager:
        locked = False

        def is_locked(self):
            return self.locked

        def unlock(self):
            self.locked = False

        def lock(self):
            self.locked = True

    manager = Manager()
    ws = types.ModuleType(compat.WORKSPACE_MODULE)
    ws.is_workspace_manager_initialized = lambda: True
    ws.current_workspace_manager = lambda: manager
    monkeypatch.setitem(sys.modules, compat.WORKSPACE_MODULE, ws)
    arm = armed_worker("0.33.0")
    model, stock = _Model(seed=40), _Model(seed=40)
    worker = arm(model)
    _serve(model, stock, 1, np.random.default_rng(40))
    assert not manager.locked
    manager.lock()  # vLLM, once its graphs are captured
    seen = []
    for a in worker._expertcache_session.armed:
        a._stock = (lambda f: lambda **kw: seen.append(manager.locked) or f(**kw))(a._stock)
    new = _new_weights(model, 41)
    worker.reload_weights(weights_iterator=iter(new))
    _copy_in_place(stock, new)
    assert seen and not any(seen) and manager.locked
    _serve(model, stock, 2, np.random.default_rng(41))
