"""The plugin under the vLLM features that change what the slots stand for, on the GPU.

The CPU stand-ins (tests/test_plugin_features.py) prove the plugin's side of each feature
against imitations of vLLM's workers; only a real vLLM shows that its own weight update,
sleep pool and speculative verify steps do what the stand-ins assume. Three checks, each a
pair of fresh engines (floor: ``EXPERT_CACHE_DISABLE=1``; cache: ``EXPERT_CACHE_SLOTS=32``)
serving the bench checkpoint with every expert offloaded (``cpu_offload_gb``,
``cpu_offload_params={"experts"}``), greedy, the same prompts:

- ``update``: generate; ``collective_rpc("reload_weights", kwargs={"weights_path": B})``
  with a second checkpoint (same shapes, another seed); generate; reload the first again;
  generate; then B again through vLLM's weight-transfer API (``start_weight_update``,
  ``update_weights``, ``finish_weight_update``: the path RL trainers use, which bypasses
  ``reload_weights``); generate. Met when the cache's tokens equal the floor's at every
  stage, the update changed them and the experts' bytes (a fingerprint of one expert read in
  the worker), the transfer served B's tokens again, and the plugin logged one slot refresh
  and one all-agreeing check of every expert per update.
- ``sleep``: ``enable_sleep_mode=True``; device memory before ``sleep(level=1)``, asleep and
  after ``wake_up()``; then ``sleep(level=2)``, ``wake_up(tags=["weights"])``,
  ``reload_weights``, ``wake_up(tags=["kv_cache"])`` (the order RL trainers use). Met when
  the cache frees and gets back its slots' and scratch's GiB beyond what the floor does
  (each arm's KV cache set aside: the cache's is smaller by the slots), memory returns to
  where it was, the tokens after each wake equal the floor's and the ones before sleeping,
  and the KV cache vLLM chose is smaller than the floor's by the slots once (not twice).
- ``spec``: n-gram speculative decoding (3 draft tokens) with 8 prompts at once, at
  ``--max-num-seqs 8`` and at the safe value the cache's startup TRAP line names. Met when
  the TRAP line and ``expertcache size`` (same slots and flags) agree, the tokens equal the
  floor's at both, no decode-width step read through at the safe value, and n-gram drafted.

Before each pair, a warm-up arm (``CHECK_floor_warm``, ``spec_floor_warmabove``,
``spec_floor_warmsafe``: the engine of the pair's configuration started once, one short
generation, no verdict) compiles the model, so that the floor and the cache both load the
same compiled artifacts. vLLM's first start of a configuration compiles it and later starts
load what it compiled, and the two are not the same computation: on the H200 a floor
started cold parted from a floor started warm at a near-tie within 64 tokens, while the
warm floor and the cache agreed on every token of every stage.

Each arm runs in its own process group (a fresh engine; the plugin reads its environment
once a process), in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the plugin's
counters, slot bytes and vLLM's KV tensors are read directly. The arm writes ``OUT/NAME.json``
after every stage (an engine that dies keeps what it measured) and its log ``OUT/NAME.log``;
the driver adds the plugin's log lines (the startup line, the check of every expert, the
memory plan, each slot refresh) and marks the record ``ok`` once every stage ran.

    python bench/features_check.py update_cache --out DIR --model A --model-b B
    python bench/features_check.py spec_cache_above --out DIR --model A --max-num-seqs 8
    python bench/features_check.py size --out DIR --model A --max-num-seqs 8
    python bench/features_check.py safe DIR      # the TRAP line's safe --max-num-seqs
    python bench/features_check.py report DIR    # one line a check: met / NOT met

Arm names are ``CHECK_ROLE[_VARIANT]``: CHECK update, sleep or spec; ROLE floor or cache.
`bench/run_features_on_device.sh` runs them all on the GPU box;
tests/bench/test_bench_features_check.py runs the flow with vLLM stubbed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

GiB = 1024**3
CHECKS = ("update", "sleep", "spec")
ROLES = ("floor", "cache")
NAME_RE = re.compile(r"^(?P<check>update|sleep|spec)_(?P<role>floor|cache)"
                     r"(?:_(?P<variant>[a-z0-9]+))?$")

#: the engine every arm starts (the spec arms' max_num_seqs is given): a short context and
#: a small KV cache (the memory numbers of the sleep check stay readable), no prefix cache
#: (a prompt served again after new weights must not reuse KV computed with the old ones)
#: every arm's KV cache, given rather than profiled: two engines whose KV caches differ in
#: size are not the same computation (vLLM's floor against itself, one engine with sleep
#: mode and one without, part at a near-tie within 64 tokens), so the floor and the cache
#: are compared at one KV size; `expertcache serve` passes one too
KV_CACHE_BYTES = 4 * 1024**3
MAX_MODEL_LEN = 1024
MAX_BATCHED_TOKENS = 2048
GPU_MEMORY_UTILIZATION = 0.3
MAX_NUM_SEQS = 4  # update and sleep: 2 prompts; 4 x top_k 8 = 32 ids, within 32 slots
#: the update arms' weight-transfer backend (registered in the arm's process, where the
#: in-process engine's worker runs): vLLM's own start/update/finish_weight_update, whose
#: chunks here name a checkpoint directory that the worker reads. vLLM's IPC and NCCL
#: transports need a trainer in a second process; what they deliver to the model between
#: start and finish (``model.load_weights`` inside a layerwise reload) is the same.
TRANSFER_BACKEND = "expertcache_bench_files"
SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}

#: update and sleep: two prompts of the bench's word-level vocabulary
PROMPTS = ("w17 w923 w4410 w88 w5120 w3 w777 w2048 w60 w1999 w4096 w31 w8000 w12 w640 w5",
           "w301 w7 w6502 w44 w190 w8111 w2 w5005 w77 w3030 w612 w9 w4000 w250 w1234 w88")
#: spec: eight prompts, each a phrase said three times, so that n-gram lookup (the last 4
#: tokens seen before) drafts from the first decode step on
SPEC_PROMPTS = tuple(" ".join([f"w{100 + 37 * i} w{2000 + 11 * i} w{4000 + 7 * i} "
                               f"w{6000 + 3 * i} w{50 + i}"] * 3) for i in range(8))

#: what "the same GiB" means when memory is compared: 5% or 0.1 GiB, whichever is more
#: (vLLM's pools round to pages; the floor and the cache differ by a few allocations)
MEM_TOL_FRACTION, MEM_TOL_BYTES = 0.05, int(0.1 * GiB)


class Refused(Exception):
    """Bad input: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        raise Refused(message)


