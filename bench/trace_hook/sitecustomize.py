"""BENCH ONLY: with this folder on PYTHONPATH, every Python process of the benchmark (vLLM's
API server, engine core and workers included) gets the bench's hooks that are asked for:
EC_BENCH_TRACE_ROUTING replays MoE routing from that trace file (bench/trace_routing.py);
EC_BENCH_SYNTH_WEIGHTS=1 fills a `--load-format dummy` gpt-oss model with the weights the
bench's checkpoint writer draws (bench/synth_weights.py). Without either variable it does
nothing. It shadows any other sitecustomize on the path: bench use only."""

import os

if os.environ.get("EC_BENCH_TRACE_ROUTING") or \
        os.environ.get("EC_BENCH_SYNTH_WEIGHTS", "") not in ("", "0"):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if os.environ.get("EC_BENCH_TRACE_ROUTING"):
        import trace_routing

        trace_routing.install()
    if os.environ.get("EC_BENCH_SYNTH_WEIGHTS", "") not in ("", "0"):
        import synth_weights

        synth_weights.install()
