"""`vllm_experts`: a cached `serve` of a checkpoint whose experts vLLM runs on a kernel the
cache does not arm says so before launch, and names the flag where one exists."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from expertcache_cli.planning.launch import make_plan
from expertcache_cli.sizing import model_size, sizing
from expertcache_cli.vllm_facts import installed_vllm, vllm_experts

V033 = 'mapping = {\n        "triton": WNA16MoEBackend.TRITON,\n        "marlin": ...'
V026 = 'mapping = {\n        "marlin": WNA16MoEBackend.MARLIN,\n        "humming": ...'


@pytest.fixture(autouse=True)
def _marlin_armed(monkeypatch):
    """Marlin arming is opt-in (EXPERT_CACHE_MARLIN=1) for the formats not yet served from
    slots (MXFP4 is armed by default); these tests are about plans where it is on (the
    default is tested on its own below)."""
    monkeypatch.setenv("EXPERT_CACHE_MARLIN", "1")


@pytest.mark.parametrize("quant", ["nvfp4"])
def test_marlin_formats_not_yet_served_are_declined_unless_asked_for(quant, monkeypatch):
    """A format not yet served from slots on a GPU (here one taken out of the served set)
    is declined by default, with the switch that arms it."""
    from expertcache_cli import config

    monkeypatch.setattr(config, "MARLIN_SERVED", config.MARLIN_SERVED - {quant})
    monkeypatch.delenv("EXPERT_CACHE_MARLIN")
    why = vllm_experts.declined_kernel(quant, None)
    assert why and "EXPERT_CACHE_MARLIN=1 arms it" in why and "served from its slots" in why
    assert f"(mxfp4, w4a16; {quant} not yet)" in why
    assert vllm_experts.declined_kernel(quant, None, marlin=True) is None
    monkeypatch.setenv("EXPERT_CACHE_MARLIN", "1")
    assert vllm_experts.declined_kernel(quant, None) is None
    if quant == "w4a16":  # vLLM 0.32+'s Triton WNA16 kernel is armed either way
        monkeypatch.setenv("EXPERT_CACHE_MARLIN", "0")
        assert vllm_experts.declined_kernel(quant, "triton") is None


def test_every_4bit_format_served_from_slots_is_armed_by_default(monkeypatch):
    """MXFP4, NVFP4 and the W4A16 family have each been served from slots against their
    floor on a GPU: nothing set arms them; =0 declines them."""
    monkeypatch.delenv("EXPERT_CACHE_MARLIN")
    for quant in ("mxfp4", "nvfp4", "w4a16"):
        assert vllm_experts.declined_kernel(quant, None) is None, quant
        monkeypatch.setenv("EXPERT_CACHE_MARLIN", "0")
        assert vllm_experts.declined_kernel(quant, None), quant
        monkeypatch.delenv("EXPERT_CACHE_MARLIN")


def test_mxfp4_served_from_slots_is_armed_by_default_and_0_declines_it(monkeypatch):
    """MXFP4 on Marlin has been served from slots on a GPU (every check at difference 0,
    tokens identical): `size` plans its cache with nothing set, as the plugin arms it;
    EXPERT_CACHE_MARLIN=0 keeps every format on the stock path, and says so."""
    monkeypatch.delenv("EXPERT_CACHE_MARLIN")
    assert vllm_experts.declined_kernel("mxfp4", None) is None
    oss = Path(__file__).parent / "configs" / "gpt-oss-120b.json"
    p = sizing.plan(model_size.load_model(oss, "mxfp4"), 24)
    assert p.verdict == "cache"
    monkeypatch.setenv("EXPERT_CACHE_MARLIN", "0")
    why = vllm_experts.declined_kernel("mxfp4", None)
    assert why == ("vLLM runs these 4-bit experts on Marlin, which EXPERT_CACHE_MARLIN=0 keeps "
                   "on the stock path")
    p = sizing.plan(model_size.load_model(oss, "mxfp4"), 24)
    assert p.verdict == "offload_no_cache" and "EXPERT_CACHE_MARLIN=0" in p.verdict_text


def test_the_oracle_source_decides(tmp_path, monkeypatch):
    assert vllm_experts.wna16_triton_available(V033) is True
    assert vllm_experts.wna16_triton_available(V026) is False
    pkg = tmp_path / "vllm"
    oracle = pkg.joinpath(*vllm_experts.WNA16_ORACLE)
    oracle.parent.mkdir(parents=True)
    oracle.write_text(V033)
    spec = types.SimpleNamespace(submodule_search_locations=[str(pkg)])
    monkeypatch.setattr(installed_vllm.importlib.util, "find_spec", lambda name: spec)
    assert vllm_experts.wna16_triton_available() is True
    monkeypatch.setattr(installed_vllm.importlib.util, "find_spec", lambda name: None)
    assert vllm_experts.wna16_triton_available() is None


@pytest.mark.parametrize("quant", ["w4a16", "nvfp4", "mxfp4"])
def test_4_bit_experts_on_vllms_default_kernel_are_armed(quant):
    """Marlin, vLLM's default for every 4-bit format on NVIDIA up to Hopper (0.26-0.33),
    is a kernel the plugin arms: no decline, no note."""
    assert vllm_experts.declined_kernel(quant, None) is None
    assert vllm_experts.declined_kernel(quant, "marlin") is None
    assert vllm_experts.kernel_note(quant, [], "0.26") is None
    assert vllm_experts.kernel_note(quant, ["--moe-backend", "marlin"], "0.33") is None


@pytest.mark.parametrize("quant, backend", [("w4a16", "humming"),
                                            ("w4a16", "flashinfer_trtllm"),
                                            ("nvfp4", "flashinfer_cutlass"),
                                            ("mxfp4", "flashinfer_trtllm_mxfp4_bf16")])
def test_4_bit_experts_on_a_backend_the_plugin_does_not_arm_are_declined_with_the_reason(
        quant, backend):
    why = vllm_experts.declined_kernel(quant, backend)
    assert why.startswith(f"vLLM runs these 4-bit experts on --moe-backend {backend}")
    note = vllm_experts.kernel_note(quant, ["--moe-backend", backend], "0.33")
    assert f"on --moe-backend {backend}: vLLM 0.33 runs them on a kernel" in note
    assert "every layer will be declined" in note and "Marlin, which it arms" in note


def test_no_note_where_the_cache_arms():
    assert vllm_experts.kernel_note("w8a8", [], "0.26") is None
    assert vllm_experts.kernel_note("bf16", ["--moe-backend", "humming"]) is None
    assert vllm_experts.kernel_note("w4a16", ["--moe-backend", "triton"]) is None  # 0.32+


def test_serve_plans_say_it_before_launch(tmp_path):
    import json

    from tiny_moe import qwen3_moe_config

    gptq = tmp_path / "gptq.json"
    gptq.write_text(json.dumps(qwen3_moe_config(quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True})))

    def plan(args=("--max-num-seqs", "1")):
        return make_plan("org/model", 24, slots=4, size_from=str(gptq), launcher=["vllm"],
                         environ={}, vllm_args=list(args), v2_runner_offloads=lambda: True,
                         wna16_triton=lambda: True)

    w4 = plan()
    assert w4.size.quant == "w4a16" and "EXPERT_CACHE_SLOTS" in w4.env
    assert not any("declined" in n for n in w4.notes)  # Marlin: armed
    other = plan(("--max-num-seqs", "1", "--moe-backend", "humming"))
    assert any("on --moe-backend humming" in n and "every layer will be declined" in n
               for n in other.notes)


def test_size_says_it_too(tmp_path):
    """`size` is where users decide: a GPTQ Qwen3-30B-A3B on 16 GiB is offloaded and, on
    vLLM's default Marlin kernel, cached; on a backend the plugin does not arm the verdict
    is offload without the cache and says why; --slots forces a cache (a kernel trial)
    with the note."""
    import json
    import subprocess
    import sys

    real = json.loads((Path(__file__).parent / "configs" / "qwen3-30b-a3b.json").read_text())
    real["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                   "desc_act": False, "sym": True}
    gptq = tmp_path / "config.json"
    gptq.write_text(json.dumps(real))

    def size(*extra: str) -> dict:
        r = subprocess.run([sys.executable, "-m", "expertcache_cli", "size", "--model",
                            str(gptq), "--vram", "16", "--json", *extra],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    armed = size("--", "--max-model-len", "8192")
    assert armed["verdict"] == "cache" and armed["slots"] > 0
    assert not any("declined" in n for n in armed["notes"])
    got = size("--", "--max-model-len", "8192", "--moe-backend", "humming")
    assert got["verdict"] == "offload_no_cache" and got["slots"] == 0
    assert "4-bit experts on --moe-backend humming" in got["verdict_text"]
    forced = size("--slots", "8", "--", "--max-model-len", "8192", "--moe-backend", "humming")
    assert forced["verdict"] == "cache"
    assert any("every layer will be declined" in n for n in forced["notes"])


MXFP4_026 = '"triton": [Mxfp4MoeBackend.TRITON],\n        "marlin": [Mxfp4MoeBackend.MARLIN],'


def test_the_mxfp4_oracle_decides_whether_marlin_is_there():
    assert vllm_experts.mxfp4_marlin_available(MXFP4_026) is True
    assert vllm_experts.mxfp4_marlin_available('"triton": [Mxfp4MoeBackend.TRITON],') is False


@pytest.mark.parametrize("args, marlin, want", [
    ([], True, ["--moe-backend", "marlin"]),
    ([], None, ["--moe-backend", "marlin"]),  # no vLLM here to read: what 0.26-0.33 have
    (["--moe-backend", "marlin"], True, []),
    (["--moe-backend", "flashinfer_cutlass"], False, []),
])
def test_offloaded_mxfp4_gets_marlin_unless_the_user_chose_an_offloadable_kernel(
        args, marlin, want):
    flags, note = vllm_experts.offload_backend_args("mxfp4", args, marlin, "0.26")
    assert flags == want
    assert (note is not None) == bool(want)
    if note:
        assert "vLLM 0.26's default kernel (triton_kernels)" in note


@pytest.mark.parametrize("args, marlin, words", [
    (["--moe-backend", "triton"], True, "--moe-backend triton cannot offload MXFP4"),
    (["--moe-backend=TRITON_UNFUSED"], True, "--moe-backend triton_unfused cannot"),
    (["--moe-backend", "auto"], True, "(on NVIDIA it picks triton_kernels) cannot"),
    ([], False, "vLLM 0.26 cannot keep MXFP4 experts in host memory"),
])
def test_offloaded_mxfp4_on_a_kernel_that_keeps_it_in_vram_is_refused(args, marlin, words):
    from expertcache_cli.errors import UserError

    with pytest.raises(UserError) as e:
        vllm_experts.offload_backend_args("mxfp4", args, marlin, "0.26")
    assert words in str(e.value) and "whatever --cpu-offload-gb says" in str(e.value)


@pytest.mark.parametrize("quant", ["bf16", "w8a8", "fp8-block", "w4a16", "nvfp4"])
def test_other_formats_need_no_flag_to_stay_offloaded(quant):
    assert vllm_experts.offload_backend_args(quant, [], False) == ([], None)


def test_size_refuses_an_mxfp4_kernel_that_cannot_offload():
    import subprocess
    import sys

    base = [sys.executable, "-m", "expertcache_cli", "size", "--model", "gpt-oss-120b",
            "--vram", "24"]
    r = subprocess.run([*base, "--", "--moe-backend", "triton"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "cannot offload MXFP4 experts" in r.stderr
    assert "Traceback" not in r.stderr
    r = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_triton_for_4_bit_experts_on_a_vllm_without_it_is_refused_before_launch(tmp_path):
    """vLLM 0.26's WNA16 oracle has no Triton backend: `--moe-backend triton` would stop
    vLLM at load with a ValueError; serve says so first, in one line."""
    import json

    from expertcache_cli.errors import UserError

    args = ["--moe-backend", "triton"]
    why = vllm_experts.triton_refusal("w4a16", args, False, "0.26")
    assert why.startswith("--moe-backend triton: vLLM 0.26 has no Triton kernel for 4-bit")
    assert "Marlin, which the cache arms" in why
    assert vllm_experts.triton_refusal("w4a16", args, True) is None  # 0.32+
    assert vllm_experts.triton_refusal("w4a16", args, None) is None  # unknown: vLLM decides
    assert vllm_experts.triton_refusal("w4a16", [], False) is None
    assert vllm_experts.triton_refusal("bf16", args, False) is None

    real = json.loads((Path(__file__).parent / "configs" / "qwen3-30b-a3b.json").read_text())
    real["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                   "desc_act": False, "sym": True}
    (tmp_path / "config.json").write_text(json.dumps(real))
    with pytest.raises(UserError, match="has no Triton kernel for 4-bit experts"):
        make_plan(str(tmp_path), 16, launcher=["vllm"], environ={},
                  vllm_args=["--max-model-len", "8192", *args],
                  v2_runner_offloads=lambda: True, wna16_triton=lambda: False)


@pytest.mark.parametrize("quant", ["nvfp4"])
def test_a_cache_forced_on_marlin_not_opted_in_is_told_why_not_a_traceback(quant, monkeypatch):
    """`size --slots N` on a 4-bit model on vLLM's default kernel, its format's Marlin not
    armed by default and not asked for: the note says why every layer will be declined (no
    backend flag to name)."""
    from expertcache_cli import config

    monkeypatch.setattr(config, "MARLIN_SERVED", config.MARLIN_SERVED - {quant})
    monkeypatch.delenv("EXPERT_CACHE_MARLIN", raising=False)
    note = vllm_experts.kernel_note(quant, [], "0.26")
    assert note.startswith("vLLM runs these 4-bit experts on Marlin, which the cache arms "
                           "by default only in the formats served from its slots on a GPU")
    assert note.endswith("every layer will be declined (the offload floor)")


HUMMING_033 = "# Compute capabilities where Humming outranks Marlin.\n" \
              "_HUMMING_PREFERRED_CAPABILITIES = frozenset({90})\n"


def test_the_humming_ranking_is_read_from_its_file():
    assert vllm_experts.humming_ranked_first(HUMMING_033) is True
    assert vllm_experts.humming_ranked_first("def prioritize_humming(k): return k") is False


@pytest.mark.parametrize("quant", ["w4a16", "nvfp4"])
def test_4bit_experts_get_marlin_where_vllm_ranks_humming_first(quant):
    flags, note = vllm_experts.offload_backend_args(quant, [], None, "0.33", humming=True)
    assert flags == ["--moe-backend", "marlin"]
    assert "vLLM 0.33 runs them on Humming" in note
    # a vLLM without the ranking (0.26), or none read: vLLM's default is Marlin already
    assert vllm_experts.offload_backend_args(quant, [], None, "0.26", humming=None) == ([], None)
    assert vllm_experts.offload_backend_args(quant, [], None, humming=False) == ([], None)
    # the user's own backend is theirs: no flag, and a declined one is said by kernel_note
    assert vllm_experts.offload_backend_args(
        quant, ["--moe-backend", "humming"], None, humming=True) == ([], None)


@pytest.mark.parametrize("quant", ["bf16", "fp16", "fp8", "fp8-block"])
def test_the_formats_vllm_may_run_elsewhere_get_triton_pinned_where_cached(quant):
    """bf16 runs on FlashInfer on Blackwell, per-channel FP8 on CUTLASS from Hopper on, block
    FP8 on DeepGEMM/FlashInfer on Blackwell (vLLM 0.26-0.34's oracles): declined kernels.
    A cached plan pins the Triton experts; nothing without the cache or with the user's own
    backend."""
    flags, note = vllm_experts.offload_backend_args(quant, [], None, "0.34", cached=True)
    assert flags == ["--moe-backend", "triton"]
    assert note.startswith(f"{quant} experts: --moe-backend triton is passed, the kernel the "
                           "cache arms (vLLM picks ")
    assert vllm_experts.offload_backend_args(quant, [], None, cached=False) == ([], None)
    for own in ("triton", "flashinfer_cutlass"):
        assert vllm_experts.offload_backend_args(
            quant, ["--moe-backend", own], None, cached=True) == ([], None)
    # INT8 W8A8 runs on Triton on every NVIDIA GPU: nothing to pin
    assert vllm_experts.offload_backend_args("w8a8", [], None, cached=True) == ([], None)


@pytest.mark.parametrize("quant", ["bf16", "w8a8", "fp8", "fp8-block"])
def test_a_named_backend_other_than_triton_declines_the_formats_armed_on_triton(quant):
    for armed in (None, "auto", "triton", "Triton"):
        assert vllm_experts.declined_kernel(quant, armed) is None
    others = ["flashinfer_cutlass", "cutlass", "deep_gemm"]
    if quant == "bf16":  # an unquantised layer reads humming and marlin as auto
        assert vllm_experts.declined_kernel(quant, "humming") is None
    else:
        others += ["humming", "marlin"]
    for other in others:
        why = vllm_experts.declined_kernel(quant, other)
        assert why is not None and f"--moe-backend {other}, a kernel the cache" in why
    note = vllm_experts.kernel_note(quant, ["--moe-backend", "cutlass"], "0.34")
    assert note.startswith("experts on --moe-backend cutlass: vLLM 0.34 runs them on a kernel")
    assert note.endswith("leave the flag out to run them on Triton, which it arms")


def test_cached_nvfp4_experts_get_marlin_on_any_vllm():
    """NVFP4 runs on vLLM's FlashInfer/CUTLASS FP4 kernels on Blackwell (0.26-0.34, Marlin
    after them): a cache pins Marlin whether or not the release ranks Humming; without a
    cache nothing changes, and the user's backend is theirs."""
    for humming in (None, False):
        flags, note = vllm_experts.offload_backend_args("nvfp4", [], None, humming=humming,
                                                        cached=True)
        assert flags == ["--moe-backend", "marlin"] and "on Blackwell GPUs" in note
        assert vllm_experts.offload_backend_args("nvfp4", [], None, humming=humming) == (
            [], None)
    assert "on Humming" in vllm_experts.offload_backend_args(
        "nvfp4", [], None, humming=True, cached=True)[1]
    assert vllm_experts.offload_backend_args(
        "nvfp4", ["--moe-backend", "flashinfer_cutlass"], None, cached=True) == ([], None)
    # GPTQ/AWQ/W4A16 run on Marlin wherever Humming does not lead: left as they come
    assert vllm_experts.offload_backend_args("w4a16", [], None, cached=True) == ([], None)


