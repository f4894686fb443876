"""Rows vLLM pads a step with install nothing and count nothing: the V1 runner's real token
count read live, the mask inside CUDA graphs only, said once a process.
Stand-ins: tests/armed_standins.py. Skipped (with the reason) without torch.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="no torch: the plugin runtime tests need torch")

from armed_standins import (  # noqa: E402
    TOPK,
    Experts,
    H,
    vllm_padding_marks,
)
from ref_slotcache import RefSlotCache  # noqa: E402

from expertcache_cli.config import CacheConfig  # noqa: E402
from expertcache_cli.plugin.arming import plan_layer  # noqa: E402
from expertcache_cli.plugin.runtime import ArmedLayer  # noqa: E402


def _ids_stepped(cache) -> list[torch.Tensor]:
    """The ids of every manager step ``cache`` takes from now on (the step runs as before)."""
    seen: list[torch.Tensor] = []
    step = cache.step
    cache.step = lambda ids, src, **kw: seen.append(ids.clone()) or step(ids, src, **kw)
    return seen


def test_rows_vllm_marks_as_padding_install_nothing_and_count_nothing(monkeypatch):
    """vLLM's V2 runner marks CUDA-graph padding rows in
    forward_context.is_padding; their ids must not reach the manager (no installs, no
    requests), the real rows' outputs stay those of the stock path, and the rows the kernel
    sees for padding are valid slots."""
    mask = torch.tensor([False, False, True])
    vllm_padding_marks(monkeypatch, lambda: mask)

    layer = Experts(seed=4)
    d = plan_layer(layer, CacheConfig(slots=6))
    cache = RefSlotCache(d.num_experts, d.num_slots, {s.name: (s.shape, s.dtype) for s in d.specs})
    seen = _ids_stepped(cache)
    armed = ArmedLayer(layer, d, cache, index=0)
    armed.install()
    ids = torch.tensor([[1, 2], [2, 3], [14, 15]], dtype=torch.int32)  # row 2 is padding
    w, x = torch.rand(3, TOPK), torch.randn(3, H)
    got = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    # the manager gets the ids as they are and vLLM's marks (it leaves the rows out itself)
    assert seen[-1].tolist() == ids.tolist()  # (after the sweep's steps, which mark none)
    assert cache.pad_rows_seen[-1] == [False, False, True] and armed.checked["slots"] == 0.0
    assert np.flatnonzero(np.asarray(cache.ref.table) >= 0).tolist() == [1, 2, 3]  # no 14, 15
    assert cache.stats.tolist() == [3, 3]  # requests: the 3 real distinct ids only
    armed.uninstall()
    want = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    assert torch.allclose(got[:2], want[:2], atol=1e-5)


def _v1_worker(count_buf, **parallel):
    runner_cls = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu_model_runner"})
    runner = runner_cls()
    runner.query_start_loc = SimpleNamespace(gpu=count_buf)
    pc = SimpleNamespace(data_parallel_size=1, use_ubatching=False,
                         use_sequence_parallel_moe=False)
    pc.__dict__.update(parallel)
    return SimpleNamespace(model_runner=runner, vllm_config=SimpleNamespace(parallel_config=pc))


def test_the_v1_runner_real_token_count_is_read_live_and_only_where_rows_are_tokens():
    from expertcache_cli.plugin import padding

    buf = torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32)  # 2 real tokens, padded to 4 reqs
    count, why = padding.v1_token_count(_v1_worker(buf))
    assert count is not None and int(count) == 2 and "query_start_loc" in why
    buf[-1] = 3
    assert int(count) == 3  # a view: the next step's value, as a graph replay reads it
    for kw, word in (({"data_parallel_size": 2}, "data parallel"),
                     ({"use_ubatching": True}, "use_ubatching"),
                     ({"use_sequence_parallel_moe": True}, "use_sequence_parallel_moe")):
        got, why = padding.v1_token_count(_v1_worker(buf, **kw))
        assert got is None and word in why
    v2 = _v1_worker(buf)
    v2.model_runner.__class__.__module__ = "vllm.v1.worker.gpu.model_runner"
    assert padding.v1_token_count(v2) == (None, "not vLLM's V1 model runner")


def test_v1_padding_rows_are_masked_inside_graphs_only(monkeypatch):
    """Rows at or past the real count are padding, read when a graph is captured (replays
    read the live count); eager calls (dummy runs with a stale count, the first-call check)
    see every row as real."""
    from expertcache_cli.plugin import padding

    buf = torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32)
    read = padding.mask_reader(buf[-1:], max_tokens=8)
    monkeypatch.setattr(padding, "capturing", lambda: False)
    assert read(4) is None
    monkeypatch.setattr(padding, "capturing", lambda: True)
    assert read(4).tolist() == [False, False, True, True]
    buf[-1] = 3
    assert read(4).tolist() == [False, False, False, True]
    assert read(9) is None  # wider than any graph: not a padded decode batch


def test_the_plugin_says_once_where_padding_rows_come_from(monkeypatch, caplog):
    import expertcache_cli.plugin as plugin
    from expertcache_cli.plugin import padding

    caplog.set_level("DEBUG", logger="vllm.expertcache")
    buf = torch.tensor([0, 1, 1], dtype=torch.int32)
    worker = _v1_worker(buf)
    worker.vllm_config.scheduler_config = SimpleNamespace(max_num_batched_tokens=8)
    read = plugin._padding_reader(worker)
    assert ("CUDA-graph padding rows are kept out of the cache (vLLM's V1 runner: rows past "
            "query_start_loc's last entry)") in caplog.text
    monkeypatch.setattr(padding, "capturing", lambda: True)
    assert read(2).tolist() == [False, True]
    plugin._padding_reader(_v1_worker(buf, data_parallel_size=2))
    assert "padding rows from vLLM's V2 marks only (data parallel" in caplog.text


@pytest.mark.parametrize("route", ["count", "mask"])
def test_v1_padding_rows_install_nothing_and_count_nothing(monkeypatch, route):
    """Captured on V1, the manager gets the real-rows count and the ids as they are (no
    mask launches); with a mask-only reader (a trace being recorded takes this path too),
    the padded ids are masked first. Both: nothing installed or counted for the padding."""
    from expertcache_cli.plugin import padding, runtime

    buf = torch.tensor([0, 1, 2, 2], dtype=torch.int32)  # 2 real tokens of a 3-row graph
    monkeypatch.setattr(padding, "capturing", lambda: True)
    monkeypatch.setattr(runtime, "_capturing", lambda: True)
    layer = Experts(seed=4)
    d = plan_layer(layer, CacheConfig(slots=6))
    cache = RefSlotCache(d.num_experts, d.num_slots, {s.name: (s.shape, s.dtype) for s in d.specs})
    seen = _ids_stepped(cache)
    reader = padding.mask_reader(buf[-1:], max_tokens=8)
    armed = ArmedLayer(layer, d, cache, index=0,
                       padding=reader if route == "count" else (lambda n: reader(n)))
    armed.install()
    ids = torch.tensor([[1, 2], [2, 3], [14, 15]], dtype=torch.int32)  # row 2 is padding
    w, x = torch.rand(3, TOPK), torch.randn(3, H)
    got = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    if route == "count":
        assert cache.real_rows_seen == [2] and seen[0].tolist() == ids.tolist()
    else:
        assert cache.real_rows_seen == [None] and seen[0].tolist() == [[1, 2], [2, 3],
                                                                      [-1, -1]]
    assert np.flatnonzero(np.asarray(cache.ref.table) >= 0).tolist() == [1, 2, 3]  # no 14, 15
    assert cache.stats.tolist() == [3, 3]
    armed.uninstall()
    want = layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    assert torch.allclose(got[:2], want[:2], atol=1e-5)


@pytest.mark.parametrize("route,launches", [
    ("count", []),
    ("marks", []),
    ("mask", ["ge", "scalar_tensor", "where", "scalar_tensor", "where"])])
def test_a_captured_v1_step_launches_no_torch_kernel_besides_the_cache_step(
        monkeypatch, route, launches):
    """What an armed layer adds to a captured decode graph, beside the cache's own step
    and the experts call: on V1 with the count, nothing (kernel ABI 2 reads it); with a
    torch mask, a compare and two torch.where with the scalars they fill (on the GPU each
    a kernel, so five graph nodes a layer; with them the all-hit layer cost ~12 us served
    against a 4.1 us step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from expertcache_cli.plugin import padding, runtime

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    class Quiet(Experts):  # a stock call that launches nothing, to see the plugin's own
        def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None,
                            shared_experts_input=None):
            return x

    layer = Quiet()
    d = plan_layer(layer, CacheConfig(slots=6))
    cache = RefSlotCache(d.num_experts, d.num_slots, {s.name: (s.shape, s.dtype) for s in d.specs})
    # the cache step launches kernels of its own (what the probe times), no torch op
    cache.step = lambda ids, sources, **rows: ids
    buf = torch.tensor([0, 1, 1], dtype=torch.int32)
    reader = padding.mask_reader(buf[-1:], max_tokens=8)
    if route == "marks":  # vLLM's V2 runner: its marks in the forward context
        marks = torch.tensor([False, True])  # vLLM's buffer, made before the step
        vllm_padding_marks(monkeypatch, lambda: marks)
        reader = padding.mask_reader()
    armed = ArmedLayer(layer, d, cache, index=0,
                       padding=reader.__call__ if route == "mask" else reader)
    armed.install()
    armed.checked["slots"] = 0.0  # (the first-call check is an eager call's business)
    monkeypatch.setattr(padding, "capturing", lambda: True)
    monkeypatch.setattr(runtime, "_capturing", lambda: True)
    x, w = torch.randn(2, H), torch.rand(2, TOPK)
    ids = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    with Ops() as ops:
        layer.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    views = {"slice", "unsqueeze", "view", "alias", "detach", "expand", "select"}
    assert [n for n in ops.names if n not in views] == launches


def test_the_real_rows_count_is_given_only_where_the_mask_would_come_from_it(monkeypatch):
    from expertcache_cli.plugin import padding

    buf = torch.tensor([0, 1, 2, 2], dtype=torch.int32)
    read = padding.mask_reader(buf[-1:], max_tokens=8)
    monkeypatch.setattr(padding, "capturing", lambda: False)
    assert read.rows(3) is None  # eager: dummy runs and the first-call check see every row
    monkeypatch.setattr(padding, "capturing", lambda: True)
    assert int(read.rows(3)["real_rows"]) == 2
    assert read.rows(9) is None  # wider than any graph
    wide = padding.mask_reader(torch.tensor([0, 2], dtype=torch.int64)[-1:], max_tokens=8)
    assert wide.rows(2) is None and wide(2).tolist() == [False, False]  # the kernel reads int32
