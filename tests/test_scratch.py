"""The wide-step scratch on CPU torch: the copy lists built on the device from the routing
and the table, and the staging they drive (with torch copies standing in for the gather
kernel, whose own device tests prove it). Skipped (with the reason) where torch is missing."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="no torch: the scratch tests need torch")

from expertcache_cli.device.scratch import Scratch, scratch_bytes, stage_lists, torch_copiers  # noqa: E402


def _lists(ids: np.ndarray, table: np.ndarray):
    e = table.shape[0]
    hit_src = torch.full((e + 1,), -1, dtype=torch.int32)
    hit_dst, miss = hit_src.clone(), hit_src.clone()
    counts = torch.zeros(2, dtype=torch.int32)
    stage_lists(torch.from_numpy(ids), torch.from_numpy(table), e, hit_src, hit_dst, miss,
                counts)
    nh, nm = counts.tolist()
    return hit_src[:nh].tolist(), hit_dst[:nh].tolist(), miss[:nm].tolist()


def test_lists_are_the_routed_experts_split_by_residence_in_ascending_order():
    rng = np.random.default_rng(0)
    for _ in range(200):
        e = int(rng.integers(2, 40))
        table = np.full(e, -1, np.int32)
        resident = rng.choice(e, int(rng.integers(0, e)), replace=False)
        table[resident] = rng.permutation(len(resident)).astype(np.int32)
        ids = rng.integers(-3, e + 3, size=(int(rng.integers(1, 30)), 3)).astype(
            rng.choice([np.int32, np.int64]))
        routed = sorted({int(x) for x in ids.ravel() if 0 <= x < e})
        hit_src, hit_dst, miss = _lists(ids, table)
        assert hit_dst == [x for x in routed if table[x] >= 0]
        assert hit_src == [int(table[x]) for x in hit_dst]
        assert miss == [x for x in routed if table[x] < 0]


def test_staging_makes_every_routed_expert_resident_from_the_right_place():
    e, s = 10, 4
    specs = {"w": ((3, 4), torch.float32), "b": ((4,), torch.float32)}
    host = {k: torch.randn((e, *shape)) for k, (shape, _) in specs.items()}
    slots = {k: torch.randn((s, *shape)) for k, (shape, _) in specs.items()}
    table = torch.full((e,), -1, dtype=torch.int32)
    table[7], table[2] = 0, 3  # experts 7 and 2 sit in slots 0 and 3
    sc = Scratch(e, specs, "cpu", copier=torch_copiers)
    assert sc.nbytes == scratch_bytes(e, {"w": 48, "b": 16}) == e * 64
    sc.stage(torch.tensor([[7, 5], [2, 5], [-1, 9]]), table, slots, host)
    assert sc.counts.tolist() == [2, 2]
    for k in specs:
        assert torch.equal(sc.buffers[k][7], slots[k][0])  # hits: from the slots
        assert torch.equal(sc.buffers[k][2], slots[k][3])
        assert torch.equal(sc.buffers[k][5], host[k][5])  # misses: from the host copies
        assert torch.equal(sc.buffers[k][9], host[k][9])
        assert not sc.buffers[k][0].any()  # not routed: untouched (zeros at start)
