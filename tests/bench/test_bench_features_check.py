"""The vLLM features check (bench/features_check.py, bench/run_features_on_device.sh) on
the CPU: the whole runner with a stand-in `vllm` package (an offline `LLM` that logs the
plugin's lines, keeps a fake device's memory for a fake nvidia-smi, reloads, sleeps and
wakes) so that every arm runs in its own process as on the GPU box, records what it
measured stage by stage, is not run twice, and the report says met; then the report's
verdicts from records that break one thing each. Device minutes are few; a driver bug
must not be found on the device."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_runner_harness import make_runner

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import features_check as fc  # noqa: E402

GiB = 1 << 30

STUB = r'''#!/usr/bin/env python3
"""python3 for the runner: the checkpoint writer faked (config.json and a seed file); the
driver, its arms and its report run for real (the arms against the stand-in vLLM)."""
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(" ".join(args) + "\n")
if args[0].endswith("write_checkpoint.py"):
    d = Path(args[1]); d.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(Path(os.environ["QWEN_CONFIG"]).read_text())
    cfg["num_hidden_layers"] = int(args[args.index("--layers") + 1])
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "seed").write_text(args[args.index("--seed") + 1])
    (d / "model.safetensors.index.json").write_text("{}")
    print(f"wrote {d}")
else:
    os.execv(os.environ["REAL_PY"], [os.environ["REAL_PY"], *args])
'''

#: the stand-in vLLM: what bench/features_check.py's arm calls, nothing more
FAKE_BASE = r'''
"""vllm.distributed.weight_transfer.base, as far as the bench's engine subclasses it."""
class WeightTransferInitInfo:
    pass


class WeightTransferUpdateInfo:
    pass


class WeightTransferEngine:
    pass
'''

FAKE_FACTORY = r'''
"""vllm.distributed.weight_transfer.factory: the registry the worker creates engines from."""
class WeightTransferEngineFactory:
    _registry = {}

    @classmethod
    def register_engine(cls, name, engine_cls):
        if name in cls._registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        cls._registry[name] = lambda: engine_cls
'''

FAKE_VLLM = r'''
"""A stand-in for vLLM 0.26's offline LLM (tests only): greedy tokens a function of the
weights' seed, the plugin's log lines, a device whose memory a fake nvidia-smi reads."""
import hashlib, json, os, sys

__version__ = "0.26.0"
GiB = 1 << 30
EXPERT = 9437184
BASE, WEIGHTS, KV = 1 * GiB, GiB // 4, 10 * GiB


def log(msg):
    print(f"INFO 01-01 00:00:00 [fake.py:1] {msg}", file=sys.stderr, flush=True)


def _arm():
    return sys.argv[sys.argv.index("--child") + 1]


def _die(stage):
    if os.environ.get("FAKE_DIE") == f"{_arm()}:{stage}":
        log(f"RuntimeError: fake death at {stage}")
        os._exit(7)


class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _LP:
    def __init__(self, v):
        self.logprob = v


class _C:
    def __init__(self, ids, lp):
        self.token_ids, self.logprobs = ids, lp


class _O:
    def __init__(self, c):
        self.outputs = [c]


class _Counter:
    def __init__(self, name, value):
        self.name, self.value = name, value


class _Storage:
    def __init__(self, n):
        self.n = n

    def nbytes(self):
        return self.n

    def data_ptr(self):
        return id(self)


class _T:
    def __init__(self, storage):
        self.s = storage

    def untyped_storage(self):
        return self.s


class _P:
    def __init__(self, v):
        self.v = v

    def __getitem__(self, i):
        return self

    def float(self):
        return self

    def sum(self):
        return self

    def item(self):
        return self.v


class _Worker:
    def __init__(self, llm):
        kv = _Storage(llm.kv)
        llm_ = llm

        class Runner:
            kv_caches = [_T(kv), _T(kv)]  # two layers' views of one storage

            def get_model(self):
                class M:
                    def named_parameters(self):
                        yield "model.layers.0.mlp.gate.weight", _P(0.0)
                        yield "model.layers.0.mlp.experts.w13_weight", _P(
                            float(llm_.seed) + 0.5)
                return M()

        self.model_runner = Runner()


class _Decision:
    def __init__(self, slots):
        self.num_slots = slots


class _Layer:
    def __init__(self, slots):
        self.decision = _Decision(slots)


