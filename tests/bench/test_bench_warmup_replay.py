"""bench/warmup_replay.py: the slots vLLM's warm-up would leave, replayed on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import warmup_replay  # noqa: E402

from expertcache_cli.rules.policy import Policy  # noqa: E402


def test_lfu_keeps_the_warm_ups_experts_and_lru_forgets_them():
    first_row = np.array([[0, 1, 2, 3, 8, 9]], np.int32)  # one layer; 3 tokens x top-2
    pre = warmup_replay.warmup_steps(first_row, [2, 2, 2], top_k=2, width=6)
    assert pre.shape == (3, 1, 6)
    assert pre[0, 0].tolist() == [0, 1, 2, 3, -1, -1]  # 2 tokens: 4 ids
    # two requests of a hot set of four experts, as many as the slots
    fit = np.array([[[4, 5]], [[6, 7]]] * 10, np.int32)
    requests = np.repeat([0, 1], 10)
    none = np.zeros((0, 1, 6), np.int32)
    rate = lambda pre, p: warmup_replay.timed_hit_rate(fit, requests, pre, [4], 16, p)  # noqa: E731
    assert rate(none, Policy.LFU) == 1.0  # the second (timed) request: every id a hit
    assert rate(pre, Policy.LFU) == 0.0  # four slots held at count 3: the hot set thrashes
    assert rate(pre, Policy.LRU) == rate(none, Policy.LRU) == 1.0


def test_the_command_prints_both_policies(tmp_path, capsys):
    raw = tmp_path / "raw.npz"
    fit = tmp_path / "fit.npz"
    plan = tmp_path / "plan.json"
    np.savez(raw, topk_ids=np.array([[[0, 1, 2, 3]]], np.int32))
    np.savez(fit, topk_ids=np.array([[[4, 5]], [[6, 7]]] * 4, np.int32),
             requests=np.repeat([0, 1], 4), top_k=2, num_experts=8)
    plan.write_text('{"recommended": {"slots": 4, "per_layer_slots": null}}')
    assert warmup_replay.main([str(raw), str(fit), str(plan), "--sizes", "2", "--repeat",
                               "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["lfu: timed requests' hits from empty slots 100.0%, after 3 warm-up "
                   "steps 0.0%",
                   "lru: timed requests' hits from empty slots 100.0%, after 3 warm-up "
                   "steps 100.0%"]
