"""What a staged wide step costs beyond its host fetches: the hits' copies from slots.

    python bench/bench_wide_stage.py [--experts 128 --slots 64]

`plan` and `replay` price a staged wide step as its missing distinct experts fetched from
host at the gather rate; the hits, copied from the layer's slots into the scratch by the
same gather kernel over device memory, are priced at zero. With a real model's routing a
staged decode step is mostly hits (35-46 a layer against 1-5 misses at 16 and 32 streams,
bench/results/wide-steps.md), and staged-install copies more hits a step than staged does
(its installs become hits). This measures that term instead of guessing it.

For the Qwen3-30B-A3B bf16 expert (w13 [1536, 2048] + w2 [2048, 768], 9.44 MB; other
shapes with --w13/--w2), a layer of E experts with S in slots, the stage of one step
routing H resident and M missing experts (`Scratch.stage`: the device-built copy lists,
the hits from slots, the misses from pinned host) is captured in a CUDA graph and timed,
in the same run as its baselines: the same step with H = 0 (its misses alone: what the
model charges) and the copy engine moving the same H slabs device to device (the HBM
ceiling). Prints each step's time over its misses-only time, and the hits' device copy
rate against the copy engine's.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from _cudabench import Baselines, graph_time, header


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want ROWSxCOLS, e.g. 1536x2048") from None
    if not dims or min(dims) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: every dimension must be positive")
    return dims


def measure(torch, E: int, S: int, specs: dict, reps: int, *, device: str = "cuda",
            timer: Callable | None = None, memcpy: Callable | None = None,
            copier: Callable | None = None) -> tuple[int, list[dict]]:
    """Every (hits, misses) row: stage seconds, the misses-alone seconds of its M, the copy
    engine's seconds for its H slabs. ``timer(torch, body, reps)``, ``memcpy(dst, src,
    nbytes, stream)`` and ``copier`` (`Scratch`'s) default to the CUDA ones; the CPU test
    passes stand-ins. Returns (bytes an expert, rows)."""
    from expertcache_cli.device.scratch import Scratch

    timer = timer or graph_time
    if memcpy is None:
        memcpy = Baselines(torch).memcpy
    scratch = Scratch(E, specs, device, copier=copier)
    slab = scratch.nbytes // E
    g = torch.Generator().manual_seed(0)
    sources = {}
    for k, (shape, dt) in specs.items():  # random bytes of any dtype (NaNs too: bytes compare)
        raw = torch.randint(0, 256, (E, scratch.buffers[k][0].nbytes), generator=g,
                            dtype=torch.uint8)
        src = raw.view(dt).view(E, *shape)
        sources[k] = src if device == "cpu" else src.pin_memory()
    # the layer's slots hold experts 0..S-1 (slot j = expert j), as the table says
    slots = {k: src[:S].to(device) for k, src in sources.items()}
    table = torch.full((E,), -1, dtype=torch.int32, device=device)
    table[:S] = torch.arange(S, dtype=torch.int32, device=device)

    def stage_time(hits: int, misses: int) -> float:
        ids = torch.cat([torch.arange(hits), torch.arange(S, S + misses)]).to(
            device=device, dtype=torch.int32)
        t = timer(torch, lambda s: [scratch.stage(ids, table, slots, sources)
                                    for _ in range(reps)], reps=3) / reps
        assert scratch.counts.tolist() == [hits, misses], scratch.counts.tolist()
        routed = ids.long().cpu()
        for k, buf in scratch.buffers.items():  # the stage moved the right bytes
            assert torch.equal(buf[routed].cpu().view(torch.uint8),
                               sources[k][routed].view(torch.uint8)), f"scratch {k} wrong"
        return t

    def d2d_time(hits: int) -> float:
        sizes = {k: src[0].nbytes for k, src in slots.items()}

        def body(stream: int) -> None:
            for _ in range(reps):
                for k, src in slots.items():
                    for j in range(hits):
                        memcpy(scratch.buffers[k][j].data_ptr(), src[j].data_ptr(), sizes[k],
                               stream)

        return timer(torch, body, reps=3) / reps

    miss_counts = sorted({0, min(42, E - S), E - S})
    hit_counts = sorted({0, min(32, S), S})
    alone = {m: stage_time(0, m) for m in miss_counts if m}
    rows = []
    for m in miss_counts:
        if m:
            rows.append({"hits": 0, "misses": m, "stage_s": alone[m], "alone_s": alone[m],
                         "d2d_s": 0.0})
        for h in hit_counts:
            if h:
                rows.append({"hits": h, "misses": m, "stage_s": stage_time(h, m),
                             "alone_s": alone.get(m, 0.0), "d2d_s": d2d_time(h)})
    return slab, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--w13", type=_shape, default=(1536, 2048), help="bf16 w13 of one expert")
    ap.add_argument("--w2", type=_shape, default=(2048, 768), help="bf16 w2 of one expert")
    ap.add_argument("--reps", type=int, default=20, help="stages per graph replay")
    args = ap.parse_args()
    E, S = args.experts, args.slots
    if not 0 < S < E:
        ap.error(f"--slots must be between 1 and --experts - 1 ({E - 1})")

    import torch

    if not torch.cuda.is_available():
        ap.exit(2, "bench_wide_stage: needs a CUDA device (torch.cuda.is_available() is False)\n")
    header(torch, "bench_wide_stage: a staged step's hit copies (slots -> scratch) vs its misses")
    specs = {"w13": (args.w13, torch.bfloat16), "w2": (args.w2, torch.bfloat16)}
    slab, rows = measure(torch, E, S, specs, args.reps)
    print(f"E={E} experts, S={S} slots, {slab:,} B an expert "
          f"({', '.join(f'{k} {list(s)}' for k, (s, _) in specs.items())}); "
          f"{args.reps} stages a graph replay")
    print(table(rows, slab))


def table(rows: list[dict], slab: int) -> str:
    """The rows as markdown, and what one miss costs (the term `plan` does charge)."""
    out = ["| hits | misses | stage us | misses alone us | stage / misses alone | "
           "hits' cost us | hit copies GB/s | copy engine D2D GB/s |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        h, m, t, a = r["hits"], r["misses"], r["stage_s"], r["alone_s"]
        extra = t - a
        rate = f"{h * slab / extra / 1e9:.0f}" if h and extra > 0 else "-"
        ce = f"{h * slab / r['d2d_s'] / 1e9:.0f}" if h and r["d2d_s"] > 0 else "-"
        ratio = f"{t / a:.3f}" if a else "-"
        out.append(f"| {h} | {m} | {t * 1e6:.0f} | {a * 1e6:.0f} | {ratio} | "
                   f"{max(extra, 0.0) * 1e6:.0f} | {rate} | {ce} |")
    alone = [r for r in rows if r["hits"] == 0]
    if alone:
        r = max(alone, key=lambda r: r["misses"])
        m, a = r["misses"], r["alone_s"]
        out.append(f"\na miss costs {a / m * 1e6:.1f} us here ({m * slab / a / 1e9:.1f} GB/s "
                   "from host): the hits' cost above is what `plan` does not charge a staged "
                   "step")
    return "\n".join(out)


if __name__ == "__main__":
    main()
