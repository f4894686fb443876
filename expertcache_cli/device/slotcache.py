"""One MoE layer's slot cache on the device: the object the vLLM plugin drives.

A `SlotCache` owns the device state of docs/design.md, The cache rules (table,
slot_expert, prio, step), the miss list, two statistics counters and one slot buffer
``[S, *shape]`` per per-expert tensor (weights, scales, zero points, biases: every
tensor indexed by the expert id, so that all of them are rebound together). `step` runs
the manager and the gather on torch's current stream and returns the routing ids in slot
space; it never synchronises with the device, and its pointers are stable for the
object's life, so a vLLM CUDA graph can capture it. Sources are read fresh on every
call, because vLLM's offloader moves the expert tensors to host memory after loading.
One tensor's slab may also be spread as it is gathered (``spread``): its 4-byte words
written into compact per-slot arrays the caller owns, by the same kernel launch
(`binding.GatherLauncher`); the plugin's packed side row fills its compact copies so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..rules.policy import Policy
from . import binding

if TYPE_CHECKING:
    import torch


class SlotCache:
    """Device-managed slot cache of one layer (see the module docstring).

    ``specs`` maps a tensor name to its per-expert ``(shape, dtype)``; its slab must be a
    multiple of 16 bytes. ``max_inserts`` (default: all misses) caps installs per step.
    An empty ``specs`` gives a manager-only cache (no gather), used by replay.
    ``spread``: at most one tensor name of ``specs`` and its compact targets, ``(device
    address, first word, words)`` each (`binding.GatherLauncher`): every install writes
    its expert's words there too, at ``slot * words``.
    """

    def __init__(
        self,
        num_experts: int,
        num_slots: int,
        specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        *,
        policy: str | Policy = "lru",
        decay: int = 0,
        max_inserts: int | None = None,
        device: torch.device | int | None = None,
        name: str = "",
        wide_inserts: int | None = None,
        pool: Callable[[], Any] | None = None,
        spread: Mapping[str, Sequence[tuple[int, int, int]]] | None = None,
    ) -> None:
        import contextlib

        import torch

        self.name = name
        self.num_experts = int(num_experts)
        self.num_slots = int(num_slots)
        self.policy = Policy.parse(policy)
        code = binding.policy_code(self.policy)
        self.decay = int(decay)
        # a cap above S means no cap: installs never exceed the slots (and the kernel
        # lists at most S misses)
        self.max_inserts = self.num_slots if max_inserts is None else min(int(max_inserts),
                                                                          self.num_slots)
        binding.check_manage_config(
            self.num_experts, self.num_slots, self.decay, self.num_slots, self.max_inserts
        )
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif isinstance(device, int):
            device = torch.device("cuda", device)
        else:
            device = torch.device(device)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        if device.type != "cuda":
            raise ValueError(f"{self._label()}SlotCache needs a CUDA device, got {device}")
        self.device = device

        self.specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        slab_bytes: list[int] = []
        for key, (shape, dtype) in specs.items():
            shape = tuple(int(x) for x in shape)
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            binding.check_slab(f"{self._label()}{key}", nbytes)
            self.specs[key] = (shape, dtype)
            slab_bytes.append(nbytes)
        self.slab_bytes = dict(zip(self.specs, slab_bytes))
        #: name -> compact targets the gather spreads that tensor's slab into (`spread`)
        self.spread = spread_of(self.specs, spread, self._label())

        E, S, dev = self.num_experts, self.num_slots, device
        self.table = torch.full((E,), -1, dtype=torch.int32, device=dev)
        self.slot_expert = torch.full((S,), -1, dtype=torch.int32, device=dev)
        self.prio = torch.zeros(S, dtype=torch.int64, device=dev)
        self.step_count = torch.zeros(1, dtype=torch.int64, device=dev)
        self.miss_expert = torch.full((S,), -1, dtype=torch.int32, device=dev)
        self.miss_slot = torch.full((S,), -1, dtype=torch.int32, device=dev)
        self.miss_count = torch.zeros(1, dtype=torch.int32, device=dev)
        #: device int64 [2]: distinct routed ids seen (requests), experts installed
        self.stats = torch.zeros(2, dtype=torch.int64, device=dev)
        #: name -> [S, *shape] slot buffer on the device; pointers stable for life
        #: (``pool``: the allocation context of vLLM's sleep-mode pool, slots only: the
        #: state above must survive a sleep that discards them)
        with pool() if pool is not None else contextlib.nullcontext():
            self.slots: dict[str, torch.Tensor] = {
                key: torch.zeros((S, *shape), dtype=dtype, device=dev)
                for key, (shape, dtype) in self.specs.items()
            }

        kernels = binding.get_kernels(dev.index)
        self.backend = kernels.description

        def manager(max_distinct: int, max_inserts: int) -> binding.ManageLauncher:
            """A manager launcher over this cache's one device state."""
            return binding.ManageLauncher(
                kernels,
                table=self.table.data_ptr(), slot_expert=self.slot_expert.data_ptr(),
                prio=self.prio.data_ptr(), step=self.step_count.data_ptr(),
                miss_expert=self.miss_expert.data_ptr(), miss_slot=self.miss_slot.data_ptr(),
                miss_count=self.miss_count.data_ptr(), stats=self.stats.data_ptr(),
                num_experts=E, num_slots=S, policy=code, decay=self.decay,
                max_distinct=max_distinct, max_inserts=max_inserts,
            )

        self._manage = manager(S, self.max_inserts)
        #: wide steps (`step_wide`): the same state through a manager with no
        #: max_distinct gate, installing at most ``wide_inserts`` misses (0: staged,
        #: refresh only; the insert cap: staged-install); None: no wide steps
        self.wide_inserts = None if wide_inserts is None else min(int(wide_inserts),
                                                                  self.max_inserts)
        self._manage_wide = (None if self.wide_inserts is None
                             else manager(E, self.wide_inserts))
        self._gather = None
        if self.specs:
            self._gather = binding.GatherLauncher(
                kernels,
                miss_expert=self.miss_expert.data_ptr(), miss_slot=self.miss_slot.data_ptr(),
                miss_count=self.miss_count.data_ptr(),
                dsts=[t.data_ptr() for t in self.slots.values()],
                slab_bytes=slab_bytes, grid=binding.default_gather_grid(dev.index),
                names=[f"{self._label()}{k}" for k in self.specs],
                spread=next(((list(self.specs).index(k), targets)
                             for k, targets in self.spread.items()), None),
            )
        self._checked: dict[str, tuple] = {}  # name -> signature of the last source seen

    def reset(self) -> None:
        """Empty every slot: fresh state, as at construction (statistics kept).

        For when the experts behind the slots changed (vLLM reloaded weights, or woke
        from a sleep that discarded them): a slot would otherwise keep serving the old
        expert. Device work only, on torch's current stream; no pointer changes, so
        captured CUDA graphs stay valid and the next steps gather the experts anew (a
        spread tensor's compact targets with them: a slot's words are rewritten whenever
        an expert is installed there, as its slab is).
        """
        self.table.fill_(-1)
        self.slot_expert.fill_(-1)
        self.prio.zero_()
        self.step_count.zero_()
        self.miss_count.zero_()
        self._checked.clear()

    def _label(self) -> str:
        return f"{self.name}: " if self.name else ""

    def fits(self, num_ids: int) -> bool:
        """The shape gate: a forward with more routing ids than slots reads through the
        host copies instead (decided from shapes, no sync)."""
        return num_ids <= self.num_slots

    def _source_ptr(self, key: str, sources: Mapping[str, torch.Tensor]) -> int:
        """Check one source tensor (cheaply when unchanged since last call); its address."""
        try:
            src = sources[key]
        except KeyError:
            raise ValueError(f"{self._label()}no source tensor for {key!r}") from None
        shape, dtype = self.specs[key]
        ptr = src.data_ptr()
        sig = (ptr, tuple(src.shape), src.dtype, src.device)
        if self._checked.get(key) == sig:
            return ptr
        want = (self.num_experts, *shape)
        if tuple(src.shape) != want or src.dtype != dtype:
            raise ValueError(
                f"{self._label()}{key}: source is {tuple(src.shape)} {src.dtype}, "
                f"expected {want} {dtype}"
            )
        if not src.is_contiguous():
            raise ValueError(f"{self._label()}{key}: source must be contiguous")
        if src.device.type == "cuda":
            if src.device.index != self.device.index:
                raise ValueError(
                    f"{self._label()}{key}: source on {src.device}, cache on {self.device}"
                )
        elif src.device.type == "cpu":
            if not src.is_pinned():
                raise ValueError(
                    f"{self._label()}{key}: a host source must be pinned (page-locked) memory "
                    "so the device can read it in place"
                )
        else:
            raise ValueError(f"{self._label()}{key}: source on unsupported device {src.device}")
        binding.check_aligned(f"{self._label()}{key} source", ptr)
        self._checked[key] = sig
        return ptr

    def check_sources(self, sources: Mapping[str, torch.Tensor]) -> None:
        """Validate ``sources`` now. `step` re-checks only tensors whose address, shape or
        dtype changed, so calling this before a CUDA graph capture keeps the host-side
        queries (``is_pinned``) out of the captured region."""
        for key in self.specs:
            self._source_ptr(key, sources)

    def step(self, topk_ids: torch.Tensor, sources: Mapping[str, torch.Tensor],
             real_rows: torch.Tensor | None = None,
             pad_rows: torch.Tensor | None = None,
             remap: bool = True,
             blocks: torch.Tensor | None = None) -> torch.Tensor | None:
        """Manage + gather on torch's current stream; returns slot-space ids.

        The result has the shape and dtype of ``topk_ids``; padding (< 0 or >= E) passes
        through unchanged. CUDA-graph padding rows of ``topk_ids``, kept out of the step
        and returned as slot 0, read by the manager itself at run time
        (`policy.padding_rows`): ``real_rows``, a one-element int32 tensor on this device,
        the number of leading rows that are real (vLLM's V1 runner), and/or ``pad_rows``,
        a bool (or uint8) tensor with one flag a row (its V2 runner's marks). No host
        synchronisation happens here. ``remap=False``: no slot-space ids written (None
        returned), for a caller whose kernel reads the routing in expert space: vLLM's
        Marlin experts, whose block list (``blocks``, contiguous int32 expert ids) the same
        manager launch rewrites in place to slots (`binding.block_slots`' rule) after its
        installs (`plugin.marlin`).
        """
        import torch

        ids = self._checked_ids(topk_ids)
        out = torch.empty_like(ids) if remap else None
        rows = ids.shape[0] if ids.dim() >= 1 else 1
        width = ids.numel() // rows if rows else 1
        real_ptr = 0 if real_rows is None else self._checked_real_rows(real_rows)
        pad_ptr = 0 if pad_rows is None else self._checked_pad_rows(pad_rows, rows)
        blocks_ptr, n_blocks = (0, 0) if blocks is None else self._checked_blocks(blocks)
        self._run(self._manage, ids, out.data_ptr() if out is not None else 0, sources,
                  real_ptr, width, pad_ptr, blocks_ptr, n_blocks)
        return out

    def _checked_blocks(self, blocks: torch.Tensor) -> tuple[int, int]:
        """A block list's address and length: contiguous int32 on this device (else
        ValueError)."""
        import torch

        if (blocks.device != self.device or blocks.dtype != torch.int32
                or not blocks.is_contiguous()):
            raise ValueError(
                f"{self._label()}the block list must be contiguous int32 on {self.device}, "
                f"not {tuple(blocks.shape)} {blocks.dtype} on {blocks.device}"
            )
        return blocks.data_ptr(), blocks.numel()

    def _checked_real_rows(self, real_rows: torch.Tensor) -> int:
        """The count's address: one int32 on this cache's device (else ValueError)."""
        import torch

        if (real_rows.device != self.device or real_rows.dtype != torch.int32
                or real_rows.numel() != 1):
            raise ValueError(
                f"{self._label()}real_rows must be one int32 on {self.device}, not "
                f"{tuple(real_rows.shape)} {real_rows.dtype} on {real_rows.device}"
            )
        return real_rows.data_ptr()

    def _checked_pad_rows(self, pad_rows: torch.Tensor, rows: int) -> int:
        """The marks' address: a contiguous bool/uint8 flag a row on this device."""
        import torch

        if (pad_rows.device != self.device or pad_rows.dtype not in (torch.bool, torch.uint8)
                or pad_rows.dim() != 1 or pad_rows.numel() < rows
                or not pad_rows.is_contiguous()):
            raise ValueError(
                f"{self._label()}pad_rows must be {rows} contiguous bool flags on "
                f"{self.device}, not {tuple(pad_rows.shape)} {pad_rows.dtype} on "
                f"{pad_rows.device}"
            )
        return pad_rows.data_ptr()

    def step_wide(self, topk_ids: torch.Tensor, sources: Mapping[str, torch.Tensor]) -> None:
        """A step too wide for the slots (docs/design.md, Wide steps): the manager with no
        max_distinct gate (hits refreshed; up to ``wide_inserts`` misses installed and
        gathered into slots), on torch's current stream, no synchronisation. The ids stay
        in expert space: the caller stages the step through a `scratch.Scratch`."""
        if self._manage_wide is None:
            raise ValueError(f"{self._label()}built without wide steps (wide_inserts=None)")
        self._run(self._manage_wide, self._checked_ids(topk_ids), 0, sources)

    def _checked_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """``topk_ids`` on this cache's device as int32/int64, contiguous (else ValueError)."""
        import torch

        if topk_ids.device != self.device:
            raise ValueError(
                f"{self._label()}topk_ids on {topk_ids.device}, cache on {self.device}"
            )
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{self._label()}topk_ids must be int32 or int64, not {topk_ids.dtype}"
            )
        return topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()

    def _run(self, manage: binding.ManageLauncher, ids: torch.Tensor, out_ptr: int,
             sources: Mapping[str, torch.Tensor], real_rows: int = 0,
             row_width: int = 1, pad_rows: int = 0, blocks: int = 0,
             n_blocks: int = 0) -> None:
        """One manager launch, then the gather of its installs, on the current stream
        (sources checked first: a bad one refuses before anything is launched)."""
        import torch

        srcs = [self._source_ptr(key, sources) for key in self.specs]
        stream = torch.cuda.current_stream(self.device).cuda_stream
        manage(ids.data_ptr(), ids.numel(), ids.dtype == torch.int64, out_ptr, stream,
               real_rows, row_width, pad_rows, blocks, n_blocks)
        if self._gather is not None:
            self._gather(srcs, stream)

    def state(self) -> dict:
        """Host copies of the state, the last miss list and the counters (syncs; tests)."""
        n = int(self.miss_count.item())
        me = self.miss_expert[:n].tolist()
        ms = self.miss_slot[:n].tolist()
        return {
            "table": self.table.cpu().numpy(),
            "slot_expert": self.slot_expert.cpu().numpy(),
            "prio": self.prio.cpu().numpy(),
            "step": int(self.step_count.item()),
            "misses": list(zip(me, ms)),
            "miss_count": n,
            "stats": self.stats.cpu().tolist(),
        }


def spread_of(specs: Mapping[str, Any],
              spread: Mapping[str, Sequence[tuple[int, int, int]]] | None,
              label: str = "") -> dict[str, list[tuple[int, int, int]]]:
    """``spread`` checked against the cache's tensors: at most one (the kernel spreads one
    slab a gather), named in ``specs``; the targets themselves are the launcher's to check
    (`binding.check_spread`)."""
    spread = dict(spread or {})
    if len(spread) > 1:
        raise ValueError(f"{label}the gather spreads one tensor, not {len(spread)} "
                         f"({', '.join(spread)})")
    for name in spread:
        if name not in specs:
            raise ValueError(f"{label}spread tensor {name!r} is not one of the cache's tensors")
    return {name: [(int(a), int(o), int(w)) for a, o, w in targets]
            for name, targets in spread.items()}