class _Session:
    def __init__(self, llm):
        self.llm = llm
        self.armed = [_Layer(llm.slots) for _ in range(llm.layers)]
        self.slot_bytes = llm.slot_bytes
        self.scratch_bytes = llm.scratch
        self.closed = False

    def totals(self):
        return {"requests": 100, "installs": 40, "read_through_steps": 5,
                "read_through_decode_steps": self.llm.decode_width, "staged_steps": 0,
                "staged_fetched": 0, "slots": self.llm.slots, "layers": []}

    def close(self):
        if not self.closed:
            self.closed = True
            log("expertcache: final hit rate 60.00% since last report, 60.00% overall "
                f"(requests=100 installs=40 read-through steps=5 (decode-width "
                f"{self.llm.decode_width}) over {self.llm.layers} layers)")


class LLM:
    def __init__(self, **kw):
        if os.environ.get("FAKE_HANG") == _arm():  # an engine that never starts, with a child
            import subprocess, time
            child = subprocess.Popen(["sleep", "300"])
            open(os.environ["FAKE_HANG_PID"], "w").write(str(child.pid))
            time.sleep(300)
        self.kw = kw
        cfg = json.load(open(os.path.join(kw["model"], "config.json")))
        self.layers, self.top_k = cfg["num_hidden_layers"], cfg["num_experts_per_tok"]
        self.cache = os.environ.get("EXPERT_CACHE_DISABLE") != "1"
        self.slots = int(os.environ.get("EXPERT_CACHE_SLOTS", "0")) if self.cache else 0
        self.slot_bytes = self.slots * self.layers * EXPERT
        # staged wide steps: a scratch of one layer's experts, in the pool with the slots
        self.scratch = 128 * EXPERT if self.cache and os.environ.get("EXPERT_CACHE_WIDE") else 0
        self.seed = self._seed(kw["model"])
        self.slot_seed, self.garbage, self.decode_width, self.trap = self.seed, False, 0, False
        # vLLM's KV shrinks by both, unless it is given
        self.kv = kw.get("kv_cache_memory_bytes") or KV - self.slot_bytes - self.scratch
        self.awake = {"weights": True, "kv_cache": True}
        spec = kw.get("speculative_config") or {}
        k = int(spec.get("num_speculative_tokens", 0))
        self.k = k
        if not self.cache:
            log("expertcache: EXPERT_CACHE_DISABLE=1: no layer will be armed (stock path)")
        else:
            from expertcache_cli.plugin import session
            from expertcache_cli.rules.budget import trap_text
            from expertcache_cli.vllm_facts.capture import (
                GraphSettings, capture_sizes, padded, safe_for_sizes)

            seqs = kw["max_num_seqs"]
            sizes = capture_sizes(seqs * (1 + k), kw["max_num_batched_tokens"], GraphSettings())
            widest = padded(seqs * (1 + k), sizes)
            line = (f"expertcache: vLLM {__version__}: armed {self.layers} of {self.layers} MoE "
                    f"layers; {self.slots} of 128 experts/layer as slots [EXPERT_CACHE_SLOTS="
                    f"{self.slots}]; {self.slot_bytes / GiB:.2f} GiB of slots; policy lru")
            if widest * self.top_k > self.slots:
                safe = safe_for_sizes(self.slots, self.top_k, sizes, 1 + k)
                line += "; TRAP: " + trap_text(seqs, widest, self.top_k, self.slots, safe,
                                               "vLLM's capture sizes", k).removeprefix(
                                                   "sizing trap: ")
                self.trap = True  # full verify steps will read through
            log(line)
            log(self._sweep("startup"))
            log(f"expertcache: memory plan: {self.slot_bytes / GiB:.2f} GiB of slots counted "
                f"as weights; vLLM chose {self.kv / GiB:.2f} GiB of KV cache")
            session.register_session(_Session(self))
        log(f"Available KV cache memory: {self.kv / GiB:.2f} GiB")
        self._smi()

    def _sweep(self, when):
        return (f"expertcache: {when} check of every expert (128 a layer, each through the "
                f"slots and the stock path): {self.layers} of {self.layers} layers agreed "
                "(largest row difference 0); 1024 synthetic steps in 0.40 s")

    @staticmethod
    def _seed(model):
        return int(open(os.path.join(model, "seed")).read())

    def _used(self):
        used = BASE
        if self.awake["weights"]:  # the slots and the scratch sleep with the weights
            used += WEIGHTS + self.slot_bytes + self.scratch
        if self.awake["kv_cache"]:
            used += self.kv
        return used

    def _smi(self):
        with open(os.environ["FAKE_GPU_STATE"], "w") as fh:
            fh.write(str(self._used() / 2**20))

    def _refreshed(self, why):
        if self.cache:
            if not os.environ.get("FAKE_STALE_SLOTS"):
                self.slot_seed = self.seed
            log(f"expertcache: {why}: the slots of {self.layers} layer(s) emptied; they "
                "refill from the new expert weights")
            log(self._sweep("new weights"))

    def generate(self, prompts, sp, use_tqdm=True):
        self.decode_width += 12 if self.trap else 0
        out = []
        for p in prompts:
            ids, lps = [], []
            for i in range(sp.max_tokens):
                seed = self.slot_seed if (self.cache and i % 2) else self.seed
                h = hashlib.sha256(f"{seed}|{self.garbage}|{p}|{i}".encode()).hexdigest()
                ids.append(int(h[:6], 16) % 8000)
                lps.append({ids[-1]: _LP(-0.5), 1: _LP(-1.5)} if sp.logprobs else None)
            out.append(_O(_C(ids, lps if sp.logprobs else None)))
        return out

    def _transfer_engine(self):
        # as vLLM's worker: the configured backend must be registered with the factory
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
        backend = (self.kw.get("weight_transfer_config") or {}).get("backend")
        if backend is None:
            raise RuntimeError("Weight transfer not configured.")
        if backend not in WeightTransferEngineFactory._registry:
            raise ValueError(f"Invalid weight transfer backend: {backend}.")
        return WeightTransferEngineFactory._registry[backend]()

    def start_weight_update(self):
        self._transfer_engine()
        self.updating = True

    def update_weights(self, request):
        assert self.updating
        self._transfer_engine().update_info_cls(**request["update_info"])
        self.seed, self.garbage = self._seed(request["update_info"]["path"]), False

    def finish_weight_update(self):
        assert self.updating
        self.updating = False
        self._refreshed("vLLM finished a weight update (weight transfer)")

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if callable(method):
            return [method(_Worker(self), *args)]
        assert method == "reload_weights", method
        _die("reload")
        path = (kwargs or {}).get("weights_path") or self.kw["model"]
        self.seed, self.garbage = self._seed(path), False
        self._refreshed("vLLM reloaded the weights")
        return [None]

    def sleep(self, level=1, mode="abort"):
        _die(f"sleep{level}")
        before = self._used()
        self.awake = {"weights": False, "kv_cache": False}
        self.garbage = level == 2
        self._smi()
        log(f"Sleep mode freed {(before - self._used()) / GiB:.2f} GiB memory, "
            f"{self._used() / GiB:.2f} GiB memory is still in use.")

    def wake_up(self, tags=None):
        for t in tags or ["weights", "kv_cache"]:
            self.awake[t] = True
        if tags is None or "weights" in tags:
            self._refreshed("vLLM woke its weights from sleep (discarded at level 2, maybe "
                            "replaced)")
        self._smi()

    def get_metrics(self):
        return [_Counter("vllm:spec_decode_num_drafts", 40),
                _Counter("vllm:spec_decode_num_draft_tokens", 120),
                _Counter("vllm:spec_decode_num_accepted_tokens", 30)]
