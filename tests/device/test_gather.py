"""The gather: bytes in every occupied slot equal the source row of its expert, for 2, 4,
6 and 10 tensors (10 > 8 splits across launches) of mixed sizes, from pinned host memory
read in place by the device (UVA), and the refusals that must never become truncation."""

from __future__ import annotations

import numpy as np
import pytest

#: per-expert (shape, dtype name) of tensors like a quantised MoE layer's
MIXED = [
    ((96, 64), "bfloat16"),      # w13 weight
    ((64, 48), "bfloat16"),      # w2 weight
    ((96, 4), "float32"),        # w13 scales
    ((64,), "float32"),          # w2 scales
    ((24, 8), "int32"),          # zero points
    ((96,), "bfloat16"),         # bias (192 bytes)
    ((8,), "float16"),           # 16 bytes: the smallest slab
    ((1008,), "uint8"),          # 1008 bytes
    ((5, 16), "int8"),
    ((3, 32), "float16"),
]


def _make_sources(torch, n: int, num_experts: int, where: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    specs, sources = {}, {}
    for i, (shape, dname) in enumerate(MIXED[:n]):
        dtype = getattr(torch, dname)
        raw = torch.randint(0, 256, (num_experts, *shape, torch.empty((), dtype=dtype)
                                     .element_size()), generator=g, dtype=torch.uint8)
        t = raw.view(dtype).reshape(num_experts, *shape)
        t = t.pin_memory() if where == "pinned" else t.cuda()
        specs[f"t{i}"] = (shape, dtype)
        sources[f"t{i}"] = t
    return specs, sources


def _check_slots(torch, cache, sources, ctx):
    st = cache.state()
    occupied = [(s, int(e)) for s, e in enumerate(st["slot_expert"]) if e >= 0]
    assert occupied, f"{ctx}: nothing installed"
    slots = torch.tensor([s for s, _ in occupied])
    experts = torch.tensor([e for _, e in occupied])
    for key, slot_buf in cache.slots.items():
        got = slot_buf[slots.cuda()].cpu().reshape(len(occupied), -1).view(torch.uint8)
        want = sources[key].cpu()[experts].reshape(len(occupied), -1).view(torch.uint8)
        if not torch.equal(got, want):
            bad = (got != want).any(dim=1).nonzero().flatten().tolist()
            raise AssertionError(f"{ctx}: {key} differs in slots {[occupied[b] for b in bad]}")


@pytest.mark.device
@pytest.mark.parametrize("n", [2, 4, 6, 10])
@pytest.mark.parametrize("where", ["pinned", "device"])
def test_gather_bytes_equal_source_rows(cuda, n, where):
    torch = cuda
    from expertcache_cli.device.slotcache import SlotCache

    E, S = 48, 12
    specs, sources = _make_sources(torch, n, E, where, seed=n)
    cache = SlotCache(E, S, specs, policy="lru", name=f"gather{n}")
    rng = np.random.default_rng(n)
    for t in range(60):
        ids = torch.from_numpy(rng.integers(-1, E, size=(2, 4)).astype(np.int32)).cuda()
        cache.step(ids, sources)
        if t % 10 == 9 or t < 3:
            _check_slots(torch, cache, sources, f"{where} n={n} step {t}")
    assert cache.stats[1].item() > S  # evictions happened, slots were rewritten


@pytest.mark.device
def test_gather_reads_sources_fresh(cuda):
    """A source tensor that moves between calls (vLLM's offloader) is read at its new home."""
    torch = cuda
    from expertcache_cli.device.slotcache import SlotCache

    E, S = 16, 4
    specs, sources = _make_sources(torch, 2, E, "pinned", seed=1)
    cache = SlotCache(E, S, specs)
    cache.step(torch.tensor([0, 1], dtype=torch.int32, device="cuda"), sources)
    moved = {k: (v.cpu() + 0).pin_memory() for k, v in sources.items()}
    for v in moved.values():
        v.view(torch.uint8).fill_(0x5A)
    cache.step(torch.tensor([2, 3], dtype=torch.int32, device="cuda"), moved)
    st = cache.state()
    for key, buf in cache.slots.items():
        for s, e in enumerate(st["slot_expert"]):
            want = (moved if e in (2, 3) else sources)[key][e].view(torch.uint8)
            assert torch.equal(buf[s].cpu().view(torch.uint8), want), (key, s, e)


@pytest.mark.device
def test_gather_refuses_bad_sources(cuda):
    torch = cuda
    from expertcache_cli.device.slotcache import SlotCache

    with pytest.raises(ValueError, match="multiple of 16"):
        SlotCache(8, 4, {"w": ((3,), torch.bfloat16)})  # 6-byte slab: refused, not truncated
    cache = SlotCache(8, 4, {"w": ((8,), torch.bfloat16)})
    ids = torch.tensor([1], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="pinned"):
        cache.step(ids, {"w": torch.zeros(8, 8, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="expected"):
        cache.step(ids, {"w": torch.zeros(8, 4, dtype=torch.bfloat16, device="cuda")})
    with pytest.raises(ValueError, match="contiguous"):
        cache.step(ids, {"w": torch.zeros(8, 16, dtype=torch.bfloat16, device="cuda")[:, ::2]})
    with pytest.raises(ValueError, match="no source"):
        cache.step(ids, {})


@pytest.mark.device
def test_the_shutdown_audit_passes_the_kernels_slots_and_catches_one_flipped_bit(cuda):
    """`audit.audit_slots` (EXPERT_CACHE_AUDIT=1) on the real cache: after 40 steps of the
    manager and the gather from pinned memory it finds every slot sound, and one bit
    flipped in one slot of one tensor, or a table entry moved, is named."""
    torch = cuda
    from expertcache_cli.device.audit import audit_slots
    from expertcache_cli.device.slotcache import SlotCache

    E, S = 48, 12
    specs, sources = _make_sources(torch, 4, E, "pinned", seed=11)
    cache = SlotCache(E, S, specs, policy="lru", name="audit")
    rng = np.random.default_rng(11)
    for _ in range(40):
        cache.step(torch.from_numpy(rng.integers(0, E, size=(2, 4)).astype(np.int32)).cuda(),
                   sources)
    r = audit_slots(cache.table, cache.slot_expert, cache.slots, sources)
    assert r.ok and r.occupied == S and r.tensors == 4
    e = int(cache.slot_expert[5])
    cache.slots["t2"][5].view(torch.uint8).reshape(-1)[3] ^= 1
    assert audit_slots(cache.table, cache.slot_expert, cache.slots, sources).problems == [
        f"slot 5 (expert {e}): t2 differs from the expert's source"]
    cache.slots["t2"][5].view(torch.uint8).reshape(-1)[3] ^= 1
    cache.table[e] = 4
    assert not audit_slots(cache.table, cache.slot_expert, cache.slots, sources).ok
