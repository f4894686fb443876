"""BENCH ONLY: with this folder on PYTHONPATH, every Python process of the benchmark (vLLM's
API server, engine core and workers included) gets the bench's hooks that are asked for:
EC_BENCH_TRACE_ROUTING replays MoE routing from that trace file (bench/trace_routing.py);
EC_BENCH_SYNTH_WEIGHTS=1 fills a `--load-format dummy` gpt-oss model with the weights the
bench's checkpoint writer draws (bench/synth_weights.py); EC_BENCH_LOADED=1 logs what the
memory vLLM counts as the model's weights is made of (bench/loaded_memory.py). Without
any of them it does nothing. It shadows any other sitecustomize on the path: bench use only."""

import os


def _on(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


if os.environ.get("EC_BENCH_TRACE_ROUTING") or _on("EC_BENCH_SYNTH_WEIGHTS") or \
        _on("EC_BENCH_LOADED"):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if os.environ.get("EC_BENCH_TRACE_ROUTING"):
        import trace_routing

        trace_routing.install()
    if _on("EC_BENCH_SYNTH_WEIGHTS"):
        import synth_weights

        synth_weights.install()
    if _on("EC_BENCH_LOADED"):
        import loaded_memory

        loaded_memory.install()