# ----------------------------------------------------------------------------- names
def parse_name(name: str) -> tuple[str, str, str | None]:
    m = NAME_RE.match(name)
    if not m:
        raise Refused(f"arm name {name!r}: expected CHECK_ROLE[_VARIANT], CHECK one of "
                      f"{', '.join(CHECKS)}, ROLE floor or cache (e.g. update_cache, "
                      "spec_floor_safe)")
    return m.group("check"), m.group("role"), m.group("variant")


def offload_gib(layers: int) -> float:
    """--cpu-offload-gb for every expert of ``layers`` layers, and 1 GiB of headroom."""
    import e2e_vllm as shape

    return round(shape.E * shape.EXPERT_BYTES * layers / GiB + 1, 2)


def engine_kwargs(model: str, check: str, layers: int, max_num_seqs: int,
                  cuda: bool = True) -> dict:
    """`vllm.LLM`'s arguments for one arm (vLLM 0.26's names)."""
    kw: dict = {"model": model, "dtype": "bfloat16", "seed": 0, "max_model_len": MAX_MODEL_LEN,
                "max_num_seqs": max_num_seqs, "max_num_batched_tokens": MAX_BATCHED_TOKENS,
                "enable_prefix_caching": False, "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
                "cpu_offload_gb": offload_gib(layers), "cpu_offload_params": {"experts"},
                "kv_cache_memory_bytes": KV_CACHE_BYTES}
    if cuda:  # the box's vLLM has no FlashAttention
        kw["attention_backend"] = "TRITON_ATTN"
    if check == "update":
        kw["weight_transfer_config"] = {"backend": TRANSFER_BACKEND}
    if check == "sleep":
        kw["enable_sleep_mode"] = True
    if check == "spec":
        kw["speculative_config"] = dict(SPEC_CONFIG)
        kw["disable_log_stats"] = False  # get_metrics(): what n-gram drafted
    return kw


def spec_size_flags(max_num_seqs: int) -> list[str]:
    """The vLLM flags `expertcache size` is given for the spec arms: the engine's own."""
    return ["--speculative-config", json.dumps(SPEC_CONFIG), "--max-num-seqs",
            str(max_num_seqs), "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]


def child_env(role: str, slots: int, extra: list[str],
              environ: dict[str, str] | None = None) -> dict[str, str]:
    """The arm process's environment: vLLM in this process, the V1 runner where the
    installed V2 runner cannot offload (0.26), no FlashInfer sampler, offline; the plugin
    off (floor) or at ``slots`` (cache); nothing of the caller's EXPERT_CACHE_* kept."""
    from expertcache_cli.errors import UserError
    from expertcache_cli.vllm_facts import installed_vllm, vllm_runner

    base = dict(os.environ if environ is None else environ)
    env = {k: v for k, v in base.items() if not k.startswith("EXPERT_CACHE_")}
    try:
        runner_env, _ = vllm_runner.offload_runner_env(
            base, vllm_runner.v2_runner_offloads(), installed_vllm.release())
    except UserError as exc:
        raise Refused(str(exc)) from None
    env.update(runner_env)
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0",
                "HF_HUB_OFFLINE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    if role == "floor":
        env["EXPERT_CACHE_DISABLE"] = "1"
    else:
        env["EXPERT_CACHE_SLOTS"] = str(slots)
    for kv in extra:
        if "=" not in kv:
            raise Refused(f"--env {kv!r}: expected K=V")
        k, v = kv.split("=", 1)
        env[k] = v
    return env


# ----------------------------------------------------------------------------- the arm
def _smi_used_mib() -> float | None:
    dev = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                              "--format=csv,noheader,nounits", "-i", dev],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return float(out.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def device_memory() -> dict:
    """Device memory in use now: torch's ``mem_get_info`` (bytes, the whole device) and
    nvidia-smi's MiB, each None where it cannot be read. Torch's cached free blocks are
    released first (a reload materialises each layer outside vLLM's pools; what the caching
    allocator keeps of that is nobody's memory)."""
    out: dict = {"cuda_used": None}
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            try:  # (vLLM's own sleep() does the same; a reading without it still counts)
                torch.cuda.empty_cache()
            except Exception:
                pass
            free, total = torch.cuda.mem_get_info()
            out["cuda_used"] = int(total - free)
    except Exception:
        pass
    out["smi_used_mib"] = _smi_used_mib()
    return out


def used_bytes(m: dict | None) -> int | None:
    """Bytes in use from a `device_memory` reading: torch's where present, else smi's."""
    if not m:
        return None
    if m.get("cuda_used") is not None:
        return int(m["cuda_used"])
    return None if m.get("smi_used_mib") is None else int(m["smi_used_mib"] * 2**20)


def _kv_bytes(worker) -> int:
    """In the worker: bytes of vLLM's KV cache tensors (each backing storage once)."""
    seen = {}
    for t in worker.model_runner.kv_caches:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return int(sum(seen.values()))


def _expert_fingerprint(worker) -> float:
    """In the worker: the sum of the first expert's w13 rows of the first MoE layer (read
    where vLLM keeps it, host memory when offloaded): it moves when the experts' bytes do."""
    model = worker.model_runner.get_model()
    for name, p in model.named_parameters():
        if name.endswith("w13_weight"):
            return float(p[0].float().sum().item())
    raise LookupError("no w13_weight parameter in the model")


def _rpc(llm, fn: Callable) -> tuple[object, str | None]:
    try:
        return llm.collective_rpc(fn)[0], None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def plugin_facts() -> dict:
    """The plugin's session in this process: layers armed, slot and scratch bytes."""
    from expertcache_cli.plugin import session as ec_session

    ss = ec_session.sessions()
    if not ss:
        return {"armed_layers": 0, "slot_bytes": 0, "scratch_bytes": 0}
    s = ss[0]
    return {"armed_layers": len(s.armed), "slot_bytes": int(s.slot_bytes),
            "scratch_bytes": int(s.scratch_bytes),
            "slots": s.armed[0].decision.num_slots if s.armed else 0}


def counters() -> dict | None:
    from expertcache_cli.plugin import session as ec_session

    ss = ec_session.sessions()
    if not ss:
        return None
    return {k: v for k, v in ss[0].totals().items() if k != "layers"}


def generate(llm, prompts: tuple[str, ...], tokens: int, logprobs: bool = True) -> list[dict]:
    """Greedy completions of ``prompts`` (one engine call: they run as one batch), each as
    token ids with, where asked, each position's margin (chosen logprob minus the
    runner-up's): where two arms part, whether it was at a near-tie."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                        logprobs=2 if logprobs else None)
    outs = llm.generate(list(prompts), sp, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        margins = []
        for top in (c.logprobs or []):
            ranked = sorted((getattr(v, "logprob", v) for v in (top or {}).values()),
                            reverse=True)
            margins.append(ranked[0] - ranked[1] if len(ranked) > 1 else None)
        res.append({"tokens": list(c.token_ids), "margin": margins})
    return res


def spec_metrics(llm) -> dict:
    """vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens), summed
    over their label sets (one a engine)."""
    try:
        metrics = llm.get_metrics()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    out: dict = {}
    for m in metrics:
        name = getattr(m, "name", "")
        if name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                    "vllm:spec_decode_num_accepted_tokens"):
            key = name.removeprefix("vllm:spec_decode_num_")
            out[key] = out.get(key, 0) + int(getattr(m, "value", 0) or 0)
    return out


def _timed(fn: Callable[[], object]) -> tuple[object, float]:
    t = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - t, 2)


def register_transfer_engine() -> None:
    """vLLM's weight-transfer factory learns `TRANSFER_BACKEND`: a worker-side engine whose
    update chunk is ``{"path": DIR}``, each safetensors file of DIR loaded onto the worker's
    device and handed to ``model.load_weights`` inside vLLM's layerwise reload (what its IPC
    and NCCL engines do with the tensors they receive)."""
    from dataclasses import dataclass

    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    @dataclass
    class FilesInit(WeightTransferInitInfo):
        pass

    @dataclass
    class FilesUpdate(WeightTransferUpdateInfo):
        path: str

    class FilesEngine(WeightTransferEngine):
        init_info_cls = FilesInit
        update_info_cls = FilesUpdate

        def init_transfer_engine(self, init_info) -> None:
            pass

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def receive_weights(self, update_info) -> None:
            from safetensors.torch import load_file

            for f in sorted(Path(update_info.path).glob("*.safetensors")):
                self.model.load_weights(list(load_file(str(f), device=str(self.device))
                                             .items()))

        def shutdown(self) -> None:
            pass

        @staticmethod
        def trainer_send_weights(iterator, trainer_args) -> None:
            raise NotImplementedError("the bench's file transport has no trainer side")

    if TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, FilesEngine)


def transfer_weights(llm, path: str) -> None:
    """One weight update through vLLM's weight-transfer API, as a trainer drives it."""
    llm.start_weight_update()
    llm.update_weights({"update_info": {"path": path}})
    llm.finish_weight_update()


