"""BENCH ONLY (also EC_BENCH_NO_CHECK, EC_BENCH_MEM below): with EC_BENCH_TRY_KERNELS
set (comma-separated experts-kernel class names,
e.g. ``MarlinExperts``) and this folder on PYTHONPATH, the plugin in every process of the
benchmark treats those kernels as known to index weights by expert id, so a device run
can try arming a kernel before it is added to `plugin.compat.KNOWN_EXPERTS`. The layer's
first eager call is still checked against the stock path (plugin.runtime), and every other
arming rule still applies. Without the variable it does nothing. It shadows any other
sitecustomize on the path: bench use only, never in a user's environment."""

import os

_names = {n.strip() for n in os.environ.get("EC_BENCH_TRY_KERNELS", "").split(",") if n.strip()}
if _names:
    from expertcache_cli.plugin import arming, compat

    compat.KNOWN_EXPERTS = compat.KNOWN_EXPERTS | _names
    arming.KNOWN_EXPERTS = compat.KNOWN_EXPERTS

# EC_BENCH_NO_CHECK=1: no first-call check against the stock path (to measure what the
# check itself allocates at startup; a user never runs without it).
if os.environ.get("EC_BENCH_NO_CHECK") == "1":
    from expertcache_cli.plugin import runtime as _runtime

    _runtime.CHECK_ATTEMPTS = 0

# EC_BENCH_MEM=1: log the CUDA memory around the first calls of the first two armed layers
# (allocated before, the allocator's peak before and after), to find which part of a step
# raises the peak vLLM's profile run measures.
if os.environ.get("EC_BENCH_MEM") == "1":
    import logging

    from expertcache_cli.plugin import runtime as _rt

    _orig_forward = _rt.ArmedLayer.forward_modular
    _seen: dict[int, int] = {}
    _log = logging.getLogger("vllm.expertcache")

    def _forward(self, x, topk_weights, topk_ids, *args, **kwargs):
        import torch

        n = _seen.get(self.index, 0)
        if self.index > 1 or n >= 3 or torch.cuda.is_current_stream_capturing():
            return _orig_forward(self, x, topk_weights, topk_ids, *args, **kwargs)
        _seen[self.index] = n + 1
        torch.cuda.synchronize()
        alloc, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        # non-torch memory: what the device has in use beyond torch's reserved pool
        free0, total = torch.cuda.mem_get_info()
        other0 = total - free0 - torch.cuda.memory_reserved()
        out = _orig_forward(self, x, topk_weights, topk_ids, *args, **kwargs)
        torch.cuda.synchronize()
        free1, _ = torch.cuda.mem_get_info()
        other1 = total - free1 - torch.cuda.memory_reserved()
        gib = 2**30
        _log.warning("EC_BENCH_MEM layer %d call %d: %d ids (wide %s): allocated %.3f GiB, "
                     "peak %.3f -> %.3f GiB (+%.3f above allocated); non-torch %.3f -> %.3f "
                     "GiB", self.index, n, topk_ids.numel(),
                     not self.cache.fits(topk_ids.numel()), alloc / gib, peak / gib,
                     torch.cuda.max_memory_allocated() / gib,
                     (torch.cuda.max_memory_allocated() - alloc) / gib, other0 / gib,
                     other1 / gib)
        return out

    _rt.ArmedLayer.forward_modular = _forward
