"""The wide-step bench's own arithmetic (bench/wide_steps.py), without a server."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

wide_steps = pytest.importorskip("wide_steps", reason="the bench needs httpx")


def test_decode_rate_is_each_streams_own_window_summed():
    """Prefill (send -> first token) is left out; a stream of one token adds nothing."""
    results = [
        {"t0": 0.0, "times": [1.0, 1.5, 2.0, 2.5, 3.0]},  # 4 tokens after the first in 2 s
        {"t0": 0.0, "times": [2.0, 3.0, 4.0]},  # 2 in 2 s
        {"t0": 0.0, "times": [5.0]},
    ]
    assert wide_steps.decode_rate(results) == pytest.approx(2.0 + 1.0)


def test_prompts_are_fresh_words_of_the_given_length():
    rng = random.Random(0)
    a, b = wide_steps.prompt(rng, 512, 8192), wide_steps.prompt(rng, 512, 8192)
    assert len(a.split()) == 512 and a != b
    assert all(w.startswith("w") and 16 <= int(w[1:]) < 8192 for w in a.split())
