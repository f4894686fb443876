"""The packed side row's spread targets (`plugin.small`), on CPU tensors: where every
small tensor is whole 4-byte words the gather can fill the compact slot buffers itself
(kernel ABI 6), and the targets it is handed, applied by the kernel's word rule, give
exactly what `SmallTensors.unpack` gives; where not, None and `unpack` stays. The kernel
itself is tests/device/test_small_and_block_order.py. Skipped where torch is missing."""

from __future__ import annotations

import ctypes

import pytest

torch = pytest.importorskip("torch", reason="no torch: SmallTensors needs torch")

from expertcache_cli.device.binding import SPREAD_MAX  # noqa: E402
from expertcache_cli.plugin.small import SmallTensors  # noqa: E402

E, S = 12, 5
F32 = torch.float32
#: NVFP4's two per-expert global scales: 8 bytes in a 16-byte row
NVFP4 = [("w13_weight_scale_2", (), F32, 4), ("w2_weight_scale_2", (), F32, 4)]
#: a (2,) float32, two scalars (float32, int32: one copy a run for both) and a (3,)
#: float32: 28 bytes of a 32-byte row, its last word padding
MIXED = [("pair", (2,), F32, 8), ("one", (), F32, 4), ("last", (), torch.int32, 4),
         ("tail", (3,), F32, 12)]


def _tensors(specs, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randint(0, 256, (E, b), generator=g, dtype=torch.uint8).view(dt)
            .reshape(E, *shape) for n, shape, dt, b in specs}


def _spread_by_the_kernels_rule(small, packed, targets):
    """What the gather does for every slot row it installs: word w of the row, inside
    target i's [off, off + words), to ``dst_i[slot * words + w - off]``."""
    row = packed.contiguous()
    for s in range(row.shape[0]):
        for addr, off, words in targets:
            ctypes.memmove(addr + 4 * s * words, row[s].data_ptr() + 4 * off, 4 * words)


@pytest.mark.parametrize("specs", [NVFP4, MIXED], ids=["nvfp4", "mixed"])
def test_word_aligned_tensors_are_spread_into_their_compact_slot_buffers(specs):
    small = SmallTensors(specs, E, S, "cpu")
    assert small.spread_targets() is not None
    targets = small.spread_targets()
    words = [b // 4 for *_, b in specs]
    assert targets == [(small.slots[n].data_ptr(), small.offsets[n] // 4, w)
                       for (n, *_), w in zip(specs, words)]
    small.refresh(_tensors(specs))
    # gathered slot rows: slot s holds expert (3 s + 1) % E
    experts = [(3 * s + 1) % E for s in range(S)]
    packed = small.source[experts].clone()
    small.unpack(packed)
    unpacked = {n: t.clone() for n, t in small.slots.items()}
    for t in small.slots.values():
        t.view(torch.uint8).fill_(0xA5)
    _spread_by_the_kernels_rule(small, packed, targets)
    for n, t in small.slots.items():  # bit for bit what the copy gave
        assert torch.equal(t.view(torch.uint8), unpacked[n].view(torch.uint8)), n


@pytest.mark.parametrize("specs, why", [
    ([("half", (), torch.bfloat16, 2), ("g", (), F32, 4)], "2 bytes: half a word"),
    ([("odd", (3,), torch.uint8, 3), ("g", (), F32, 4)], "g at byte 3"),
    ([(f"s{i}", (), F32, 4) for i in range(SPREAD_MAX + 1)], "more targets than the kernel's"),
])
def test_a_row_the_gather_cannot_spread_keeps_the_unpack(specs, why):
    small = SmallTensors(specs, E, S, "cpu")
    assert small.spread_targets() is None, why
    assert small.spread_targets() is None


def test_as_many_tensors_as_the_kernel_takes_are_spread():
    specs = [(f"s{i}", (), F32, 4) for i in range(SPREAD_MAX)]
    targets = SmallTensors(specs, E, S, "cpu").spread_targets()
    assert [(o, w) for _, o, w in targets] == [(i, 1) for i in range(SPREAD_MAX)]
