"""probe-link's conclusions and plumbing, without a GPU: link classes, NUMA pinning from a
fake sysfs, the decode ceilings by hand, the gather's all-miss rotation, and the one-line
refusal where there is no CUDA device."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from expertcache_cli import probe
from expertcache_cli.errors import UserError
from expertcache_cli.rules.policy import LayerCache, Policy
from expertcache_cli.sizing import model_size


@pytest.mark.parametrize(
    "gbps,want",
    [
        (6.5, "narrower than PCIe Gen3"),
        (12.3, "PCIe Gen3 x16"),
        (26.0, "PCIe Gen4 x16"),
        (55.5, "PCIe Gen5 x16"),
        (90.0, "faster than PCIe Gen5"),
        (400.0, "coherent C2C"),
    ],
)
def test_link_classes(gbps, want):
    assert probe.classify_link(gbps).startswith(want)


def test_integrated_gpu_is_named_as_such():
    assert "integrated" in probe.classify_link(55.0, integrated=True)


def test_cpulist_parsing_and_compression():
    assert probe.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert probe.parse_cpulist("") == []
    assert probe._compress([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


def _fake_sysfs(tmp_path, bdf: str, node: str, cpus: str, speed: str = "32.0 GT/s PCIe"):
    d = tmp_path / bdf
    d.mkdir(parents=True)
    (d / "numa_node").write_text(node + "\n")
    (d / "local_cpulist").write_text(cpus + "\n")
    (d / "current_link_speed").write_text(speed + "\n")
    (d / "current_link_width").write_text("16\n")
    (d / "max_link_speed").write_text("32.0 GT/s PCIe\n")
    (d / "max_link_width").write_text("16\n")
    return tmp_path


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_pin_near_gpu_uses_the_local_cpus_we_are_allowed(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    mine = allowed[:1]
    sysfs = _fake_sysfs(tmp_path, "0000:1b:00.0", "1", ",".join(map(str, mine)))
    try:
        node, text, cpus = probe.pin_near_gpu("0000:1b:00.0", sysfs)
        assert node == 1 and cpus == mine
        assert "pinned to NUMA node 1:" in text
        assert sorted(os.sched_getaffinity(0)) == mine
    finally:
        os.sched_setaffinity(0, allowed)


def test_pin_near_gpu_explains_why_not(tmp_path):
    sysfs = _fake_sysfs(tmp_path, "0000:01:00.0", "-1", "")
    node, text, cpus = probe.pin_near_gpu("0000:01:00.0", sysfs)
    assert node == -1 and cpus == [] and "no NUMA node" in text
    assert "unknown" in probe.pin_near_gpu("", sysfs)[1]
    # a node whose CPUs are all outside our allowed set
    sysfs2 = _fake_sysfs(tmp_path / "b", "0000:02:00.0", "0", "100000")
    if hasattr(os, "sched_getaffinity"):
        assert "none of its CPUs" in probe.pin_near_gpu("0000:02:00.0", sysfs2)[1]


def test_pcie_link_text(tmp_path):
    sysfs = _fake_sysfs(tmp_path, "0000:1b:00.0", "0", "0", speed="16.0 GT/s PCIe")
    assert probe.pcie_link("0000:1b:00.0", sysfs) == "16.0 GT/s PCIe x16 (max 32.0 GT/s PCIe x16)"
    assert probe.pcie_link("0000:ff:00.0", sysfs) == ""


def test_decode_ceilings_by_hand():
    m = model_size.load_model()  # Qwen3-30B-A3B W8A8
    d = probe.decode_ceilings(m, gather_gbps=50.0, hbm_gbps=4000.0)
    host = 8 * 227_180_544  # top_k x bytes per slot = 1,817,444,352 B a token
    assert d["host_bytes_per_token"] == host
    assert d["resident_bytes_per_token"] == host + 2_177_593_344
    t_res = (host + 2_177_593_344) / 4000e9
    t_off = 2_177_593_344 / 4000e9 + host / 50e9
    assert d["resident_tok_s"] == pytest.approx(1 / t_res)
    assert d["offload_tok_s"] == pytest.approx(1 / t_off)  # ~27 tok/s offloaded
    assert 25 < d["offload_tok_s"] < 28
    assert d["offload_penalty"] == pytest.approx(t_off / t_res)
    t90 = 2_177_593_344 / 4000e9 + host * 0.9 / 4000e9 + host * 0.1 / 50e9
    assert d["cache_tok_s"]["0.90"] == pytest.approx(1 / t90)
    assert d["offload_tok_s"] < d["cache_tok_s"]["0.50"] < d["cache_tok_s"]["0.99"]


def test_gather_rotation_makes_every_id_a_miss():
    """The probe's id schedule, run through the reference cache: n misses every step."""
    for num_experts in (8, 64, 128, 256):
        e, s, ns = probe.gather_counts(num_experts)
        assert e >= 2 * s
        for n in ns:
            steps = e * 2
            ref = LayerCache(e, s, Policy.LRU)
            for t in range(3 * steps):
                row = t % steps
                res = ref.step([(row * n + j) % e for j in range(n)])
                assert res.miss_count == n, (num_experts, n, t)


