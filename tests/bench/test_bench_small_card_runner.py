"""The small-card device runner (bench/run_small_card_on_device.sh) with every GPU step
stubbed (the ballast, nvidia-smi, the servers): the 24 GiB card's arms with the flags
`size` planned, and `mem24`'s three profile-run servers (in place, staged, staged without
the first-call check) with the memory hook, their lines collected. Device minutes are few;
a runner bug must not be found on the device."""

from __future__ import annotations

import os
import time

import pytest
from bench_runner_harness import make_runner

STUB = r'''#!/usr/bin/env python3
"""python3 for the runner: GPU steps recorded and faked; inline scripts run for real."""
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
env = ",".join(k + "=" + os.environ[k] for k in ("EC_BENCH_MEM", "EC_BENCH_NO_CHECK")
               if k in os.environ)
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(" ".join(args) + ("  ENV=" + env if env else "") + "\n")
if args[0] in ("-", "-c") or args[0].endswith("groups.py") or args[1:2] == ["--greedy-report"]:
    os.execv(os.environ["REAL_PY"], [os.environ["REAL_PY"], *args])
if args[0].endswith("ballast.py"):
    print(json.dumps({"verb": args[1]}))
elif args[0].endswith("small_card.py"):
    name, out = args[1], Path(args[args.index("--out") + 1])
    status = "failed" if name == os.environ.get("STUB_FAIL") else "ok"
    rec = {"arm": name, "status": status, "greedy": ["a", "b"]}
    if "--warm-only" in args:  # as small_card.py writes a warm-up: no tokens
        rec = {"arm": name, "status": status, "warm_only": True}
    (out / f"{name}.json").write_text(json.dumps(rec))
    (out / f"{name}.log").write_text("log\n")
elif args[1:3] == ["expertcache_cli", "size"]:
    print(json.dumps({"safe_max_num_seqs": 8}) if "--json" in args else "size text")
elif args[1:3] == ["expertcache_cli", "serve"] and "--dry-run" in args:
    print("serve: dry run")
elif args[1:3] == ["expertcache_cli", "serve"]:  # mem24: the lines the runner waits for
    wide = "staged" if "--wide" in args else "in place"
    print(f"(EngineCore) WARNING [x] EC_BENCH_MEM layer 0 call 0: {wide}")
    print("(EngineCore) INFO [x] Actual usage is 20.0 GiB for weight")
    print("(EngineCore) INFO [x] Available KV cache memory: 0.44 GiB")
    sys.stdout.flush()
    __import__("time").sleep(60)  # a server runs until the runner ends its process group
'''


@pytest.fixture()
def runner(tmp_path):
    binp = tmp_path / "bin"
    binp.mkdir()
    smi = binp / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'memory.used, memory.free, memory.total'\n")
    smi.chmod(0o755)
    run = make_runner(tmp_path, "run_small_card_on_device.sh",
                      ("small_card.py", "trace_routing.py"), STUB,
                      keep_bench_helpers=True, SC=str(tmp_path / "sc"),
                      MODEL_DIR=str(tmp_path / "models"),
                      PATH=f"{binp}{os.pathsep}{os.environ['PATH']}")
    return run, tmp_path


def test_card24_runs_the_floor_and_the_cache_with_what_size_planned(runner):
    run, tmp = runner
    calls, _ = run(STEPS="setup card24")
    servers = [c for c in calls if c.startswith("bench/small_card.py")
               and "--greedy-report" not in c]
    assert [c.split()[1] for c in servers] == ["warm24", "floor24", "cache24"]
    assert all("--max-num-seqs 8" in c and "--vram 24" in c for c in servers)
    assert "EXPERT_CACHE_DISABLE=1" in servers[1] and "--streams 5" in servers[2]
    # the warm-up: the floor's very command and environment, right before it
    assert servers[0].replace(" warm24 ", " ").replace(" --warm-only", "") == \
        servers[1].replace(" floor24 ", " ").replace(" --runs 5", "")
    ballast = [c for c in calls if c.startswith("bench/ballast.py")]
    assert ballast[0].startswith("bench/ballast.py stop") and "start --leave 24" in ballast[1]
    assert ballast[-1] == "bench/ballast.py stop"  # the card is given back
    assert (tmp / "out" / "size24.json").exists() and (tmp / "sc" / "size24.json").exists()


