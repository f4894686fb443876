"""bench/bench_wide_stage.py's bookkeeping on CPU: every (hits, misses) row staged and its
bytes checked against the host copies, and the table's arithmetic, with a stand-in timer
that charges each copy by the bytes it moved (host 2 ns a byte, slots 1, copy engine 0.5),
so the rates the table prints are known. The GPU numbers come from the device."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

torch = pytest.importorskip("torch")

NS = 1e-9


def _stand_ins():
    from expertcache_cli.device.scratch import torch_copiers

    spent = [0.0]

    def charged(copy, per_byte):
        def run(srcs, src_list, dst_list, count):
            n = int(count.reshape(-1)[0])
            spent[0] += n * sum(s[0].nbytes for s in srcs.values()) * per_byte
            copy(srcs, src_list, dst_list, count)
        return run

    def copier(scratch):
        from_slots, from_host = torch_copiers(scratch)
        return charged(from_slots, 1 * NS), charged(from_host, 2 * NS)

    def memcpy(dst, src, nbytes, stream):
        ctypes.memmove(dst, src, nbytes)
        spent[0] += nbytes * 0.5 * NS

    def timer(torch_, body, reps):
        spent[0] = 0.0
        body(0)
        return spent[0]

    return timer, memcpy, copier


def test_every_row_stages_the_right_bytes_and_the_table_prices_them():
    import bench_wide_stage as b

    timer, memcpy, copier = _stand_ins()
    specs = {"w13": ((64, 128), torch.bfloat16), "w2": ((128, 64), torch.bfloat16)}
    slab, rows = b.measure(torch, 128, 64, specs, reps=3, device="cpu", timer=timer,
                           memcpy=memcpy, copier=copier)
    assert slab == 32768
    assert [(r["hits"], r["misses"]) for r in rows] == [
        (32, 0), (64, 0), (0, 42), (32, 42), (64, 42), (0, 64), (32, 64), (64, 64)]
    for r in rows:
        assert r["stage_s"] == pytest.approx((2 * r["misses"] + r["hits"]) * slab * NS)
        assert r["d2d_s"] == pytest.approx(r["hits"] * slab * 0.5 * NS)
    text = b.table(rows, slab)
    # hits 1 GB/s (the stand-in slots rate), the copy engine 2, a miss 0.5 GB/s
    assert "| 32 | 42 | 3801 | 2753 | 1.381 | 1049 | 1 | 2 |" in text
    assert "| 0 | 64 | 4194 | 4194 | 1.000 | 0 | - | - |" in text
    assert "| 64 | 0 | 2097 | 0 | - | 2097 | 1 | 2 |" in text
    assert "a miss costs 65.5 us here (0.5 GB/s from host)" in text


def test_a_stage_that_moved_the_wrong_bytes_fails_the_row():
    import bench_wide_stage as b

    timer, memcpy, copier = _stand_ins()

    def lossy(scratch):  # the hit copies write nothing: the scratch keeps its zeros
        _, from_host = copier(scratch)
        return (lambda *a: None), from_host

    with pytest.raises(AssertionError, match="scratch w13 wrong"):
        b.measure(torch, 16, 8, {"w13": ((2, 8), torch.bfloat16)}, reps=1, device="cpu",
                  timer=timer, memcpy=memcpy, copier=lossy)
