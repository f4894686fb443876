"""End-to-end proof of the plugin in vLLM: resident vs offloaded vs the cache at two budgets.

What it does (one process per arm, because the plugin reads its environment once per
process and vLLM loads plugins once):

1. writes a random-weight model of the Qwen3-30B-A3B shape (config.json; a small
   word-level tokenizer; fewer layers than the real 48 to keep start-up short, the same
   expert shape: 128 experts x (2048 x 768) x 3 in bf16, 9.4 MB each) and serves it with
   ``load_format="dummy"``;
2. per arm: builds `vllm.LLM` in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the
   worker, and the plugin's live counters, are in this process), CUDA graphs on;
   re-seeds the router (gate) weights of every layer and the LM head (a bench-only hook:
   vLLM's dummy weights are the same tiny values in every layer, so every layer would
   route alike and greedy decoding would repeat one token); warms up; then times
   single-stream greedy decoding: decode tok/s = 199 / (t(200 tokens) - t(1 token)),
   median of three;
3. reads the plugin's live counters around the timed runs (hit rate = 1 - installs /
   distinct routed ids, on the steps served from slots), the startup line from the log,
   and the greedy token ids;
4. for the arm with ``EXPERT_CACHE_TRACE``: replays the recorded trace with the replay
   engine and checks that it gives the live install count exactly.

Run on the GPU box (vLLM importable): ``python bench/e2e_vllm.py --out OUT``. Writes
``OUT/arm_<name>.json`` and ``.log`` as each arm finishes, then ``OUT/summary.json`` and
``OUT/summary.md``. ``--help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

E, TOP_K, HIDDEN, MOE_INTER = 128, 8, 2048, 768
HEADS, KV_HEADS = 32, 4
if os.environ.get("EC_E2E_TINY") == "1":  # a CPU smoke test of this script's plumbing
    E, TOP_K, HIDDEN, MOE_INTER, HEADS, KV_HEADS = 16, 2, 256, 128, 4, 2
EXPERT_BYTES = 3 * HIDDEN * MOE_INTER * 2  # gate+up+down, bf16: 9,437,184 B
VOCAB = 8192
PROMPT = "w17 w923 w4410 w88 w5120 w3 w777 w2048 w60 w1999 w4096 w31 w8000 w12 w640 w5"

#: arm name -> (offload experts?, environment for the plugin)
ARMS: dict[str, tuple[bool, dict[str, str]]] = {
    # order: the offload and cache arms share one vLLM config, so the torch.compile cache
    # the first arm fills serves the next ones; the resident arm compiles anew
    "offload": (True, {"EXPERT_CACHE_DISABLE": "1"}),
    "cache32": (True, {"EXPERT_CACHE_SLOTS": "32"}),
    "cache48trace": (True, {"EXPERT_CACHE_SLOTS": "48", "EXPERT_CACHE_STATS": "4000"}),
    "resident": (False, {}),
    "cache64": (True, {"EXPERT_CACHE_SLOTS": "64"}),
    # all-hit arms: the router only ever picks among the first 32 experts (bench-only
    # re-seed), so 32 slots hold every routed expert after warm-up: the cache's pure cost
    "hot_resident": (False, {"EC_E2E_HOT": "32"}),
    "hot_cache32": (True, {"EXPERT_CACHE_SLOTS": "32", "EC_E2E_HOT": "32"}),
}


# ----------------------------------------------------------------------------- the model
def write_model(d: Path, layers: int, vocab_size: int = VOCAB,
                quantization_config: dict | None = None, context: int = 4096,
                head_dim: int | None = None, top_k: int | None = None,
                experts: int | None = None) -> Path:
    """config.json of the Qwen3-30B-A3B shape with ``layers`` layers, and a tokenizer.

    ``vocab_size`` 151936 is the real model's (embeddings and LM head then weigh what they
    do in the checkpoints users download); ``quantization_config`` goes into config.json;
    ``context`` 40960 is the real model's max_position_embeddings; ``head_dim`` 128 its
    attention heads (the bench shape's default is hidden / heads = 64); ``top_k`` the
    experts a token (default the shape's 8): a routing trace recorded at another width
    drives a model of that width (`bench/trace_routing.py` replaces ids only where the
    widths agree); ``experts`` the experts a layer (default the shape's 128): a recording of
    a model with fewer drives a model with as many.
    """
    d.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": HIDDEN,
        "intermediate_size": 6144,
        "moe_intermediate_size": MOE_INTER,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": head_dim or HIDDEN // HEADS,
        "num_experts": experts or E,
        "num_experts_per_tok": top_k or TOP_K,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": vocab_size,
        "max_position_embeddings": context,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if quantization_config:
        cfg["quantization_config"] = quantization_config
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": context,
    }))
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return d


def reseed(model) -> int:
    """Bench-only: distinct random router weights per layer and a random LM head.

    With ``EC_E2E_HOT=H`` the router rows of experts >= H are zeroed: their logits are 0
    while the H others are random of either sign, so top-k lands among the first H
    experts unless fewer than k of them come out positive (rare for H=32, k=8).
    """
    import torch

    from expertcache_cli.plugin.session import layer_index

    n = 0
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if w is None:
            continue
        if name.endswith("mlp.gate"):
            seed = 1000 + (layer_index(name) or 0)
        elif name.endswith("lm_head"):
            seed = 7
        else:
            continue
        g = torch.Generator().manual_seed(seed)
        new = torch.randn(tuple(w.shape), generator=g)
        hot = int(os.environ.get("EC_E2E_HOT", "0"))
        if hot and name.endswith("mlp.gate"):
            new[hot:] = 0
        w.data.copy_(new.to(w.dtype))
        n += 1
    return n


# ----------------------------------------------------------------------------- one arm
def run_arm(name: str, model_dir: Path, out: Path, tokens: int, layers: int,
            reps: int = 3) -> dict:
    """Inside the arm's own process: serve, warm up, time, count. Returns the record."""
    offload, env = ARMS[name]
    if "trace" in name:
        env = {**env, "EXPERT_CACHE_TRACE": str(out / f"trace_{name}.npz")}
    os.environ.update(env)
    import torch
    from vllm import LLM, SamplingParams

    from expertcache_cli.planning import launch
    from expertcache_cli.plugin import session as ec_session

    rec: dict = {"arm": name, "offload": offload, "env": env, "layers": layers}
    rec["plugin_entry_point"] = launch.plugin_installed()
    if not rec["plugin_entry_point"]:
        import expertcache_cli.plugin as plugin

        plugin.register()  # same process as the worker: equivalent to the entry point
    kw = {}
    if offload:
        # every expert tensor of every layer: 128 x 9.4 MB x layers, plus headroom
        kw = {"cpu_offload_gb": E * EXPERT_BYTES * layers / 2**30 + 1,
              "cpu_offload_params": {"experts"}}
    cuda = torch.cuda.is_available()
    if cuda:
        kw.update(attention_backend="TRITON_ATTN", cudagraph_capture_sizes=[1, 2, 4],
                  gpu_memory_utilization=0.85)
    t0 = time.time()
    llm = LLM(
        model=str(model_dir), load_format="dummy", dtype="bfloat16", max_model_len=1024,
        max_num_seqs=4, seed=0, **kw,
    )
    rec["startup_s"] = round(time.time() - t0, 1)
    rec["reseeded"] = llm.apply_model(reseed)[0]
    sess = ec_session.sessions()
    s = sess[0] if sess else None
    rec["armed_layers"] = len(s.armed) if s else 0

    def gen(n: int):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        o = llm.generate([PROMPT], sp, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t, list(o[0].outputs[0].token_ids)

    gen(tokens)  # warm-up
    gen(1)
    before = s.totals() if s else None
    rates, ids = [], None
    for _ in range(reps):
        t1, _ = gen(1)
        tn, ids = gen(tokens)
        rates.append((tokens - 1) / (tn - t1))
    after = s.totals() if s else None
    rec["tok_s"] = round(statistics.median(rates), 2)
    rec["tok_s_runs"] = [round(r, 2) for r in rates]
    rec["token_ids"] = ids
    if cuda and os.environ.get("EC_E2E_PROFILE") == "1":
        # where the GPU time of a decode goes, per kernel (bench-only diagnosis)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gen(32)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        (out / f"profile_{name}.txt").write_text(table)
    if s:
        d_req = after["requests"] - before["requests"]
        d_ins = after["installs"] - before["installs"]
        rec["window"] = {"requests": d_req, "installs": d_ins,
                         "read_through_steps": after["read_through_steps"]
                         - before["read_through_steps"],
                         "hit_rate": round(1 - d_ins / d_req, 4) if d_req else None,
                         "installs_per_token": round(d_ins / (reps * (tokens - 1)), 3)}
        rec["slots"] = s.armed[0].decision.num_slots if s.armed else 0
        s.close()  # final line; writes the trace and its .live.json for the trace arm
        rec["live_total"] = {k: v for k, v in s.totals().items() if k != "layers"}
    return rec


# ----------------------------------------------------------------------------- driver
def replay_check(out: Path, name: str) -> dict:
    """Replay the recorded trace at the live budget; installs must equal the live count."""
    from expertcache_cli.rules.engine import sweep
    from expertcache_cli.rules.policy import Policy
    from expertcache_cli.rules.replay import live_requests
    from expertcache_cli.rules.trace import load

    tr = load(out / f"trace_{name}.npz")
    live = json.loads((out / f"trace_{name}.live.json").read_text())
    counts = sweep(tr.topk_ids, tr.num_experts, [Policy.LRU], [live["slots"]])
    replay_installs = sum(c.installs for c in counts)
    replay_requests = sum(live_requests(c.requests, c.read_through_ids) for c in counts)
    return {"steps": tr.steps, "layers": tr.num_layers, "width": tr.width,
            "live_installs": live["installs"], "replay_installs": replay_installs,
            "live_requests": live["requests"], "replay_requests": replay_requests,
            "equal": replay_installs == live["installs"]}


def summarise(out: Path, recs: dict[str, dict], layers: int, tokens: int) -> dict:
    summ: dict = {"layers": layers, "tokens": tokens, "arms": {}}
    res = recs.get("resident", {}).get("tok_s") or recs.get("hot_resident", {}).get("tok_s")
    off = recs.get("offload", {}).get("tok_s")
    # the link rate the uncached floor implies: every routed expert read over it per token
    link = off * layers * TOP_K * EXPERT_BYTES if off else None
    for name, r in recs.items():
        row = {k: r.get(k) for k in ("tok_s", "tok_s_runs", "startup_s", "armed_layers",
                                     "slots", "window", "startup_line", "plugin_entry_point")}
        if res:
            row["vs_resident"] = round(r["tok_s"] / res, 3) if r.get("tok_s") else None
        if off:
            row["vs_offload"] = round(r["tok_s"] / off, 3) if r.get("tok_s") else None
        w = r.get("window")
        if w and res and link:
            # predicted: resident time + the misses' bytes over the link the floor measured
            t_pred = 1 / res + w["installs_per_token"] * EXPERT_BYTES / link
            row["predicted_tok_s"] = round(1 / t_pred, 1)
        summ["arms"][name] = row
    if link:
        summ["implied_link_GBps"] = round(link / 1e9, 1)
    base = recs.get("offload", {}).get("token_ids")
    summ["greedy_identical_to_offload"] = {
        n: (r.get("token_ids") == base) for n, r in recs.items() if base and n != "offload"
    }
    for n in recs:
        if "trace" in n and (out / f"trace_{n}.live.json").exists():
            summ["replay_" + n] = replay_check(out, n)
    (out / "summary.json").write_text(json.dumps(summ, indent=1))
    lines = ["| arm | tok/s | vs resident | vs offload | live hit rate | installs/token "
             "| predicted tok/s |", "|---|---|---|---|---|---|---|"]
    for n, row in summ["arms"].items():
        w = row.get("window") or {}
        lines.append(
            f"| {n} | {row.get('tok_s')} | {row.get('vs_resident', '')} | "
            f"{row.get('vs_offload', '')} | {w.get('hit_rate', '')} | "
            f"{w.get('installs_per_token', '')} | {row.get('predicted_tok_s', '')} |"
        )
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return summ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per arm (median)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--budget-s", type=float, default=540,
                    help="start no new arm after this many seconds")
    ap.add_argument("--arm-timeout-s", type=float, default=300)
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one arm here
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if a.arm:
        rec = run_arm(a.arm, Path(a.model_dir), out, a.tokens, a.layers, a.reps)
        (out / f"arm_{a.arm}.json").write_text(json.dumps(rec, indent=1))
        return 0
    t_start = time.time()
    model_dir = write_model(Path(os.environ.get("TMPDIR", "/tmp")) / f"qwen3moe-{a.layers}l",
                            a.layers)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    for k in [k for k in env if k.startswith("EXPERT_CACHE_")]:
        del env[k]
    recs: dict[str, dict] = {}
    for name in a.arms.split(","):
        left = a.budget_s - (time.time() - t_start)
        if left < 60:
            print(f"[e2e] budget spent: skipping {name}", flush=True)
            continue
        log = out / f"arm_{name}.log"
        cmd = [sys.executable, __file__, "--arm", name, "--model-dir", str(model_dir),
               "--out", str(out), "--tokens", str(a.tokens), "--layers", str(a.layers),
               "--reps", str(a.reps)]
        t = time.time()
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                    timeout=min(a.arm_timeout_s, left)).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        text = log.read_text(errors="replace")
        m = re.findall(r"expertcache: vLLM \S+: .*", text)
        rec_path = out / f"arm_{name}.json"
        rec = json.loads(rec_path.read_text()) if rec_path.exists() else {"arm": name}
        rec["rc"], rec["wall_s"] = rc, round(time.time() - t, 1)
        rec["startup_line"] = m[-1] if m else None
        rec_path.write_text(json.dumps(rec, indent=1))
        recs[name] = rec
        print(f"[e2e] {name}: rc={rc} {rec.get('tok_s')} tok/s window={rec.get('window')} "
              f"({rec['wall_s']} s)", flush=True)
        if rc != 0:
            print("\n".join(text.splitlines()[-30:]), flush=True)
        summarise(out, {k: v for k, v in recs.items() if v.get("tok_s")}, a.layers, a.tokens)
    summ = summarise(out, {k: v for k, v in recs.items() if v.get("tok_s")}, a.layers, a.tokens)
    print(json.dumps(summ, indent=1))
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
