"""A model named by its Hugging Face id: sized from the local cache or the Hub's config.json.

No test here reaches the network: the Hub is an ``httpx.MockTransport`` that records what
it was asked, and the local cache a directory laid out as the Hub client lays it out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_marlin_sizing import GPTQ
from test_sizing import _write_safetensors

from expertcache_cli.errors import UserError
from expertcache_cli.sizing import hub, model_size

ROOT = Path(__file__).resolve().parents[1]
QWEN3 = json.loads((ROOT / "tests" / "configs" / "qwen3-30b-a3b.json").read_text())
REPO = "someorg/Qwen3-30B-A3B-GPTQ-Int4"


@pytest.fixture(autouse=True)
def hf_env(tmp_path, monkeypatch):
    """An empty Hugging Face home, no token, the default endpoint, online, the main branch."""
    for name in ("HF_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH",
                 "HF_ENDPOINT", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    token = hub.REVISION.set("main")
    hub._get_once.cache_clear()
    yield tmp_path / "hf"
    hub.REVISION.reset(token)
    hub._get_once.cache_clear()


def snapshot(hf_home: Path, repo: str, config: dict, commit: str = "0123abc",
             ref: str = "main") -> Path:
    """A repository in the local cache, as the Hub client leaves it: refs/<ref> names the
    snapshot folder of that commit."""
    base = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / ref).write_text(commit)
    (snap / "config.json").write_text(json.dumps(config))
    return snap


def hub_transport(files: dict[str, tuple[int, object]],
                  seen: list[httpx.Request]) -> httpx.MockTransport:
    """A Hub that serves ``files`` ({url path: (status, JSON body)}) and records requests."""
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        status, body = files.get(request.url.path, (404, {"error": "not found"}))
        return httpx.Response(status, json=body)
    return httpx.MockTransport(answer)


def hub_client(files: dict[str, tuple[int, object]], seen: list[httpx.Request]) -> httpx.Client:
    return httpx.Client(transport=hub_transport(files, seen))


def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Hub was asked where the local cache should answer")
    monkeypatch.setattr(hub, "_fetch", refuse)


@pytest.mark.parametrize("spec,expected", [
    ("Qwen/Qwen3-30B-A3B-GPTQ-Int4", True), ("openai/gpt-oss-120b", True),
    ("zai-org/GLM-4.5-Air", True), ("./org/name", False), ("/abs/path", False),
    ("org/name/extra", False), ("name-only", False), ("org/", False)])
def test_what_is_a_hub_id(spec, expected):
    assert hub.is_hub_id(spec) is expected


def test_an_existing_path_is_never_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not hub.is_hub_id("org/name")


def test_the_local_cache_answers_before_the_hub(hf_env, monkeypatch):
    snapshot(hf_env, REPO, QWEN3 | {"quantization_config": GPTQ})
    no_network(monkeypatch)
    m = model_size.load_model(REPO)
    direct = model_size.model_from_config(QWEN3 | {"quantization_config": GPTQ}, "x")
    assert (m.name, m.quant, m.source) == ("Qwen3-30B-A3B-GPTQ-Int4", "w4a16", "config")
    assert m.bytes_per_expert == direct.bytes_per_expert
    assert any("local Hugging Face cache" in n for n in m.notes)


def test_hf_hub_cache_is_where_the_cache_is_looked_for(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    snap = snapshot(tmp_path / "unused", REPO, QWEN3)
    assert hub.cached_snapshot(REPO) is None
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / snap.parents[1].name).symlink_to(snap.parents[1])
    assert hub.cached_snapshot(REPO) == tmp_path / "elsewhere" / snap.parents[1].name / \
        "snapshots" / "0123abc"


def _tiny_checkpoint() -> tuple[dict, dict[str, tuple[str, list[int]]]]:
    conf = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
            "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "intermediate_size": 128, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "max_position_embeddings": 256}
    t: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("BF16", [100, 64])}
    for layer in range(2):
        for e in range(4):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            for proj, shape in (("gate_proj", [32, 64]), ("up_proj", [32, 64]),
                                ("down_proj", [64, 32])):
                t[p + proj + ".weight"] = ("BF16", shape)
    return conf, t


def test_a_complete_snapshot_is_sized_from_its_safetensors(hf_env, monkeypatch):
    conf, t = _tiny_checkpoint()
    snap = snapshot(hf_env, "org/tiny-moe", conf)
    items = list(t.items())
    _write_safetensors(snap / "model-00001-of-00002.safetensors", dict(items[:9]))
    _write_safetensors(snap / "model-00002-of-00002.safetensors", dict(items[9:]))
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        name: f"model-0000{1 + (i >= 9)}-of-00002.safetensors"
        for i, (name, _) in enumerate(items)}}))
    no_network(monkeypatch)
    m = model_size.load_model("org/tiny-moe")
    assert m.source == "checkpoint" and m.name == "tiny-moe"
    assert m.bytes_per_expert == 3 * 32 * 64 * 2
    assert m.non_expert_bytes == 100 * 64 * 2  # only what the files hold: the embeddings


def test_an_interrupted_download_is_sized_from_its_config(hf_env, monkeypatch):
    """A snapshot whose index names a shard that is not there would miss layers: the
    config's arithmetic sizes it instead."""
    conf, t = _tiny_checkpoint()
    snap = snapshot(hf_env, "org/tiny-moe", conf)
    items = list(t.items())
    _write_safetensors(snap / "model-00001-of-00002.safetensors", dict(items[:9]))
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        name: f"model-0000{1 + (i >= 9)}-of-00002.safetensors"
        for i, (name, _) in enumerate(items)}}))
    assert not hub.complete(snap)
    no_network(monkeypatch)
    m = model_size.load_model("org/tiny-moe")
    assert m.source == "config" and m.moe_layers == [0, 1]


