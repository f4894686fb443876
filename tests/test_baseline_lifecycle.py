"""Server lifecycle of `baseline` against a small stand-in server process (no vLLM needed):
crash at start, never healthy, death in the middle of a run, process-group cleanup
(including a child that ignores polite signals), and an interrupt followed by --resume.
Each test waits on what it needs to have happened (a file, a record, a process gone), with
deadlines that a busy machine stays far within, never on a time window.

The stand-in speaks the three endpoints baseline uses (/health, /v1/models, streaming
/v1/completions). The same flows against a real vLLM server are in test_baseline_vllm.py;
these run everywhere in seconds and pin the failure handling exactly.
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
from terminal import sigint_default

from expertcache_cli.baseline import store
from expertcache_cli.baseline.arms import parse_arms
from expertcache_cli.baseline.runner import BaselineConfig, load_summary, run_baseline
from expertcache_cli.errors import UserError

STUB = r"""
import json, os, signal, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

arm, port, pidfile, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
with open(modes) as fh:
    mode = json.load(fh).get(arm, "ok")
delay = float(os.environ.get("STUB_TOKEN_DELAY", "0.001"))
# A child in the server's process group, like vLLM's engine core; it ignores SIGINT and
# SIGTERM, so only a SIGKILL to the whole group ends it.
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
with open(pidfile, "a") as fh:
    fh.write(f"{os.getpid()} {child.pid}\n")
print(f"stub {mode} starting on {port}", flush=True)
if mode == "crash":
    print("stub: RuntimeError: cannot load the model", flush=True)
    sys.exit(3)
if mode == "hang":
    time.sleep(600)
