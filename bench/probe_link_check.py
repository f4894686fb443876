"""Check `expertcache probe-link` against an independent measurement in the same run.

The probe measures with torch (copies, an elementwise kernel over a UVA view, the
project's gather); the check (`bench/probe_check.cu`) measures the same paths with only
the CUDA runtime: a plain cudaMemcpyAsync loop and a plain 16-byte copy kernel over the
mapped pointer. Both run on the CPUs of the GPU's NUMA node. The check runs before and
after the probe, so its own drift is visible beside the probe-vs-check ratio.

    python bench/probe_link_check.py [OUT_DIR]        # default: $OUT or ./probe_out

Writes probe.txt (the table), probe.json (every number), check_before/after.json and
compare.json, and prints the comparison: PASS when every primary figure agrees within 3%.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 0.03
MiB = 1 << 20

#: (probe path, probe bytes, check key, primary?)
PAIRS = [
    ("h2d_pinned", 1024 * MiB, "h2d_pinned_1024MiB", True),
    ("h2d_pinned", 256 * MiB, "h2d_pinned_256MiB", True),
    ("d2h_pinned", 1024 * MiB, "d2h_pinned_1024MiB", True),
    ("d2h_pinned", 256 * MiB, "d2h_pinned_256MiB", True),
    ("zero_copy_read", 256 * MiB, "zero_copy_read_256MiB", True),
    ("h2d_pinned", 1 * MiB, "h2d_pinned_1MiB", False),
    ("d2h_pinned", 1 * MiB, "d2h_pinned_1MiB", False),
    ("d2d_copy", 1024 * MiB, "d2d_copy_1024MiB", False),
]


def local_cpus() -> list[int]:
    """The CPUs of GPU 0's NUMA node that we may use (what the probe pins to)."""
    import torch

    from expertcache_cli import probe

    bdf = probe.pci_bus_id(torch, 0)
    text = probe._read(Path("/sys/bus/pci/devices") / bdf / "local_cpulist") if bdf else ""
    return sorted(set(probe.parse_cpulist(text)) & os.sched_getaffinity(0))


def run_check(exe: Path, cpus: list[int]) -> dict:
    cmd = [str(exe), "0"]
    if cpus and shutil.which("taskset"):
        cmd = ["taskset", "-c", ",".join(map(str, cpus))] + cmd
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise SystemExit(f"probe_check failed: {r.stderr.strip()}")
    return json.loads(r.stdout)


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "probe_out"))
    out.mkdir(parents=True, exist_ok=True)
    exe = out / "probe_check"
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    subprocess.run([nvcc, "-O3", "-arch=native", "-o", str(exe), str(ROOT / "bench" /
                    "probe_check.cu")], check=True)
    cpus = local_cpus()
    before = run_check(exe, cpus)
    (out / "check_before.json").write_text(json.dumps(before, indent=2))
    env = dict(os.environ, COLUMNS="120", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "expertcache_cli", "probe-link", "--save",
                        str(out / "probe.json")], capture_output=True, text=True, env=env,
                       timeout=600)
    (out / "probe.txt").write_text(r.stdout + r.stderr)
    print(r.stdout + r.stderr)
    if r.returncode:
        return r.returncode
    after = run_check(exe, cpus)
    (out / "check_after.json").write_text(json.dumps(after, indent=2))
    rep = json.loads((out / "probe.json").read_text())
    rates = {(x["path"], x["nbytes"]): x["gbps"] for x in rep["rates"]}

    rows, ok = [], True
    print(f"{'figure':28} {'probe':>8} {'check':>8} {'check2':>8} {'ratio':>7}  verdict")
    for path, nbytes, key, primary in PAIRS:
        p = rates.get((path, nbytes))
        c1, c2 = before.get(key), after.get(key)
        if p is None or c1 is None or c2 is None:
            rows.append({"figure": key, "missing": True})
            ok = ok and not primary
            print(f"{key:28} missing")
            continue
        c = (c1 + c2) / 2
        ratio = p / c
        good = abs(ratio - 1) <= TOLERANCE
        verdict = ("PASS" if good else "FAIL") if primary else "info"
        ok = ok and (good or not primary)
        rows.append({"figure": key, "probe_gbps": p, "check_gbps": c1, "check2_gbps": c2,
                     "ratio": ratio, "check_drift": abs(c1 - c2) / c, "verdict": verdict})
        print(f"{key:28} {p:8.2f} {c1:8.2f} {c2:8.2f} {ratio:7.3f}  {verdict}")
    summary = {"tolerance": TOLERANCE, "pass": ok, "rows": rows, "cpus": cpus,
               "device": before.get("device"), "data_ok": before.get("data_ok")}
    (out / "compare.json").write_text(json.dumps(summary, indent=2))
    print("independent check:", "PASS (all primary figures within 3%)" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
