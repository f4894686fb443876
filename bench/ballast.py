"""A small card on a big GPU: hold all but N GiB of it in another process.

Why: every serving claim must hold on the 12-32 GiB cards users have, and the benches'
GPU is far bigger (an H200: 139.8 GiB). A ballast process allocates everything but N GiB
and sleeps, so a vLLM started next finds N GiB free, as on an N GiB card; `expertcache
serve --vram N` (or `baseline --vram N`) then gives vLLM the card's share of the GPU,
utilization x 139.8 = 0.9 x N GiB, and the card's batch default (what vLLM picks below 70
GiB). For a plain `vllm serve`, `flags` prints the same flags.

What it does not emulate: the small card's compute (SMs, HBM bandwidth) and its host link
(an H200 on PCIe Gen5 x16 reads host memory at ~50 GB/s; a 4090 on Gen4 at ~25): tok/s
measured this way are the big GPU's at the card's memory budget, and a miss costs what it
costs on this link. The CUDA context of every process on the GPU also comes out of the
N GiB, as it does on a real card.

    python bench/ballast.py start --leave 24      # prints JSON, returns once it holds
    python bench/ballast.py flags --card 24       # vLLM flags for a plain `vllm serve`
    python bench/ballast.py stop                  # by the PID it recorded

The PID file (``EC_BALLAST_PIDFILE``, default /tmp/expertcache-ballast.pid) holds the
holder's PID and start time: `stop` ends that process (its own process group) and nothing
else, and a PID since reused by another process is left alone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from expertcache_cli.baseline import groups  # noqa: E402

GiB = 1024**3
MiB = 1024**2
PIDFILE = Path(os.environ.get("EC_BALLAST_PIDFILE", "/tmp/expertcache-ballast.pid"))


def smi_id(device: int, environ: dict[str, str] | None = None) -> str:
    """nvidia-smi's name for torch's ``device``: nvidia-smi ignores CUDA_VISIBLE_DEVICES,
    so under ``CUDA_VISIBLE_DEVICES=1`` torch's device 0 is nvidia-smi's 1 (a runner per
    GPU of a 2-GPU box)."""
    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else []
    return ids[device] if 0 <= device < len(ids) and ids[device] else str(device)


def _smi_free_mib(device: int) -> float | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.free,memory.used,memory.total",
             "--format=csv,noheader,nounits", "-i", smi_id(device)],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
        return float(out.split(",")[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def hold(leave_gib: float, device: int, ready: Path) -> None:
    """The ballast itself: allocate until ``leave_gib`` is free, report, sleep."""
    import torch

    torch.cuda.set_device(device)
    torch.zeros(1, device="cuda")  # create the context first: it is part of what we hold
    blocks = []
    target = int(leave_gib * GiB)
    for step in (GiB, 64 * MiB, 2 * MiB):
        while torch.cuda.mem_get_info()[0] - step >= target:
            blocks.append(torch.empty(step, dtype=torch.uint8, device="cuda"))
    free, total = torch.cuda.mem_get_info()
    ready.write_text(json.dumps({"pid": os.getpid(), "free_gib": free / GiB,
                                 "total_gib": total / GiB,
                                 "held_gib": sum(b.numel() for b in blocks) / GiB}))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)


def flags(card_gib: float, total_gib: float) -> list[str]:
    """vLLM flags that budget as a ``card_gib`` card would, on a GPU of ``total_gib``."""
    from expertcache_cli.sizing import sizing

    p = sizing.plan(None, card_gib, max_model_len=1024, device_total_gib=total_gib)
    args = p.vllm_args()
    keep = ("--gpu-memory-utilization", "--max-num-batched-tokens")
    return [x for i, a in enumerate(args[::2]) if a in keep for x in (a, args[2 * i + 1])]


def start(leave_gib: float, device: int, timeout_s: float = 120.0) -> dict:
    # the holder's report, beside the PID file; read once, then removed
    ready = PIDFILE.with_name(f"expertcache-ballast-{os.getpid()}.json")
    ready.unlink(missing_ok=True)
    try:
        return _start(leave_gib, device, timeout_s, ready)
    finally:
        ready.unlink(missing_ok=True)


def _start(leave_gib: float, device: int, timeout_s: float, ready: Path) -> dict:
    proc = subprocess.Popen(
        [sys.executable, __file__, "hold", "--leave", str(leave_gib), "--device", str(device),
         "--ready", str(ready)],
        # never the caller's stdout: a pipe reader (`start | tee`) would wait for the
        # holder, which lives until `stop`, and hang
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    t0 = time.time()
    while not ready.exists():
        if proc.poll() is not None:
            raise SystemExit(f"ballast: the holder exited with {proc.returncode}")
        if time.time() - t0 > timeout_s:
            proc.kill()
            raise SystemExit("ballast: the holder did not report in time")
        time.sleep(0.2)
    time.sleep(0.3)
    info = json.loads(ready.read_text())
    PIDFILE.write_text(f"{proc.pid} {groups.start_time(proc.pid) or '-'}")
    smi = _smi_free_mib(device)
    info.update(
        smi_free_gib=None if smi is None else smi / 1024,
        verified=smi is not None and abs(smi / 1024 - leave_gib) <= 0.25,
        leave_gib=leave_gib,
    )
    if abs(info["free_gib"] - leave_gib) > 0.25:
        # another process already holds the memory (a server a killed run left behind):
        # every number measured on this "card" would be on a smaller one, or fail to start
        proc.kill()
        PIDFILE.unlink(missing_ok=True)
        raise SystemExit(
            f"ballast: cannot leave {leave_gib:g} GiB free: {info['free_gib']:.2f} GiB is "
            f"free with the ballast holding {info['held_gib']:.2f} GiB; another process "
            "holds the GPU (nvidia-smi lists it)")
    info["vllm_flags"] = flags(leave_gib, info["total_gib"])
    return info


def stop() -> str:
    """End the holder the PID file names, if that process is still the holder."""
    if not PIDFILE.exists():
        return "ballast: no pid file, nothing to stop"
    words = PIDFILE.read_text().split()
    try:
        pid, started = int(words[0]), words[1]
    except (IndexError, ValueError):
        return (f"ballast: {PIDFILE} does not hold a PID and its start time; nothing "
                "stopped (remove it once no holder runs)")
    now = groups.start_time(pid)
    if now is None or now != started:
        PIDFILE.unlink(missing_ok=True)
        return f"ballast: pid {pid} has ended already, nothing to stop"
    if not groups.end_group(pid):  # the holder leads a process group of its own
        return f"ballast: pid {pid} would not end"
    PIDFILE.unlink(missing_ok=True)
    return f"ballast: stopped pid {pid}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="hold all but --leave GiB; prints JSON")
    s.add_argument("--leave", type=float, required=True)
    s.add_argument("--device", type=int, default=0)
    sub.add_parser("stop", help="stop the ballast by its recorded PID")
    f = sub.add_parser("flags", help="vLLM flags for a --card GiB card on this GPU")
    f.add_argument("--card", type=float, required=True)
    f.add_argument("--total", type=float, default=None, help="GPU GiB (default: nvidia-smi)")
    h = sub.add_parser("hold")
    h.add_argument("--leave", type=float, required=True)
    h.add_argument("--device", type=int, default=0)
    h.add_argument("--ready", type=Path, required=True)
    a = ap.parse_args()
    if a.cmd == "hold":
        hold(a.leave, a.device, a.ready)
    elif a.cmd == "start":
        print(json.dumps(start(a.leave, a.device)))
    elif a.cmd == "stop":
        print(stop())
    else:
        from expertcache_cli.device.gpu_info import device_total_gib

        total = a.total or device_total_gib()
        if total is None:
            raise SystemExit("ballast: no GPU found; pass --total GiB")
        print(" ".join(flags(a.card, total)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
