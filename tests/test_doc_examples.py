"""Every example output in the README and the manual pages is what the command prints now.

The README and docs/*.md show real runs as fenced blocks that start ``$ expertcache ...``
followed by what it printed, often an excerpt (``...`` marks a cut). An example is only
worth showing while it is true, and outputs drift as the tool changes: a row is added, a
line moves, a default changes. Here each example that needs no GPU, no vLLM and no file
outside the repository is run again, and every line it shows must appear in what the
command prints now, in the same order (whitespace aside, and at one of a few terminal
widths, since rich wraps tables to the terminal). Examples that cannot run here are listed
in ``NOT_RUN`` with the reason; an entry whose example is gone fails, so the list cannot
outlive the docs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_hub import snapshot
from test_marlin_sizing import GPTQ

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
WIDTHS = (100, 80, 120, 140)  # rich wraps to COLUMNS; the examples were taken at one of these
CUT = {"...", "…"}

#: (document, the start of the command): why that example is not run here
NOT_RUN = {
    ("README.md", "expertcache probe-link"): "measures a GPU's link (its figures are checked "
                                             "against their record in test_published_numbers)",
    ("docs/probe-link.md", "expertcache probe-link"): "measures a GPU's link",
    ("README.md", "expertcache build-kernels --arch"): "compiles with NVRTC; prints this "
                                                       "machine's cache paths and hashes",
    ("docs/kernels.md", "expertcache build-kernels --arch"): "compiles with NVRTC; prints this "
                                                             "machine's cache paths and hashes",
    ("docs/kernels.md", "expertcache build-kernels --library"): "builds with nvcc",
    ("docs/baseline.md", "expertcache baseline /tmp/tinymoe"): "starts vLLM servers on a GPU",
    ("docs/baseline.md", "expertcache baseline report tiny.jsonl"): "reports the GPU run above",
    ("docs/serve.md", "expertcache serve Qwen/Qwen3-30B-A3B --vram 24 -- "):
        "not a dry run: checks an installed vLLM 0.35 and would start it",
    ("docs/serve.md", "expertcache serve /tmp/w8a8"): "reads a local W8A8 checkpoint's "
                                                      "safetensors",
    ("docs/trace.md", "expertcache trace import"): "imports recordings kept beside the "
                                                   "traces' sources, not in the repository",
}

#: a checkpoint directory an example names, made here from a config in tests/configs: the
#: example says what it holds ("its config.json with GPTQ's quantization_config")
CHECKPOINTS = {"Qwen3-30B-A3B-GPTQ-Int4": ("qwen3-30b-a3b.json", GPTQ)}
#: Hub ids the examples name, put in a local Hugging Face cache the runs read offline
HUB_CACHE = {"Qwen/Qwen3-30B-A3B-GPTQ-Int4": ("qwen3-30b-a3b.json", GPTQ)}

PYTHON_RUN = re.compile(r"\S*python[\d.]*(?= -m vllm)")  # the interpreter serve execs


@dataclass(frozen=True)
class Example:
    doc: str
    line: int
    command: str
    shown: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def examples(doc: str) -> list[Example]:
    """The ``$ expertcache`` blocks of one document, with their continuation lines joined
    and any annotation after the command (``  (H200, ...)``, ``  # ...``) dropped."""
    lines, out, inside, i = (ROOT / doc).read_text().splitlines(), [], False, 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside and line.startswith("$ expertcache"):
            start, command = i + 1, line[2:]
            while command.rstrip().endswith("\\"):
                i += 1
                command = command.rstrip()[:-1] + " " + lines[i].strip()
            shown = []
            while (i + 1 < len(lines) and not lines[i + 1].lstrip().startswith("```")
                   and not lines[i + 1].startswith("$ ")):
                i += 1
                shown.append(lines[i])
            command = re.sub(r"\s+#.*$", "", re.sub(r"\s{2,}\(.*$", "", command))
            out.append(Example(doc, start, command.strip(), tuple(shown)))
        i += 1
    return out


def why_not_run(ex: Example) -> str | None:
    for (doc, prefix), reason in NOT_RUN.items():
        if ex.doc == doc and ex.command.startswith(prefix):
            return reason
    return None


ALL = [ex for doc in DOCS for ex in examples(doc)]


def normal(text: str) -> str:
    return " ".join(PYTHON_RUN.sub("python3", text).split())


def missing_lines(shown: tuple[str, ...], printed: str) -> list[str]:
    """The shown lines not found in ``printed``, in order, whitespace aside."""
    out, pos = [], 0
    for line in shown:
        want = normal(line)
        if not want or want in CUT:
            continue
        at = printed.find(want, pos)
        if at < 0:
            out.append(want)
        else:
            pos = at + len(want)
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A working directory that sees the repository's traces, records and configs under
    the paths the examples use, holds the checkpoints and the Hugging Face cache they name
    (never the network), and keeps their own files (``--save plan.json``) out of the
    checkout."""
    d = tmp_path_factory.mktemp("examples")
    for name in ("traces", "bench", "tests"):
        (d / name).symlink_to(ROOT / name)
    for name, (config, quant) in CHECKPOINTS.items():
        (d / name).mkdir()
        cfg = json.loads((ROOT / "tests" / "configs" / config).read_text())
        (d / name / "config.json").write_text(json.dumps(cfg | {"quantization_config": quant}))
    for repo, (config, quant) in HUB_CACHE.items():
        cfg = json.loads((ROOT / "tests" / "configs" / config).read_text())
        snapshot(d / ".hf", repo, cfg | {"quantization_config": quant})
    return d


def test_examples_are_found():
    """The parser sees the examples (a change of fence style would make this file vacuous)."""
    assert len(ALL) >= 20 and {ex.doc for ex in ALL} >= {"README.md", "docs/size.md"}
    assert all(ex.shown for ex in ALL), [ex.id for ex in ALL if not ex.shown]


def test_every_not_run_entry_names_an_example():
    stale = [key for key in NOT_RUN
             if not any(ex.doc == key[0] and ex.command.startswith(key[1]) for ex in ALL)]
    assert not stale, f"NOT_RUN names examples the docs no longer have: {stale}"


def test_the_matcher_catches_drift():
    printed = normal("alpha  beta\ngamma delta\n│ lru │  32 │ 9,810 │\nomega")
    assert missing_lines(("alpha beta gamma", "...", "│ lru    │    32 │  9,810 │"), printed) == []
    assert missing_lines(("gamma delta", "alpha beta"), printed) == ["alpha beta"]  # order
    assert missing_lines(("│ lru │ 33 │",), printed) == ["│ lru │ 33 │"]
    assert normal("X=1 /opt/venv/bin/python3.11 -m vllm.x") == "X=1 python3 -m vllm.x"


@pytest.mark.parametrize("ex", [ex for ex in ALL if why_not_run(ex) is None], ids=lambda e: e.id)
def test_example_prints_what_it_shows(ex: Example, workdir: Path):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("the examples show a machine without vLLM; `serve` and `size` read the "
                    "installed release")
    argv = [sys.executable, "-m", "expertcache_cli", *shlex.split(ex.command)[1:]]
    best: tuple[int, list[str], str] | None = None
    for width in WIDTHS:
        # one stream, unbuffered: the lines interleave as a terminal shows them
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env |= {"COLUMNS": str(width), "NO_COLOR": "1", "TERM": "dumb",
                "PYTHONUNBUFFERED": "1", "HF_HOME": str(workdir / ".hf"), "HF_HUB_OFFLINE": "1"}
        env.pop("FORCE_COLOR", None)
        proc = subprocess.run(argv, cwd=workdir, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=180,
                              stdin=subprocess.DEVNULL)
        miss = missing_lines(ex.shown, normal(proc.stdout))
        if not miss:
            return
        if best is None or len(miss) < len(best[1]):
            best = (width, miss, proc.stdout[-600:])
    width, miss, tail = best
    pytest.fail(f"{ex.id}: `{ex.command}` no longer prints {len(miss)} of the lines shown; "
                f"first, at {width} columns: {miss[0]!r}\nit printed, ending: {tail}")
