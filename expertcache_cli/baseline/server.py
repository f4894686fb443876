"""One server process per arm per restart: build its command, start it in its own process
group, wait for health, and stop it together with every child it spawned.

Why a process group of its own: vLLM forks engine-core and worker processes. Stopping
only the parent can leave a child holding the GPU (and the port) into the next arm's
measurement; a Ctrl-C at the terminal must not reach the server before we stop it in
order. ``start_new_session`` gives the server its own session and group; stopping asks
the leader first (it stops its own children in order) and then ends whatever of the group
is left. With ``EXPERTCACHE_SERVER_GROUPS`` set, the group is recorded while it runs
(``groups``), so that a later process can end it if this one is killed first.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from . import groups

#: Placeholders a ``--server-cmd`` template may use. ``{arm_args}`` and ``{vllm_args}``
#: expand to several words and must stand alone; when a template omits them they are
#: appended, so a custom command can never silently drop an arm's offload flags.
PLACEHOLDERS = ("model", "host", "port", "python", "arm", "arm_args", "vllm_args")


def default_template() -> str:
    """``vllm serve`` started the way `expertcache serve` starts it, as a template.

    `launch.vllm_command` is the one place that decides: the ``vllm`` script where
    it exists, else the same CLI through this python (the project's device bundle and some
    CPU builds have no working script). Braces in its paths are escaped for the template.
    """
    from ..planning.launch import vllm_command

    launcher = shlex.join(vllm_command()).replace("{", "{{").replace("}", "}}")
    return launcher + " serve {model} --host {host} --port {port} {arm_args} {vllm_args}"


def build_command(
    template: str,
    *,
    model: str,
    host: str,
    port: int,
    arm: str,
    arm_args: list[str],
    vllm_args: list[str],
) -> list[str]:
    """The argv of one server: the template split like a shell would, then filled in.

    Splitting before substituting keeps a model path with spaces one argument.
    """
    try:
        words = shlex.split(template)
    except ValueError as exc:
        raise UserError(f"--server-cmd: cannot parse {template!r}: {exc}") from None
    if not words:
        raise UserError("--server-cmd is empty")
    values = {
        "model": model,
        "host": host,
        "port": str(port),
        "python": sys.executable,
        "arm": arm,
    }
    argv: list[str] = []
    used_multi: set[str] = set()
    for w in words:
        if w in ("{arm_args}", "{vllm_args}"):
            name = w[1:-1]
            used_multi.add(name)
            argv.extend(arm_args if name == "arm_args" else vllm_args)
            continue
        if "{arm_args}" in w or "{vllm_args}" in w:
            raise UserError("--server-cmd: {arm_args} and {vllm_args} must be words of their own")
        try:
            argv.append(w.format(**values))
        except (KeyError, IndexError, ValueError) as exc:
            raise UserError(
                f"--server-cmd: unknown placeholder in {w!r} ({exc}); "
                f"known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}"
            ) from None
    if "arm_args" not in used_multi:
        argv.extend(arm_args)
    if "vllm_args" not in used_multi:
        argv.extend(vllm_args)
    return argv


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def read_end(path: str | os.PathLike[str], max_bytes: int) -> str:
    """The last ``max_bytes`` of a (possibly huge, still growing) log as text."""
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        fh.seek(max(0, fh.tell() - max_bytes))
        return fh.read().decode("utf-8", errors="replace")


def tail(path: str | os.PathLike[str], lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    """The last lines of a log, for a failure record a human will read."""
    try:
        text = read_end(path, max_bytes)
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


class ServerFailed(Exception):
    """The server died or never became healthy; ``phase`` says when."""

    def __init__(self, phase: str, reason: str) -> None:
        super().__init__(f"{phase}: {reason}")
        self.phase = phase
        self.reason = reason


@dataclass
class Server:
    """A server process we own, its log file and its address."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    host: str
    port: int
    server_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    proc: subprocess.Popen[bytes] | None = None
    t_spawn: float = 0.0
    start_s: float | None = None
    model_id: str | None = None
    group_record: Path | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Spawn the server in a new session (own process group), its output to the log."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it after Popen
        try:
            log.write(f"# expertcache baseline: {shlex.join(self.argv)}\n".encode())
            log.flush()
            self.t_spawn = time.perf_counter()
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        except OSError as exc:
            raise ServerFailed("start", f"cannot run {self.argv[0]!r}: {exc}") from None
        finally:
            log.close()
        directory = groups.record_dir()
        if directory is not None:
            try:
                self.group_record = groups.record(directory, self.proc.pid, self.argv)
            except OSError:
                pass  # without the record only the cleanup after a killed run is lost

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_exit(self, timeout_s: float) -> bool:
        """Give a process that is going down a moment to finish; True once it has exited."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def exit_reason(self) -> str:
        assert self.proc is not None
        rc = self.proc.returncode
        if rc is not None and rc < 0:
            try:
                return f"exited on signal {signal.Signals(-rc).name}"
            except ValueError:
                return f"exited on signal {-rc}"
        return f"exited with code {rc}"

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> float:
        """Poll ``/health`` until it answers 200; return seconds since spawn.

        Raises ServerFailed if the process exits first or the timeout passes. Then asks
        ``/v1/models`` for the served name, so requests work whatever the model was
        called on the command line.
        """
        import httpx

        assert self.proc is not None
        deadline = self.t_spawn + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise ServerFailed(
                        "health", f"server {self.exit_reason()} before it was healthy"
                    )
                try:
                    r = client.get(self.base_url + "/health")
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() >= deadline:
                    raise ServerFailed(
                        "health", f"server not healthy within {timeout_s:g} s (still running)"
                    )
                time.sleep(poll_s)
            self.start_s = time.perf_counter() - self.t_spawn
            try:
                r = client.get(self.base_url + "/v1/models")
                r.raise_for_status()
                data = r.json().get("data") or []
                self.model_id = data[0]["id"] if data else None
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                raise ServerFailed("health", f"/v1/models failed after /health: {exc}") from None
            if not self.model_id:
                raise ServerFailed("health", "/v1/models lists no model")
        return self.start_s

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGINT the leader, then SIGTERM and SIGKILL the whole group.

        The leader alone gets the polite signal: vLLM's API server then stops its engine
        process itself with one SIGTERM, which the engine handles (drains, runs its
        shutdown, where the plugin logs its final counters). Signalling the whole group
        gives the engine a second signal that can land after vLLM restored the default
        handlers, killing it mid-shutdown (2 of 3 servers lost the final line that way;
        bench/results/baseline.md). Waits until no process of the group is left, so the
        next arm starts on a quiet machine with its port and memory free.
        """
        if self.proc is None:
            return
        pgid = self.proc.pid  # leader of its own session: pgid == pid
        if self.proc.poll() is None:
            try:
                os.kill(pgid, signal.SIGINT)
            except ProcessLookupError:
                pass
            self._wait_quiet(pgid, grace_s, leader_gone_s=min(grace_s, ORPHAN_WAIT_S))
        term_s = max(1.0, min(10.0, grace_s))
        for sig, wait_s in ((signal.SIGTERM, term_s), (signal.SIGKILL, 10.0)):
            if not _group_alive(pgid) and self.proc.poll() is not None:
                break
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
            except PermissionError:
                break
            self._wait_quiet(pgid, wait_s)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self.group_record is not None and not groups.members(pgid):
            self.group_record.unlink(missing_ok=True)
            self.group_record = None

    def _wait_quiet(self, pgid: int, wait_s: float, leader_gone_s: float | None = None) -> None:
        """Until the group is gone or ``wait_s`` passes; once the leader has exited, the
        rest get only ``leader_gone_s`` more (orphans that outlive it will not go alone)."""
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            if self.proc.poll() is not None and leader_gone_s is not None:
                end = min(end, time.monotonic() + leader_gone_s)
                leader_gone_s = None
            if not _group_alive(pgid):
                return
            time.sleep(0.1)


#: After the leader exits, how long the rest of its group may take before SIGTERM.
ORPHAN_WAIT_S = 5.0


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group still exists (zombies of ours are reaped first)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def server_env(overrides: dict[str, str | None]) -> dict[str, str]:
    """This process's environment with an arm's overrides applied (None removes)."""
    env = dict(os.environ)
    for k, v in overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env
