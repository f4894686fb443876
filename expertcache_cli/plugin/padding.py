"""Which rows of a step are CUDA-graph padding, read on the device.

Why: vLLM pads a decode batch up to its next captured graph size. The padded rows carry
router ids computed from garbage hidden states; fed to the manager they install experts
nobody asked for and count as requests. Measured with vLLM 0.26's V1 runner
(bench/results/padding.md): 5 streams run as the 8-graph made 46% more expert requests,
2.9% more installs and 4.0% less throughput than an exact 5-graph.

Two places vLLM says which rows are real, both device tensors at fixed addresses written
before each step, so a captured graph reads the current step's value at replay:

- the V2 model runner marks the rows: ``forward_context.is_padding``, a bool per token;
- the V1 runner marks nothing, but keeps the real token count on the device: its
  ``query_start_loc`` buffer (cumulative tokens per request) is filled past the last
  request with the last real value before every step, so its final entry is the number
  of real tokens, and rows at or past it are padding.

The V1 count is used only inside a graph being captured (replays then read it live): the
dummy runs vLLM makes while starting leave that entry stale, and the eager calls where the
first-call check runs see every row. It is used only where a MoE layer's rows are the
step's tokens in order: one data-parallel rank, no micro-batching, no sequence-parallel MoE.
"""

from __future__ import annotations

from typing import Any

#: the module of vLLM's V1 GPU model runner (the V2 runner lives in v1/worker/gpu/)
V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


def v1_token_count(worker: Any) -> tuple[Any | None, str]:
    """The device view of the V1 runner's real token count, or None and why not."""
    import torch

    runner = getattr(worker, "model_runner", None)
    if type(runner).__module__ != V1_RUNNER_MODULE:
        return None, "not vLLM's V1 model runner"
    pc = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
    if pc is None:
        return None, "no parallel config"
    if int(getattr(pc, "data_parallel_size", 1) or 1) != 1:
        return None, "data parallel: a MoE layer's rows are several ranks' tokens"
    for flag in ("use_ubatching", "use_sequence_parallel_moe"):
        if getattr(pc, flag, False) is True:
            return None, f"{flag}: a MoE layer's rows are not the step's tokens in order"
    buf = getattr(getattr(runner, "query_start_loc", None), "gpu", None)
    if not (isinstance(buf, torch.Tensor) and buf.dim() == 1 and buf.numel() >= 2
            and not buf.dtype.is_floating_point):
        return None, "no device query_start_loc buffer"
    return buf[-1:], "vLLM's V1 runner: rows past query_start_loc's last entry"


class PaddingReader:
    """How an armed layer reads a step's padded rows: ``reader(n)`` is the ``[n]`` bool mask
    (None where vLLM does not say; the rows are then served as real ones and vLLM discards
    their output), for the paths that mask in torch (the trace, wide steps);
    ``reader.rows(n)`` the same facts as the cache step takes them, read by the manager
    itself (`SlotCache.step(real_rows=... / pad_rows=...)`) with no mask and no
    ``torch.where`` launches: five graph nodes a layer fewer."""

    def __init__(self, token_count: Any | None, max_tokens: int, context: bool) -> None:
        self.token_count = token_count
        self.positions = None
        #: the manager reads the count as one int32 (else the torch mask serves)
        self.count_readable = False
        if token_count is not None and max_tokens > 0:
            import torch

            self.positions = torch.arange(max_tokens, dtype=token_count.dtype,
                                          device=token_count.device)
            self.count_readable = token_count.dtype == torch.int32
        self.context = context

    def _v2_mask(self, n: int) -> Any | None:
        if self.context:
            from vllm.forward_context import get_forward_context, is_forward_context_available

            if is_forward_context_available():
                mask = getattr(get_forward_context(), "is_padding", None)
                if mask is not None and mask.dim() == 1 and mask.shape[0] >= n:
                    return mask[:n]
        return None

    def _v1_ready(self, n: int) -> bool:
        return self.positions is not None and n <= self.positions.shape[0] and capturing()

    def __call__(self, n: int) -> Any | None:
        mask = self._v2_mask(n)
        if mask is not None:
            return mask
        if self._v1_ready(n):
            return self.positions[:n] >= self.token_count
        return None

    def rows(self, n: int) -> dict[str, Any] | None:
        """The padded rows as `SlotCache.step` takes them: V2's marks (``pad_rows``),
        else V1's real-token count (``real_rows``, one int32, only inside a graph being
        captured: eager calls see a stale count), else None (every row real)."""
        mask = self._v2_mask(n)
        if mask is not None:
            return {"pad_rows": mask} if mask.is_contiguous() else None
        if self.count_readable and self._v1_ready(n):
            return {"real_rows": self.token_count}
        return None


def mask_reader(token_count: Any | None = None,
                max_tokens: int = 0) -> PaddingReader | None:
    """A `PaddingReader` over vLLM's V2 marks and, given, the V1 runner's device count of
    real tokens (``token_count``, rows up to ``max_tokens``); None when neither exists."""
    try:
        import vllm.forward_context  # noqa: F401
        context = True
    except ImportError:
        context = False
    if not context and (token_count is None or max_tokens <= 0):
        return None
    return PaddingReader(token_count, max_tokens, context)


def capturing() -> bool:
    """A CUDA graph is being captured on the current stream (Python runs no more at replay)."""
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
