"""Wide steps through VRAM: a scratch holding one layer's routed experts for one call.

Why: a step carrying more routing ids than the layer has slots (a prefill chunk, a decode
batch past the sizing trap) cannot be served from slots alone, and in place the stock
fused-MoE kernel reads every routed expert from pinned host memory, tile by tile, often
more than once, slots or not. Staged instead (docs/design.md, Wide steps), the step's
distinct routed experts are copied into a VRAM scratch indexed by expert id, hits from
the layer's slots at device-memory speed and the rest from host at the gather kernel's
rate, each exactly once; the stock kernel then runs on the scratch with the routing ids
unchanged. Same weights, same ids, same expert count for the tile lookup: the outputs
are the in-place path's, bit for bit.

One scratch serves every layer of the same shape (layers run one after another on one
stream), so it costs one layer's experts of VRAM, counted in vLLM's memory plan with the
slots. The copy lists are built on the device from the routing and the layer's table
(`stage_lists`): no host synchronisation, fixed buffer addresses, so CUDA graphs capture
the whole step as they capture the slot path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def routed_mask(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` bool: the experts the routing ``ids`` name (padding < 0 or >= E ignored),
    computed on the ids' device with fixed shapes and no synchronisation."""
    import torch

    e = num_experts
    flat = ids.reshape(-1).to(torch.int64)
    routed = torch.zeros(e + 1, dtype=torch.bool, device=ids.device)
    # padding goes to the extra entry E, dropped below: a fixed-shape scatter
    routed.index_fill_(0, torch.where((flat >= 0) & (flat < e), flat, e), True)
    return routed[:e]


def stage_lists(ids: torch.Tensor, table: torch.Tensor, num_experts: int,
                hit_src: torch.Tensor, hit_dst: torch.Tensor, miss: torch.Tensor,
                counts: torch.Tensor) -> None:
    """Fill the copy lists of one wide step, on the device, without synchronising.

    ``ids``: the step's routing (any shape; < 0 or >= E is padding). ``table``: the
    layer's expert -> slot map after this step's installs. Writes, in ascending expert
    order, the slots of the routed experts that are resident (``hit_src``) and their ids
    (``hit_dst``), the routed experts that are not (``miss``), and the two counts
    (``counts[0]`` hits, ``counts[1]`` misses). The lists have E + 1 entries: entry E
    takes the writes of the experts not listed (a fixed-shape scatter needs somewhere
    to put them), and the copies read only the first ``count`` entries.
    """
    import torch

    e = num_experts
    dev = table.device
    routed = routed_mask(ids.to(dev), e)
    resident = table >= 0
    hit = routed & resident
    missing = routed & ~resident
    experts = torch.arange(e, dtype=torch.int32, device=dev)
    for mask, values, out in ((hit, table, hit_src), (hit, experts, hit_dst),
                              (missing, experts, miss)):
        rank = torch.cumsum(mask, 0) - 1
        out.scatter_(0, torch.where(mask, rank, e), values.to(out.dtype))
    counts[0] = hit.sum()
    counts[1] = missing.sum()


#: copy(sources by name, src index list, dst index list, count tensor) -> None
Copier = Callable[[Mapping[str, "torch.Tensor"], "torch.Tensor", "torch.Tensor", "torch.Tensor"],
                  None]


