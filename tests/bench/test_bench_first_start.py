"""The first-start runner (bench/run_first_start_on_device.sh) with its GPU steps stubbed, and
its report (bench/first_start_report.py): every start cold (its own empty caches), serve as
typed, what was planned saved beside what vLLM did, and goals that can fail."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from bench_runner_harness import make_runner

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import first_start_report as fsr  # noqa: E402

STUB = r'''#!/usr/bin/env python3
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(" ".join(args) + "\n")
if args[0] in ("-", "-c"):
    os.execv(os.environ["REAL_PY"], [os.environ["REAL_PY"], *args])
if args[0].endswith("first_start_report.py"):
    os.execv(os.environ["REAL_PY"], [os.environ["REAL_PY"], *args])
if args[0].endswith("ballast.py"):
    print(json.dumps({"verb": args[1]}))
elif args[0].endswith("small_card.py"):
    name, out = args[1], Path(args[args.index("--out") + 1])
    env = dict(a.split("=", 1) for a in args[1:args.index("--")] if "=" in a)
    cold = Path(env["VLLM_CACHE_ROOT"]).parent
    assert cold.is_dir() and not any(cold.iterdir()), "the start's caches are not empty"
    (out / f"{name}.json").write_text(json.dumps({"arm": name, "status": "ok", "start_s": 200,
        "tok_s": [30.0], "log": {"kv_gib": 3.85, "slots": 71, "armed_layers": 48,
                                 "moe_layers": 48, "compile": "cold"}}))
    (out / f"{name}.log").write_text("log\n")
elif args[1:3] == ["expertcache_cli", "size"]:
    print(json.dumps({"slots": 71, "kv_cache_bytes": int(3.85 * 2**30), "max_num_seqs": 8}))
elif args[1:3] == ["expertcache_cli", "serve"]:
    print("serve: dry run")
'''


@pytest.fixture()
def runner(tmp_path):
    return make_runner(tmp_path, "run_first_start_on_device.sh",
                       ("small_card.py", "trace_routing.py", "first_start_report.py"), STUB,
                       keep_bench_helpers=True,
                       FS=str(tmp_path / "fs"), MODEL_DIR=str(tmp_path / "models")), tmp_path


def test_every_start_is_cold_and_serve_is_run_as_typed(runner):
    run, tmp = runner
    calls, out = run(STEPS="starts report", STARTS="24:in-place:default 16:staged-install:8192")
    serves = [c for c in calls if "small_card.py" in c]
    assert len(serves) == 2
    first, second = (c.split(" -- ", 1)[1] for c in serves)
    # as typed: no batch flag, no memory flag of ours; only the bundle's backend and a port
    assert "--max-num-seqs" not in first and "--gpu-memory-utilization" not in first
    assert first.endswith("serve " + str(tmp / "models" / "w8a8") + " --vram 24 -- "
                          "--attention-backend TRITON_ATTN --seed 0 --host 127.0.0.1 "
                          "--port {port}")
    assert "--vram 16 --wide staged-install -- --max-model-len 8192" in second
    # the ballast changes with the card, and is stopped at the end
    ballasts = [c for c in calls if "ballast.py start" in c]
    assert [b.split()[-1] for b in ballasts] == ["24", "16"]
    assert "fs24-in-place-default" in out and "goals" in out
    assert not list((tmp / "fs").glob("cache-*"))  # the cold caches are removed after


def test_another_format_writes_and_starts_its_own_checkpoint(runner):
    """FORMAT/LAYERS: the 4-bit NVFP4 checkpoint of 24 layers, written once, started as
    typed on a card it does not fit; the default checkpoint keeps its folder."""
    run, tmp = runner
    model = tmp / "models" / "nvfp4-24"
    calls, _ = run(STEPS="ckpt starts", STARTS="8:in-place:8192", FORMAT="nvfp4", LAYERS="24")
    write = next(c for c in calls if "write_checkpoint.py" in c)
    assert write.startswith(f"bench/write_checkpoint.py {model} --layers 24 --format nvfp4 ")
    serve = next(c for c in calls if "small_card.py" in c).split(" -- ", 1)[1]
    assert f"serve {model} --vram 8 -- --max-model-len 8192" in serve
    calls, _ = run(STEPS="ckpt", STARTS="8:in-place:8192")
    assert f"bench/write_checkpoint.py {tmp / 'models' / 'w8a8'} --layers 48 --format w8a8" \
        in next(c for c in calls if "write_checkpoint.py" in c)


def test_a_start_done_before_is_not_run_again(runner):
    run, _ = runner
    run(STEPS="starts", STARTS="24:in-place:8192")
    calls, out = run(STEPS="starts", STARTS="24:in-place:8192")
    assert not any("small_card.py" in c for c in calls) and "done before" in out


def _write(folder: Path, name: str, rec: dict, size: dict) -> None:
    (folder / f"{name}.json").write_text(json.dumps(rec))
    (folder / f"{name}.size.json").write_text(json.dumps(size))


def test_report_goals_fail_on_kv_far_from_the_plan_and_on_a_refused_start(tmp_path):
    size = {"slots": 71, "kv_cache_bytes": int(3.85 * 2**30), "max_num_seqs": 8}
    ok_log = {"kv_gib": 3.85, "slots": 71, "armed_layers": 48, "moe_layers": 48}
    _write(tmp_path, "fs24-in-place-default", {"status": "ok", "log": ok_log}, size)
    _write(tmp_path, "fs24-in-place-8192", {"status": "ok", "log": {**ok_log, "kv_gib": 3.5}},
           size)
    _write(tmp_path, "fs16-staged-install-8192",
           {"status": "failed", "error": "server exited", "log": {"cause": "OOM"}}, size)
    text = "\n".join(fsr.report(tmp_path))
    assert "- fs24-in-place-default: met" in text
    assert "- fs24-in-place-8192: NOT met (KV 3.50 vs planned 3.85 GiB)" in text
    assert "- fs16-staged-install-8192: NOT met (start failed: OOM)" in text
    assert "| 16 GiB | staged-install | 8192 | FAILED |" in text


def test_report_goals_fail_where_vllm_loaded_more_than_the_plan_holds(tmp_path):
    """Llama 4 Scout cut to 8 layers: vLLM loaded 9.17 GiB where a plan without its rotary
    cache held 6.67; with the cache counted the two agree."""
    size = {"slots": 5, "kv_cache_bytes": int(0.81 * 2**30), "max_num_seqs": 4,
            "non_expert_bytes": 7159326720}
    log = {"kv_gib": 0.81, "slots": 5, "armed_layers": 8, "moe_layers": 8, "weights_gib": 9.17}
    _write(tmp_path, "fs24-in-place-8192", {"status": "ok", "log": log}, size)
    _write(tmp_path, "fs24-in-place-131072", {"status": "ok", "log": log},
           size | {"rope_cache_bytes": 10485760 * 128 * 2})
    text = "\n".join(fsr.report(tmp_path))
    assert ("- fs24-in-place-8192: NOT met (vLLM loaded 9.17 GiB, the plan holds 6.67)"
            in text)
    assert "- fs24-in-place-131072: met" in text
    assert "| 9.17 / 9.17 |" in text


def test_report_on_an_empty_folder_says_so(tmp_path):
    assert fsr.report(tmp_path) == [f"no first-start records in {tmp_path}"]
    assert os.path.isdir(tmp_path)


def test_an_architecture_is_written_config_only_and_served_with_dummy_weights(runner):
    """ARCH: a real architecture's config cut to 8 layers, no weights; every start of it
    loads vLLM's dummy weights, and nothing writes a checkpoint."""
    run, tmp = runner
    model = tmp / "models" / "llama4-scout-8"
    calls, _ = run(STEPS="ckpt starts", STARTS="24:in-place:131072", ARCH="llama4-scout")
    assert f"bench/write_arch_config.py {model} --arch llama4-scout --layers 8" in calls
    assert not any("write_checkpoint.py" in c for c in calls)
    size = next(c for c in calls if "expertcache_cli size" in c)
    assert f"--model {model} --vram 24 --json -- --max-model-len 131072" in size
    serve = next(c for c in calls if "small_card.py" in c).split(" -- ", 1)[1]
    assert f"serve {model} --vram 24 -- --max-model-len 131072 " in serve
    assert serve.endswith("--port {port} --load-format dummy")