def test_a_typed_moe_backend_auto_is_declined_where_it_means_humming():
    why = vllm_experts.declined_kernel("w4a16", "auto", marlin=True, humming=True)
    assert why is not None and "on Humming on Hopper" in why
    assert vllm_experts.declined_kernel("w4a16", "auto", marlin=True, humming=False) is None
    # left out, serve passes marlin: armed
    assert vllm_experts.declined_kernel("w4a16", None, marlin=True, humming=True) is None
    assert vllm_experts.declined_kernel("mxfp4", "auto", marlin=True, humming=True) is None


def test_serve_passes_marlin_for_gptq_where_vllm_ranks_humming_first(tmp_path, monkeypatch):
    import json

    from tiny_moe import qwen3_moe_config

    gptq = tmp_path / "gptq.json"
    gptq.write_text(json.dumps(qwen3_moe_config(quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True})))

    def plan(humming, args=("--max-num-seqs", "1")):
        return make_plan("org/model", 24, slots=4, size_from=str(gptq), launcher=["vllm"],
                         environ={}, vllm_args=list(args), v2_runner_offloads=lambda: True,
                         wna16_triton=lambda: True, humming=lambda: humming)

    ranked = plan(True)
    assert ranked.argv[ranked.argv.index("--moe-backend") + 1] == "marlin"
    assert any("runs them on Humming" in n for n in ranked.notes)
    assert not any("declined" in n for n in ranked.notes)
    assert "--moe-backend" not in plan(None).argv
    # the user's own auto, which on such a vLLM means Humming: kept, and said
    monkeypatch.setattr(vllm_experts, "humming_ranked_first", lambda source=None: True)
    own = plan(True, ("--max-num-seqs", "1", "--moe-backend", "auto"))
    assert own.argv.count("--moe-backend") == 1
    assert any("--moe-backend auto" in n and "every layer will be declined" in n
               for n in own.notes)


def test_a_backend_spelled_with_dashes_is_read_as_vllm_reads_it():
    from expertcache_cli.errors import UserError

    with pytest.raises(UserError, match="--moe-backend triton_unfused cannot offload MXFP4"):
        vllm_experts.offload_backend_args("mxfp4", ["--moe-backend", "Triton-Unfused"], True)