def run_update(llm, a, rec: dict, save: Callable[[], None]) -> None:
    phases = rec["phases"]

    def stage(name: str) -> None:
        fp, err = _rpc(llm, _expert_fingerprint)
        phases[name] = {"outputs": generate(llm, PROMPTS, a.tokens), "counters": counters(),
                        "fingerprint": fp, "fingerprint_error": err}
        save()

    stage("before")
    for name, path in (("after", a.model_b), ("back", a.model)):
        _, s = _timed(lambda p=path: llm.collective_rpc(
            "reload_weights", kwargs={"weights_path": str(p)}))
        phases[f"reload_{name}"] = {"weights_path": str(path), "seconds": s}
        save()
        stage(name)
    _, s = _timed(lambda: transfer_weights(llm, str(a.model_b)))
    phases["transfer_update"] = {"path": str(a.model_b), "seconds": s}
    save()
    stage("transfer")


def run_sleep(llm, a, rec: dict, save: Callable[[], None]) -> None:
    phases = rec["phases"]
    phases["before"] = {"outputs": generate(llm, PROMPTS, a.tokens), "counters": counters()}
    save()
    # level 1: weights (and slots) backed up to host, KV discarded; a plain wake
    mem = {"before": device_memory()}
    _, s_sleep = _timed(lambda: llm.sleep(level=1))
    mem["asleep"] = device_memory()
    save()
    _, s_wake = _timed(llm.wake_up)
    mem["awake"] = device_memory()
    phases["sleep1"] = {"memory": mem, "seconds": {"sleep": s_sleep, "wake": s_wake}}
    save()
    phases["sleep1"]["outputs"] = generate(llm, PROMPTS, a.tokens)
    phases["sleep1"]["counters"] = counters()
    save()
    # level 2: everything discarded; the weights woken, reloaded, then the KV cache
    mem = {"before": device_memory()}
    _, s_sleep = _timed(lambda: llm.sleep(level=2))
    mem["asleep"] = device_memory()
    save()
    _, s_wake = _timed(lambda: llm.wake_up(tags=["weights"]))
    mem["weights"] = device_memory()
    _, s_reload = _timed(lambda: llm.collective_rpc("reload_weights"))
    _, s_kv = _timed(lambda: llm.wake_up(tags=["kv_cache"]))
    mem["awake"] = device_memory()
    phases["sleep2"] = {"memory": mem, "seconds": {"sleep": s_sleep, "wake_weights": s_wake,
                                                   "reload": s_reload, "wake_kv": s_kv}}
    save()
    phases["sleep2"]["outputs"] = generate(llm, PROMPTS, a.tokens)
    phases["sleep2"]["counters"] = counters()
    save()


