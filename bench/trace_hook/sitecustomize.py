"""BENCH ONLY: with EC_BENCH_TRACE_ROUTING set and this folder on PYTHONPATH, every Python
process of the benchmark (vLLM's API server, engine core and workers included) replays MoE
routing from that trace file (see bench/trace_routing.py). Without the variable it does
nothing. It shadows any other sitecustomize on the path: bench use only."""

import os

if os.environ.get("EC_BENCH_TRACE_ROUTING"):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import trace_routing

    trace_routing.install()
