"""The protocol: restart rounds x rotated arms x (fresh server, warm-up, measured runs).

Everything measured is appended to the results file before the next thing happens, and
every server is stopped (with its whole process group) before the next one starts, even
on Ctrl-C. A server that fails is a result, recorded with its log tail; the experiment
goes on with the next arm.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import re
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import Interrupted, UserError
from ..vllm_facts import installed_vllm, vllm_runner
from . import store as _store
from .arms import Arm, round_order
from .client import RequestFailed, measure_run
from .counters import latest_counters, plugin_state
from .server import (
    Server,
    ServerFailed,
    build_command,
    default_template,
    free_port,
    server_env,
    tail,
)

DEFAULT_PROMPT = (
    "Explain, step by step and in plain words, how a mixture-of-experts language model "
    "decides which experts process each token, and why that matters for memory."
)


@dataclass
class BaselineConfig:
    """Everything that defines one baseline experiment (see ``expertcache baseline --help``)."""

    model: str
    arms: list[Arm]
    out: Path
    restarts: int = 3
    runs: int = 5
    max_tokens: int = 200
    concurrency: int = 1
    #: one prompt for every request, or several taken in turn (`prompts_of_run`)
    prompt: str | list[str] = DEFAULT_PROMPT
    resume: bool = False
    server_cmd: str | None = None
    vllm_args: list[str] = field(default_factory=list)
    cpu_offload_gb: float | None = None
    #: flags the offloaded arms need for the model's format to stay offloaded
    #: (`vllm_experts.offload_backend_args`: MXFP4's --moe-backend marlin)
    offload_args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 0
    start_timeout_s: float = 1800.0
    request_timeout_s: float = 600.0
    stop_grace_s: float = 30.0
    stats_every: int | None = None
    log_dir: Path | None = None
    retry_failed: bool = False

    def validate(self) -> None:
        """Every option checked before anything is started or written (one line each)."""
        for name, value in (("--start-timeout", self.start_timeout_s),
                            ("--request-timeout", self.request_timeout_s),
                            ("--stop-grace", self.stop_grace_s),
                            ("--cpu-offload-gb", self.cpu_offload_gb)):
            if value is not None and not math.isfinite(value):
                raise UserError(f"{name} must be a finite number, got {value}")
        if self.stop_grace_s < 0:
            raise UserError(f"--stop-grace must be >= 0 seconds, got {self.stop_grace_s:g}")
        if not 0 <= self.port <= 65535:
            raise UserError(f"--port must be 0 (a free port) or 1..65535, got {self.port}")
        if self.stats_every is not None and self.stats_every < 0:
            raise UserError(f"--stats must be >= 0 layer-steps, got {self.stats_every}")
        if self.restarts < 1:
            raise UserError("--restarts must be at least 1")
        if self.runs < 1:
            raise UserError("--runs must be at least 1")
        if self.max_tokens < 2:
            raise UserError("--max-tokens must be at least 2 (decode speed needs two tokens)")
        if self.concurrency < 1:
            raise UserError("--concurrency must be at least 1")
        if not self.prompt or any(not p for p in self.prompt_list()):
            raise UserError("--prompt is empty")
        if self.start_timeout_s <= 0:
            raise UserError(f"--start-timeout must be positive, got {self.start_timeout_s:g}")
        if self.request_timeout_s <= 0:
            raise UserError(f"--request-timeout must be positive, got {self.request_timeout_s:g}")
        if self.cpu_offload_gb is not None and self.cpu_offload_gb <= 0:
            raise UserError("--cpu-offload-gb must be positive: 0 would offload nothing")
        for arm in self.arms:
            arm.server_args(self.cpu_offload_gb)  # raises when an offload size is missing
        self.check_server_command()

    def check_server_command(self) -> None:
        """The servers can be started at all: the template parses and names a program that
        exists, and the default one (vLLM through this python) finds vLLM installed."""
        import importlib.util
        import shutil

        argv = build_command(self.server_cmd or default_template(), model=self.model,
                             host=self.host, port=self.port or 8000, arm="check",
                             arm_args=[], vllm_args=[])
        exe = argv[0]
        if shutil.which(exe) is None and not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise UserError(f"--server-cmd: {exe!r} is not a program on PATH")
        if (self.server_cmd is None and exe == sys.executable
                and importlib.util.find_spec("vllm") is None):
            raise UserError(
                f"vLLM is not installed in this python ({sys.executable}): install it "
                "(pip install 'expertcache[vllm]'), or give --server-cmd to start it elsewhere"
            )

    def meta(self) -> dict[str, Any]:
        from .. import __version__

        return {
            "kind": "meta",
            "format": _store.FORMAT_VERSION,
            "model": self.model,
            "arms": [a.name for a in self.arms],
            "restarts": self.restarts,
            "runs": self.runs,
            "max_tokens": self.max_tokens,
            "concurrency": self.concurrency,
            "prompt": self.prompt,
            "server_cmd": self.server_cmd or default_template(),
            "vllm_args": self.vllm_args,
            "cpu_offload_gb": self.cpu_offload_gb,
            "offload_args": self.offload_args,
            "stats_every": self.stats_every,
            "created_at": now_iso(),
            "expertcache": __version__,
        }

    def prompt_list(self) -> list[str]:
        return _prompt_list(self.prompt)

    def prompts_of_run(self, run: int) -> list[str]:
        """The prompts of a server's request ``run`` (-1: its warm-up), one a stream.

        Why several: a run that repeats the last one's prompt finds its prefix in vLLM's
        cache and, on a MoE model, the experts its routing left hot; users' requests
        differ. So the warm-up and the runs take the prompts in turn, and a run's streams
        the ones after its own, the same order in every server, so arms still compare.
        """
        ps = self.prompt_list()
        first = (run + 1) * self.concurrency
        return [ps[(first + i) % len(ps)] for i in range(self.concurrency)]

    @property
    def logs(self) -> Path:
        return self.log_dir or self.out.parent / f"{self.out.stem}-logs"


def _prompt_list(prompt: str | list[str]) -> list[str]:
    return [prompt] if isinstance(prompt, str) else list(prompt)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C, so a killed baseline still stops its server group."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM while a server is being stopped; they act right after.

    A second Ctrl-C in the middle of stopping would otherwise leave the server's process
    group running, which is exactly what stopping it by group is there to prevent.
    """
    sigs = {signal.SIGINT, signal.SIGTERM}
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    except (AttributeError, ValueError, OSError):  # not POSIX, or not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)


