"""Where an all-hit cache's decode time goes: two vLLM profiler traces, kernel by kernel.

Why: with every expert a hit, the cache should cost only its per-layer step (probed at
~4.1 us a MoE layer on the H200), yet served it costs ~12 us a layer (fp8-block, 24
layers: 0.874 of resident; the 8-layer bf16 profile and the 48-layer W8A8 run showed the
same ~11 us). An event window cannot say which part; the GPU's own kernel records can.
`bench/small_card.py --profile DIR` records the decode steps of one request with vLLM's
torch profiler (the prefill skipped: it reads the host through in the cache arm); this
reads the Chrome traces it wrote and prints, per decode step, the GPU's busy time, its
span (busy plus the gaps between kernels), the kernels launched, and the kernels whose
time differs most between the two arms; then the host side: each step's period between
two graph launches and the GPU's idle time in it (median, p90, max), and the host calls
(aten ops, CUDA runtime calls) whose time a step differs most.

    python bench/profile_report.py RESIDENT_DIR CACHE_DIR [--labels resident,hot] [--top 15]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

#: trace categories that are GPU work
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: the host call that replays one captured decode step
GRAPH_LAUNCH = "cudaGraphLaunch"
#: trace categories that are the host's own work
HOST_CATS = ("cuda_runtime", "cpu_op")


@dataclass
class GpuSummary:
    """One arm's profiled window: GPU work by kernel name, and how many decode steps."""

    steps: int
    busy_us: float
    span_us: float
    launches: int
    by_name: dict[str, list[float]] = field(default_factory=dict)  # name -> [us, count]
    files: list[str] = field(default_factory=list)
    #: name -> us during which that kernel ran and no other did: what it adds to the busy
    #: time. Kernels launched with PDL start early and wait inside, so their durations
    #: overlap the kernel before them and no longer add up (the sum of these, plus the
    #: time two kernels overlap, is the busy time).
    alone: dict[str, float] = field(default_factory=dict)
    #: the host side: when each captured step was launched, and the host's own calls
    #: (aten ops, CUDA runtime calls) by name -> [us, count]. The GPU waits for the host
    #: when a step's period exceeds its busy time; these say whether the host's extra
    #: time is spread over every step or spent in a few (a periodic report, a GC pause).
    launch_ts: list[float] = field(default_factory=list)
    host: dict[str, list[float]] = field(default_factory=dict)
    intervals: list[tuple[float, float]] = field(default_factory=list)