'''

SMI = r'''#!/bin/sh
# nvidia-smi for the stand-in vLLM: the fake device's memory in use, MiB
cat "$FAKE_GPU_STATE"; echo
'''


@pytest.fixture()
def runner(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    run = make_runner(tmp_path, "run_features_on_device.sh", ("features_check.py", "e2e_vllm.py"),
                      STUB, keep_bench_helpers=True, FE=str(tmp_path / "fe"),
                      MODEL_DIR=str(tmp_path / "models"),
                      QWEN_CONFIG=str(ROOT / "tests" / "configs" / "qwen3-30b-a3b.json"),
                      FAKE_GPU_STATE=str(tmp_path / "gpu_state"),
                      PATH=f"{bin_dir}:{os.environ['PATH']}")
    # the runner puts its checkout on PYTHONPATH (bench/_device_vllm.sh): the package under
    # test and the stand-in vLLM are found there, as the real ones are on the box
    tree = tmp_path / "tree"
    (tree / "expertcache_cli").symlink_to(ROOT / "expertcache_cli")
    (tree / "vllm").mkdir()
    (tree / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    wt = tree / "vllm" / "distributed" / "weight_transfer"
    wt.mkdir(parents=True)
    for d in (tree / "vllm" / "distributed", wt):
        (d / "__init__.py").write_text("")
    (wt / "base.py").write_text(FAKE_BASE)
    (wt / "factory.py").write_text(FAKE_FACTORY)
    return run, tmp_path


def _arms(calls: list[str]) -> list[str]:
    return [c.split()[1] for c in calls if c.startswith("bench/features_check.py")
            and c.split()[1] not in ("size", "safe", "report")]


def _rec(tmp: Path, name: str) -> dict:
    return json.loads((tmp / "fe" / f"{name}.json").read_text())


def test_every_check_runs_once_as_on_the_device_and_the_report_says_met(runner):
    run, tmp = runner
    calls, stdout = run()
    models = tmp / "models"
    writes = [c for c in calls if c.startswith("bench/write_checkpoint.py")]
    assert writes == [f"bench/write_checkpoint.py {models / 'fe8a'} --layers 8 --seed 0",
                      f"bench/write_checkpoint.py {models / 'fe8b'} --layers 8 --seed 1"]
    # each pair after a warm-up start of its configuration (one compiled model for both)
    assert _arms(calls) == ["update_floor_warm", "update_floor", "update_cache",
                            "sleep_floor_warm", "sleep_floor", "sleep_cache",
                            "spec_floor_warmabove", "spec_cache_above", "spec_floor_above",
                            "spec_floor_warmsafe", "spec_cache_safe", "spec_floor_safe"]
    warm = _rec(tmp, "spec_floor_warmsafe")
    assert warm["status"] == "ok" and list(warm["phases"]) == ["warmup"]
    assert warm["engine"]["max_num_seqs"] == 1
    update = next(c for c in calls if c.startswith("bench/features_check.py update_cache"))
    assert f"--model {models / 'fe8a'}" in update and f"--model-b {models / 'fe8b'}" in update
    # the safe pair runs at the value the cache's TRAP line named (1 at 32 slots, k=3)
    safe = next(c for c in calls if c.startswith("bench/features_check.py spec_cache_safe"))
    assert "--max-num-seqs 1 " in safe + " "
    size = next(c for c in calls if c.startswith("bench/features_check.py size"))
    assert "--slots 32 --max-num-seqs 8" in size
    assert calls.index(size) < calls.index(next(
        c for c in calls if c.startswith("bench/features_check.py spec_cache_above")))

    # each arm: its own engine and environment, every stage recorded, the log's lines
    floor, cache = _rec(tmp, "update_floor"), _rec(tmp, "update_cache")
    assert floor["env"] == {"EXPERT_CACHE_DISABLE": "1"}
    assert cache["env"] == {"EXPERT_CACHE_SLOTS": "32"}
    assert cache["status"] == "ok" and set(cache["phases"]) >= {"before", "after", "back",
                                                                "transfer"}
    assert cache["engine"]["weight_transfer_config"] == {"backend": fc.TRANSFER_BACKEND}
    assert cache["engine"]["cpu_offload_params"] == ["experts"]
    assert cache["engine"]["cpu_offload_gb"] == pytest.approx(128 * 9437184 * 8 / GiB + 1,
                                                              abs=0.01)
    assert cache["engine"]["enable_prefix_caching"] is False
    assert cache["log"]["armed_layers"] == 8 and cache["log"]["memory_line"]
    assert [e["why"] for e in cache["log"]["emptied"]] == [
        "vLLM reloaded the weights", "vLLM reloaded the weights",
        "vLLM finished a weight update (weight transfer)"]
    assert floor["log"]["disabled"] and floor["log"]["armed_layers"] is None
    sleep = _rec(tmp, "sleep_cache")
    assert sleep["engine"]["enable_sleep_mode"] is True
    assert sleep["env"] == {"EXPERT_CACHE_SLOTS": "32", "EXPERT_CACHE_WIDE": "staged-install"}
    slots, scratch = 32 * 8 * 9437184, 128 * 9437184
    assert sleep["engine"]["kv_cache_memory_bytes"] == fc.KV_CACHE_BYTES
    assert sleep["kv_bytes"] == fc.KV_CACHE_BYTES  # one storage, two views
    assert sleep["plugin"] == {"armed_layers": 8, "slot_bytes": slots, "scratch_bytes": scratch,
                               "slots": 32}
    assert set(sleep["phases"]["sleep2"]["memory"]) == {"before", "asleep", "weights", "awake"}
    spec = _rec(tmp, "spec_cache_above")
    assert spec["engine"]["speculative_config"] == fc.SPEC_CONFIG
    assert spec["log"]["trap"].startswith("TRAP: a full batch of 8 seqs x (1 + 3 draft")
    # no process group left recorded: each arm's group ended and forgotten
    assert not list((tmp / "groups").glob("*.json"))

    text = (tmp / "out" / "features.txt").read_text().splitlines()
    assert text[0].startswith("vLLM 0.26.0; records in")
    assert len(text) == 5 and all(": met: " in line for line in text[1:]), text
    assert "the experts changed (fingerprint 0.5 -> 1.5; 0.5 -> 1.5 by the transfer)" in text[1]
    assert "each of the 3 updates emptied the slots of 8 layers" in text[1]
    assert "slots and scratch 3.38 GiB: sleep freed 3.38 GiB beyond the floor's" in text[2]
    assert "the KV cache given to each engine: 4.00 / 4.00 GiB (cache / floor)" in text[2]
    assert "waking the weights alone brought back 3.38 GiB beyond the floor's" in text[3]
    assert ("the TRAP line (8 seqs: 256 ids > 32 slots, safe --max-num-seqs 1) against size "
            "(256 ids, 32 slots, safe 1): agree") in text[4]
    assert "decode-width read-throughs 0 at the safe value, 12 above it" in text[4]
    for name in ("update_cache", "spec_floor_safe", "size_spec"):
        assert (tmp / "out" / f"{name}.json").exists()
    assert (tmp / "out" / "sleep_cache.log").exists()

    again, _ = run()  # re-entrant: nothing written or served twice
    assert _arms(again) == [] and not any("write_checkpoint" in c for c in again)
    assert (tmp / "out" / "features.txt").read_text().splitlines()[1:] == text[1:]


def test_an_engine_that_dies_keeps_what_it_measured_and_runs_again(runner):
    run, tmp = runner
    run(STEPS="model sleep report", FAKE_DIE="sleep_cache:sleep2")
    rec = _rec(tmp, "sleep_cache")
    assert rec["status"] == "failed" and rec["rc"] == 7
    assert set(rec["phases"]) == {"before", "sleep1"} and rec["phases"]["sleep1"]["outputs"]
    lines = (tmp / "out" / "features.txt").read_text().splitlines()
    assert lines[2].startswith("sleep level 1 (wake_up()): met: ")
    assert "sleep_cache failed later: RuntimeError: fake death at sleep2" in lines[2]
    assert lines[3].startswith("sleep level 2 (wake weights, reload_weights, wake KV): NOT met: "
                               "sleep_cache stopped before its sleep2 stage")
    assert lines[1].startswith("weight update (reload_weights; start/update/finish_weight_update): "
                               "NOT met: update_floor not run")
    calls, _ = run(STEPS="sleep report")
    assert _arms(calls) == ["sleep_cache"]  # the floor's ok record stands
    lines = (tmp / "out" / "features.txt").read_text().splitlines()
    assert ": met: " in lines[2] and ": met: " in lines[3]


def test_an_arm_past_its_time_is_ended_with_everything_it_started(runner):
    run, tmp = runner
    pid_file = tmp / "hang.pid"
    run(STEPS="model update", FAKE_HANG="update_cache", FAKE_HANG_PID=str(pid_file),
        ARM_TIMEOUT="3")
    rec = _rec(tmp, "update_cache")
    assert rec["rc"] == "timeout" and rec["status"] == "failed" and rec["phases"] == {}
    assert _rec(tmp, "update_floor")["status"] == "ok"  # the arm before it stands
    grandchild = int(pid_file.read_text())
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(
        f"/proc/{grandchild}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert not list((tmp / "groups").glob("*.json"))


def test_stale_slots_after_a_reload_are_not_met(runner):
    run, tmp = runner
    run(STEPS="model update report", FAKE_STALE_SLOTS="1")
    line = (tmp / "out" / "features.txt").read_text().splitlines()[1]
    assert line.startswith("weight update (reload_weights; start/update/finish_weight_update): "
                           "NOT met: after reloading the second checkpoint the cache against "
                           "the floor: part at prompt 0, token 1 (margins 1.0000 / 1.0000)")


def test_a_bad_step_is_refused_before_anything_runs(runner, tmp_path):
    run, tmp = runner
    r = subprocess.run(["bash", "bench/run_features_on_device.sh"], cwd=tmp / "tree",
                       env={**os.environ, "STEPS": "setup bogus", "OUT": str(tmp / "o2")},
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "run_features_on_device.sh: unknown step 'bogus' (steps: setup model update sleep "
        "spec report)"]
    assert not (tmp / "o2").exists()


# ----------------------------------------------------------------------------- verdicts
SLOT_BYTES = 32 * 8 * 9437184
KV_FLOOR = 10 * GiB


def _outputs(seed: int, prompts: int = 2) -> list[dict]:
    return [{"tokens": [seed * 100 + p * 10 + i for i in range(4)], "margin": [0.5] * 4}
            for p in range(prompts)]


def _mem(before: int, asleep: int, awake: int, weights: int | None = None) -> dict:
    m = {"before": {"cuda_used": before}, "asleep": {"cuda_used": asleep},
         "awake": {"cuda_used": awake}}
    if weights is not None:
        m["weights"] = {"cuda_used": weights}
    return m


def _log(cache: bool, trap: str | None = None, emptied: tuple[str, ...] = ()) -> dict:
    sweep = {"when": "startup", "agreed": 8, "layers": 8, "diff": "0", "line": "startup"}
    new = [{"when": "new weights", "agreed": 8, "layers": 8, "diff": "0", "line": "new"}
           for _ in emptied]
    if not cache:
        return {"disabled": True, "armed_layers": None, "moe_layers": None, "sweeps": [],
                "emptied": [], "trap": None, "memory_line": None}
    return {"armed_layers": 8, "moe_layers": 8, "startup_line": "expertcache: vLLM 0.26.0: "
            "armed 8 of 8 MoE layers", "trap": trap, "memory_line": "expertcache: memory plan",
            "sweeps": [sweep, *new], "emptied": [{"why": w, "layers": 8} for w in emptied]}


def _sleep_rec(cache: bool, stay: bool = False, kv_less: int = SLOT_BYTES) -> dict:
    slots = SLOT_BYTES if cache else 0
    kv = KV_FLOOR - (kv_less if cache else 0)
    pool = GiB // 4 + (0 if stay else slots) + kv
    used = GiB + GiB // 4 + slots + kv
    phases = {"before": {"outputs": _outputs(0)}}
    for lvl in (1, 2):
        phases[f"sleep{lvl}"] = {"memory": _mem(used, used - pool, used), "outputs": _outputs(0)}
    woke = ("vLLM woke its weights from sleep", "vLLM woke its weights from sleep",
            "vLLM reloaded the weights")
    return {"arm": f"sleep_{'cache' if cache else 'floor'}", "status": "ok", "phases": phases,
            "kv_bytes": kv, "plugin": {"slot_bytes": slots, "scratch_bytes": 0},
            "log": _log(cache, emptied=woke if cache else ())}


def _update_rec(cache: bool) -> dict:
    phases = {"before": {"outputs": _outputs(0), "fingerprint": 0.5},
              "after": {"outputs": _outputs(1), "fingerprint": 1.5},
              "back": {"outputs": _outputs(0), "fingerprint": 0.5},
              "transfer": {"outputs": _outputs(1), "fingerprint": 1.5}}
    emptied = ("vLLM reloaded the weights",) * 2 + (
        "vLLM finished a weight update (weight transfer)",)
    return {"arm": f"update_{'cache' if cache else 'floor'}", "status": "ok", "phases": phases,
            "log": _log(cache, emptied=emptied if cache else ())}


TRAP = ("TRAP: a full batch of 8 seqs x (1 + 3 draft tokens, speculative decoding) x top_k 8 "
        "= 256 ids > 32 slots: batched decode steps bypass the cache silently; --max-num-seqs 1 "
        "keeps every decode step on it")


def _spec_recs() -> dict[str, dict]:
    out = {}
    for role in ("cache", "floor"):
        for variant, seqs in (("above", 8), ("safe", 1)):
            width = 12 if variant == "above" else 0
            out[f"spec_{role}_{variant}"] = {
                "arm": f"spec_{role}_{variant}", "status": "ok",
                "engine": {"max_num_seqs": seqs},
                "phases": {"generate": {
                    "outputs": _outputs(0, 8),
                    "counters_before": {"read_through_decode_steps": 0},
                    "counters": {"read_through_decode_steps": width},
                    "spec_metrics": {"draft_tokens": 120, "accepted_tokens": 30}}},
                "log": _log(role == "cache", TRAP if variant == "above" else None)}
    return out


SIZE = {"trap": True, "trap_ids": 256, "slots": 32, "safe_max_num_seqs": 1}


def test_the_met_records_are_met():
    assert fc.verdict_update(_update_rec(False), _update_rec(True))[0]
    assert fc.verdict_sleep(_sleep_rec(False), _sleep_rec(True), 1)[0]
    assert fc.verdict_sleep(_sleep_rec(False), _sleep_rec(True), 2)[0]
    ok, line = fc.verdict_spec(_spec_recs(), SIZE)
    assert ok, line
    assert "n-gram drafted 120 tokens (30 accepted) above the safe value" in line


def test_update_not_met_when_the_cache_parts_the_update_is_empty_or_no_refresh_is_logged():
    floor, cache = _update_rec(False), _update_rec(True)
    cache["phases"]["after"]["outputs"][1]["tokens"][2] = -1
    ok, line = fc.verdict_update(floor, cache)
    assert not ok and ("after reloading the second checkpoint the cache against the floor: "
                       "part at prompt 1, token 2 (margins 0.5000 / 0.5000)") in line
    cache = _update_rec(True)
    cache["phases"]["after"]["fingerprint"] = 0.5
    ok, line = fc.verdict_update(floor, cache)
    assert not ok and "an update left the experts' bytes as they were" in line
    cache = _update_rec(True)
    cache["log"]["emptied"] = cache["log"]["emptied"][:1]
    ok, line = fc.verdict_update(floor, cache)
    assert not ok and "1 slot refreshes logged for 2 reloads" in line
    assert "0 slot refreshes logged for 1 weight transfers" in line
    # the transfer path alone stale: the reloads right, the transfer's tokens not
    cache, floor2 = _update_rec(True), _update_rec(False)
    cache["phases"]["transfer"]["outputs"] = _outputs(0)
    ok, line = fc.verdict_update(floor2, cache)
    assert not ok and ("after the second through the weight-transfer API the cache against "
                       "the floor: part at prompt 0") in line
    assert "did not serve what its reload served" in line
    cache = _update_rec(True)
    cache["log"]["armed_layers"] = 0
    ok, line = fc.verdict_update(floor, cache)
    assert not ok and "update_cache armed 0 of 8 MoE layers" in line
    ok, line = fc.verdict_update(floor, None)
    assert not ok and line.endswith("NOT met: update_cache not run")


def test_sleep_not_met_when_the_slots_stay_or_are_counted_twice_or_tokens_part():
    floor = _sleep_rec(False)
    ok, line = fc.verdict_sleep(floor, _sleep_rec(True, stay=True), 1)
    assert not ok and ("slots and scratch 2.25 GiB, but sleep freed 0.00 GiB beyond the "
                       "floor's and the wake brought back 0.00") in line
    ok, line = fc.verdict_sleep(floor, _sleep_rec(True, kv_less=2 * SLOT_BYTES), 1)
    assert not ok and ("vLLM's KV cache 4.50 GiB smaller than the floor's for 2.25 GiB of "
                       "slots (counted twice?)") in line
    cache = _sleep_rec(True)
    cache["phases"]["sleep2"]["outputs"][0]["tokens"][0] = -1
    assert fc.verdict_sleep(floor, cache, 1)[0]  # level 1 is judged on its own stage
    ok, line = fc.verdict_sleep(floor, cache, 2)
    assert not ok and "tokens after waking against the floor's: part at prompt 0, token 0" in line
    cache = _sleep_rec(True)
    cache["phases"]["sleep1"]["memory"]["awake"]["cuda_used"] -= GiB
    ok, line = fc.verdict_sleep(floor, cache, 1)
    assert not ok and ("memory after waking against before: cache -1.00, floor 0.00 GiB"
                       in line.split("NOT met: ")[1])


def test_spec_not_met_when_trap_and_size_differ_or_the_safe_value_reads_through():
    ok, line = fc.verdict_spec(_spec_recs(), {**SIZE, "safe_max_num_seqs": 2})
    assert not ok and "against size (256 ids, 32 slots, safe 2): differ" in line
    recs = _spec_recs()
    recs["spec_cache_safe"]["phases"]["generate"]["counters"]["read_through_decode_steps"] = 3
    ok, line = fc.verdict_spec(recs, SIZE)
    assert not ok and "decode-width read-throughs 3 at the safe value (12 above it)" in line
    recs = _spec_recs()
    recs["spec_cache_above"]["phases"]["generate"]["spec_metrics"]["draft_tokens"] = 0
    ok, line = fc.verdict_spec(recs, SIZE)
    assert not ok and "n-gram drafted no token above the safe value" in line
    recs = _spec_recs()
    recs["spec_cache_above"]["log"]["trap"] = None
    ok, line = fc.verdict_spec(recs, SIZE)
    assert not ok and "spec_cache_above (--max-num-seqs 8) logged no TRAP" in line
    recs = _spec_recs()
    recs["spec_floor_above"]["phases"]["generate"]["outputs"][7]["tokens"][3] = -1
    ok, line = fc.verdict_spec(recs, SIZE)
    assert not ok and ("tokens at --max-num-seqs 8 (above) against the floor's: part at "
                       "prompt 7, token 3") in line


def test_report_reads_a_directory_and_safe_prefers_the_trap_line(tmp_path):
    for name, rec in {"update_floor": _update_rec(False), "update_cache": _update_rec(True),
                      "sleep_floor": _sleep_rec(False), "sleep_cache": _sleep_rec(True),
                      **_spec_recs(), "size_spec": SIZE}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(rec))
    ok, lines = fc.report(tmp_path)
    assert ok and len(lines) == 5
    assert fc.safe_value(tmp_path) == (1, "the TRAP line of spec_cache_above")
    rec = copy.deepcopy(_spec_recs()["spec_cache_above"])
    rec["log"]["trap"] = None
    (tmp_path / "spec_cache_above.json").write_text(json.dumps(rec))
    assert fc.safe_value(tmp_path)[0] == 1  # size's, said so
    assert fc.main(["report", str(tmp_path)]) == 1  # the TRAP is missing: not met


@pytest.mark.parametrize("argv, says", [
    (["nonsense", "--out", "d", "--model", "m"], "arm name 'nonsense': expected CHECK_ROLE"),
    (["update_cache", "--out", "d"], "the following arguments are required: --model"),
    (["report", "/nonexistent/dir"], "report DIR: give the directory the arms wrote"),
    (["safe"], "safe DIR: give the directory the arms wrote (none given)"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    assert fc.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("features_check: error: ") and says in err[0]


def test_an_arm_needs_its_checkpoints(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text("{}")
    assert fc.main(["update_cache", "--out", str(tmp_path / "o"), "--model",
                    str(tmp_path / "a")]) == 2
    assert "--model-b: the update check needs a second checkpoint" in capsys.readouterr().err
    assert fc.main(["spec_cache_above", "--out", str(tmp_path / "o"), "--model",
                    str(tmp_path / "a")]) == 2
    assert "--max-num-seqs: the spec arms need it" in capsys.readouterr().err
    assert fc.main(["sleep_cache", "--out", str(tmp_path / "o"), "--model",
                    str(tmp_path / "nowhere")]) == 2
    assert "no config.json there" in capsys.readouterr().err
    assert fc.main(["safe", str(tmp_path)]) == 2
    assert "names a safe --max-num-seqs" in capsys.readouterr().err


def test_the_second_checkpoint_is_another_draw_of_the_same_shapes(monkeypatch):
    torch = pytest.importorskip("torch", reason="the writer needs torch")
    monkeypatch.setenv("EC_E2E_TINY", "1")
    # the writer and its shape module again, at the tiny shape; put back as they were after
    names = ("write_checkpoint", "e2e_vllm")
    saved = {n: sys.modules.pop(n, None) for n in names}
    try:
        _check_seeds(torch)
    finally:
        for n in names:
            sys.modules.pop(n, None)
            if saved[n] is not None:
                sys.modules[n] = saved[n]


def _check_seeds(torch) -> None:
    import write_checkpoint as wc

    a = dict(wc.tensors(2, "cpu", "bf16", vocab=64))
    b = dict(wc.tensors(2, "cpu", "bf16", vocab=64, seed=1))
    assert a.keys() == b.keys()
    # seed 0 is the checkpoint the benches always wrote: routers from 1000 + layer
    from write_gpt_oss import normal

    g = torch.Generator().manual_seed(1001)
    assert torch.equal(a["model.layers.1.mlp.gate.weight"],
                       normal(g, wc.shape.E, wc.shape.HIDDEN, std=1.0))
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.0.mlp.experts.3.up_proj.weight",
                 "lm_head.weight"):
        assert a[name].shape == b[name].shape and not torch.equal(a[name], b[name])
    assert torch.equal(a["model.norm.weight"], b["model.norm.weight"])  # ones, either way
    with pytest.raises(SystemExit, match="--seed: the Qwen3 shape's formats only"):
        wc.write(Path("/nonexistent"), 1, "mxfp4", seed=1)