def plan_blocks(cfg: BaselineConfig, done: set[tuple[str, int]]) -> list[tuple[int, Arm]]:
    """The (restart, arm) blocks still to run, in the order they will run."""
    by_name = {a.name: a for a in cfg.arms}
    todo = []
    for r in range(cfg.restarts):
        for name in round_order([a.name for a in cfg.arms], r):
            if (name, r) not in done:
                todo.append((r, by_name[name]))
    return todo


def open_results(cfg: BaselineConfig) -> tuple[_store.ResultsStore, set[tuple[str, int]]]:
    """Start a new results file, or check and reopen one for --resume."""
    meta = cfg.meta()
    exists = cfg.out.exists() and cfg.out.stat().st_size > 0
    if exists and not cfg.resume:
        raise UserError(f"{cfg.out} exists: pass --resume to continue it, or choose another --out")
    st = _store.ResultsStore(cfg.out)
    if not exists:
        st.open()
        st.append(meta)
        return st, set()
    old, records = _store.load(cfg.out)
    if old is None:
        raise UserError(f"{cfg.out} has no meta record: not an expertcache baseline file")
    _store.check_resumable(old, meta)
    done = _store.completed_blocks(records, cfg.runs)
    if cfg.retry_failed:
        done = _store.completed_blocks(
            [r for r in records if not (r["kind"] == "server" and r.get("status") == "failed")],
            cfg.runs,
        )
    st.open()
    st.append(
        {
            "kind": "resume",
            "at": now_iso(),
            "restarts": cfg.restarts,
            "retry_failed": cfg.retry_failed,
        }
    )
    return st, done