posts = 0

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.path == "/health":
            body = b""
        elif self.path == "/v1/models":
            body = json.dumps({"data": [{"id": "stub-model"}]}).encode()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        global posts
        posts += 1
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        assert req["stream"] and req["ignore_eos"] and req["temperature"] == 0, req
        if os.environ.get("STUB_PROMPTS"):
            with open(os.environ["STUB_PROMPTS"], "a") as fh:
                fh.write(f"{arm} {req['prompt']}\n")
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        n = req["max_tokens"]
        for i in range(n):
            if mode == "die" and posts == 2 and i == 3:
                print("stub: segfault in the middle of a run", flush=True)
                os._exit(7)
            if mode == "hold" and posts == 3 and i == 3:
                # the second measured run (after the warm-up and the first): say so, then
                # hold it open (up to 120 s) so that a signal surely lands inside it
                open(modes + ".held", "w").close()
                for _ in range(1200):
                    time.sleep(0.1)
            ev = {"choices": [{"index": 0, "text": "x",
                               "finish_reason": "length" if i == n - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
            self.wfile.flush()
            time.sleep(delay)
        print("INFO [session.py:89] expertcache: live hit rate 80.00% since last report, "
              f"90.00% overall (requests={posts * 10} installs={posts} read-through steps=0 "
              "over 2 layers)", flush=True)
        ev = {"choices": [], "usage": {"completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(ev)}\n\ndata: [DONE]\n\n".encode())

ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _pids(pidfile: Path) -> list[int]:
    if not pidfile.exists():
        return []
    return [int(p) for line in pidfile.read_text().split("\n") for p in line.split()]


def _wait_dead(pids: list[int], timeout: float = 30.0) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        live = [p for p in pids if _alive(p)]
        if not live:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.fixture
def stub(tmp_path):
    path = tmp_path / "stub_server.py"
    path.write_text(STUB)
    pidfile = tmp_path / "pids.txt"
    yield path, pidfile
    for pid in _pids(pidfile):  # never leave a stray process behind, even on failure
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _template(stub_path: Path, pidfile: Path, mode_by_arm: dict[str, str]) -> str:
    """A --server-cmd whose behaviour depends on the arm ({arm} is filled in by baseline)."""
    modes = pidfile.parent / "modes.json"
    modes.write_text(json.dumps(mode_by_arm))
    return f"{sys.executable} {stub_path} {{arm}} {{port}} {pidfile} {modes}"


def _cfg(tmp_path, stub_path, pidfile, modes, **kw) -> BaselineConfig:
    base = dict(
        model="stub-model",
        arms=parse_arms(kw.pop("arms", "resident,offload")),
        out=tmp_path / "results.jsonl",
        restarts=2,
        runs=2,
        max_tokens=16,
        cpu_offload_gb=1,
        server_cmd=_template(stub_path, pidfile, modes),
        start_timeout_s=20,
        request_timeout_s=20,
        stop_grace_s=0.5,
    )
    base.update(kw)
    return BaselineConfig(**base)


def test_full_flow_and_process_groups(tmp_path, stub):
    stub_path, pidfile = stub
    cfg = _cfg(tmp_path, stub_path, pidfile, {}, arms="resident,offload,cache:4", stats_every=5)
    run_baseline(cfg)
    meta, recs = store.load(cfg.out)
    assert meta["arms"] == ["resident", "offload", "cache:4"]
    runs = [r for r in recs if r["kind"] == "run"]
    assert len(runs) == 3 * 2 * 2
    assert len([r for r in recs if r["kind"] == "warmup"]) == 3 * 2
    order = [(r["restart"], r["arm"]) for r in recs if r["kind"] == "server"]
    assert order == [
        (0, "resident"),
        (0, "offload"),
        (0, "cache:4"),
        (1, "offload"),
        (1, "cache:4"),
        (1, "resident"),
    ]
    for r in runs:
        assert r["tokens"] == 16 and r["tok_s"] > 0 and r["ttft_s"] >= 0
        assert r["counters"]["hit_rate"] == pytest.approx(0.9)
        assert r["counters"]["requests"] == 10 * (r["run"] + 2)  # warm-up was request 1
        assert r["server_start_s"] > 0
    finals = [r for r in recs if r["kind"] == "counters"]
    assert len(finals) == 6 and all(r["counters"]["requests"] == 30 for r in finals)
    servers = [r for r in recs if r["kind"] == "server"]
    assert servers[0]["env"]["EXPERT_CACHE_DISABLE"] == "1"
    cache_srv = next(s for s in servers if s["arm"] == "cache:4")
    assert cache_srv["env"] == {"EXPERT_CACHE_SLOTS": "4", "EXPERT_CACHE_POLICY": "lru",
                                "EXPERT_CACHE_STATS": "5"}
    assert "--cpu-offload-params" in cache_srv["argv"]
    assert "--cpu-offload-params" not in servers[0]["argv"]
    for srv in servers:  # cache servers drain on stop (final counters kept); others stock
        assert ("--shutdown-timeout" in srv["argv"]) == (srv["arm"] == "cache:4")
    # six servers, each with a child that ignored SIGINT/SIGTERM: all gone
    pids = _pids(pidfile)
    assert len(pids) == 12
    assert _wait_dead(pids) == []
    summary, _ = load_summary(cfg.out)
    assert {a.arm for a in summary.arms if a.restarts == 2} == {"resident", "offload", "cache:4"}


def test_crash_never_healthy_and_death_mid_run_are_recorded(tmp_path, stub):
    stub_path, pidfile = stub
    modes = {"offload": "crash", "cache:4": "hang", "cache:8": "die"}
    cfg = _cfg(
        tmp_path,
        stub_path,
        pidfile,
        modes,
        arms="resident,offload,cache:4,cache:8",
        restarts=1,
        start_timeout_s=4,
    )
    run_baseline(cfg)
    _, recs = store.load(cfg.out)
    failed = {r["arm"]: r for r in recs if r["kind"] == "server" and r["status"] == "failed"}
    assert set(failed) == {"offload", "cache:4", "cache:8"}
    assert failed["offload"]["phase"] == "health"
    assert "exited with code 3" in failed["offload"]["reason"]
    assert "cannot load the model" in failed["offload"]["log_tail"]
    assert failed["cache:4"]["phase"] == "health"
    assert "not healthy within 4 s" in failed["cache:4"]["reason"]
    assert failed["cache:8"]["phase"] == "run"
    assert "exited with code 7" in failed["cache:8"]["reason"]
    assert "segfault in the middle" in failed["cache:8"]["log_tail"]
    # the arm after each failure still ran: resident is complete
    assert len([r for r in recs if r["kind"] == "run" and r["arm"] == "resident"]) == 2
    assert _wait_dead(_pids(pidfile)) == []
    summary, _ = load_summary(cfg.out)
    assert len(summary.failures) == 3
    assert any("3 server(s) failed" in w for w in summary.warnings)


def test_server_command_that_does_not_exist(tmp_path):
    """A typo in --server-cmd is one line before anything is written (no results file
    that would then block the corrected rerun)."""
    cfg = BaselineConfig(
        model="m",
        arms=parse_arms("resident"),
        out=tmp_path / "r.jsonl",
        restarts=1,
        runs=1,
        server_cmd="/nonexistent/vllm serve {model}",
    )
    with pytest.raises(UserError, match="'/nonexistent/vllm' is not a program"):
        run_baseline(cfg)
    assert not cfg.out.exists()


def test_every_server_failing_is_an_error_with_the_first_cause(tmp_path):
    """All servers died: exit nonzero, and the cause from the server's own log in the
    message, not only in per-server logs."""
    from expertcache_cli.baseline.runner import NoRunSucceeded

    dies = ("{python} -c \"import sys; print('ModuleNotFoundError: No module named vllm'); "
            "sys.exit(1)\"")
    cfg = BaselineConfig(model="m", arms=parse_arms("resident,offload"), out=tmp_path / "r.jsonl",
                         restarts=1, runs=1, server_cmd=dies, cpu_offload_gb=1.0,
                         start_timeout_s=30)
    with pytest.raises(NoRunSucceeded) as info:
        run_baseline(cfg)
    msg = str(info.value)
    assert info.value.exit_code == 1 and "all 2 server(s) failed" in msg
    assert "No module named vllm" in msg and "(log: " in msg
    _, recs = store.load(cfg.out)
    assert [r["status"] for r in recs if r["kind"] == "server"] == ["failed", "failed"]


@pytest.mark.parametrize("field, value, words", [
    ("cpu_offload_gb", float("nan"), "--cpu-offload-gb must be a finite number"),
    ("port", 70000, "--port must be 0"),
    ("start_timeout_s", -1.0, "--start-timeout must be positive"),
    ("request_timeout_s", 0.0, "--request-timeout must be positive"),
    ("stop_grace_s", -2.0, "--stop-grace must be >= 0"),
    ("restarts", 0, "--restarts"),
])
def test_bad_options_are_refused_before_anything_is_written(tmp_path, field, value, words):
    cfg = BaselineConfig(model="m", arms=parse_arms("offload"), out=tmp_path / "r.jsonl",
                         cpu_offload_gb=1.0, server_cmd="{python} -c pass")
    setattr(cfg, field, value)
    with pytest.raises(UserError, match=words):
        run_baseline(cfg)
    assert not cfg.out.exists()


def _cli_args(cfg: BaselineConfig) -> list[str]:
    return [
        sys.executable,
        "-m",
        "expertcache_cli",
        "baseline",
        cfg.model,
        "--arms",
        ",".join(a.name for a in cfg.arms),
        "--restarts",
        str(cfg.restarts),
        "--runs",
        str(cfg.runs),
        "--max-tokens",
        str(cfg.max_tokens),
        "--cpu-offload-gb",
        "1",
        "--out",
        str(cfg.out),
        "--server-cmd",
        cfg.server_cmd or "",
        "--stop-grace",
        "0.5",
        "--start-timeout",
        "120",
    ]


def _signal_and_wait(proc: subprocess.Popen, sig: int, ready=lambda: None) -> str:
    """Wait for ``ready()``, send ``sig`` to the CLI, return its stderr; never leak it."""
    try:
        ready()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return err


def test_interrupt_mid_run_then_resume(tmp_path, stub):
    stub_path, pidfile = stub
    # the offload server holds its second measured run open once it has begun
    cfg = _cfg(tmp_path, stub_path, pidfile, {"offload": "hold"}, max_tokens=100)
    held = tmp_path / "modes.json.held"
    # tokens 10 ms apart, a 1 s decode a run: a client starved for a moment on a busy
    # machine still sees a steady stream, so that no run is taken for a burst and left out
    # of the summary counted below
    paced = {**os.environ, "STUB_TOKEN_DELAY": "0.01"}
    proc = subprocess.Popen(
        _cli_args(cfg), env=paced, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=sigint_default,
    )

    def in_second_offload_run() -> None:
        end = time.monotonic() + 300
        while not held.exists():
            assert proc.poll() is None, "baseline exited before the offload server's 2nd run"
            assert time.monotonic() < end, "the offload server's 2nd run never began"
            time.sleep(0.05)

    # interrupt while the second block ("offload", restart 0) is in its second run
    err = _signal_and_wait(proc, signal.SIGINT, in_second_offload_run)
    assert proc.returncode == 130, err
    assert "interrupted: the server was stopped" in err and "Traceback" not in err
    assert _wait_dead(_pids(pidfile)) == []  # the interrupted server's group is gone
    _, recs = store.load(cfg.out)
    runs = [r for r in recs if r["kind"] == "run"]
    assert [(r["arm"], r["run"]) for r in runs] == [
        ("resident", 0),
        ("resident", 1),
        ("offload", 0),
    ]
    partial_sid = runs[-1]["server_id"]

    (tmp_path / "modes.json").write_text("{}")  # the resumed servers serve every run
    p = subprocess.run(
        _cli_args(cfg) + ["--resume", "--json"], env=paced, capture_output=True, text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "resuming: 1 block(s) already done, 3 to run" in p.stderr
    _, recs = store.load(cfg.out)
    kept = [r for r in recs if r["kind"] == "run" and r["server_id"] != partial_sid]
    assert sorted((r["restart"], r["arm"], r["run"]) for r in kept) == sorted(
        (rs, arm, i) for rs in (0, 1) for arm in ("resident", "offload") for i in (0, 1)
    )
    assert [r["kind"] for r in recs].count("resume") == 1
    summary = json.loads(p.stdout)
    assert summary["superseded_runs"] == 1
    by = {a["arm"]: a for a in summary["arms"]}
    assert by["offload"]["runs"] == 4 and by["resident"]["runs"] == 4
    assert _wait_dead(_pids(pidfile)) == []

    again = subprocess.run(
        _cli_args(cfg) + ["--resume"], env=paced, capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0 and "0 to run" in again.stderr


def test_sigterm_while_a_server_starts_stops_its_group(tmp_path, stub):
    stub_path, pidfile = stub
    cfg = _cfg(tmp_path, stub_path, pidfile, {"resident": "hang"}, arms="resident")
    proc = subprocess.Popen(
        _cli_args(cfg), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )

    def server_up() -> None:
        end = time.monotonic() + 120
        while len(_pids(pidfile)) < 2 and time.monotonic() < end:
            time.sleep(0.05)

    err = _signal_and_wait(proc, signal.SIGTERM, server_up)
    assert proc.returncode == 130, err
    assert "--resume" in err
    assert len(_pids(pidfile)) == 2 and _wait_dead(_pids(pidfile)) == []
    _, recs = store.load(cfg.out)
    assert recs == []  # an interrupt is not a server failure: nothing to resume past


LEADER = r"""
import signal, subprocess, sys, time
# like vLLM's API server: on SIGINT it stops its engine child with one SIGTERM and waits
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
try:
    time.sleep(600)
except KeyboardInterrupt:
    child.terminate()
    child.wait(20)
"""

ENGINE = r"""
import signal, sys, time
log = open(sys.argv[1], "a", buffering=1)
got = []
def on_signal(signum, frame):
    got.append(signal.Signals(signum).name)
    log.write(f"signal {got[-1]}\n")
signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
log.write("ready\n")
while not got:
    time.sleep(0.01)
# like vLLM's engine: default handlers back, then a slow shutdown that a second signal kills
signal.signal(signal.SIGINT, signal.SIG_DFL)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
time.sleep(0.5)
log.write("final counters\n")
"""


def test_stop_lets_the_leader_stop_its_engine_so_its_shutdown_completes(tmp_path):
    # Signalling the whole group gave vLLM's engine two signals; the second, landing after
    # it restored the default handlers, killed it before the plugin's final counters line.
    from expertcache_cli.baseline.server import Server

    log = tmp_path / "engine.log"
    srv = Server(
        argv=[sys.executable, "-c", LEADER, ENGINE, str(log)],
        env=dict(os.environ), log_path=tmp_path / "server.log", host="127.0.0.1", port=0,
    )
    srv.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (log.exists() and log.read_text()):
        time.sleep(0.05)  # until the engine has its handlers installed
    srv.stop(grace_s=20)
    assert log.read_text().splitlines() == ["ready", "signal SIGTERM", "final counters"]


def test_the_failure_cause_is_the_root_not_vllms_wrapper():
    from expertcache_cli.baseline.runner import failure_cause

    kv = ("(EngineCore pid=6020) ERROR 12-01 05:26:56 [core.py:1330] ValueError: To serve at "
          "least one request with the model's max seq len (8192), (0.75 GiB KV cache is needed")
    wrapper = ("(APIServer pid=5938) RuntimeError: Engine core initialization failed. See root "
               "cause above. Failed core proc(s): {}")
    plugin = ("(EngineCore pid=6020) ERROR 12-01 05:26:56 [__init__.py:308] expertcache: after "
              "the slots, vLLM's KV cache (0.44 GiB) cannot hold one --max-model-len 8192 "
              "sequence (0.75 GiB), so vLLM will refuse to start; serve with 2 fewer slots")
    assert failure_cause("\n".join([kv, wrapper])).startswith(
        "ValueError: To serve at least one request")
    assert failure_cause("\n".join([plugin, kv, wrapper])).startswith(
        "expertcache: after the slots, vLLM's KV cache (0.44 GiB)")
    stock = ("ERROR [runtime.py:420] expertcache: model.layers.3.mlp.experts: the slots "
             "path's output differs from the stock path's; layer back on the stock path")
    assert failure_cause("\n".join([stock, kv, wrapper])).startswith("ValueError: To serve")
    assert failure_cause("expertcache: error: VLLM_USE_V2_MODEL_RUNNER=1 in your environment"
                         ) == "expertcache: error: VLLM_USE_V2_MODEL_RUNNER=1 in your environment"
    assert failure_cause("ModuleNotFoundError: No module named vllm\n") == (
        "ModuleNotFoundError: No module named vllm")
    assert failure_cause("warning: something\nfatal error in the thing\n") == (
        "fatal error in the thing")
    assert failure_cause("all fine\n") == ""


@pytest.mark.parametrize("concurrency,want", [
    (1, ["p0", "p1", "p2"]),  # the warm-up, then each run the next prompt
    (2, ["p0", "p1", "p2", "p0", "p1", "p2"]),  # a run's streams the ones after
])
def test_several_prompts_are_taken_in_turn_in_every_server(tmp_path, stub, monkeypatch,
                                                           concurrency, want):
    stub_path, pidfile = stub
    log = tmp_path / "prompts.txt"
    monkeypatch.setenv("STUB_PROMPTS", str(log))
    cfg = _cfg(tmp_path, stub_path, pidfile, {}, restarts=1, runs=2,
               concurrency=concurrency, prompt=["p0", "p1", "p2"])
    run_baseline(cfg)
    seen = [ln.split() for ln in log.read_text().splitlines()]
    for arm in ("resident", "offload"):  # the same order in both servers
        assert sorted(p for a, p in seen if a == arm) == sorted(want)
        # streams of one run arrive in either order: compare the runs as sets
        got = [p for a, p in seen if a == arm]
        runs = [sorted(got[i:i + concurrency]) for i in range(0, len(got), concurrency)]
        assert runs == [sorted(want[i:i + concurrency]) for i in range(0, len(want),
                                                                      concurrency)]
    meta, _ = store.load(cfg.out)
    assert meta["prompt"] == ["p0", "p1", "p2"]
    with pytest.raises(UserError, match="--prompt is empty"):
        _cfg(tmp_path, stub_path, pidfile, {}, prompt=["p0", ""]).validate()