def test_the_hub_config_when_nothing_is_cached(monkeypatch):
    seen: list[httpx.Request] = []
    client = hub_client({f"/{REPO}/resolve/main/config.json":
                         (200, QWEN3 | {"quantization_config": GPTQ})}, seen)
    m = model_size.model_from_hub(REPO, client=client)
    assert m.quant == "w4a16" and m.num_experts == 128 and m.top_k == 8
    assert [r.url.path for r in seen] == [f"/{REPO}/resolve/main/config.json"]
    assert "authorization" not in seen[0].headers
    assert any(f"https://huggingface.co/{REPO}/resolve/main/config.json" in n for n in m.notes)


def test_the_token_and_the_endpoint_are_the_hub_clients(hf_env, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "https://mirror.example/")
    hf_env.mkdir(parents=True)
    (hf_env / "token").write_text("hf_saved\n")
    seen: list[httpx.Request] = []
    client = hub_client({f"/{REPO}/resolve/main/config.json": (200, QWEN3)}, seen)
    hub.resolve(REPO, client=client)
    assert seen[0].url.host == "mirror.example"
    assert seen[0].headers["authorization"] == "Bearer hf_saved"
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    hub.resolve(REPO, client=client)
    assert seen[-1].headers["authorization"] == "Bearer hf_env"