def trace_files(path: Path) -> list[Path]:
    """The Chrome traces under ``path`` (a file, or a directory vLLM's profiler wrote)."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file()
                  and (p.name.endswith(".json") or p.name.endswith(".json.gz")))


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data.get("traceEvents", []) if isinstance(data, dict) else data


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (overlapping kernels count once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _alone(events: list[tuple[float, float, str]]) -> dict[str, float]:
    """Per kernel name, the time its kernels ran with no other kernel running (a sweep over
    start and end points)."""
    points = sorted([(ts, 1, i) for i, (ts, _, _) in enumerate(events)]
                    + [(te, -1, i) for i, (_, te, _) in enumerate(events)],
                    key=lambda p: (p[0], p[1]))  # ends before starts at the same instant
    alone: dict[str, float] = defaultdict(float)
    active: set[int] = set()
    last = None
    for t, kind, i in points:
        if last is not None and len(active) == 1 and t > last:
            alone[events[next(iter(active))][2]] += t - last
        if kind > 0:
            active.add(i)
        else:
            active.discard(i)
        last = t
    return dict(alone)


def summarize(path: Path) -> GpuSummary:
    """Sum the GPU events of every trace under ``path``; steps = graph replays seen."""
    files = trace_files(path)
    if not files:
        raise FileNotFoundError(f"no profiler trace (*.json[.gz]) under {path}")
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    intervals: list[tuple[float, float]] = []
    events: list[tuple[float, float, str]] = []
    launch_ts: list[float] = []
    host: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for f in files:
        for ev in load_events(f):
            if ev.get("ph") != "X":
                continue
            cat, name = ev.get("cat", ""), ev.get("name", "")
            if cat in GPU_CATS:
                ts, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
                by_name[name][0] += dur
                by_name[name][1] += 1
                intervals.append((ts, ts + dur))
                events.append((ts, ts + dur, name))
            elif cat in HOST_CATS:
                host[name][0] += float(ev.get("dur", 0.0))
                host[name][1] += 1
                if name == GRAPH_LAUNCH:
                    launch_ts.append(float(ev["ts"]))
    span = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    return GpuSummary(steps=len(launch_ts), busy_us=_busy(intervals), span_us=span,
                      launches=sum(int(c) for _, c in by_name.values()),
                      by_name=dict(by_name), files=[str(f) for f in files],
                      alone=_alone(events), launch_ts=sorted(launch_ts), host=dict(host),
                      intervals=intervals)


def step_periods(s: GpuSummary) -> list[tuple[float, float]]:
    """(period, GPU idle) of every step between two graph launches: the time from one
    launch to the next, and how much of it no GPU work ran (the GPU waiting for the host
    when the period exceeds the step's work)."""
    out = []
    ivs = sorted(s.intervals)
    for t0, t1 in zip(s.launch_ts, s.launch_ts[1:]):
        clipped = [(max(a, t0), min(b, t1)) for a, b in ivs if b > t0 and a < t1]
        out.append((t1 - t0, (t1 - t0) - _busy(clipped)))
    return out


def _dist(values: list[float]) -> str:
    """median (p90, max) of ``values``, in us."""
    import statistics

    if not values:
        return "-"
    v = sorted(values)
    p90 = v[min(len(v) - 1, int(0.9 * len(v)))]
    return f"{statistics.median(v):.1f} us (p90 {p90:.1f}, max {v[-1]:.1f})"


def short(name: str, width: int = 64) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def compare(a: GpuSummary, b: GpuSummary, labels: tuple[str, str] = ("resident", "cache"),
            top: int = 15) -> list[str]:
    """Per decode step: busy, span and launches of both arms, then the kernels whose time
    a step differs most (b - a), with their launches a step."""
    for lab, s in zip(labels, (a, b), strict=True):
        if s.steps <= 0:
            raise ValueError(f"{lab}: no {GRAPH_LAUNCH} in the trace: no captured decode "
                             "step was profiled (CUDA graphs off, or only the prefill)")
    na, nb = a.steps, b.steps
    la, lb = labels
    out = [
        f"decode steps profiled: {la} {na}, {lb} {nb}",
        f"GPU busy a step: {la} {a.busy_us / na:.1f} us, {lb} {b.busy_us / nb:.1f} us "
        f"({(b.busy_us / nb - a.busy_us / na):+.1f})",
        f"GPU span a step (busy + gaps): {la} {a.span_us / na:.1f} us, {lb} "
        f"{b.span_us / nb:.1f} us ({(b.span_us / nb - a.span_us / na):+.1f})",
        f"GPU launches a step: {la} {a.launches / na:.1f}, {lb} {b.launches / nb:.1f} "
        f"({(b.launches / nb - a.launches / na):+.1f})",
        f"kernels by the difference a step ({lb} - {la}), us a step and launches a step, "
        f"then the {lb} kernel's time with no other kernel running (what it adds to busy; "
        "a PDL launch's duration includes its wait for the kernel before it):",
    ]
    for n, (ua, ca), (ub, cb) in _top_differences(a, b, "by_name", top):
        alone = b.alone.get(n, 0.0) / b.steps
        out.append(f"  {ub - ua:+8.1f} us  {la} {ua:8.1f} ({ca:5.1f})  {lb} {ub:8.1f} "
                   f"({cb:5.1f}, alone {alone:6.1f})  {short(n)}")
    return out + host_lines(a, b, labels, top)


def _top_differences(a: GpuSummary, b: GpuSummary, table: str, top: int
                     ) -> list[tuple[str, tuple[float, float], tuple[float, float]]]:
    """The ``top`` names of one of the summaries' ``name -> [us, count]`` tables (kernels:
    ``by_name``, host calls: ``host``) whose us a step differ most between the arms, each
    with (us, count) a step in a and in b."""
    ta, tb = getattr(a, table), getattr(b, table)

    def per_step(t: dict[str, list[float]], steps: int, n: str) -> tuple[float, float]:
        us, count = t.get(n, [0.0, 0])
        return us / steps, count / steps

    rows = [(n, per_step(ta, a.steps, n), per_step(tb, b.steps, n)) for n in set(ta) | set(tb)]
    return sorted(rows, key=lambda r: -abs(r[2][0] - r[1][0]))[:top]


def host_lines(a: GpuSummary, b: GpuSummary, labels: tuple[str, str], top: int) -> list[str]:
    """The host side of the same steps: each step's period (graph launch to graph launch)
    and the GPU's idle time in it, as distributions (extra host time spread over every step
    moves the median; a periodic stall moves only the max), then the host calls whose time
    a step differs most between the arms."""
    la, lb = labels
    pa, pb = step_periods(a), step_periods(b)
    out = [
        f"step period, launch to launch: {la} {_dist([p for p, _ in pa])}; "
        f"{lb} {_dist([p for p, _ in pb])}",
        f"GPU idle in a step: {la} {_dist([i for _, i in pa])}; {lb} {_dist([i for _, i in pb])}",
        f"host calls by the difference a step ({lb} - {la}), us a step (calls a step):",
    ]
    for n, (ua, ca), (ub, cb) in _top_differences(a, b, "host", top):
        out.append(f"  {ub - ua:+8.1f} us  {la} {ua:8.1f} ({ca:5.1f})  {lb} {ub:8.1f} "
                   f"({cb:5.1f})  {short(n)}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--labels", default="resident,cache")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    labels = tuple(args.labels.split(",", 1))
    if len(labels) != 2:
        print("profile_report: --labels takes two names, comma-separated", file=sys.stderr)
        return 2
    try:
        lines = compare(summarize(args.a), summarize(args.b), labels, args.top)
    except (OSError, ValueError) as exc:
        print(f"profile_report: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