class Scratch:
    """One layer's worth of expert buffers ``[E, *shape]`` per per-expert tensor, shared by
    every armed layer with the same experts and tensor shapes, and the lists and
    counters of the step being staged."""

    def __init__(self, num_experts: int, specs: Mapping[str, tuple[tuple[int, ...], Any]],
                 device: Any, copier: Callable[[Scratch], tuple[Copier, Copier]] | None = None
                 ) -> None:
        import torch

        self.num_experts = int(num_experts)
        self.specs = {k: (tuple(int(x) for x in shape), dt) for k, (shape, dt) in specs.items()}
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        e = self.num_experts
        # zeros, not empty: a padded row of a CUDA graph may route to an expert this step
        # did not stage; it must read finite weights (its output is discarded)
        self.buffers = {k: torch.zeros((e, *shape), dtype=dt, device=self.device)
                        for k, (shape, dt) in self.specs.items()}
        self.nbytes = sum(b.numel() * b.element_size() for b in self.buffers.values())
        self.hit_src = torch.full((e + 1,), -1, dtype=torch.int32, device=self.device)
        self.hit_dst = torch.full((e + 1,), -1, dtype=torch.int32, device=self.device)
        self.miss = torch.full((e + 1,), -1, dtype=torch.int32, device=self.device)
        self.counts = torch.zeros(2, dtype=torch.int32, device=self.device)
        self._from_slots, self._from_host = (copier or cuda_copiers)(self)

    def signature(self) -> tuple:
        return scratch_key(self.num_experts, self.specs)

    def stage(self, ids: torch.Tensor, table: torch.Tensor, slots: Mapping[str, torch.Tensor],
              sources: Mapping[str, torch.Tensor]) -> None:
        """Make every routed expert of this step resident in the scratch: hits copied from
        ``slots`` (the layer's slot buffers), the rest from ``sources`` (the host copies).
        ``table`` must already hold this step's installs (`SlotCache.step_wide`)."""
        stage_lists(ids, table, self.num_experts, self.hit_src, self.hit_dst, self.miss,
                    self.counts)
        self._from_slots(slots, self.hit_src, self.hit_dst, self.counts[0:1])
        self._from_host(sources, self.miss, self.miss, self.counts[1:2])


def scratch_key(num_experts: int, specs: Mapping[str, tuple[tuple[int, ...], Any]]) -> tuple:
    """Layers whose scratch can be one: same experts, same tensors, shapes and dtypes."""
    return (int(num_experts), tuple((k, tuple(s), str(dt)) for k, (s, dt) in specs.items()))


def scratch_bytes(num_experts: int, slab_bytes: Mapping[str, int] | int) -> int:
    """VRAM of one scratch: every expert of one layer."""
    per_expert = slab_bytes if isinstance(slab_bytes, int) else sum(slab_bytes.values())
    return int(num_experts) * int(per_expert)


def cuda_copiers(scratch: Scratch) -> tuple[Copier, Copier]:
    """The gather kernel, twice: slots -> scratch (device memory) and host -> scratch
    (mapped pinned memory). Each launch's list and count pointers are the scratch's
    fixed buffers; the sources are read per call (a layer's slots, its host copies)."""
    import torch

    from . import binding

    dev = scratch.device
    kernels = binding.get_kernels(dev.index)
    names = list(scratch.specs)
    slabs = [math.prod(shape) * torch.empty((), dtype=dt).element_size()
             for shape, dt in scratch.specs.values()]
    grid = binding.default_gather_grid(dev.index)

    def launcher(src_list: torch.Tensor, dst_list: torch.Tensor, count: torch.Tensor, what: str):
        return binding.GatherLauncher(
            kernels, miss_expert=src_list.data_ptr(), miss_slot=dst_list.data_ptr(),
            miss_count=count.data_ptr(), dsts=[scratch.buffers[n].data_ptr() for n in names],
            slab_bytes=slabs, grid=grid, names=[f"scratch ({what}) {n}" for n in names])

    from_slots = launcher(scratch.hit_src, scratch.hit_dst, scratch.counts[0:1], "hits")
    from_host = launcher(scratch.miss, scratch.miss, scratch.counts[1:2], "misses")

    def run(gather: binding.GatherLauncher) -> Copier:
        def copy(srcs, _src_list, _dst_list, _count) -> None:
            stream = torch.cuda.current_stream(dev).cuda_stream
            gather([srcs[n].data_ptr() for n in names], stream)

        return copy

    return run(from_slots), run(from_host)


def torch_copiers(scratch: Scratch) -> tuple[Copier, Copier]:
    """The same copies with torch indexing (synchronises: for CPU tests and checks only)."""

    def copy(srcs, src_list, dst_list, count) -> None:
        n = int(count.reshape(-1)[0])
        src_idx = src_list[:n].long()
        dst_idx = dst_list[:n].long()
        for name, buf in scratch.buffers.items():
            buf[dst_idx] = srcs[name][src_idx].to(buf.device)

    return copy, copy