def is_warmup(variant: str | None) -> bool:
    """A warm-up arm: it only starts the engine (compiling the model) and generates once."""
    return bool(variant) and variant.startswith("warm")


def run_warmup(llm, a, rec: dict, save: Callable[[], None]) -> None:
    rec["phases"]["warmup"] = {"outputs": generate(llm, PROMPTS[:1], 4, logprobs=False)}
    save()


def run_spec(llm, a, rec: dict, save: Callable[[], None]) -> None:
    before = counters()
    outs = generate(llm, SPEC_PROMPTS, a.tokens, logprobs=False)
    rec["phases"]["generate"] = {"outputs": outs, "counters_before": before,
                                 "counters": counters(), "spec_metrics": spec_metrics(llm)}
    save()


def child_main(a) -> int:
    """Inside the arm's own process: the engine, the check's stages, the record."""
    check, role, variant = parse_name(a.name)
    out = Path(a.out)
    path = out / f"{a.name}.json"
    rec: dict = {"arm": a.name, "check": check, "role": role, "variant": variant,
                 "status": "running", "complete": False, "phases": {},
                 "env": {k: v for k, v in os.environ.items() if k.startswith("EXPERT_CACHE_")}}

    def save() -> None:
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(rec, indent=1))
        tmp.replace(path)

    save()
    code = 1
    try:
        import vllm
        from vllm import LLM

        from expertcache_cli.planning import launch

        rec["vllm"] = getattr(vllm, "__version__", None)
        rec["plugin_entry_point"] = launch.plugin_installed()
        if not rec["plugin_entry_point"]:
            import expertcache_cli.plugin as plugin

            plugin.register()  # this process is the worker's: as the entry point would
        try:
            import torch

            cuda = torch.cuda.is_available()
        except ImportError:
            cuda = False
        kw = engine_kwargs(a.model, check, a.layers, a.max_num_seqs, cuda)
        if check == "update":
            register_transfer_engine()
        rec["engine"] = {k: sorted(v) if isinstance(v, set) else v for k, v in kw.items()}
        save()
        llm, rec["startup_s"] = _timed(lambda: LLM(**kw))
        rec["plugin"] = plugin_facts()
        rec["kv_bytes"], rec["kv_bytes_error"] = _rpc(llm, _kv_bytes)
        save()
        run = run_warmup if is_warmup(variant) else {
            "update": run_update, "sleep": run_sleep, "spec": run_spec}[check]
        run(llm, a, rec, save)
        rec["complete"] = True
        code = 0
    except Exception as exc:
        import traceback

        traceback.print_exc()
        rec["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            from expertcache_cli.plugin import session as ec_session

            for s in ec_session.sessions():
                s.close()  # the final counters line, into the log
        except Exception:
            pass
        rec["status"] = "complete" if code == 0 else "failed"
        save()
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    # vLLM's in-process engine can hang in its teardown: the record is written, so leave
    # now (the driver ends whatever this process group still holds)
    os._exit(code)


# ----------------------------------------------------------------------------- the log
SWEEP_RE = re.compile(r"expertcache: (?P<when>startup|new weights) check of every expert .*?: "
                      r"(?P<agreed>\d+) of (?P<layers>\d+) layers agreed"
                      r"(?: \(largest row difference (?P<diff>[^)]+)\))?")
EMPTIED_RE = re.compile(r"expertcache: (?P<why>.+?): the slots of (?P<n>\d+) layer\(s\) emptied")
KV_RE = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
VLLM_SLEEP_RE = re.compile(r"Sleep mode freed ([\d.]+) GiB memory, ([\d.]+) GiB memory is still")
TRAP_RE = re.compile(r"a full batch of (?P<seqs>\d+) seqs.*? = (?P<ids>\d+) ids > (?P<slots>\d+) "
                     r"slots.*?--max-num-seqs (?P<safe>\d+) keeps")


def read_log(text: str) -> dict:
    """The plugin's and vLLM's lines an arm's verdict needs."""
    from expertcache_cli.baseline.counters import ARMED_RE, parse_stats_line

    out: dict = {"startup_line": None, "armed_layers": None, "moe_layers": None, "trap": None,
                 "disabled": False, "memory_line": None, "sweeps": [], "emptied": [],
                 "check_line": None, "kv_gib": None, "vllm_sleep": [], "not_armed": [],
                 "final": None}
    for line in text.splitlines():
        at = line.find("expertcache:")
        own = line[at:] if at >= 0 else ""
        if (m := ARMED_RE.search(line)):
            out["startup_line"] = own
            out["armed_layers"], out["moe_layers"] = int(m.group("armed")), int(m.group("layers"))
            out["trap"] = own[own.index("TRAP:"):] if "TRAP:" in own else None
        elif "EXPERT_CACHE_DISABLE=1: no layer will be armed" in line:
            out["disabled"] = True
        elif "expertcache: memory plan" in line:
            out["memory_line"] = own
        elif (m := SWEEP_RE.search(line)):
            out["sweeps"].append({"when": m.group("when"), "agreed": int(m.group("agreed")),
                                  "layers": int(m.group("layers")), "diff": m.group("diff"),
                                  "line": own})
        elif (m := EMPTIED_RE.search(line)):
            out["emptied"].append({"why": m.group("why"), "layers": int(m.group("n"))})
        elif "expertcache: first-call checks" in line:
            out["check_line"] = own
        elif "not armed:" in line and own:
            out["not_armed"].append(own)
        if (m := KV_RE.search(line)):
            out["kv_gib"] = float(m.group(1))
        if (m := VLLM_SLEEP_RE.search(line)):
            out["vllm_sleep"].append({"freed_gib": float(m.group(1)),
                                      "in_use_gib": float(m.group(2))})
        got = parse_stats_line(line)
        if got and got["final"]:
            out["final"] = got
    return out


def _exited_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the child ``pid`` to exit, without reaping it."""
    deadline = time.monotonic() + timeout_s
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def run_arm(a) -> int:
    """The driver's side of one arm: its process group, its time limit, its log read."""
    from expertcache_cli.baseline import groups

    check, role, variant = parse_name(a.name)
    if not Path(a.model, "config.json").is_file():
        raise Refused(f"--model {a.model}: no config.json there (bench/write_checkpoint.py "
                      "writes the checkpoint)")
    if (check == "update" and not is_warmup(variant)
            and not (a.model_b and Path(a.model_b, "config.json").is_file())):
        raise Refused("--model-b: the update check needs a second checkpoint directory")
    if check == "spec" and a.max_num_seqs is None:
        raise Refused("--max-num-seqs: the spec arms need it (8, or `features_check.py safe "
                      "DIR`)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = child_env(role, a.slots, a.env)
    max_num_seqs = a.max_num_seqs or MAX_NUM_SEQS
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", a.name, "--out", str(out),
           "--model", a.model, "--layers", str(a.layers), "--tokens", str(a.tokens),
           "--max-num-seqs", str(max_num_seqs)]
    if a.model_b:
        cmd += ["--model-b", a.model_b]
    log = out / f"{a.name}.log"
    path = out / f"{a.name}.json"
    path.unlink(missing_ok=True)
    directory = groups.record_dir()
    t0 = time.time()
    with open(log, "w") as fh:
        # a session of its own: its process group is exactly what this arm started
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
        if directory is not None:
            groups.record(directory, p.pid, cmd)
        try:
            ended = _exited_unreaped(p.pid, a.timeout_s)
        finally:
            # the leader is not reaped yet, so its PID (the group's ID) is still ours: end
            # what the group holds (the engine on a timeout, compile workers after an exit)
            groups.end_group(p.pid, grace_s=5.0)
            rc: int | str = p.wait()
            if directory is not None:
                groups.forget(directory, p.pid)
        if not ended:
            rc = "timeout"
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        rec = {"arm": a.name, "check": check, "role": role, "phases": {}}
    text = log.read_text(errors="replace")
    rec["rc"], rec["wall_s"] = rc, round(time.time() - t0, 1)
    rec["log"] = read_log(text)
    ok = rc == 0 and rec.get("complete") is True
    rec["status"] = "ok" if ok else "failed"
    if not ok:
        from expertcache_cli.baseline.runner import failure_cause

        rec["cause"] = rec.get("error") or failure_cause(text) or f"exit {rc}"
        rec["log_tail"] = text.splitlines()[-30:]
    path.write_text(json.dumps(rec, indent=1))
    lg = rec["log"]
    print(f"{a.name}: {rec['status']} in {rec['wall_s']} s (startup {rec.get('startup_s')} s); "
          f"armed {lg['armed_layers']} of {lg['moe_layers']}"
          + (f"; {rec['cause']}" if not ok else ""), flush=True)
    return 0 if ok else 1


# ----------------------------------------------------------------------------- size, safe
def run_size(a) -> int:
    """`expertcache size` for the spec arms' slots and flags, as JSON and as text."""
    if not Path(a.model, "config.json").is_file():
        raise Refused(f"--model {a.model}: no config.json there")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "expertcache_cli", "size", "--model", a.model, "--vram",
            str(a.vram), "--slots", str(a.slots)]
    flags = ["--", *spec_size_flags(a.max_num_seqs)]
    r = subprocess.run([*base, "--json", *flags], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"size failed (exit {r.returncode}): {r.stderr.strip()[-400:]}")
        return 1
    (out / "size_spec.json").write_text(r.stdout)
    t = subprocess.run([*base, *flags], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "200"})
    (out / "size_spec.txt").write_text(t.stdout + t.stderr)
    d = json.loads(r.stdout)
    print(f"size: {d.get('slots')} slots, trap {d.get('trap')} ({d.get('trap_ids')} ids), "
          f"safe --max-num-seqs {d.get('safe_max_num_seqs')}")
    return 0