def test_gather_counts():
    assert probe.gather_counts(128) == (64, 32, [1, 8, 32])
    assert probe.gather_counts(8) == (8, 4, [1, 4])
    assert probe.gather_counts(32) == (32, 16, [1, 8, 16])


def test_fmt_bytes():
    assert probe.fmt_bytes(1 << 20) == "1 MiB"
    assert probe.fmt_bytes(4_732_928) == "4.51 MiB"
    assert probe.fmt_bytes(4096) == "4 KiB"


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(_has_cuda(), reason="a CUDA device is present: the refusal path is moot")
def test_no_cuda_is_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "-m", "expertcache_cli", "probe-link"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "CUDA device" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_options_are_user_errors():
    for args in (["--sizes", "0"], ["--sizes", "a,b"], ["--model", "nope"]):
        r = subprocess.run([sys.executable, "-m", "expertcache_cli", "probe-link", *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, args
        assert "Traceback" not in r.stderr


class _FakeProps:
    name = "Fake GPU"
    is_integrated = False


class _FakeTorch:
    """Enough of torch for probe_link's orchestration (the measurements are replaced)."""

    __version__ = "0.fake"

    class version:  # noqa: N801 - mirrors torch.version
        cuda = "13.0"

    class cuda:  # noqa: N801 - mirrors torch.cuda
        @staticmethod
        def get_device_properties(device):
            return _FakeProps()

        @staticmethod
        def set_device(device):
            pass


def _fake_registry(monkeypatch, calls: list[str], fail: str = ""):
    """Replace the measurements' bodies with fixed rates; ``fail`` raises in that one."""
    from expertcache_cli.probe import measurements as meas

    def fake_run(self, torch, s, rep):
        calls.append(self.key)
        if self.key == fail:
            raise RuntimeError("boom")
        if self.key == "pinned":
            rep.rates.append(probe.Rate("h2d_pinned", 256 * probe.MiB, 0.005, 53.7, 3, 0.01))
        elif self.key == "hbm":
            rep.rates.append(probe.Rate("d2d_copy", 1024 * probe.MiB, 0.0006, 1800.0, 3, 0.0))
            rep.hbm_copy_gbps, rep.hbm_traffic_gbps = 1800.0, 3600.0
        elif self.key == "gather":
            rep.gather = [probe.Rate(f"gather_{n}", n, 1.0, 40.0 + n, 3, 0.0) for n in (1, 8, 32)]
            rep.gather_impl = "fake"
        elif self.key == "step":
            rep.step_us, rep.step_cold_us = 3.7, 4.9

    for m in meas.MEASUREMENTS.values():
        monkeypatch.setattr(type(m), "run", fake_run)
    monkeypatch.setattr(probe, "require_cuda", lambda device: _FakeTorch)
    monkeypatch.setattr(probe, "pci_bus_id", lambda torch, device: "")


def test_probe_runs_every_measurement_and_a_failure_spares_the_rest(monkeypatch):
    calls: list[str] = []
    _fake_registry(monkeypatch, calls, fail="zero-copy")
    rep = probe.probe_link(pin=False)
    assert calls == list(probe.MEASUREMENTS)
    assert rep.errors == ["zero-copy read: RuntimeError: boom"]
    assert rep.link_class == "PCIe Gen5 x16"
    assert rep.decode["gather_row"] == "gather_8"  # Qwen3-30B-A3B routes 8 experts
    assert rep.decode["gather_gbps"] == 48.0
    assert rep.settings["measurements"] == list(probe.MEASUREMENTS)


def test_probe_only_runs_the_named_measurements(monkeypatch):
    calls: list[str] = []
    _fake_registry(monkeypatch, calls)
    rep = probe.probe_link(pin=False, only=["gather"])
    assert calls == ["gather"]
    assert rep.link_class == "" and rep.decode == {}  # no copies, no HBM: no conclusions
    assert probe.gather_row(rep.gather, rep.model["top_k"]).path == "gather_8"
    with pytest.raises(UserError, match="unknown measurement.*known: pinned"):
        probe.probe_link(pin=False, only=["copies"])
    calls.clear()
    probe.probe_link(pin=False, pageable_mib=())  # nothing asked of it: not run, no error
    assert "pageable" not in calls


def test_the_cache_step_is_measured_saved_and_read_by_plan(monkeypatch, tmp_path):
    """`probe-link --only gather,step` saves the all-hit step, and `plan --probe` adds it."""
    import json

    from expertcache_cli.planning import planner

    calls: list[str] = []
    _fake_registry(monkeypatch, calls)
    rep = probe.probe_link(pin=False, only=["gather", "step"])
    assert calls == ["gather", "step"] and rep.step_us == 3.7
    saved = tmp_path / "probe.json"
    saved.write_text(json.dumps(rep.to_json()))
    assert planner.read_probe(saved)[2][0] == 3.7
    assert planner.read_probe(saved)[0] == 48.0


def test_every_measured_row_has_one_label():
    labels = [p for m in probe.MEASUREMENTS.values() for p in m.rows]
    assert len(labels) == len(set(labels))
    assert probe.row_label("zero_copy_read").startswith("SM zero-copy")
    assert probe.row_label("unlabelled") == "unlabelled"


def test_probe_link_prints_the_cold_step_beside_the_warm_one(monkeypatch, tmp_path):
    """Both all-hit step figures reach the user and the saved file; plan reads the warm
    one (`step_us`) until the device has compared the cold one with served profiles."""
    import json

    from typer.testing import CliRunner

    from expertcache_cli.cli import app
    from expertcache_cli.planning import planner

    calls: list[str] = []
    _fake_registry(monkeypatch, calls)
    out = tmp_path / "probe.json"
    r = CliRunner().invoke(app, ["probe-link", "--only", "gather,step", "--save", str(out)],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "every expert hits: 3.70 us per MoE layer" in r.output
    assert "evicted from L2 before each layer" in r.output and "4.90 us" in r.output
    saved = json.loads(out.read_text())
    assert (saved["step_us"], saved["step_cold_us"]) == (3.7, 4.9)
    assert planner.read_probe(out)[2][0] == 3.7


def test_the_stage_measurement_copies_every_hit_from_the_slots_and_checks_it():
    """probe-link's `stage` times a stage that routes only experts in the slots; its check
    fails where the scratch does not hold the slots' bytes or something came from host."""
    torch = pytest.importorskip("torch", reason="no torch: the scratch is torch tensors")
    from expertcache_cli.device.scratch import torch_copiers
    from expertcache_cli.probe.measurements import gather_counts, stage_setup

    stage, check, hits = stage_setup(torch, torch.device("cpu"), [("w", 64), ("s", 8)], 128,
                                     copier=torch_copiers)
    assert hits == gather_counts(128)[1] == 32
    with pytest.raises(RuntimeError, match="did not copy its 32 hits"):
        check()  # nothing staged yet
    stage()
    check()
