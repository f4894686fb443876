"""BENCH ONLY: serve gpt-oss-120b's real shape with no checkpoint on disk.

Why: gpt-oss-120b's MXFP4 experts are 63 GiB as vLLM holds them after Marlin's padding
(36 layers x 128 experts x 14.43 MB); with attention, embeddings and LM head the checkpoint
would not fit the GPU box's 64 GiB disk beside vLLM, and writing fewer layers would change
what a card holds a layer (the slots a 24 GiB card gives each layer halve when the layers
double). vLLM's own ``--load-format dummy`` builds the model from config.json at its real
shape, so the host-offloaded expert tensors are real-shaped and really pinned, but it
fills only floating-point tensors with near-zero noise: MXFP4's uint8 codes and e8m0
scales stay as allocated (scales of 2^128 are infinities) and every layer's router is
alike. So with ``EC_BENCH_SYNTH_WEIGHTS=1`` set (and ``bench/trace_hook`` on PYTHONPATH,
whose sitecustomize imports this in every process), vLLM's dummy loader, after its own
fill, loads the weights `bench/write_gpt_oss.py` draws for a checkpoint on disk (seeded
codes at scale 2^-6, per-layer seeded routers) through the model's own ``load_weights``:
the loading path of a checkpoint, the bytes from a generator instead of a file. Every
server of a run gets the same weights, so greedy tokens compare across servers. One
warning line says the weights were synthesized; the flagship report requires it in every
server's log. Never part of the package.

    EC_BENCH_SYNTH_WEIGHTS=1 PYTHONPATH=bench/trace_hook:$PYTHONPATH \\
      expertcache serve /tmp/fs/gpt-oss-120b --vram 24 -- --load-format dummy ...
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

ENV = "EC_BENCH_SYNTH_WEIGHTS"
LOADER_MODULE = "vllm.model_executor.model_loader.dummy_loader"
LOADER_CLASS = "DummyModelLoader"
#: the checkpoint's name for the format, and the one vLLM 0.26 writes over it in the
#: config it hands the loader (its gpt-oss MXFP4 method)
MXFP4_METHODS = ("mxfp4", "gpt_oss_mxfp4")
#: the line the flagship report looks for in every server's log
DONE_LINE = "BENCH: weights synthesized"

log = logging.getLogger("vllm.expertcache.bench")


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def shape_of(hf_config: Any) -> Any:
    """`write_gpt_oss.Shape` of the served config; refuses anything but gpt-oss in MXFP4
    (the only layout this generator draws: a dummy fill would serve garbage silently)."""
    import write_gpt_oss

    quant = _get(hf_config, "quantization_config") or {}
    if (_get(hf_config, "model_type") != "gpt_oss"
            or _get(quant, "quant_method") not in MXFP4_METHODS):
        raise RuntimeError(f"{ENV}: only gpt-oss in MXFP4 is synthesized (model_type "
                           f"{_get(hf_config, 'model_type')!r}, quant "
                           f"{_get(quant, 'quant_method')!r})")
    return write_gpt_oss.Shape(
        hidden=int(_get(hf_config, "hidden_size")),
        inter=int(_get(hf_config, "intermediate_size")),
        experts=int(_get(hf_config, "num_local_experts")),
        top_k=int(_get(hf_config, "num_experts_per_tok")),
        heads=int(_get(hf_config, "num_attention_heads")),
        kv_heads=int(_get(hf_config, "num_key_value_heads")),
        head_dim=int(_get(hf_config, "head_dim")),
        sliding_window=int(_get(hf_config, "sliding_window") or 128))


def gpt_oss_pairs(hf_config: Any, device: str) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs as `bench/write_gpt_oss.py` writes them for this config."""
    import write_gpt_oss

    s = shape_of(hf_config)
    return write_gpt_oss.tensors(int(_get(hf_config, "num_hidden_layers")), device,
                                 int(_get(hf_config, "vocab_size")), 0, s)


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def patch_loader_class(cls: Any,
                       make_pairs: Callable[[Any, str], Iterator[tuple[str, Any]]]
                       = gpt_oss_pairs,
                       device: Callable[[], str] = _device) -> bool:
    """Wrap ``cls.load_weights(model, model_config)`` (once): vLLM's dummy fill, then the
    generated weights through ``model.load_weights``. False where the class has no
    ``load_weights`` of its own (a vLLM whose dummy loader works otherwise)."""
    orig = cls.__dict__.get("load_weights")
    if orig is None:
        return False
    if getattr(orig, "_ec_synth", False):
        return True

    def load_weights(self: Any, model: Any, model_config: Any, *args: Any,
                     **kwargs: Any) -> Any:
        out = orig(self, model, model_config, *args, **kwargs)
        t0 = time.time()
        hf = model_config.hf_config
        seen = model.load_weights(make_pairs(hf, device()))
        try:
            import torch

            if torch.cuda.is_available():  # the generator's device blocks: not weights
                torch.cuda.empty_cache()
        except ImportError:
            pass
        n = len(seen) if hasattr(seen, "__len__") else "all"
        log.warning("%s: %s tensors of %s (%d layers x %d experts) loaded through the model's "
                    "load_weights in %.0f s, drawn as bench/write_gpt_oss.py writes them (%s "
                    "is set, --load-format dummy)", DONE_LINE, n,
                    _get(hf, "model_type"), int(_get(hf, "num_hidden_layers")),
                    int(_get(hf, "num_local_experts")), time.time() - t0, ENV)
        return out

    load_weights._ec_synth = True  # type: ignore[attr-defined]
    cls.load_weights = load_weights
    return True


def install() -> bool:
    """Arrange the patch for when vLLM's dummy loader is imported (no-op without ``ENV``)."""
    if os.environ.get(ENV, "") in ("", "0"):
        return False
    from expertcache_cli.plugin import when_imported

    def patch(module: Any) -> None:
        cls = getattr(module, LOADER_CLASS, None)
        if cls is None or not patch_loader_class(cls):
            log.error("BENCH: %s.%s has no load_weights to wrap: weights NOT synthesized "
                      "(the dummy fill serves garbage MXFP4 scales)", LOADER_MODULE,
                      LOADER_CLASS)

    when_imported(LOADER_MODULE, patch)
    return True
