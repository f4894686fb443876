"""Routing trace recording inside a live server, without a host sync per step.

Every armed layer appends its ``topk_ids`` (padded with -1 to the row width) to its own
row of a device ring ``[capacity, layers, width]``, at a position held in a device
counter. All of it is device work on the current stream (a cast, a pad, an
``index_copy_`` at a device index, an increment), so it is captured in vLLM's CUDA
graphs like the cache step itself. The host reads the ring only when it is half full
(`maybe_flush`, called once per engine step with a host-side count, one sync per
``capacity / 2`` steps) and at exit.

Why nothing is lost that the replay needs: a step carrying more than ``width = E`` ids
(a prefill chunk) is not recorded. At any budget ``S < E`` such a step reads through in
the live server and in `LayerCache.forward` alike (``ids > S``), and a read-through step
changes no cache state, so leaving it out of the file changes no count. Warm-up,
profiling and capture forwards are recorded like any other: the live cache saw them too,
which is what makes a replay of the file reproduce the live miss counters exactly.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("vllm.expertcache")

#: device rows per layer before the host drains the ring (each row is ``width`` ids)
DEFAULT_CAPACITY = 2048


class TraceRecorder:
    """Device ring of routing ids for ``num_layers`` armed layers."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        top_k: int,
        device: Any,
        *,
        capacity: int = DEFAULT_CAPACITY,
        layer_names: list[int] | None = None,
        model: str | None = None,
    ) -> None:
        import torch

        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k
        self.width = num_experts
        self.capacity = capacity
        self.layer_names = layer_names
        self.model = model
        dtype = torch.int16 if num_experts < 2**15 else torch.int32
        self.ring = torch.full((num_layers, capacity, self.width), -1, dtype=dtype, device=device)
        self.tokens = torch.zeros((num_layers, capacity), dtype=torch.int32, device=device)
        self.pos = torch.zeros(num_layers, dtype=torch.int64, device=device)
        self._one = torch.ones(1, dtype=torch.int64, device=device)
        self.chunks: list[np.ndarray] = []
        self.token_chunks: list[np.ndarray] = []
        self.host_steps = 0
        self.overflowed = False

    def record(self, layer: int, topk_ids: Any) -> None:
        """Append one forward's ids for ``layer`` (device work only)."""
        import torch
        import torch.nn.functional as F

        n = int(topk_ids.numel())
        if n > self.width:
            return
        row = topk_ids.reshape(1, n).to(self.ring.dtype)
        if n < self.width:
            row = F.pad(row, (0, self.width - n), value=-1)
        at = torch.clamp(self.pos[layer : layer + 1], max=self.capacity - 1)
        self.ring[layer].index_copy_(0, at, row)
        self.tokens[layer].index_fill_(0, at, n // max(1, self.top_k))
        self.pos[layer : layer + 1].add_(self._one)

    def drain(self) -> None:
        """Move the recorded rows to host memory and rewind the ring (syncs)."""
        pos = self.pos.cpu().numpy()
        if pos.size == 0:
            return
        if int(pos.max()) > self.capacity:
            self.overflowed = True
        n = int(min(pos.min(), self.capacity))
        if int(pos.max()) != int(pos.min()):
            log.warning("expertcache: trace layers out of step (%s..%s rows)", pos.min(), pos.max())
        if n:
            self.chunks.append(self.ring[:, :n].cpu().numpy().transpose(1, 0, 2).copy())
            self.token_chunks.append(self.tokens[0, :n].cpu().numpy().astype(np.int64))
        self.ring[:, :n].fill_(-1)
        self.pos.zero_()

    def maybe_flush(self, forwards_hint: int = 1) -> None:
        """Called once per engine step: drain when the ring may be half full."""
        self.host_steps += forwards_hint
        if self.host_steps >= self.capacity // 2:
            self.host_steps = 0
            self.drain()

    def save(self, path: str | Path, live: dict[str, Any] | None = None) -> Path | None:
        """Drain and write the trace (docs/design.md, The routing trace format); the live
        counters go beside it as JSON."""
        from ..files import atomic_write
        from ..trace import Trace, save

        self.drain()
        if not self.chunks:
            log.warning("expertcache: no routing recorded; %s not written", path)
            return None
        ids = np.concatenate(self.chunks, axis=0)
        used = ids >= 0
        width = int(np.max(np.nonzero(used.any(axis=(0, 1)))[0])) + 1 if used.any() else 1
        trace = Trace(
            topk_ids=ids[:, :, :width],
            num_experts=self.num_experts,
            top_k=self.top_k,
            model=self.model,
            layers=np.asarray(self.layer_names) if self.layer_names is not None else None,
            step_tokens=np.concatenate(self.token_chunks),
            source="expertcache plugin (live vLLM; steps wider than E ids not recorded)"
            + ("; RING OVERFLOWED: rows lost" if self.overflowed else ""),
        )
        out = save(trace, path)
        if live is not None:
            side = out.with_name(out.name[: -len(".npz")] + ".live.json")
            text = json.dumps(live, indent=1) + "\n"
            atomic_write(side, lambda tmp: tmp.write_text(text))
        return out
