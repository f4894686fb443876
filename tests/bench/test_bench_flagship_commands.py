"""The flagship's user commands for real, on this CPU machine (bench/run_flagship_on_device.sh
stubs them): `size` and `plan` on gpt-oss-120b's config-only directory with the bench's
vLLM flags, and the serve command `plan` prints, as the runner reads it back
(`flagship_report.serve_argv`), accepted by `serve --dry-run` with the cache armed on
Marlin, the experts offloaded and the dummy-load flag carried to vLLM, with no
EXPERT_CACHE_* variable set, as a new user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

report = pytest.importorskip("flagship_report", reason="the bench needs httpx")
import write_gpt_oss  # noqa: E402

FLAGS = ["--max-model-len", "8192", "--attention-backend", "TRITON_ATTN",
         "--load-format", "dummy"]
PROBE = ROOT / "bench" / "results" / "probe-link-h200-gpt-oss-120b.json"


def _cli(*args: str) -> subprocess.CompletedProcess:
    # as a new user types them: nothing set (MXFP4 on Marlin is armed by default)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPERT_CACHE_")}
    env["COLUMNS"] = "200"
    return subprocess.run([sys.executable, "-m", "expertcache_cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_size_plan_and_plans_serve_command_on_the_config_only_model(tmp_path):
    model = tmp_path / "gpt-oss-120b"
    model.mkdir()
    cfg = write_gpt_oss.config(write_gpt_oss.Shape(experts=128), 36, 201088, 131072)
    (model / "config.json").write_text(json.dumps(cfg))
    trace = tmp_path / "tasks.npz"
    r = _cli("trace", "synth", str(trace), "--kind", "tasks", "--steps", "300", "--layers",
             "36", "--experts", "128", "--top-k", "4", "--seed", "29")
    assert r.returncode == 0, r.stderr
    r = _cli("size", "--model", str(model), "--vram", "24", "--json", "--", *FLAGS)
    assert r.returncode == 0, r.stderr
    size = json.loads(r.stdout)
    assert size["verdict"] == "cache" and size["bytes_per_expert"] == 14431744
    saved = tmp_path / "plan24.json"
    r = _cli("plan", str(trace), "--model", str(model), "--vram", "24", "--probe", str(PROBE),
             "--resident-tok-s", "150", "--save", str(saved), "--", *FLAGS)
    assert r.returncode == 0, r.stderr
    plan = json.loads(saved.read_text())
    argv = report.serve_argv(plan)
    assert argv[:2] == ["serve", str(model)] and argv[argv.index("--") + 1:][:6] == FLAGS
    assert report.prediction(plan) is not None
    assert plan["recommended"]["slots"] <= size["max_slots"]
    r = _cli(*argv[:2], "--dry-run", *argv[2:], "--seed", "0", "--port", "8123")
    assert r.returncode == 0, r.stdout + r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert "EXPERT_CACHE_SLOTS=" in line and "--moe-backend marlin" in line
    assert "--cpu-offload-params experts" in line and "--load-format dummy" in line