def run_baseline(cfg: BaselineConfig, say: Callable[[str], None] = lambda s: None) -> Path:
    """Run (or continue) the experiment; returns the results path."""
    cfg.validate()
    template = cfg.server_cmd or default_template()
    offload_env = _offload_env(cfg, say)
    st, done = open_results(cfg)
    todo = plan_blocks(cfg, done)
    if cfg.resume:
        say(f"resuming: {len(done)} block(s) already done, {len(todo)} to run")
    try:
        with _sigterm_as_interrupt():
            for i, (restart, arm) in enumerate(todo):
                say(f"[{i + 1}/{len(todo)}] restart {restart}, arm {arm.name}")
                _run_block(cfg, template, st, restart, arm, say, offload_env)
    except KeyboardInterrupt:
        # the CLI prints this as its one line for the Ctrl-C (and exits 130)
        raise Interrupted(
            f"interrupted: the server was stopped and everything measured is in {cfg.out}; "
            "run the same command with --resume to continue"
        ) from None
    finally:
        st.close()
    _fail_when_nothing_ran(cfg.out)
    return cfg.out


def _offload_env(cfg: BaselineConfig, say: Callable[[str], None]) -> dict[str, str]:
    """What the offloading arms' servers need from the environment to offload at all (a
    vLLM whose V2 model runner ignores --cpu-offload-gb runs them on V1), decided once,
    before anything starts; a user who forced V2 on is refused here (`vllm_runner`)."""
    if not any(a.offloaded for a in cfg.arms):
        return {}
    if cfg.server_cmd and "{python}" not in cfg.server_cmd:
        return {}  # another program, maybe another vLLM: nothing here to read it by
    env, note = vllm_runner.offload_runner_env(
        os.environ, vllm_runner.v2_runner_offloads(),
        installed_vllm.release(), vllm_runner.v1_runner_present())
    if note:
        say(f"note: {note}")
    return env


class NoRunSucceeded(UserError):
    """Every server of the experiment failed: the cause is one line, the exit code 1."""

    exit_code = 1


#: vLLM's wrapper around the engine's own failure: true, and never the cause
_WRAPPERS = ("Engine core initialization failed", "Failed core proc")
_EXCEPTION = re.compile(r"\b[A-Z]\w*(?:Error|Exception): \S")


def failure_cause(log_tail: str) -> str:
    """The one line of a dead server's log that says why: our own fatal line (`serve`'s
    refusal, or the plugin's "vLLM will refuse to start", which names the fix), else the
    last exception line that is not vLLM's wrapper around the real one, else the last line
    that mentions an error. (The plugin's other errors, a layer back on the stock path,
    do not stop a server.)"""
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "expertcache: error:" in ln or ("expertcache:" in ln and "refuse to start" in ln):
            return ln[ln.index("expertcache:"):]
    for ln in reversed(lines):
        if (m := _EXCEPTION.search(ln)) and not any(w in ln for w in _WRAPPERS):
            return ln[m.start():]
    return next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), "")


def _fail_when_nothing_ran(path: Path) -> None:
    """No measured run in the results file: say why (the first failure), exit nonzero."""
    _, records = _store.load(path)
    if any(r.get("kind") == "run" for r in records):
        return
    failed = [r for r in records if r.get("kind") == "server" and r.get("status") == "failed"]
    if not failed:
        return
    first = failed[0]
    cause = failure_cause(first.get("log_tail") or "")
    raise NoRunSucceeded(
        f"no run succeeded: all {len(failed)} server(s) failed; the first ({first.get('arm')}, "
        f"{first.get('phase')}): {first.get('reason')}" + (f": {cause}" if cause else "")
        + f" (log: {first.get('log')})"
    )