def _load(directory: Path, name: str) -> dict | None:
    try:
        return json.loads((directory / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def parse_trap(text: str | None) -> dict | None:
    m = TRAP_RE.search(text or "")
    return {k: int(v) for k, v in m.groupdict().items()} if m else None


def safe_value(directory: Path) -> tuple[int, str]:
    """The safe --max-num-seqs for the spec arms: the cache's startup TRAP line's, else
    (no TRAP line) size's, saying which."""
    rec = _load(directory, "spec_cache_above")
    trap = parse_trap(((rec or {}).get("log") or {}).get("trap"))
    if trap:
        return trap["safe"], "the TRAP line of spec_cache_above"
    size = _load(directory, "size_spec")
    if size and size.get("trap") and size.get("safe_max_num_seqs"):
        return int(size["safe_max_num_seqs"]), "size (spec_cache_above logged no TRAP line)"
    raise Refused(f"{directory}: neither spec_cache_above's TRAP line nor size_spec.json "
                  "names a safe --max-num-seqs (run the spec_cache_above arm and `size` first)")


# ----------------------------------------------------------------------------- verdicts
def compare(a: list[dict] | None, b: list[dict] | None) -> dict:
    """Two arms' greedy outputs, prompt by prompt: identical, or where they first part and
    each arm's margin there."""
    if not a or not b:
        return {"identical": False, "missing": True}
    if len(a) != len(b):
        return {"identical": False, "prompts": [len(a), len(b)]}
    for i, (x, y) in enumerate(zip(a, b)):
        tx, ty = x["tokens"], y["tokens"]
        n = min(len(tx), len(ty))
        split = next((j for j in range(n) if tx[j] != ty[j]), None)
        if split is None and len(tx) != len(ty):
            split = n
        if split is not None:
            def margin(o: dict, j: int = split) -> float | None:
                m = o.get("margin") or []
                return m[j] if j < len(m) else None

            return {"identical": False, "prompt": i, "token": split,
                    "margin_a": margin(x), "margin_b": margin(y)}
    return {"identical": True, "prompts": len(a), "tokens": len(a[0]["tokens"])}


def describe(c: dict) -> str:
    if c.get("missing"):
        return "not recorded"
    if c["identical"]:
        return f"identical ({c['prompts']} prompts x {c['tokens']} tokens)"
    if "prompts" in c:
        return f"{c['prompts'][0]} against {c['prompts'][1]} prompts"
    text = f"part at prompt {c['prompt']}, token {c['token']}"
    ma, mb = c.get("margin_a"), c.get("margin_b")
    if ma is not None or mb is not None:
        shown = ("n/a" if v is None else f"{v:.4f}" for v in (ma, mb))
        text += " (margins " + " / ".join(shown) + ")"
    return text


def _outputs(rec: dict | None, phase: str) -> list[dict] | None:
    return (((rec or {}).get("phases") or {}).get(phase) or {}).get("outputs")


def _gib(b: float | None) -> str:
    return "n/a" if b is None else f"{b / GiB:.2f}"


def _close(x: float, target: float) -> bool:
    return abs(x - target) <= max(MEM_TOL_FRACTION * abs(target), MEM_TOL_BYTES)


def _incomplete(recs: dict[str, dict | None], phases: tuple[str, ...]) -> str | None:
    """Why these arms cannot be judged on ``phases``, or None. An arm that failed after
    recording them still counts (a later stage's crash does not hide an earlier result)."""
    bad = []
    for name, rec in recs.items():
        if rec is None:
            bad.append(f"{name} not run")
            continue
        missing = [ph for ph in phases if _outputs(rec, ph) is None]
        if missing:
            why = rec.get("cause") or rec.get("error") or rec.get("status", "unfinished")
            bad.append(f"{name} stopped before its {missing[0]} stage ({why})")
    return "; ".join(bad) if bad else None


def arming_problems(cache: dict, floor: dict | None = None) -> list[str]:
    """What the plugin's own lines say about the cache arm (and that the floor armed
    nothing): every MoE layer armed, the startup check of every expert agreed everywhere,
    the memory-plan line logged."""
    lg = cache.get("log") or {}
    out = []
    if not lg.get("armed_layers") or lg.get("armed_layers") != lg.get("moe_layers"):
        out.append(f"{cache.get('arm')} armed {lg.get('armed_layers')} of {lg.get('moe_layers')}"
                   f" MoE layers ({lg.get('startup_line') or 'no startup line'})")
    sweeps = lg.get("sweeps") or []
    if not any(s["when"] == "startup" for s in sweeps):
        out.append(f"{cache.get('arm')}: no startup check of every expert in the log")
    out += [f"{cache.get('arm')}: {s['line']}" for s in sweeps if s["agreed"] != s["layers"]]
    if not lg.get("memory_line"):
        out.append(f"{cache.get('arm')}: no memory-plan line in the log")
    if floor is not None:
        fl = floor.get("log") or {}
        if fl.get("armed_layers"):
            out.append(f"{floor.get('arm')} (the floor) armed {fl['armed_layers']} layers")
    return out


def _failed_later(*recs: dict) -> list[str]:
    """The arms that failed after the stages judged here (said, not held against them)."""
    return [f"{r.get('arm')} failed later: {r.get('cause') or r.get('error')}"
            for r in recs if r.get("status") != "ok"]


def _verdict(name: str, problems: list[str], facts: list[str],
             *recs: dict) -> tuple[bool, str]:
    facts = facts + _failed_later(*recs)
    if problems:
        return False, f"{name}: NOT met: " + "; ".join(problems) + (
            " (" + "; ".join(facts) + ")" if facts else "")
    return True, f"{name}: met: " + "; ".join(facts)


def verdict_update(floor: dict | None, cache: dict | None) -> tuple[bool, str]:
    name = "weight update (reload_weights; start/update/finish_weight_update)"
    if (why := _incomplete({"update_floor": floor, "update_cache": cache},
                           ("before", "after", "back", "transfer"))):
        return False, f"{name}: NOT met: {why}"
    problems, facts = arming_problems(cache, floor), []
    labels = {"before": "before the update", "after": "after reloading the second checkpoint",
              "back": "after reloading the first again",
              "transfer": "after the second through the weight-transfer API"}
    for phase, label in labels.items():
        c = compare(_outputs(cache, phase), _outputs(floor, phase))
        (facts if c["identical"] else problems).append(
            f"{label} the cache against the floor: {describe(c)}")
    moved = compare(_outputs(cache, "before"), _outputs(cache, "after"))
    if moved["identical"]:
        problems.append("the update did not change the tokens (the check shows nothing)")
    else:
        facts.append(f"the update changed the tokens (first at prompt {moved.get('prompt')}, "
                     f"token {moved.get('token')})")
    same = compare(_outputs(cache, "after"), _outputs(cache, "transfer"))
    if not same["identical"]:
        problems.append("the second checkpoint through the weight-transfer API did not serve "
                        f"what its reload served: {describe(same)}")
    fp = [((cache.get("phases") or {}).get(p) or {}).get("fingerprint")
          for p in ("before", "after", "back", "transfer")]
    if None in fp:
        facts.append("the experts' fingerprint was not read")
    elif fp[0] == fp[1] or fp[2] == fp[3]:
        problems.append(f"an update left the experts' bytes as they were (fingerprints "
                        f"{', '.join(f'{v:.6g}' for v in fp)}): nothing here tests the "
                        "slots' refresh")
    else:
        facts.append(f"the experts changed (fingerprint {fp[0]:.6g} -> {fp[1]:.6g}; "
                     f"{fp[2]:.6g} -> {fp[3]:.6g} by the transfer)")
    lg = cache.get("log") or {}
    armed = lg.get("armed_layers")
    emptied = lg.get("emptied") or []
    for what, key, want in (("reloads", "reloaded", 2), ("weight transfers", "weight update", 1)):
        got = [e for e in emptied if key in e["why"]]
        if len(got) < want or any(e["layers"] != armed for e in got):
            problems.append(f"{len(got)} slot refreshes logged for {want} {what} "
                            f"({', '.join(str(e['layers']) for e in got) or 'none'} layers)")
    new = [s for s in lg.get("sweeps") or [] if s["when"] == "new weights"]
    if len(new) < 3 or any(s["agreed"] != s["layers"] for s in new):
        problems.append(f"checks of every expert on the new weights (3 updates): "
                        f"{[s['line'] for s in new] or 'none logged'}")
    else:
        facts.append(f"each of the {len(new)} updates emptied the slots of {armed} layers and "
                     f"the new-weights check agreed on {new[-1]['agreed']} of "
                     f"{new[-1]['layers']} layers (largest row difference {_largest_diff(new)})")
    return _verdict(name, problems, facts, floor, cache)


def _largest_diff(sweeps: list[dict]) -> str:
    vals = []
    for s in sweeps:
        try:
            vals.append(float(s.get("diff") or 0))
        except ValueError:
            return str(s.get("diff"))
    return f"{max(vals, default=0.0):.3g}"


def _kv(rec: dict) -> int | None:
    if rec.get("kv_bytes") is not None:
        return int(rec["kv_bytes"])
    gib = (rec.get("log") or {}).get("kv_gib")
    return None if gib is None else int(gib * GiB)


def verdict_sleep(floor: dict | None, cache: dict | None, level: int) -> tuple[bool, str]:
    name = ("sleep level 1 (wake_up())" if level == 1 else
            "sleep level 2 (wake weights, reload_weights, wake KV)")
    phase = f"sleep{level}"
    if (why := _incomplete({"sleep_floor": floor, "sleep_cache": cache}, ("before", phase))):
        return False, f"{name}: NOT met: {why}"
    problems, facts = arming_problems(cache, floor), []
    pc = cache.get("plugin") or {}
    want = int(pc.get("slot_bytes") or 0) + int(pc.get("scratch_bytes") or 0)
    kv_f, kv_c = _kv(floor), _kv(cache)
    mem = {}
    for role, rec in (("floor", floor), ("cache", cache)):
        m = ((rec.get("phases") or {}).get(phase) or {}).get("memory") or {}
        mem[role] = {k: used_bytes(m.get(k)) for k in ("before", "asleep", "awake")}
    readings = [v for r in mem.values() for v in r.values()]
    if not want:
        problems.append("the cache arm reports no slot bytes")
    elif None in readings or kv_f is None or kv_c is None:
        problems.append("device memory or a KV size was not read")
    else:
        f, c = mem["floor"], mem["cache"]
        freed = (c["before"] - c["asleep"] - kv_c) - (f["before"] - f["asleep"] - kv_f)
        back = (c["awake"] - c["asleep"] - kv_c) - (f["awake"] - f["asleep"] - kv_f)
        what = f"slots and scratch {_gib(want)} GiB"
        if _close(freed, want) and _close(back, want):
            facts.append(f"{what}: sleep freed {_gib(freed)} GiB beyond the floor's and the "
                         f"wake brought back {_gib(back)} (KV cache set aside)")
        else:
            problems.append(f"{what}, but sleep freed {_gib(freed)} GiB beyond the floor's "
                            f"and the wake brought back {_gib(back)} (KV cache set aside)")
        wm = [((r.get("phases") or {}).get(phase) or {}).get("memory", {}).get("weights")
              for r in (floor, cache)]
        if all(used_bytes(x) is not None for x in wm):  # level 2: the weights' wake alone
            alone = ((used_bytes(wm[1]) - c["asleep"]) - (used_bytes(wm[0]) - f["asleep"]))
            (facts if _close(alone, want) else problems).append(
                f"waking the weights alone brought back {_gib(alone)} GiB beyond the floor's")
        # awake against before: what vLLM itself keeps or drops the floor shows too
        drift = {r: mem[r]["awake"] - mem[r]["before"] for r in mem}
        text = (f"memory after waking against before: cache {_gib(drift['cache'])}, floor "
                f"{_gib(drift['floor'])} GiB")
        if abs(drift["cache"] - drift["floor"]) <= MEM_TOL_BYTES:
            facts.append(text)
        else:
            problems.append(text)
    c = compare(_outputs(cache, phase), _outputs(floor, phase))
    (facts if c["identical"] else problems).append(
        f"tokens after waking against the floor's: {describe(c)}")
    same = compare(_outputs(cache, phase), _outputs(cache, "before"))
    (facts if same["identical"] else problems).append(
        f"against the cache's own before sleeping: {describe(same)}")
    emptied = (cache.get("log") or {}).get("emptied") or []
    woke = [e for e in emptied if "woke" in e["why"]]
    if len(woke) < level:
        problems.append(f"{len(woke)} slot refreshes on waking logged by level {level}")
    if level == 2 and not any("reloaded" in e["why"] for e in emptied):
        problems.append("no slot refresh logged for the reload after level 2")
    given = {(r.get("engine") or {}).get("kv_cache_memory_bytes") for r in (floor, cache)}
    if level == 1 and given != {None}:
        (facts if len(given) == 1 else problems).append(
            "the KV cache given to each engine: "
            + " / ".join(_gib(g) if g else "profiled" for g in
                         ((r.get("engine") or {}).get("kv_cache_memory_bytes")
                          for r in (cache, floor))) + " GiB (cache / floor)")
    elif level == 1 and want and kv_f is not None and kv_c is not None:
        less = kv_f - kv_c
        if 0.5 * want <= less <= 1.5 * want:
            facts.append(f"vLLM's KV cache {_gib(less)} GiB smaller than the floor's (the "
                         "slots counted once)")
        else:
            problems.append(f"vLLM's KV cache {_gib(less)} GiB smaller than the floor's for "
                            f"{_gib(want)} GiB of slots (counted "
                            f"{'twice' if less > 1.5 * want else 'not at all'}?)")
    return _verdict(name, problems, facts, floor, cache)


def verdict_spec(recs: dict[str, dict | None], size: dict | None) -> tuple[bool, str]:
    name = "speculative decoding (n-gram, 3 draft tokens)"
    if (why := _incomplete(recs, ("generate",))):
        return False, f"{name}: NOT met: {why}"
    cache_above, floor_above = recs["spec_cache_above"], recs["spec_floor_above"]
    cache_safe, floor_safe = recs["spec_cache_safe"], recs["spec_floor_safe"]
    problems = arming_problems(cache_above, floor_above) + arming_problems(cache_safe, floor_safe)
    facts: list[str] = []
    trap = parse_trap((cache_above.get("log") or {}).get("trap"))
    seqs = lambda r: (r.get("engine") or {}).get("max_num_seqs")  # noqa: E731
    if not trap:
        problems.append(f"spec_cache_above (--max-num-seqs {seqs(cache_above)}) logged no TRAP")
    elif not size:
        problems.append("no size_spec.json (`features_check.py size`) to compare the TRAP with")
    else:
        mine = (trap["ids"], trap["slots"], trap["safe"])
        theirs = (size.get("trap_ids"), size.get("slots"), size.get("safe_max_num_seqs"))
        text = (f"the TRAP line ({trap['seqs']} seqs: {mine[0]} ids > {mine[1]} slots, safe "
                f"--max-num-seqs {mine[2]}) against size ({theirs[0]} ids, {theirs[1]} slots, "
                f"safe {theirs[2]})")
        (facts if size.get("trap") and mine == theirs else problems).append(
            text + (": agree" if size.get("trap") and mine == theirs else ": differ"))
        if seqs(cache_safe) != trap["safe"]:
            problems.append(f"the safe arms ran at --max-num-seqs {seqs(cache_safe)}, not the "
                            f"TRAP's {trap['safe']}")
    if (cache_safe.get("log") or {}).get("trap"):
        problems.append(f"spec_cache_safe still logged a TRAP: {cache_safe['log']['trap'][:160]}")
    for label, c_rec, f_rec in (("safe", cache_safe, floor_safe),
                                ("above", cache_above, floor_above)):
        c = compare(_outputs(c_rec, "generate"), _outputs(f_rec, "generate"))
        (facts if c["identical"] else problems).append(
            f"tokens at --max-num-seqs {seqs(c_rec)} ({label}) against the floor's: {describe(c)}")

    def decode_width(rec: dict) -> int | None:
        g = (rec.get("phases") or {}).get("generate") or {}
        after, before = g.get("counters") or {}, g.get("counters_before") or {}
        if after.get("read_through_decode_steps") is not None:
            return int(after["read_through_decode_steps"]) - int(
                before.get("read_through_decode_steps") or 0)
        final = (rec.get("log") or {}).get("final") or {}
        return final.get("read_through_decode_steps")

    dw_safe, dw_above = decode_width(cache_safe), decode_width(cache_above)
    if dw_safe == 0:
        facts.append(f"decode-width read-throughs 0 at the safe value, {dw_above} above it")
    else:
        problems.append(f"decode-width read-throughs {dw_safe} at the safe value "
                        f"({dw_above} above it)")
    sm = ((cache_above.get("phases") or {}).get("generate") or {}).get("spec_metrics") or {}
    if sm.get("draft_tokens") == 0:
        problems.append("n-gram drafted no token above the safe value: no verify step was "
                        "wider than plain decoding")
    elif sm.get("draft_tokens") is not None:
        facts.append(f"n-gram drafted {sm['draft_tokens']} tokens ({sm.get('accepted_tokens')} "
                     "accepted) above the safe value")
    else:
        facts.append(f"vLLM's draft counters not read ({sm.get('error', 'none')})")
    return _verdict(name, problems, facts, *recs.values())


def report(directory: Path) -> tuple[bool, list[str]]:
    """One line a check (two for sleep, a line a level): met or NOT met, with the numbers."""
    r = {n: _load(directory, n) for n in ("update_floor", "update_cache", "sleep_floor",
                                          "sleep_cache", "spec_floor_above", "spec_cache_above",
                                          "spec_floor_safe", "spec_cache_safe")}
    got = [verdict_update(r["update_floor"], r["update_cache"]),
           verdict_sleep(r["sleep_floor"], r["sleep_cache"], 1),
           verdict_sleep(r["sleep_floor"], r["sleep_cache"], 2),
           verdict_spec({k: v for k, v in r.items() if k.startswith("spec_")},
                        _load(directory, "size_spec"))]
    vllm = next((x.get("vllm") for x in r.values() if x and x.get("vllm")), None)
    head = f"vLLM {vllm or 'unknown'}; records in {directory}"
    return all(ok for ok, _ in got), [head, *(line for _, line in got)]


# ----------------------------------------------------------------------------- main
def _arm_parser(child: bool = False) -> _Parser:
    ap = _Parser(prog="features_check.py", description=__doc__.splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", required=True, help="the checkpoint served (seed 0)")
    ap.add_argument("--model-b", default=None, help="update: the checkpoint reloaded into it")
    ap.add_argument("--layers", type=int, default=8, help="the checkpoint's layers (offload GiB)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens a prompt")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help=f"spec: required; update and sleep: {MAX_NUM_SEQS}")
    if not child:
        ap.add_argument("--slots", type=int, default=32, help="the cache arm's slots a layer")
        ap.add_argument("--env", action="append", default=[], help="K=V for the arm")
        ap.add_argument("--timeout-s", type=float, default=600)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["--child"]:
            return child_main(_arm_parser(child=True).parse_args(argv[1:]))
        if argv[:1] in (["report"], ["safe"]):
            if len(argv) != 2 or not Path(argv[1]).is_dir():
                raise Refused(f"{argv[0]} DIR: give the directory the arms wrote "
                              f"({' '.join(argv[1:]) or 'none given'})")
            if argv[0] == "safe":
                value, source = safe_value(Path(argv[1]))
                print(f"safe --max-num-seqs {value}, from {source}", file=sys.stderr)
                print(value)
                return 0
            ok, lines = report(Path(argv[1]))
            print("\n".join(lines))
            return 0 if ok else 1
        if argv[:1] == ["size"]:
            ap = _Parser(prog="features_check.py size")
            ap.add_argument("--out", required=True)
            ap.add_argument("--model", required=True)
            ap.add_argument("--slots", type=int, default=32)
            ap.add_argument("--vram", type=float, default=24)
            ap.add_argument("--max-num-seqs", type=int, default=8)
            return run_size(ap.parse_args(argv[1:]))
        a = _arm_parser().parse_args(argv)
        parse_name(a.name)
        for opt in ("layers", "tokens", "slots", "max_num_seqs"):
            v = getattr(a, opt)
            if v is not None and v < 1:
                raise Refused(f"--{opt.replace('_', '-')} {v}: 1 or more")
        return run_arm(a)
    except Refused as exc:
        print(f"features_check: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
