"""Hand-worked sequences for every rule of docs/design.md (The cache rules), on the reference."""

from __future__ import annotations

import numpy as np
import pytest

from expertcache_cli.rules.policy import NEVER, LayerCache, Policy


def state(c: LayerCache) -> tuple[list[int], list[int], list[int], int]:
    return c.table.tolist(), c.slot_expert.tolist(), c.prio.tolist(), c.step_count


def test_fresh_state_is_empty():
    c = LayerCache(6, 3)
    assert state(c) == ([-1] * 6, [-1, -1, -1], [0, 0, 0], 0)


def test_lru_misses_ascending_into_empty_slots_in_index_order():
    c = LayerCache(8, 3, Policy.LRU)
    r = c.step([5, 1])  # unsorted routing: misses still go out ascending by id
    assert r.misses == [(1, 0), (5, 1)]
    assert state(c) == ([-1, 0, -1, -1, -1, 1, -1, -1], [1, 5, -1], [1, 1, 0], 1)


def test_lru_refresh_and_victim_is_least_recent():
    c = LayerCache(8, 2, Policy.LRU)
    c.step([1, 3])  # slot0=1, slot1=3, both prio 1
    r = c.step([3])  # refresh 3 -> prio 2
    assert r.misses == [] and c.prio.tolist() == [1, 2]
    r = c.step([6])  # victim: slot0 (prio 1 < 2)
    assert r.misses == [(6, 0)]
    assert c.table[1] == -1 and c.table[6] == 0 and c.prio.tolist() == [3, 2]


def test_ties_go_to_lowest_slot_index():
    c = LayerCache(8, 3, Policy.LRU)
    c.step([0, 1, 2])  # all prio 1
    r = c.step([7])
    assert r.misses == [(7, 0)]
    r = c.step([6, 5])  # slot1, slot2 tie at prio 1; slot0 holds 7 at prio 2
    assert r.misses == [(5, 1), (6, 2)]


def test_never_evict_what_this_step_needs():
    c = LayerCache(8, 2, Policy.LRU, max_distinct=3)
    c.step([1, 2])
    r = c.step([1, 2, 3])  # both slots hold needed experts: 3 cannot be installed
    assert r.misses == [] and r.dropped == 1 and not r.read_through
    assert c.slot_expert.tolist() == [1, 2] and c.prio.tolist() == [2, 2]


def test_insert_cap_keeps_the_smallest_ids():
    c = LayerCache(8, 4, Policy.LRU, max_inserts=2)
    r = c.step([6, 2, 4])
    assert r.misses == [(2, 0), (4, 1)] and r.dropped == 1
    assert c.table[6] == -1


def test_read_through_gate_changes_only_step():
    c = LayerCache(16, 4, Policy.LRU, max_distinct=2)
    c.step([1, 2])
    before = state(c)
    r = c.step([3, 4, 5])
    assert r.read_through and r.misses == [] and r.distinct == 3
    t, se, p, step = state(c)
    assert (t, se, p) == before[:3] and step == before[3] + 1


def test_padding_and_out_of_range_ids_are_ignored():
    c = LayerCache(4, 2, Policy.LRU)
    r = c.step([-1, 2, 4, 99, -7, 2])
    assert r.misses == [(2, 0)] and r.distinct == 1


def test_lfu_refresh_increments_install_sets_one():
    c = LayerCache(8, 2, Policy.LFU)
    c.step([1])
    c.step([1])
    c.step([1])
    assert c.prio.tolist() == [3, 0]
    r = c.step([2, 3])  # 2 -> the empty slot1 first, then 3 evicts expert 1 from slot0
    assert r.misses == [(2, 1), (3, 0)]
    assert c.prio.tolist() == [1, 1] and c.table[1] == -1


def test_lfu_decay_halves_after_refresh_before_install():
    c = LayerCache(8, 3, Policy.LFU, decay=2)
    c.step([0])  # step1: slot0 prio 1
    r = c.step([0, 1])  # step2: refresh 0 -> 2, decay -> 1, then install 1 with prio 1
    assert r.misses == [(1, 1)]
    assert c.prio.tolist() == [1, 1, 0]
    c.step([0])  # step3: 0 -> 2, no decay
    c.step([0])  # step4: 0 -> 3, decay -> 1; slot1 1 -> 0
    assert c.prio.tolist() == [1, 0, 0]


def test_empty_slots_before_decayed_zero_priority():
    # LFU decay can bring an occupied slot to priority 0; an empty slot still goes first.
    c = LayerCache(8, 3, Policy.LFU, decay=1)
    c.step([0])  # decay at step 1 (nothing yet), install 0 in slot0 with prio 1
    r = c.step([1])  # decay: slot0 -> 0; victim must be empty slot1, not slot0
    assert r.misses == [(1, 1)]
    assert c.table[0] == 0


def test_lru_victims_ranked_by_priority_then_slot():
    c = LayerCache(10, 4, Policy.LRU)
    c.step([0, 1, 2, 3])  # prio 1 everywhere
    c.step([2])  # slot2 -> 2
    c.step([0])  # slot0 -> 3
    r = c.step([8, 9])  # ranks: slot1 (1), slot3 (1), slot2 (2), slot0 (3)
    assert r.misses == [(8, 1), (9, 3)]


