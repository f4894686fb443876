"""Every bad input is one line on stderr, exit code 2, no traceback, no file left behind.

The table of bench/RESULTS.md (section faults) is this list, run as a user would.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

BAD = [
    (["size", "--vram", "nan"], "--vram must be a finite number"),
    (["size", "--vram", "inf"], "--vram must be a finite number"),
    (["size", "--vram", "abc"], "--vram 'abc': neither GiB nor a known card"),
    (["size", "--overhead-gb", "-1"], "--overhead-gb must be >= 0"),
    (["size", "--kv-tokens", "0"], "--kv-tokens must be positive"),
    (["size", "--max-model-len", "0"], "--max-model-len must be positive"),
    (["size", "--max-num-seqs", "-3"], "--max-num-seqs must be positive"),
    (["size", "--fraction", "1"], "--fraction: 1 is not a fraction"),
    (["size", "--bogus"], "unknown option or argument '--bogus'"),
    (["size", "--vram", "24", "--", "--max-num-seqs", "x"], "--max-num-seqs 'x'"),
    (["replay", "--decay", "8", "--policy", "lru"], "--decay 8 applies to lfu only"),
    (["replay", "--slots", "x"], "--slots wants comma-separated integers"),
    (["serve", "qwen3-30b-a3b-w8a8", "--vram", "24"], "is a sizing preset"),
    (["serve", "Qwen/Qwen3-30B-A3B", "--vram", "nan"], "--vram must be a finite number"),
    (["serve", "Qwen/Qwen3-30B-A3B", "--vram", "24", "--dryrun"], "unknown option"),
    (["baseline", "m", "--vram", "inf"], "--vram must be a finite number"),
    (["baseline", "m", "--arms", "offload", "--cpu-offload-gb", "nan"],
     "--cpu-offload-gb must be a finite number"),
    (["baseline", "m", "--arms", "resident", "--port", "70000"], "--port must be 0"),
    (["baseline", "m", "--arms", "resident", "--start-timeout", "-1"],
     "--start-timeout must be positive"),
    (["baseline", "m", "--arms", "resident", "--server-cmd", "nosuchprog {model}"],
     "'nosuchprog' is not a program"),
    (["probe-link", "--only", "copies"], "unknown measurement(s) copies; known: pinned"),
    (["probe-link", "--only", ","], "--only takes measurement names"),
    (["nosuch"], "No such command"),
]


@pytest.mark.parametrize("args, words", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, words):
    r = subprocess.run([sys.executable, "-m", "expertcache_cli", *args], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, (r.returncode, r.stderr[-500:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("expertcache: error: "), r.stderr
    assert words in lines[0] and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []  # no results file, no partial output


def test_version():
    r = subprocess.run([sys.executable, "-m", "expertcache_cli", "--version"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("expertcache ")


def test_probe_link_lists_its_measurements_without_a_gpu():
    r = subprocess.run([sys.executable, "-m", "expertcache_cli", "probe-link", "--list"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    keys = [line.split()[0] for line in r.stdout.splitlines()]
    assert keys == ["pinned", "pageable", "zero-copy", "hbm", "latency", "gather", "step"]
