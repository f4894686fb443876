"""Per-expert tensors too small or oddly sized for the gather's 16-byte slabs.

Why this exists: the gather moves 16 bytes a lane and refuses a per-expert slab that is
not a multiple of 16 bytes (docs/design.md: 16-byte slabs). Some per-expert tensors are
just that: NVFP4's per-expert global weight scale is one float a layer's expert (4 bytes),
vLLM's per-tensor FP8 scales too. They must still follow their expert into its slot
(weights and their scales share the id), or the kernel would scale a slot's weights with
another expert's scale.

How: every such tensor of a layer is packed, expert by expert, into one side row of
``row_bytes`` (a multiple of 16) in device memory: ``source[E, row_bytes]`` (uint8),
built from the layer's own tensors when the layer is armed and again whenever vLLM
changes the weights (`refresh`); its size and limit are `formats`' rule
(`side_row_bytes`, `SIDE_ROW_LIMIT`), which sizing uses too. That row is one more slab of
the layer's `SlotCache`: it is gathered with the weights, by the same kernel launch, into
``[S, row_bytes]``. What vLLM's kernel is handed are compact ``[S, *shape]`` buffers of
the tensors' own dtypes (`slots`), filled from those packed rows in one of two ways:

* spread (kernel ABI 6; every tensor's size and offset in the row a multiple of 4 bytes,
  NVFP4's and FP8's float32 scales alike, and at most `binding.SPREAD_MAX` of them): the
  gather writes each installed row's 4-byte words into the compact buffers too, as it
  installs it (`spread_targets`, handed to the `SlotCache`). Why: a copy after every
  step is one more CUDA-graph node a layer on every decode step, a few microseconds of
  an all-hit step that otherwise launches only the manager and an empty gather; spread,
  an all-hit step moves nothing at all for the side row, and a miss moves its words with
  its weights.
* otherwise, after each cache step, one copy per run of equally sized tensors
  (`unpack`) from the packed slot rows (`spread_targets` is None).

The wide-step scratch is indexed by expert id, so there the kernel gets `full`: compact
``[E, *shape]`` device copies made with the source, and no copy per step.

The side row's bytes come from vLLM's tensors at arming (the values are final then:
vLLM's offloader has moved them, and the plugin arms after the load), so "sources read
fresh" holds for the values; a weight reload calls `refresh` (`Session.invalidate`) and
empties the slots, whose compact copies the next installs rewrite, spread or unpacked.
Nothing here reads a device value on the host, so CUDA graphs capture `unpack`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..device.binding import SPREAD_MAX, WORD_BYTES
from ..sizing.formats import SIDE_ROW, side_row_bytes

#: the packed row's name among a layer's slot buffers (`formats.SIDE_ROW`)
SMALL_ROW = SIDE_ROW


class SmallTensors:
    """The packed side row of one layer: its device source, and the compact buffers the
    kernel reads (see the module docstring). ``specs``: (name, per-expert shape, dtype,
    bytes per expert) of each small tensor, in the order they are packed."""

    def __init__(self, specs: Sequence[tuple[str, tuple[int, ...], Any, int]],
                 num_experts: int, num_slots: int, device: Any) -> None:
        import torch

        self.specs = [(n, tuple(int(d) for d in s), dt, int(b)) for n, s, dt, b in specs]
        self.names = [n for n, *_ in self.specs]
        self.num_experts, self.num_slots = int(num_experts), int(num_slots)
        self.row_bytes = side_row_bytes([b for *_, b in self.specs])
        self.device = torch.device(device)
        #: name -> byte offset of the tensor in the packed row
        self.offsets: dict[str, int] = {}
        off = 0
        for name, _, _, nbytes in self.specs:
            self.offsets[name] = off
            off += nbytes
        #: [E, row_bytes] uint8 on the device: the gather's source for the side row
        self.source = torch.zeros((self.num_experts, self.row_bytes), dtype=torch.uint8,
                                  device=self.device)
        #: tensors packed next to each other with the same size are unpacked by one copy:
        #: (byte offset of the run, bytes each, names in the run)
        self.runs = _runs(self.specs)
        #: name -> compact [S, *shape] buffer the slot-bound kernel reads
        self.slots, self._slot_bytes = self._compact(self.num_slots)
        #: name -> compact [E, *shape] device copy, for calls indexed by expert id
        self.full, self._full_bytes = self._compact(self.num_experts)

    @property
    def nbytes_per_slot(self) -> int:
        """VRAM one slot adds: its packed row and its compact copies."""
        return self.row_bytes + sum(b for *_, b in self.specs)

    @property
    def fixed_bytes(self) -> int:
        """VRAM independent of the slot count: the source rows and the full copies."""
        return self.num_experts * (self.row_bytes + sum(b for *_, b in self.specs))

    def _compact(self, rows: int) -> tuple[dict[str, Any], list[Any]]:
        """One uint8 buffer ``[k, rows, b]`` per run, and each tensor of the run viewed in
        it with its own dtype and shape ``[rows, *shape]``."""
        import torch

        views: dict[str, Any] = {}
        bufs: list[Any] = []
        shapes = {n: (s, dt) for n, s, dt, _ in self.specs}
        for _, nbytes, names in self.runs:
            buf = torch.zeros((len(names), rows, nbytes), dtype=torch.uint8, device=self.device)
            bufs.append(buf)
            for i, name in enumerate(names):
                shape, dtype = shapes[name]
                views[name] = buf[i].view(dtype).view(rows, *shape)
        return views, bufs

    def spread_targets(self) -> list[tuple[int, int, int]] | None:
        """The compact slot buffers as the gather's spread targets of the side row, in
        packing order: ``(address, first word in the row, words)`` each (`SlotCache`'s
        ``spread``); None where the row cannot be spread (a tensor's bytes or offset not a
        multiple of 4, or more tensors than the kernel takes), and `unpack` is needed."""
        if not spreadable([nbytes for *_, nbytes in self.specs]):
            return None
        return [(self.slots[name].data_ptr(), self.offsets[name] // WORD_BYTES,
                 nbytes // WORD_BYTES) for name, _, _, nbytes in self.specs]

    def refresh(self, tensors: Mapping[str, Any]) -> None:
        """(Re)build the source rows and the full copies from the layer's tensors (each
        ``[E, *shape]``, any device vLLM keeps them on): at arming, and after vLLM changed
        the weights."""
        import torch

        e = self.num_experts
        for name, shape, dtype, nbytes in self.specs:
            t = tensors[name]
            if tuple(t.shape) != (e, *shape) or t.dtype != dtype:
                raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype}, expected "
                                 f"{(e, *shape)} {dtype}")
            raw = t.detach().contiguous().view(torch.uint8).reshape(e, nbytes)
            off = self.offsets[name]
            self.source[:, off:off + nbytes].copy_(raw.to(self.device))
        self._unpack(self.source, self._full_bytes)

    def unpack(self, packed_slots: Any) -> None:
        """The compact slot buffers from the gathered ``[S, row_bytes]`` rows: one copy a
        run, on the current stream, no host synchronisation. For a row the gather does not
        spread (`spread_targets` is None)."""
        self._unpack(packed_slots, self._slot_bytes)

    def _unpack(self, packed: Any, bufs: Sequence[Any]) -> None:
        rows = packed.shape[0]
        for (off, nbytes, names), buf in zip(self.runs, bufs):
            run = packed[:, off:off + nbytes * len(names)].view(rows, len(names), nbytes)
            buf.copy_(run.transpose(0, 1))


def spreadable(sizes: Sequence[int]) -> bool:
    """Whether a side row of tensors of ``sizes`` bytes an expert, packed in that order,
    can be spread by the gather (`SmallTensors.spread_targets`): whole 4-byte words each
    (so every offset is too), and no more tensors than the kernel takes."""
    return len(sizes) <= SPREAD_MAX and all(b % WORD_BYTES == 0 for b in sizes)


def _runs(specs: Sequence[tuple[str, tuple[int, ...], Any, int]]
          ) -> list[tuple[int, int, list[str]]]:
    """Consecutive tensors of equal byte size, as (offset, bytes each, names)."""
    runs: list[tuple[int, int, list[str]]] = []
    off = 0
    for name, _, _, nbytes in specs:
        if runs and runs[-1][1] == nbytes and runs[-1][0] + nbytes * len(runs[-1][2]) == off:
            runs[-1][2].append(name)
        else:
            runs.append((off, nbytes, [name]))
        off += nbytes
    return runs