def test_belady_evicts_furthest_next_use():
    seq = np.array([[0], [1], [2], [0], [1], [2]])
    c = LayerCache(4, 2, Policy.OPT, future=seq)
    assert c.step(seq[0]).misses == [(0, 0)]
    assert c.step(seq[1]).misses == [(1, 1)]
    # at t=2: 0 next used at t=3, 1 at t=4 -> evict 1 (slot1)
    assert c.step(seq[2]).misses == [(2, 1)]
    assert c.step(seq[3]).misses == []
    # at t=4: resident 0 (never again), 2 (t=5) -> evict 0
    assert c.step(seq[4]).misses == [(1, 0)]
    assert c.prio.tolist() == [NEVER, 5]


def test_belady_refuses_a_wrong_future():
    seq = np.array([[0], [1]])
    c = LayerCache(4, 1, Policy.OPT, future=seq)
    c.step([0])
    with pytest.raises(ValueError, match="not fed"):
        c.step([3])  # future[1] routes 1, not 3


def test_forward_shape_gate_skips_the_manager():
    c = LayerCache(16, 4, Policy.LRU)
    c.forward([1, 2])
    r = c.forward([1, 2, 3, 4, 1])  # 5 ids > 4 slots, though only 4 are distinct
    assert r.read_through and c.step_count == 1 and c.forwards == 2
    assert c.forward([1, 1, 1, 1]).misses == [] and c.step_count == 2


def test_remap_to_slot_space():
    c = LayerCache(8, 3)
    c.step([4, 7])
    assert c.remap(np.array([[7, 4], [-1, 4]])).tolist() == [[1, 0], [-1, 0]]


def test_rows_past_the_real_count_are_padding_and_remap_to_slot_zero():
    """A captured batch of 3 rows with 1 real token (vLLM's V1 count): the padded rows'
    ids are not requested (no install, not counted) and come back as slot 0."""
    c = LayerCache(8, 3)
    ids = np.array([[5, 6], [1, 2], [3, -1]])
    r = c.step(ids, real_rows=1)
    assert r.misses == [(5, 0), (6, 1)] and r.distinct == 2
    assert c.remap(ids, real_rows=1).tolist() == [[0, 1], [0, 0], [0, 0]]
    # all rows real (the count past the last row): the plain step; none real: nothing asked
    assert c.remap(ids, real_rows=9).tolist() == [[0, 1], [-1, -1], [-1, -1]]  # not resident
    assert c.step(ids, real_rows=0).distinct == 0
    assert c.remap(np.array([[6, -1]]), real_rows=1).tolist() == [[1, -1]]


def test_rows_the_runner_marks_are_padding_too():
    """vLLM's V2 runner marks each padded row; the same rule, with the two combined."""
    c = LayerCache(8, 4)
    ids = np.array([[5, 6], [1, 2], [3, 4]])
    r = c.step(ids, pad_rows=[False, True, False])  # 1 and 2 never asked for
    assert r.distinct == 4 and r.misses == [(3, 0), (4, 1), (5, 2), (6, 3)]
    assert c.remap(ids, pad_rows=[False, True, False])[1].tolist() == [0, 0]
    both = c.remap(ids, real_rows=2, pad_rows=[True, False, False])
    assert both[0].tolist() == [0, 0] and both[2].tolist() == [0, 0]


@pytest.mark.parametrize("bad", ["mru", "", "3"])
def test_unknown_policy_is_a_clear_error(bad):
    with pytest.raises(ValueError):
        Policy.parse(bad)


def test_wide_codes_are_pinned_to_the_engine_and_the_kernel():
    """`Wide.code` is written on each member, not the enum's order: the numba engine
    branches on these integers, and the kernel takes a wide step as a manager call whose
    ``max_inserts`` is `Wide.insert_cap` (the ABI has no wide-mode argument of its own)."""
    from pathlib import Path

    from expertcache_cli.device import binding
    from expertcache_cli.rules import engine
    from expertcache_cli.rules.policy import Wide

    assert {m: m.code for m in Wide} == {Wide.IN_PLACE: 0, Wide.STAGED: 1,
                                        Wide.STAGED_INSTALL: 2}
    assert (engine.WIDE_IN_PLACE, engine.WIDE_STAGED, engine.WIDE_STAGED_INSTALL) == (0, 1, 2)
    # the insert cap, once: staged installs nothing, staged-install keeps the cache's cap
    assert [m.insert_cap(5) for m in Wide] == [0, 0, 5]
    for m in Wide:  # every cap is an argument the kernel's manager takes
        binding.check_manage_config(64, 8, 0, 64, m.insert_cap(8))
    names = [name for name, _ in binding.MANAGE_ARGS]
    assert names[-1] == "max_inserts" and not any("wide" in n for n in names)
    cu = (Path(__file__).resolve().parents[1] / "kernels" / "expert_cache.cu").read_text()
    assert "max_inserts < 0" in cu and "min(n_missing, max_inserts)" in cu
    assert "EC_WIDE" not in cu