def _run_block(
    cfg: BaselineConfig,
    template: str,
    st: _store.ResultsStore,
    restart: int,
    arm: Arm,
    say: Callable[[str], None],
    offload_env: dict[str, str] | None = None,
) -> None:
    port = cfg.port or free_port(cfg.host)
    argv = build_command(
        template,
        model=cfg.model,
        host=cfg.host,
        port=port,
        arm=arm.name,
        arm_args=arm.server_args(cfg.cpu_offload_gb, cfg.vllm_args, cfg.offload_args),
        vllm_args=cfg.vllm_args,
    )
    arm_env = {**arm.env(cfg.stats_every), **((offload_env or {}) if arm.offloaded else {})}
    env = server_env(arm_env)
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", arm.name).strip("-")  # plan:PATH too
    sid = uuid.uuid4().hex[:12]
    log_path = cfg.logs / f"r{restart}-{safe}-{sid}.log"
    server = Server(argv=argv, env=env, log_path=log_path, host=cfg.host, port=port, server_id=sid)
    started_at = now_iso()
    base = {"arm": arm.name, "restart": restart, "server_id": server.server_id}
    try:
        server.start()
        start_s = server.wait_healthy(cfg.start_timeout_s)
        say(f"  server healthy after {start_s:.1f} s (port {port}, log {server.log_path})")
        st.append(
            {
                **base,
                "kind": "server",
                "status": "healthy",
                "start_s": start_s,
                "started_at": started_at,
                "argv": argv,
                "log": str(server.log_path),
                "model_id": server.model_id,
                "port": port,
                "pid": server.proc.pid if server.proc else None,
                "env": {k: v for k, v in arm_env.items() if v is not None},
            }
        )
        common = {**base, "server_start_s": start_s, "server_started_at": started_at}
        for run in range(-1, cfg.runs):
            phase = "warmup" if run < 0 else "run"
            try:
                res = measure_run(
                    server.base_url,
                    server.model_id or cfg.model,
                    cfg.prompts_of_run(run),
                    cfg.max_tokens,
                    cfg.concurrency,
                    cfg.request_timeout_s,
                )
            except RequestFailed as exc:
                why = str(exc)
                server.wait_exit(2.0)  # a dying server closes its sockets just before it exits
                if not server.alive():
                    why = f"server {server.exit_reason()} ({why})"
                raise ServerFailed(phase, why) from None
            rec = {
                **common,
                "kind": "warmup" if run < 0 else "run",
                "run": run if run >= 0 else None,
                "tok_s": res.tok_s,
                "ttft_s": res.ttft_s,
                "tokens": res.tokens,
                "chunks": res.chunks,
                "decode_s": res.decode_s,
                "wall_s": res.wall_s,
                "concurrency": res.streams,
                "coalesced_share": res.coalesced_share,
                "e2e_tok_s": res.e2e_tok_s,
                "e2e_s": res.e2e_s,
                "bursty": res.bursty,
                "finished_at": now_iso(),
                "counters": latest_counters(server.log_path),
            }
            st.append(rec)
            label = "warm-up" if run < 0 else f"run {run + 1}/{cfg.runs}"
            if res.bursty:
                label += (
                    f" [bursty: all tokens came within {res.decode_s * 1000:.0f} ms after a "
                    f"{res.ttft_s:.2f} s wait]"
                )
            say(
                f"  {label}: {res.tok_s:.2f} tok/s, TTFT {res.ttft_s * 1000:.0f} ms, "
                f"{res.tokens} tokens"
            )
    except ServerFailed as exc:
        with _signals_deferred():
            server.stop(cfg.stop_grace_s)
        st.append(
            {
                **base,
                "kind": "server",
                "status": "failed",
                "phase": exc.phase,
                "reason": exc.reason,
                "started_at": started_at,
                "argv": argv,
                "log": str(server.log_path),
                "log_tail": tail(server.log_path),
                "pid": server.proc.pid if server.proc else None,
                "failed_at": now_iso(),
            }
        )
        say(f"  server failed ({exc.phase}): {exc.reason}; continuing with the next arm")
        return
    finally:
        with _signals_deferred():
            server.stop(cfg.stop_grace_s)
    # The plugin logs its final counters as the server shuts down: the whole server's
    # hit rate, available even when periodic stats (EXPERT_CACHE_STATS) were off.
    final = latest_counters(server.log_path)
    if final is not None:
        st.append({**base, "kind": "counters", "counters": final, "at": now_iso(),
                   "plugin": plugin_state(server.log_path)})


def load_summary(path: str | os.PathLike[str]):
    """(summary, records) of a results file, for ``report`` and after a run."""
    from .summary import summarise

    meta, records = _store.load(path)
    if meta is None and not records:
        raise UserError(f"{path}: empty results file")
    return summarise(records, meta), records


def resident_from_baseline(path: str | Path) -> tuple[float, str]:
    """The resident arm's decode rate (mean of restart rates) from a baseline results file."""
    summary, _ = load_summary(path)
    arm = next((a for a in summary.arms if a.arm == "resident" and a.restarts > 0), None)
    if arm is None or not math.isfinite(arm.mean_tok_s):
        raise UserError(f"--baseline {path}: no measured resident arm")
    return float(arm.mean_tok_s), (f"baseline {path}: resident arm, {arm.restarts} restart(s), "
                                   f"{arm.runs} run(s)")
