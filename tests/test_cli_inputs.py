"""Every bad input is one line on stderr, exit code 2, no traceback, no file left behind.

Each input below is run as a user would, with what the user must see.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from terminal import sigint_default

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
    (["size", "qwen3-30b-a3b", "--model", "mixtral-8x7b"], "the model is given twice"),
    (["size", "qwen3-30b-a3b", "stray"], "unknown option or argument 'stray'"),
    (["plan", "Qwen/Qwen3-30B-A3B", "--vram", "24"], "a model goes in --model"),
    (["replay", "Qwen/Qwen3-30B-A3B"], "no such trace file"),
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


def test_size_takes_the_model_as_its_first_word_as_serve_does():
    """`size MODEL` as `serve MODEL` and `vllm serve MODEL` take it: the same plan as
    `--model MODEL`, and a flag after `--` is still vLLM's, never the model."""
    def size_json(*args: str) -> dict:
        r = _cli(["size", "--vram", "24", "--json", *args], None)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    r = _cli(["size", "mixtral-8x7b", "--vram", "24", "--json"], None)
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout)
    assert first == size_json("--model", "mixtral-8x7b") == size_json("mixtral-8x7b")
    assert first["model"] == "mixtral-8x7b"
    after = size_json("--", "--max-model-len", "8192")
    assert after["model"] != "--max-model-len" and after["max_model_len"] == 8192


def test_version():
    r = subprocess.run([sys.executable, "-m", "expertcache_cli", "--version"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("expertcache ")


def test_probe_link_lists_its_measurements_without_a_gpu():
    r = subprocess.run([sys.executable, "-m", "expertcache_cli", "probe-link", "--list"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    keys = [line.split()[0] for line in r.stdout.splitlines()]
    assert keys == ["pinned", "pageable", "zero-copy", "hbm", "latency", "gather", "step",
                    "stage"]


def _cli(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expertcache_cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


#: the three commands that write a file the user names, and how each is told where
WRITERS = {
    "replay --csv": ["replay", "--slots", "8", "--policy", "lru", "--csv"],
    "plan --save": ["plan", "--link-gbps", "50", "--resident-tok-s", "100", "--save"],
    "trace synth": ["trace", "synth", "--steps", "5"],
}

#: where to (in tmp_path: `dir` is a directory, `file` a file), and the reason the line gives
BAD_OUTPUTS = [
    ("dir", "is a directory; give a file name"),
    ("file/out.json", "file is not a directory"),
    ("missing/out.json", "directory missing does not exist"),
    ("/proc/out.npz", "cannot create a file in /proc"),
]


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("where, reason", BAD_OUTPUTS, ids=[w for w, _ in BAD_OUTPUTS])
def test_an_output_that_cannot_be_written_is_one_line_before_the_work(tmp_path, writer, where,
                                                                       reason):
    if where.startswith("/proc") and not __import__("os").path.isdir("/proc"):
        pytest.skip("no /proc here")
    if writer == "trace synth" and where.startswith("missing"):
        reason = None  # synth makes missing directories: covered by the next test
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    if reason is None:
        return
    args = WRITERS[writer]
    args = [*args[:2], where, *args[2:]] if writer == "trace synth" else [*args, where]
    r = _cli(args, tmp_path)
    assert r.returncode == 2, (r.returncode, r.stderr[-800:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("expertcache: error: "), r.stderr
    assert where in lines[0] and reason in lines[0], lines[0]
    assert r.stdout == ""  # refused before the work: no table, no progress
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"]
    assert list((tmp_path / "dir").iterdir()) == []


def test_trace_synth_makes_missing_directories_and_writes_through_links(tmp_path):
    r = _cli(["trace", "synth", "a/b/t", "--steps", "5"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "a" / "b" / "t.npz").is_file()
    # a link is written through (replacing it would replace the link: think /dev/stdout)
    (tmp_path / "real.csv").write_text("")
    (tmp_path / "link.csv").symlink_to(tmp_path / "real.csv")
    r = _cli(["replay", "--slots", "8", "--policy", "lru", "--csv", "link.csv"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "link.csv").is_symlink()
    assert (tmp_path / "real.csv").read_text().startswith("policy,slots,")


def test_a_write_that_fails_anyway_is_one_line_naming_the_path(tmp_path):
    from expertcache_cli.errors import UserError
    from expertcache_cli.files import atomic_write

    def full(tmp):
        raise OSError(28, "No space left on device")

    (tmp_path / "old.csv").write_text("kept")
    with pytest.raises(UserError, match=r"cannot write .*old.csv: No space left on device"):
        atomic_write(tmp_path / "old.csv", full)
    assert (tmp_path / "old.csv").read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir()] == ["old.csv"]  # no temporary left behind


#: a real SIGINT delivered inside a command (here: while replay loads its trace), or while
#: the commands load, then the console entry point as the `expertcache` script runs it
_CTRL_C = """
import os, signal, sys, time
import expertcache_cli.cli as cli
where = sys.argv[1]

def ctrl_c(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)  # the KeyboardInterrupt arrives here

if where == "command":
    import expertcache_cli.commands.replay as replay
    replay.load = ctrl_c
elif where == "loading":
    import expertcache_cli.commands as commands
    commands.register_all = ctrl_c
elif where == "explained":
    from expertcache_cli.errors import Interrupted
    import expertcache_cli.commands.replay as replay
    def explained(*args, **kwargs):
        raise Interrupted("interrupted: what was kept, and how to go on")
    replay.load = explained
sys.argv = ["expertcache", "replay"]
cli.main()
"""


#: `python -m` of a package whose __main__ has a Ctrl-C land while exec() runs a string
_EXEC_CTRL_C = """
import sys
import expertcache_cli.cli as cli
import expertcache_cli.commands.replay as replay

def ctrl_c_in_exec(*args, **kwargs):
    exec("raise KeyboardInterrupt")  # as when it lands while a dataclass builds its methods

replay.load = ctrl_c_in_exec
sys.argv = ["expertcache", "replay"]
cli.main()
"""


def test_ctrl_c_inside_exec_still_exits_130_under_python_m(tmp_path):
    """CPython marks a KeyboardInterrupt that leaves exec()'d code as unhandled even when it
    is handled later, and under `python -m` ends such a process by SIGINT (-2) whatever
    exit code it asked for: the CLI clears the mark, so the exit is 130 either way."""
    pkg = tmp_path / "ctrlc_in_exec"
    pkg.mkdir()
    (pkg / "__main__.py").write_text(_EXEC_CTRL_C)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), str(Path(__file__).resolve().parents[1]),
         os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "ctrlc_in_exec"], capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL, env=env, cwd=tmp_path)
    assert r.returncode == 130, (r.returncode, r.stderr[-800:])
    assert r.stderr.strip().splitlines() == ["expertcache: interrupted"], r.stderr


@pytest.mark.parametrize("where, line", [
    ("command", "expertcache: interrupted"),
    ("loading", "expertcache: interrupted"),
    ("explained", "expertcache: interrupted: what was kept, and how to go on"),
])
def test_ctrl_c_is_one_line_and_exit_130(where, line):
    r = subprocess.run([sys.executable, "-c", _CTRL_C, where], capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL, preexec_fn=sigint_default)
    assert r.returncode == 130, (r.returncode, r.stderr[-800:])
    assert r.stderr.strip().splitlines() == [line], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
