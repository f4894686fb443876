"""Routing trace recording inside a live server, without a host sync per step.

Every armed layer appends its ``topk_ids`` (padded with -1 to the row width) to its own
row of a device ring ``[capacity, layers, width]``, at a position held in a device
counter. All of it is device work on the current stream (a cast, a pad, an
``index_copy_`` at a device index, an increment), so it is captured in vLLM's CUDA
graphs like the cache step itself. The host reads the ring only when it is half full
(`maybe_flush`, called once per engine step with a host-side count, one sync per
``capacity / 2`` steps) and at exit.

Host memory stays bounded however long the server runs: each drained chunk is appended
to a spill file beside the trace (``.NAME.spill``, raw ids, and ``.NAME.tokens``), not
kept in a Python list (about 12 KiB a step for Qwen3-30B-A3B: gigabytes an hour). At
exit the spill is memory-mapped into the trace file, written atomically, and removed.

Why nothing is lost that the replay needs: a row holds ``width = E`` ids. A step carrying
more (a prefill chunk) is recorded as its distinct routed experts, with its real token
count in ``tokens``: the cache rules see only the distinct set and the shape gate only
``tokens x top_k`` (docs/design.md, The cache rules), so the row replays as the step ran,
read through in place or staged through the scratch. Warm-up, profiling and capture
forwards are dropped (`restart`) when the live cache is emptied after vLLM's warm-up
(`Session.serving_starts`): the file holds the served steps, which the live cache ran from
empty slots as a replay of the file does, so the replay reproduces the live miss counters
exactly.
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
        spill: str | Path | None = None,
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
        self.ring_dtype = np.int16 if dtype == torch.int16 else np.int32
        self.tokens = torch.zeros((num_layers, capacity), dtype=torch.int32, device=device)
        self.pos = torch.zeros(num_layers, dtype=torch.int64, device=device)
        self._one = torch.ones(1, dtype=torch.int64, device=device)
        self._experts = torch.arange(num_experts, dtype=dtype, device=device)
        self.host_steps = 0
        self.overflowed = False
        #: rows drained so far, and where they went (the spill file, else host memory)
        self.rows = 0
        self.spill = Path(spill) if spill is not None else None
        self.chunks: list[np.ndarray] = []
        self.token_chunks: list[np.ndarray] = []

    def _spill_paths(self) -> tuple[Path, Path]:
        assert self.spill is not None
        return self.spill, self.spill.with_name(self.spill.name + ".tokens")

    def record(self, layer: int, topk_ids: Any) -> None:
        """Append one forward's ids for ``layer`` (device work only)."""
        import torch
        import torch.nn.functional as F

        n = int(topk_ids.numel())
        if n > self.width:
            # wider than a row: its distinct experts (all the rules read), ascending
            from ..device.scratch import routed_mask

            routed = routed_mask(topk_ids, self.num_experts)
            row = torch.where(routed, self._experts, -1).reshape(1, -1).to(self.ring.dtype)
        else:
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
            ids = self.ring[:, :n].cpu().numpy().transpose(1, 0, 2).copy()  # owns its data
            tokens = self.tokens[0, :n].cpu().numpy().astype(np.int32)
            if self.spill is not None:
                for path, data in zip(self._spill_paths(), (ids, tokens)):
                    with open(path, "ab") as f:
                        f.write(data.tobytes())
            else:
                self.chunks.append(ids)
                self.token_chunks.append(tokens)
            self.rows += n
        self.ring[:, :n].fill_(-1)
        self.pos.zero_()

    def restart(self) -> None:
        """Drop every row recorded so far (the ring, what was drained, the spill files):
        the next row is the trace's first. Device work and file removal, no sync."""
        self.ring.fill_(-1)
        self.tokens.zero_()
        self.pos.zero_()
        self.host_steps = 0
        self.overflowed = False
        self.rows = 0
        self.chunks, self.token_chunks = [], []
        if self.spill is not None:
            for p in self._spill_paths():
                p.unlink(missing_ok=True)

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
        from ..rules.trace import Trace, save

        self.drain()
        if not self.rows:
            log.warning("expertcache: no routing recorded; %s not written", path)
            return None
        shape = (self.rows, self.num_layers, self.width)
        if self.spill is not None:
            ids_path, tok_path = self._spill_paths()
            ids = np.memmap(ids_path, dtype=self.ring_dtype, mode="r", shape=shape)
            tokens = np.memmap(tok_path, dtype=np.int32, mode="r", shape=(self.rows,))
        else:
            ids = np.concatenate(self.chunks, axis=0)
            tokens = np.concatenate(self.token_chunks)
        width = _used_width(ids)
        trace = Trace(
            topk_ids=ids[:, :, :width],
            num_experts=self.num_experts,
            top_k=self.top_k,
            model=self.model,
            layers=np.asarray(self.layer_names) if self.layer_names is not None else None,
            step_tokens=np.asarray(tokens, dtype=np.int64),
            source="expertcache plugin (live vLLM; steps wider than E ids as their distinct "
                   "experts)"
            + ("; RING OVERFLOWED: rows lost" if self.overflowed else ""),
        )
        out = save(trace, path)
        if self.spill is not None:
            del ids, tokens, trace
            for p in self._spill_paths():
                p.unlink(missing_ok=True)
        if live is not None:
            side = out.with_name(out.name[: -len(".npz")] + ".live.json")
            text = json.dumps(live, indent=1) + "\n"
            atomic_write(side, lambda tmp: tmp.write_text(text))
        return out


def _used_width(ids: np.ndarray, block: int = 4096) -> int:
    """Columns up to the last one holding an id anywhere (read in blocks: a memory-mapped
    trace is never loaded whole)."""
    width = 0
    for start in range(0, ids.shape[0], block):
        used = np.nonzero((ids[start:start + block] >= 0).any(axis=(0, 1)))[0]
        if used.size:
            width = max(width, int(used[-1]) + 1)
    return max(width, 1)
