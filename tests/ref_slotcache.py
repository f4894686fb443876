"""`SlotCache`'s contract on the host, for the plugin's CPU tests (needs torch).

The real `SlotCache` runs CUDA kernels (its own device tests prove it bit-exact against
`policy.LayerCache`); this emulation, built on that very reference, stands in for it so the
plugin's part is tested on CPU: the same state, installs and remapped ids.
"""

from __future__ import annotations

import ctypes

import torch

from expertcache_cli.device.slotcache import spread_of
from expertcache_cli.rules.policy import LayerCache, Policy


class RefSlotCache:
    """`SlotCache`'s contract on the host, driven by the reference rules."""

    def __init__(self, num_experts, num_slots, specs, *, policy="lru", decay=0,
                 wide_inserts=None, pool=None, spread=None, **_):
        import contextlib

        self.ref = LayerCache(num_experts, num_slots, Policy.parse(policy), decay)
        self.num_slots = num_slots
        self.wide_inserts = wide_inserts
        with pool() if pool is not None else contextlib.nullcontext():  # as SlotCache
            self.slots = {
                n: torch.zeros((num_slots, *shape), dtype=dt) for n, (shape, dt) in specs.items()
            }
        self.stats = torch.zeros(2, dtype=torch.int64)
        self.steps = 0
        #: as SlotCache's: name -> (address, first word, words) targets its installs spread
        #: their words into (host addresses here: the plugin's CPU tests keep every
        #: buffer on the CPU)
        self.spread = spread_of(self.slots, spread)

    def fits(self, n):
        return n <= self.num_slots

    def reset(self):
        self.ref = LayerCache(self.ref.num_experts, self.num_slots, self.ref.policy,
                              self.ref.decay)

    def step(self, topk_ids, sources, real_rows=None, pad_rows=None, remap=True,
             blocks=None):
        ids = topk_ids.numpy()
        real = None if real_rows is None else int(real_rows.reshape(-1)[0])
        pad = None if pad_rows is None else pad_rows.numpy().astype(bool)
        self.real_rows_seen = getattr(self, "real_rows_seen", []) + [real]
        self.pad_rows_seen = getattr(self, "pad_rows_seen", []) + [
            None if pad is None else pad.tolist()]
        r = self.ref.step(ids, real_rows=real, pad_rows=pad)
        self._install(r.misses, sources)
        self.stats += torch.tensor([r.distinct, r.miss_count])
        self.steps += 1
        if blocks is not None:  # vLLM Marlin's block list, to slots in place (the manager's)
            from expertcache_cli.device.binding import block_slots

            blocks.copy_(block_slots(blocks, self.table))
            self.block_lists = getattr(self, "block_lists", 0) + 1
        if not remap:  # no slot-space ids (vLLM's Marlin reads the routing in expert space)
            return None
        return torch.from_numpy(self.ref.remap(ids, real, pad)).to(topk_ids.dtype)

    @property
    def table(self):
        return torch.from_numpy(self.ref.table)

    @property
    def slot_expert(self):
        return torch.from_numpy(self.ref.slot_expert)

    def step_wide(self, topk_ids, sources):
        """The kernel's wide manager: no max_distinct gate, at most wide_inserts installs."""
        r = self.ref.step(topk_ids.numpy(), max_distinct=self.ref.num_experts,
                          max_inserts=self.wide_inserts)
        self._install(r.misses, sources)
        self.stats += torch.tensor([r.distinct, r.miss_count])
        self.wide_steps = getattr(self, "wide_steps", 0) + 1

    def _install(self, misses, sources):
        """Each missed expert's rows into its slot, and the spread tensor's words into the
        spread targets from the row just installed (the gather kernel's rule)."""
        for e, s in misses:
            for n, buf in self.slots.items():
                buf[s] = sources[n][e]
                row = buf[s].contiguous()
                for addr, off, words in self.spread.get(n, ()):
                    ctypes.memmove(addr + 4 * s * words, row.data_ptr() + 4 * off, 4 * words)