def test_mem24_starts_four_servers_with_the_memory_hook_and_keeps_their_lines(runner):
    run, tmp = runner
    t0 = time.monotonic()
    calls, stdout = run(STEPS="setup mem24", MEM24="inplace staged nocheck inplace2")
    # each stub server sleeps 60 s after its memory lines: the runner ended each one's
    # process group, recorded while it ran, and dropped the record
    assert time.monotonic() - t0 < 60
    assert len([c for c in calls if c.startswith("bench/groups.py record")]) == 4
    assert len([c for c in calls if c.startswith("bench/groups.py forget")]) == 4
    assert not list((tmp / "groups").glob("*.json"))
    serves = [c for c in calls if c.startswith("-m expertcache_cli serve")]
    assert len(serves) == 4  # in place again last: vLLM's compile cache warm by then
    assert serves[3] == serves[0]
    assert "--wide" not in serves[0] and serves[0].endswith("ENV=EC_BENCH_MEM=1")
    assert "--wide staged-install" in serves[1] and serves[1].endswith("ENV=EC_BENCH_MEM=1")
    assert serves[2].endswith("ENV=EC_BENCH_MEM=1,EC_BENCH_NO_CHECK=1")
    assert all("--max-model-len 4096" in c for c in serves)
    text = (tmp / "out" / "mem24.txt").read_text()
    assert text.count("Available KV cache memory: 0.44 GiB") == 4
    assert "EC_BENCH_MEM layer 0 call 0: staged" in text
    for name in ("inplace", "staged", "nocheck", "inplace2"):
        assert (tmp / "out" / f"mem24{name}.log").exists()


def test_mem24_by_default_serves_in_place_twice_around_staged(runner):
    """The check's cost is measured (bench/results/memory.md): by default no nocheck
    server; in place last again, with vLLM's compile cache warm; an unknown name is said
    and skipped."""
    run, tmp = runner
    calls, stdout = run(STEPS="setup mem24")
    serves = [c for c in calls if c.startswith("-m expertcache_cli serve")]
    assert len(serves) == 3 and serves[0] == serves[2] and "--wide staged-install" in serves[1]
    _, said = run(STEPS="setup mem24", MEM24="inplace bogus")
    assert "mem24: no server bogus" in said


def _servers(calls: list[str]) -> list[str]:
    return [c.split()[1] for c in calls if c.startswith("bench/small_card.py")
            and "--greedy-report" not in c]


def test_the_warm_ups_run_once_and_only_while_a_compared_arm_is_owed(runner):
    """acct and card24 start the floor's command once before their pair; a warm-up whose
    record says ok is not run again, none runs where the pair is done, card24b reuses
    card24's (the same command), and the greedy report passes over them."""
    run, tmp = runner
    calls, _ = run(STEPS="setup acct card24", STUB_FAIL="cache24")
    assert _servers(calls) == ["acct_warm", "acct_cache", "acct_off", "warm24", "floor24",
                               "cache24"]
    warm = next(c for c in calls if c.startswith("bench/small_card.py acct_warm "))
    off = next(c for c in calls if c.startswith("bench/small_card.py acct_off "))
    assert warm.replace(" acct_warm ", " ").replace(" --warm-only", "") == \
        off.replace(" acct_off ", " ").replace(" --runs 1 --max-tokens 32", "")
    again, _ = run(STEPS="setup acct card24 card24b")
    assert _servers(again) == ["cache24", "floor24b", "cache24q"]  # warm24 done before
    (tmp / "sc" / "warm24.json").unlink()
    (tmp / "sc" / "acct_warm.json").unlink()
    assert _servers(run(STEPS="setup acct card24 card24b")[0]) == []
    # card24b alone, on a box where card24 never ran: its own warm-up first
    for name in ("floor24b", "cache24q"):
        (tmp / "sc" / f"{name}.json").unlink()
    assert _servers(run(STEPS="setup card24b")[0]) == ["warm24", "floor24b", "cache24q"]
    greedy = (tmp / "out" / "greedy.txt").read_text()
    assert "warm" not in greedy and "cache24 vs floor24: identical" in greedy
