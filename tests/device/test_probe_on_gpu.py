"""probe-link on a real GPU: every figure present and sane, the data actually read, the
gather measured with the project's kernel (every step all misses), JSON complete."""

from __future__ import annotations

import json
import subprocess
import sys

MiB = 1 << 20


def test_probe_small_run_is_complete_and_sane(cuda):
    from expertcache_cli import probe

    rep = probe.probe_link(device=0, sizes_mib=(1, 64), repeats=3, warmup=1,
                           zero_copy_mib=64, pageable_mib=(16,))
    assert rep.errors == [], rep.errors
    paths = {(r.path, r.nbytes) for r in rep.rates}
    for want in [("h2d_pinned", MiB), ("h2d_pinned", 64 * MiB), ("d2h_pinned", 64 * MiB),
                 ("h2d_pageable", 16 * MiB), ("zero_copy_read", 64 * MiB)]:
        assert want in paths, want
    for r in rep.rates:
        assert r.gbps > 0.5, r  # even PCIe Gen3 x4 moves more than this
        assert "WRONG" not in r.note, r
    # the copy engine at 64 MiB beats 1 MiB (fixed per-transfer cost amortised)
    assert rep.rate("h2d_pinned", 64 * MiB).gbps >= rep.rate("h2d_pinned", MiB).gbps * 0.9
    assert rep.gather and "FALLBACK" not in rep.gather_impl, rep.gather_impl
    assert [r.path for r in rep.gather] == ["gather_1", "gather_8", "gather_32"]
    assert all("INSTALLS" not in r.note for r in rep.gather)
    # the all-hit cache step, timed in a CUDA graph (measure_step raises if a timed step
    # installed anything, which rep.errors above would show)
    assert rep.step_us > 0 and json.loads(json.dumps(rep.to_json()))["step_us"] == rep.step_us
    # with its state evicted from L2 before each layer (as served) the step costs more
    assert rep.step_cold_us > rep.step_us * 0.9, (rep.step_cold_us, rep.step_us)
    assert rep.link_class
    assert rep.hbm_traffic_gbps > rep.rate("h2d_pinned").gbps  # HBM beats any host link
    # a staged step's hits, copied slots -> scratch on the device (measure_stage checks
    # the scratch's bytes and counts): device memory, far past the host link
    assert rep.stage_gbps > 5 * rep.rate("h2d_pinned").gbps, rep.stage_gbps
    assert rep.rate("stage_hits") is not None
    d = rep.decode
    assert d["resident_tok_s"] > d["offload_tok_s"] > 0
    json.dumps(rep.to_json())


def test_bad_device_index_is_one_line_exit_2(cuda):
    r = subprocess.run([sys.executable, "-m", "expertcache_cli", "probe-link", "--device", "99"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "--device 99" in r.stderr and "Traceback" not in r.stderr