def test_a_modelopt_side_file_declares_nvfp4(monkeypatch):
    """ModelOpt checkpoints may keep their quantisation in hf_quant_config.json, which vLLM
    reads when config.json declares none."""
    seen: list[httpx.Request] = []
    side = {"producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16}}
    client = hub_client({"/org/m-nvfp4/resolve/main/config.json": (200, QWEN3),
                         "/org/m-nvfp4/resolve/main/hf_quant_config.json": (200, side)}, seen)
    assert model_size.model_from_hub("org/m-nvfp4", client=client).quant == "nvfp4"
    seen.clear()
    client = hub_client({"/org/m/resolve/main/config.json": (200, QWEN3)}, seen)
    assert model_size.model_from_hub("org/m", client=client).quant == "bf16"  # 404: none


@pytest.mark.parametrize("status,words", [
    (404, "no such model on the Hugging Face Hub"), (401, "gated or private"),
    (403, "set HF_TOKEN"), (500, "the Hub answered 500")])
def test_the_hub_refusing_is_one_line(status, words):
    client = hub_client({f"/{REPO}/resolve/main/config.json": (status, {})}, [])
    with pytest.raises(UserError, match=words) as err:
        model_size.model_from_hub(REPO, client=client)
    assert "\n" not in str(err.value) and err.value.exit_code == 2


def test_no_network_is_one_line():
    def down(request):
        raise httpx.ConnectError("Name or service not known", request=request)
    client = httpx.Client(transport=httpx.MockTransport(down))
    with pytest.raises(UserError, match="could not be reached.*give its config.json"):
        model_size.model_from_hub(REPO, client=client)


def test_offline_uses_only_the_cache(hf_env, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    no_network(monkeypatch)
    with pytest.raises(UserError, match="not in the local Hugging Face cache.*HF_HUB_OFFLINE"):
        model_size.load_model(REPO)
    snapshot(hf_env, REPO, QWEN3)
    assert model_size.load_model(REPO).num_experts == 128


def test_a_preset_id_never_asks_the_hub(monkeypatch):
    no_network(monkeypatch)
    assert model_size.load_model("Qwen/Qwen3-30B-A3B").source == "preset"


def test_size_and_serve_take_a_cached_hub_id(hf_env, tmp_path):
    """As typed: `size org/name` and `serve org/name --dry-run` plan a GPTQ model
    that only the local Hugging Face cache knows; offline with nothing cached, one line."""
    snapshot(hf_env, REPO, QWEN3 | {"quantization_config": GPTQ})
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_HOME": str(hf_env), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    cli = [sys.executable, "-m", "expertcache_cli"]
    size = subprocess.run([*cli, "size", REPO, "--vram", "16", "--",
                           "--max-model-len", "8192"], env=env, capture_output=True, text=True,
                          cwd=tmp_path)
    assert size.returncode == 0, size.stderr
    assert "cache at 102 of 128 slots" in size.stdout
    serve = subprocess.run([*cli, "serve", REPO, "--vram", "16", "--dry-run", "--",
                            "--max-model-len", "8192"], env=env, capture_output=True, text=True,
                           cwd=tmp_path)
    assert serve.returncode == 0, serve.stderr
    assert "EXPERT_CACHE_SLOTS=102 EXPERT_CACHE_POLICY=lru" in serve.stdout
    assert f"serve {REPO} " in serve.stdout
    snapshot(hf_env, REPO, QWEN3, commit="b16", ref="bf16")
    other = subprocess.run([*cli, "size", "--model", REPO, "--vram", "16", "--",
                            "--revision", "bf16"], env=env, capture_output=True, text=True,
                           cwd=tmp_path)
    assert other.returncode == 0 and "(bf16, from config)" in other.stdout, other.stderr
    env["HF_HOME"] = str(tmp_path / "empty")
    gone = subprocess.run([*cli, "size", "--model", REPO, "--vram", "16"], env=env,
                          capture_output=True, text=True, cwd=tmp_path)
    assert gone.returncode == 2 and gone.stdout == ""
    assert gone.stderr.count("\n") == 1 and "HF_HUB_OFFLINE" in gone.stderr
    # serve's line says how serve is given the config (beside the id vLLM still loads)
    gone = subprocess.run([*cli, "serve", REPO, "--vram", "16", "--dry-run"], env=env,
                          capture_output=True, text=True, cwd=tmp_path)
    assert gone.returncode == 2 and gone.stderr.count("\n") == 1, gone.stderr
    assert "--size-from PATH" in gone.stderr


def test_vllms_revision_is_the_one_sized(hf_env):
    """`-- --revision R` is what vLLM loads, so the sizing reads R's config: from the cache
    by its ref or commit, else from the Hub at R."""
    from expertcache_cli.commands import passthrough_args

    snapshot(hf_env, REPO, QWEN3, commit="aaa")
    snapshot(hf_env, REPO, QWEN3 | {"quantization_config": GPTQ}, commit="bbb", ref="int4")
    assert model_size.load_model(REPO).quant == "bf16"
    assert passthrough_args(["--revision", "int4"], ["size", "--", "--revision", "int4"])
    assert model_size.load_model(REPO).quant == "w4a16"
    hub.REVISION.set("bbb")  # a commit hash names its snapshot folder
    assert model_size.load_model(REPO).quant == "w4a16"
    seen: list[httpx.Request] = []
    client = hub_client({f"/{REPO}/resolve/v9/config.json": (200, QWEN3)}, seen)
    found = hub.resolve(REPO, "v9", client=client)
    assert seen[0].url.path == f"/{REPO}/resolve/v9/config.json"
    assert "--revision v9" in found.origin


def test_the_hub_is_asked_once_a_process(monkeypatch):
    """`serve` sizes its model more than once (the plan, the online-quantisation check):
    each Hub file is fetched once, with the process's own client."""
    seen: list[httpx.Request] = []
    transport = hub_transport({f"/{REPO}/resolve/main/config.json": (200, QWEN3)}, seen)
    real = httpx.Client
    monkeypatch.setattr(httpx, "Client", lambda *a, **k: real(transport=transport))
    first = model_size.load_model(REPO)
    again = model_size.load_model(REPO)
    assert first.bytes_per_expert == again.bytes_per_expert
    assert [r.url.path for r in seen] == [f"/{REPO}/resolve/main/config.json",
                                          f"/{REPO}/resolve/main/hf_quant_config.json"]
