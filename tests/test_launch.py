"""`expertcache serve`: the plan (sizing -> environment + vllm argv) and the CLI dry run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from expertcache_cli.errors import UserError
from expertcache_cli.planning.launch import flag_value, make_plan, sizing_overrides
from expertcache_cli.sizing import sizing

MODEL = "Qwen/Qwen3-30B-A3B"  # bf16 preset: 128 experts, top-8, 48 MoE layers
VLLM = ["vllm"]


def _plan(**kw):
    kw.setdefault("launcher", VLLM)
    kw.setdefault("environ", {})
    kw.setdefault("v2_runner_offloads", lambda: True)  # hermetic: not the vLLM installed here
    kw.setdefault("wna16_triton", lambda: True)
    kw.setdefault("mxfp4_marlin", lambda: True)
    return make_plan(kw.pop("model", MODEL), kw.pop("vram", 24), **kw)


def test_cache_plan_sets_the_environment_and_offloads_the_experts():
    p = _plan(vllm_args=["--", "--max-num-seqs", "4", "--max-model-len", "8192", "--port", "9"])
    s = p.size
    assert s.verdict == "cache" and 0 < s.slots < 128 and not s.trap
    assert p.env == {"EXPERT_CACHE_SLOTS": str(s.slots), "EXPERT_CACHE_POLICY": "lru",
                     "EXPERT_CACHE_PLANNED_WEIGHTS": str(s.non_expert_bytes
                                                         + s.rope_cache_bytes)}
    assert p.argv[:3] == ["vllm", "serve", MODEL]
    a = p.argv
    assert a[a.index("--cpu-offload-gb") + 1] == str(s.cpu_offload_gb) and s.cpu_offload_gb > 0
    assert a[a.index("--cpu-offload-params") + 1] == "experts"
    # the user's flags are passed unchanged, once, after the planned ones
    assert a[-6:] == ["--max-num-seqs", "4", "--max-model-len", "8192", "--port", "9"]
    assert a.count("--max-num-seqs") == 1 and a.count("--max-model-len") == 1
    # and they fed the sizing
    assert (s.max_num_seqs, s.max_model_len) == (4, 8192)


def test_more_slots_on_a_bigger_card():
    args = ["--max-num-seqs", "4", "--max-model-len", "8192"]
    small = _plan(vram=24, vllm_args=args).size.slots
    big = _plan(vram=48, vllm_args=args).size.slots
    assert big == 128 or big > small


def test_sizing_trap_is_refused_unless_accepted():
    with pytest.raises(UserError) as info:
        _plan(vllm_args=["--max-num-seqs", "64", "--max-model-len", "8192"])
    msg = str(info.value)
    assert "sizing trap" in msg and "64 seqs x top_k 8 = 512 ids" in msg
    assert "--allow-trap" in msg
    # the way out that keeps the batch: the wide path, named as serve and the plugin take it
    assert "--wide staged-install (EXPERT_CACHE_WIDE=staged-install) stages them" in msg
    p = _plan(vllm_args=["--max-num-seqs", "64", "--max-model-len", "8192"], allow_trap=True)
    assert p.size.trap and "EXPERT_CACHE_SLOTS" in p.env


def test_a_staged_wide_path_serves_full_batches_and_pays_for_its_scratch():
    """--wide staged-install: no trap refusal (a full batch is staged, not bypassed), the
    plugin is told the mode, and the scratch (one layer's 128 experts) costs slots."""
    args = ["--max-num-seqs", "64", "--max-model-len", "8192"]
    p = _plan(vllm_args=args, wide="staged-install")
    s = p.size
    assert not s.trap and p.env["EXPERT_CACHE_WIDE"] == "staged-install"
    assert s.scratch_bytes == 128 * s.bytes_per_expert
    in_place = _plan(vllm_args=args, allow_trap=True).size
    assert s.slots == (in_place.slot_budget_bytes - s.scratch_bytes) // s.bytes_per_slot
    assert s.slots < in_place.slots
    assert any("staged through it" in n for n in p.notes)
    with pytest.raises(UserError, match="--wide: unknown wide-step mode"):
        _plan(vllm_args=args, wide="sideways")


def test_with_every_batch_narrow_the_scratch_says_when_it_costs_more_than_it_saves():
    """No full batch wider than the slots: the scratch serves only prefills, so the plan
    says how many decoded tokens a prompt it pays for (uniform routing), and past that
    it costs more than it saves. With wide batches it serves those and says so instead."""
    from expertcache_cli.sizing.sizing import scratch_break_even

    # 82 slots of 128, top-8, 2.67 slots of scratch: 82 x 128 / (8 x 2.67)
    assert scratch_break_even(82, 128, 8, 2.67) == round(82 * 128 / (8 * 2.67))
    assert scratch_break_even(10, 128, 8, 2.67) < scratch_break_even(82, 128, 8, 2.67)
    narrow = _plan(vllm_args=["--max-num-seqs", "4", "--max-model-len", "8192"],
                   wide="staged-install")
    s = narrow.size
    cost = s.scratch_bytes / s.bytes_per_slot
    assert s.scratch_break_even_tokens == scratch_break_even(s.slots, 128, 8, cost) > 0
    (note,) = [n for n in narrow.notes if "scratch" in n and "slots a layer" in n]
    assert f"fewer than ~{s.scratch_break_even_tokens:,} tokens a prompt" in note
    assert "costs more than it saves past that" in note
    assert s.to_json()["scratch_break_even_tokens"] == s.scratch_break_even_tokens
    wide = _plan(vllm_args=["--max-num-seqs", "64", "--max-model-len", "8192"],
                 wide="staged-install").size
    assert wide.scratch_break_even_tokens is None
    assert not any("tokens a prompt" in n for n in wide.notes)
    assert _plan(vllm_args=["--max-num-seqs", "4", "--max-model-len", "8192"]
                 ).size.scratch_break_even_tokens is None  # in place: no scratch


def test_model_that_fits_outright_runs_without_offload_and_cache_off():
    p = _plan(vram=141, vllm_args=["--max-model-len", "8192"])
    assert p.size.verdict == "fits_outright"
    assert p.env == {"EXPERT_CACHE_DISABLE": "1"}
    assert "--cpu-offload-gb" not in p.argv
    assert any("without offload" in n for n in p.notes)


def test_does_not_fit_is_an_error():
    with pytest.raises(UserError, match="does not fit"):
        _plan(vram=2)


def test_forced_budget_policy_and_decay():
    p = _plan(slots=24, policy="lfu", decay=32,
              vllm_args=["--max-num-seqs", "2", "--max-model-len", "8192"])
    held = str(p.size.non_expert_bytes + p.size.rope_cache_bytes)
    assert p.env == {"EXPERT_CACHE_SLOTS": "24", "EXPERT_CACHE_POLICY": "lfu",
                     "EXPERT_CACHE_DECAY": "32", "EXPERT_CACHE_PLANNED_WEIGHTS": held}
    p = _plan(fraction=0.25, vllm_args=["--max-num-seqs", "2", "--max-model-len", "8192"])
    assert p.env["EXPERT_CACHE_SLOTS"] == "32"


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"policy": "opt"}, "choose lru or lfu"),
        ({"decay": 8}, "lfu only"),
        ({"decay": -1, "policy": "lfu"}, ">= 0"),
        ({"slots": 8, "fraction": 0.5}, "not both"),
        ({"fraction": 1.0}, "between 0 and 1"),
        ({"vllm_args": ["--max-num-seqs", "many"]}, "--max-num-seqs 'many'"),
        ({"vllm_args": ["--max-num-seqs"]}, "has no value"),
    ],
)
def test_bad_options_are_user_errors(kw, needle):
    with pytest.raises(UserError) as info:
        _plan(**kw)
    assert needle in str(info.value)


def test_user_offload_flag_wins_with_a_note():
    p = _plan(vllm_args=["--max-num-seqs", "4", "--max-model-len", "8192",
                         "--cpu-offload-gb=60"])
    assert p.argv.count("--cpu-offload-gb") == 0 and "--cpu-offload-gb=60" in p.argv
    assert any("--cpu-offload-gb 60 given by you" in n for n in p.notes)


def test_environment_fraction_is_replaced_by_the_planned_slots():
    p = _plan(vllm_args=["--max-num-seqs", "4", "--max-model-len", "8192"],
              environ={"EXPERT_CACHE_FRACTION": "0.5", "EXPERT_CACHE_DISABLE": "1"})
    assert p.env["EXPERT_CACHE_FRACTION"] == ""  # the plugin reads '' as unset
    assert any("control run" in n for n in p.notes)
    from expertcache_cli.config import from_env

    cfg = from_env({"EXPERT_CACHE_FRACTION": "0.5", **p.env})
    assert cfg.slots == p.size.slots and cfg.fraction is None


def test_flag_parsing_helpers():
    args = ["--max-num-seqs", "8", "--gpu-memory-utilization=0.8", "--kv-cache-dtype", "fp8"]
    assert flag_value(args, "--max-num-seqs") == "8"
    assert flag_value(args, "--max-model-len") is None
    kw = sizing_overrides(args)
    assert kw.pop("graphs").source.startswith("vLLM's defaults")
    assert kw == {"max_num_seqs": 8, "gpu_memory_utilization": 0.8, "kv_cache_dtype": "fp8"}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "expertcache_cli", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_dry_run_prints_the_command():
    r = _cli("serve", MODEL, "--vram", "24", "--dry-run", "--",
             "--max-num-seqs", "4", "--max-model-len", "8192")
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("EXPERT_CACHE_SLOTS=") and " serve Qwen/Qwen3-30B-A3B " in line
    assert "--cpu-offload-params experts" in line
    assert "cache at" in r.stderr


def test_cli_bad_input_is_one_line_and_exit_2():
    r = _cli("serve", MODEL, "--vram", "24", "--dry-run", "--policy", "fifo")
    assert r.returncode == 2
    assert r.stderr.strip() == ("expertcache: error: --policy 'fifo': choose lru or lfu (opt "
                                "needs the future: it exists only in `expertcache replay`)")
    # a batch the user asked for that bypasses the cache: the trap, refused
    r = _cli("serve", MODEL, "--vram", "24", "--dry-run", "--", "--max-num-seqs", "256")
    assert r.returncode == 2 and "sizing trap" in r.stderr and "Traceback" not in r.stderr


def test_a_card_emulated_on_a_bigger_gpu_gets_its_share_of_it():
    """`serve --vram 24` on the H200 (139.8 GiB): vLLM's utilization is of the
    whole GPU, so the plan passes the card's 0.9 x 24 GiB as 0.1545, and the small card's
    batch default (2048 tokens) instead of the one vLLM would pick for an H200 (8192)."""
    args = ["--max-num-seqs", "4", "--max-model-len", "8192"]
    p = _plan(vllm_args=args, device_total_gib=139.8)
    card = _plan(vllm_args=args)
    a = p.argv
    assert p.size.slots == card.size.slots
    assert a[a.index("--gpu-memory-utilization") + 1] == "0.1545"
    assert a[a.index("--max-num-batched-tokens") + 1] == "2048"
    assert any("share of a 139.80 GiB GPU" in n for n in p.notes)
    with pytest.raises(UserError, match="more than --vram 24"):
        _plan(vllm_args=[*args, "--gpu-memory-utilization", "0.5"], device_total_gib=139.8)
    mine = _plan(vllm_args=[*args, "--max-num-batched-tokens", "1024"], device_total_gib=139.8)
    assert mine.argv.count("--max-num-batched-tokens") == 1


def _fake_smi(tmp_path, body: str):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + body)
    smi.chmod(0o755)
    return {"PATH": f"{tmp_path}:/usr/bin:/bin"}


def test_gpu_total_is_what_vllm_sees_total_minus_reserved(tmp_path, monkeypatch):
    from expertcache_cli.device import gpu_info

    env = _fake_smi(tmp_path, 'echo "$@" >> "$(dirname "$0")/args"\necho "143771, 615"\n')
    monkeypatch.setenv("PATH", env["PATH"])
    got = gpu_info.device_total_gib({"CUDA_VISIBLE_DEVICES": "3,1"})
    assert got == pytest.approx((143771 - 615) / 1024)
    assert "-i 3" in (tmp_path / "args").read_text()
    assert gpu_info.device_total_gib({"CUDA_VISIBLE_DEVICES": ""}) is None
    _fake_smi(tmp_path, 'case "$1" in *reserved*) exit 6;; esac\necho "24564"\n')
    assert gpu_info.device_total_gib({}) == pytest.approx(24564 / 1024)
    _fake_smi(tmp_path, "exit 9\n")
    assert gpu_info.device_total_gib({}) is None
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert gpu_info.device_total_gib({}) is None


def test_model_must_be_what_vllm_loads(tmp_path):
    """A preset name or a config.json is for sizing; vLLM would fail on it after the plan
    was printed, so serve refuses it at once with the way (--size-from)."""
    with pytest.raises(UserError, match="is a sizing preset.*--size-from qwen3-30b-a3b-w8a8"):
        _plan(model="qwen3-30b-a3b-w8a8")
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text("{}")
    with pytest.raises(UserError, match="is a file.*--size-from"):
        _plan(model=str(cfg_file))
    ok = _plan(model=str(tmp_path), size_from="qwen3-30b-a3b-w8a8",
               vllm_args=["--max-num-seqs", "4", "--max-model-len", "8192"])
    assert ok.argv[2] == str(tmp_path)


def test_launch_refusal_names_what_is_missing(monkeypatch):
    import importlib.util

    from expertcache_cli.planning.launch import launch_refusal

    assert "not a program" in launch_refusal(["/nonexistent/vllm", "serve", "m"])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    why = launch_refusal([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "m"])
    assert "vLLM is not installed in this python" in why


def _plan_file(tmp_path, per_layer, policy="lru"):
    import json

    from expertcache_cli.planning.planner import PLAN_FORMAT

    f = tmp_path / "plan.json"
    f.write_text(json.dumps({"format": PLAN_FORMAT, "recommended": {
        "policy": policy, "slots": max(per_layer), "per_layer_slots": per_layer}}))
    return str(f)


def test_serve_plan_passes_the_per_layer_budgets_it_checked(tmp_path):
    """`serve --plan`: one budget per MoE layer, each below E, the bytes of all of them
    within the uniform budget that fits, and the narrowest layer decides the trap."""
    flags = ["--max-num-seqs", "4", "--max-model-len", "8192"]
    uniform = _plan(vllm_args=flags).size.slots  # 40 on 24 GiB for the bf16 model
    split = [uniform + 8] * 24 + [uniform - 8] * 24
    p = _plan(plan_file=_plan_file(tmp_path, split, "lfu"), vllm_args=flags)
    assert p.env["EXPERT_CACHE_SLOTS"] == ",".join(map(str, split))
    assert p.env["EXPERT_CACHE_POLICY"] == "lfu" and p.per_layer == split
    with pytest.raises(UserError, match="47 per-layer budgets for a model of 48"):
        _plan(plan_file=_plan_file(tmp_path, split[:47]), vllm_args=flags)
    with pytest.raises(UserError, match="this card has room"):
        _plan(plan_file=_plan_file(tmp_path, [uniform + 1] * 48), vllm_args=flags)
    with pytest.raises(UserError, match="not below the 128 experts"):
        _plan(plan_file=_plan_file(tmp_path, [128] + [8] * 47), vllm_args=flags)
    with pytest.raises(UserError, match="below top_k 8"):
        _plan(plan_file=_plan_file(tmp_path, [4] + [8] * 47), vllm_args=flags)
    narrow = [uniform] * 47 + [20]  # 4 seqs x 8 = 32 ids > the 20-slot layer
    with pytest.raises(UserError, match="32 ids > 20 slots"):
        _plan(plan_file=_plan_file(tmp_path, narrow), vllm_args=flags)
    with pytest.raises(UserError, match="--plan or --slots"):
        _plan(plan_file=_plan_file(tmp_path, split), slots=8, vllm_args=flags)


def test_online_quantization_with_offloaded_experts_is_refused_with_the_way():
    """--quantization fp8 on bf16 weights creates the experts on the meta device; vLLM's
    offloader copies them before they hold data (0.26 died at load on the H200)."""
    flags = ["--max-num-seqs", "4", "--max-model-len", "8192"]
    with pytest.raises(UserError, match="quantises qwen3-30b-a3b's bf16 weights while loading"):
        _plan(vllm_args=[*flags, "--quantization", "fp8"])
    with pytest.raises(UserError, match="pre-quantised checkpoint"):
        _plan(vllm_args=[*flags, "-q", "fp8"])
    # a checkpoint that is already quantised: vLLM reads its format, nothing to refuse
    ok = _plan(model="/models/w8a8", size_from="qwen3-30b-a3b-w8a8",
               vllm_args=[*flags, "--quantization", "compressed-tensors"])
    assert "EXPERT_CACHE_SLOTS" in ok.env
    # the whole model fits: nothing is offloaded, online quantisation is vLLM's business
    big = _plan(vram=141, vllm_args=[*flags, "--quantization", "fp8"])
    assert big.size.verdict == "fits_outright"


def test_offloaded_mxfp4_experts_run_on_marlin_or_are_refused():
    """vLLM's default MXFP4 kernel on NVIDIA (triton_kernels) keeps every expert in VRAM
    whatever --cpu-offload-gb says (H200, vLLM 0.26: 5.8 GiB of weights in VRAM with 3.16 GB
    "offloaded"): serve passes --moe-backend marlin, and refuses the backends that cannot."""
    flags = ["--max-num-seqs", "2", "--max-model-len", "8192"]
    kw = dict(model="/models/gpt-oss-120b", size_from="gpt-oss-120b", vram=24)
    p = _plan(**kw, vllm_args=flags)
    assert p.size.quant == "mxfp4" and p.size.cpu_offload_gb > 0
    a = p.argv
    assert a[a.index("--moe-backend") + 1] == "marlin" and a.count("--moe-backend") == 1
    assert any("--moe-backend marlin is passed" in n for n in p.notes)
    # the user's own kernel that keeps its Parameters (offloadable) is left alone
    own = _plan(**kw, vllm_args=[*flags, "--moe-backend", "flashinfer_cutlass"])
    assert own.argv.count("--moe-backend") == 1 and own.argv[-1] == "flashinfer_cutlass"
    for bad in ("triton", "triton_unfused", "auto"):
        with pytest.raises(UserError, match=f"--moe-backend {bad}.* cannot offload MXFP4"):
            _plan(**kw, vllm_args=[*flags, f"--moe-backend={bad}"])
    with pytest.raises(UserError, match="vLLM cannot keep MXFP4 experts in host memory"):
        make_plan("/models/gpt-oss-120b", 24, size_from="gpt-oss-120b", launcher=VLLM,
                  environ={}, vllm_args=flags, v2_runner_offloads=lambda: True,
                  wna16_triton=lambda: True, mxfp4_marlin=lambda: False)
    # nothing offloaded (the whole model fits): vLLM's default kernel is right
    fits = _plan(**{**kw, "vram": 141}, vllm_args=flags)
    assert fits.size.verdict == "fits_outright" and "--moe-backend" not in fits.argv
    # ... unless the user offloads anyway
    mine = _plan(**{**kw, "vram": 141}, vllm_args=[*flags, "--cpu-offload-gb", "40"])
    assert mine.argv.count("--moe-backend") == 1 and "marlin" in mine.argv
    # `size` prints the same vLLM command
    assert p.size.vllm_args()[-2:] == ["--moe-backend", "marlin"]


def test_the_formats_on_triton_get_it_pinned_where_the_cache_is_asked():
    """bf16, W8A8 and FP8 experts are armed on vLLM's Triton experts, which vLLM does not
    pick on every GPU (FlashInfer for bf16 on Blackwell, CUTLASS for per-channel FP8 from
    Hopper on: every layer declined). A cached serve pins --moe-backend triton and says
    why; the user's own backend is theirs (one that the cache declines leaves the cache
    off, as `size` says), and nothing is pinned where the cache is off."""
    cached = _plan(vllm_args=["--max-num-seqs", "4"])
    assert cached.env["EXPERT_CACHE_SLOTS"]
    assert cached.argv.count("--moe-backend") == 1
    assert cached.argv[cached.argv.index("--moe-backend") + 1] == "triton"
    assert any("bf16 experts: --moe-backend triton is passed" in n for n in cached.notes)
    assert cached.size.vllm_args()[-2:] == ["--moe-backend", "triton"]  # `size`'s command
    mine = _plan(vllm_args=["--max-num-seqs", "4", "--moe-backend", "triton"])
    assert mine.argv.count("--moe-backend") == 1
    assert not any("--moe-backend triton is passed" in n for n in mine.notes)
    other = _plan(vllm_args=["--max-num-seqs", "4", "--moe-backend", "flashinfer_cutlass"])
    assert other.size.verdict == "offload_no_cache" and "EXPERT_CACHE_SLOTS" not in other.env
    assert "flashinfer_cutlass, a kernel the cache does not arm" in other.size.verdict_text
    assert other.argv.count("--moe-backend") == 1
    fits = _plan(vram=141)
    assert fits.size.verdict == "fits_outright" and "--moe-backend" not in fits.argv


def test_baseline_gives_offloaded_mxfp4_arms_marlin_and_resident_the_stock_kernel():
    from expertcache_cli.baseline.arms import parse_arms

    resident, offload, cache = parse_arms("resident,offload,cache:8")
    extra = ["--moe-backend", "marlin"]
    assert resident.server_args(30, [], extra) == []
    assert offload.server_args(30, [], extra)[-2:] == extra
    assert cache.server_args(30, [], extra)[4:6] == extra


def test_baseline_refuses_online_quantization_for_offloaded_arms(tmp_path):
    r = subprocess.run([sys.executable, "-m", "expertcache_cli", "baseline", MODEL, "--arms",
                        "offload", "--cpu-offload-gb", "30", "--server-cmd", "{python} -c pass",
                        "--", "--quantization", "fp8"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "while loading (online)" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_serve_and_baseline_refuse_to_run_the_cache_without_the_plugin(tmp_path, monkeypatch):
    """A cache arm or a cached server whose vLLM cannot find the plugin would run uncached
    and look like it worked: refused before anything starts (a dry run only warns)."""
    from expertcache_cli.baseline.arms import parse_arms as arms
    from expertcache_cli.baseline.arms import plugin_refusals
    from expertcache_cli.planning import launch

    monkeypatch.setattr(launch, "plugin_installed", lambda: False)
    assert plugin_refusals(arms("offload,cache:8"), None)[0].startswith(
        "the expertcache vLLM plugin is not installed")
    assert plugin_refusals(arms("offload,resident"), None) == []
    assert plugin_refusals(arms("cache:8"), "{python} -c pass") == []
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    assert "does not name expertcache" in plugin_refusals(arms("cache:8"), "{python} -c pass")[0]
    assert plugin_refusals(arms("cache:8"), "{python} -c pass", {"VLLM_PLUGINS": "a,expertcache"}
                           ) == []
    from expertcache_cli.vllm_facts import installed_vllm

    monkeypatch.delenv("VLLM_PLUGINS")
    monkeypatch.setattr(launch, "plugin_installed", lambda: True)
    monkeypatch.setattr(installed_vllm, "text", lambda: "0.99.0")
    assert plugin_refusals(arms("offload,cache:8"), None) == [
        "vLLM 0.99.0 is outside the releases whose MoE layout is known (0.26-0.34.x): the "
        "plugin would decline every layer and cache arms would run uncached"]
    assert plugin_refusals(arms("offload,resident"), None) == []
    monkeypatch.setattr(installed_vllm, "text", lambda: "0.33.0")
    assert plugin_refusals(arms("offload,cache:8"), None) == []


def test_serve_refuses_a_cache_no_plugin_would_arm_after_the_program_itself(monkeypatch):
    """`serve` starts nothing that cannot start (the program first), nor a cache that no
    plugin would arm (vLLM would serve uncached); a plan with the cache off needs none."""
    from expertcache_cli.planning import launch

    args = ["--max-num-seqs", "4", "--max-model-len", "8192"]
    cached = _plan(vllm_args=args, launcher=[sys.executable])
    off = _plan(vllm_args=args, launcher=[sys.executable], vram=141)
    assert "EXPERT_CACHE_SLOTS" in cached.env and "EXPERT_CACHE_SLOTS" not in off.env
    monkeypatch.setattr(launch, "plugin_installed", lambda: False)
    assert launch.plugin_missing(cached) and not launch.plugin_missing(off)
    assert launch.start_refusal(cached) == launch.PLUGIN_MISSING
    assert launch.start_refusal(cached, missing=False) is None  # the caller asked already
    assert launch.start_refusal(off) is None
    nowhere = _plan(vllm_args=args, launcher=["/nonexistent/vllm"])
    assert "not a program" in launch.start_refusal(nowhere)
    monkeypatch.setattr(launch, "plugin_installed", lambda: True)
    assert not launch.plugin_missing(cached) and launch.start_refusal(cached) is None


def test_serve_refuses_a_cache_on_a_vllm_release_the_plugin_does_not_know(monkeypatch):
    """Inside a vLLM the plugin has not read, it declines every layer: the server would run
    at the offload floor with the slots' memory planned away. `serve` says so up front and
    starts nothing; the known releases, no vLLM here, or the cache off start as before."""
    from expertcache_cli.planning import launch
    from expertcache_cli.vllm_facts import installed_vllm

    args = ["--max-num-seqs", "4", "--max-model-len", "8192"]
    cached = _plan(vllm_args=args, launcher=[sys.executable])
    off = _plan(vllm_args=args, launcher=[sys.executable], vram=141)
    monkeypatch.setattr(launch, "plugin_installed", lambda: True)
    monkeypatch.setattr(installed_vllm, "text", lambda: "0.99.0")
    why = launch.start_refusal(cached)
    assert why is not None and why.startswith("vLLM 0.99.0 is outside the releases whose MoE "
                                              "layout is known (0.26-0.34.x)")
    assert "pip install 'vllm>=0.26,<0.35'" in why and "EXPERT_CACHE_DISABLE=1" in why
    assert launch.start_refusal(off) is None
    for known in ("0.26.0", "0.33.1"):
        monkeypatch.setattr(installed_vllm, "text", lambda v=known: v)
        assert launch.start_refusal(cached) is None
    monkeypatch.setattr(installed_vllm, "text", lambda: None)
    assert launch.vllm_refusal(cached) is None


def test_a_wide_batched_token_budget_plans_the_staged_peak_as_runtime_memory():
    """Measured on the H200: past 2,048 batched tokens a staged server's profile step
    peaked 0.82 GiB above the runtime estimate; at 2,048 nothing. The plan counts it as
    runtime memory there (so the KV it hands vLLM is real), says so, and only there."""
    base = ["--max-num-seqs", "4", "--max-model-len", "8192"]

    def plan(tokens):
        return _plan(vllm_args=[*base, "--max-num-batched-tokens", str(tokens)],
                     wide="staged-install").size

    def note(p):
        (n,) = [n for n in p.notes if "slots a layer" in n]
        return n

    wide, narrow = plan(8192), plan(2048)
    in_place = _plan(vllm_args=[*base, "--max-num-batched-tokens", "8192"]).size
    peak = int(sizing.STAGED_WARM_PEAK_GIB * sizing.GiB)
    assert wide.overhead_bytes == in_place.overhead_bytes + peak
    assert "includes the 0.82 GiB a staged server's profile step peaked" in note(wide)
    assert narrow.overhead_bytes < wide.overhead_bytes - peak
    assert "peaked" not in note(narrow)


def test_serve_as_typed_chooses_the_batch_that_keeps_decode_on_the_cache():
    """`serve MODEL --vram 24`, nothing else: vLLM's default 256 sequences would bypass
    the cache, so the plan chooses the widest batch whose padded decode step fits the
    slots, passes it, and says so in one line (how to change it included)."""
    p = _plan()
    s = p.size
    assert s.max_num_seqs < 256 and not s.trap
    assert flag_value(p.argv, "--max-num-seqs") == str(s.max_num_seqs)
    assert s.padded_batch * s.top_k <= s.slots  # every decode step on the slots
    # the widest: one more sequence would pad past the slots (serve refuses it as the trap)
    with pytest.raises(UserError, match="sizing trap"):
        _plan(vllm_args=["--max-num-seqs", str(s.max_num_seqs + 1)])
    assert s.batch_choice.startswith(f"--max-num-seqs {s.max_num_seqs}, the widest batch")
    assert "choose another with -- --max-num-seqs N" in s.batch_choice


def test_a_batch_the_user_gave_is_never_replaced():
    p = _plan(vllm_args=["--max-num-seqs", "4"])
    assert p.size.batch_choice is None and flag_value(p.argv, "--max-num-seqs") == "4"
    # staged: a full batch is staged, nothing is chosen; vLLM's default stays
    st = _plan(wide="staged-install").size
    assert st.batch_choice is None and st.max_num_seqs == 256


def test_serve_hands_vllm_the_planned_kv_cache():
    """The profile step cannot shrink what the plan gives KV: --kv-cache-memory-bytes is
    the reserve plus what whole slots leave, and weights (with vLLM's rotary cache) +
    slots + KV + runtime add up to the budget."""
    p = _plan(vllm_args=["--max-model-len", "8192"])
    s = p.size
    kv = int(flag_value(p.argv, "--kv-cache-memory-bytes"))
    assert kv == s.kv_cache_bytes and kv >= s.kv_reserved_bytes
    assert kv - s.kv_reserved_bytes < s.bytes_per_slot  # less than one more slot
    used = (s.non_expert_bytes + s.rope_cache_bytes + s.overhead_bytes
            + s.slots * s.bytes_per_slot + kv)
    assert used == s.budget_bytes
    # and the plugin is told what the plan holds beside the slots, to warn if vLLM loads more
    assert p.env["EXPERT_CACHE_PLANNED_WEIGHTS"] == str(s.non_expert_bytes + s.rope_cache_bytes)
    # a KV size the user gives is planned around and passed as theirs, once
    own = _plan(vllm_args=["--max-model-len", "8192", "--kv-cache-memory-bytes", "2G"])
    assert own.argv.count("--kv-cache-memory-bytes") == 1
    assert flag_value(own.argv, "--kv-cache-memory-bytes") == "2G"
    assert own.size.kv_reserved_bytes == 2 * 2**30 and own.size.slots < s.slots


def test_a_kv_size_below_one_sequence_is_refused_before_launch():
    with pytest.raises(UserError, match="cannot hold one --max-model-len 8192 sequence"):
        _plan(vllm_args=["--max-model-len", "8192", "--kv-cache-memory-bytes", "100M"])


def test_a_per_layer_plan_gets_the_batch_its_narrowest_layer_allows(tmp_path):
    per_layer = [24] * 24 + [56] * 24  # the uniform budget here is 40 a layer
    p = _plan(plan_file=_plan_file(tmp_path, per_layer),
              vllm_args=["--max-model-len", "8192"])
    s = p.size
    assert s.max_num_seqs == 2 and s.padded_batch * s.top_k <= 24
    assert "narrowest layer (24 slots)" in s.batch_choice
    assert flag_value(p.argv, "--max-num-seqs") == str(s.max_num_seqs)


def test_cards_by_name_plan_for_the_memory_they_report():
    l4 = _plan(vram="l4", vllm_args=["--max-model-len", "8192"]).size
    rtx = _plan(vram="rtx-4090", vllm_args=["--max-model-len", "8192"]).size
    plain = _plan(vram=24, vllm_args=["--max-model-len", "8192"]).size
    assert l4.vram_gib == pytest.approx(22.49, abs=0.01) and l4.slots < rtx.slots
    assert rtx.vram_gib == pytest.approx(23.99, abs=0.01) and rtx.slots <= plain.slots
    assert l4.card == "L4 (22.49 GiB, PCIe 4.0 x16)" and plain.card is None
    assert l4.where == l4.card and plain.where == "24 GiB"


def test_serve_says_which_card_and_the_batch_in_its_lines():
    r = _cli("serve", MODEL, "--vram", "rtx-4090", "--dry-run", "--", "--max-model-len", "8192")
    assert r.returncode == 0, r.stderr
    err = " ".join(r.stderr.split())
    assert "on RTX 4090 (23.99 GiB, PCIe 4.0 x16)" in err
    assert "batch: --max-num-seqs" in err and "KV cache:" in err
    assert "--kv-cache-memory-bytes" in r.stdout


def test_serve_refuses_a_tensor_parallel_size_vllm_cannot_split():
    """`serve`/`baseline` size through `sizing.plan`: -tp 3 on Qwen3-30B-A3B (32 heads, 4
    KV heads) is one line before anything starts, as vLLM would refuse it after loading."""
    with pytest.raises(UserError, match="vLLM cannot split qwen3-30b-a3b 3 ways"):
        _plan(vllm_args=["-tp", "3", "--max-num-seqs", "8"])


def test_cli_serve_on_an_unknown_vllm_release_is_one_line_and_exit_2_and_size_says_so(tmp_path):
    """As a user with a vLLM newer than the plugin knows runs it: `serve` prints one line
    and starts nothing (the `vllm` program here would leave a mark); the dry run warns."""
    import os

    site = tmp_path / "site"
    meta = site / "vllm-0.99.0.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.99.0\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mark = tmp_path / "started"
    fake = bin_dir / "vllm"
    fake.write_text(f"#!/bin/sh\ntouch {mark}\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    env.pop("EXPERT_CACHE_DISABLE", None)
    cmd = [sys.executable, "-m", "expertcache_cli", "serve", MODEL, "--vram", "24", "--",
           "--max-num-seqs", "4", "--max-model-len", "8192"]
    from expertcache_cli.planning.launch import plugin_installed

    if not plugin_installed():
        pytest.skip("the plugin's entry point is not installed in this python")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("expertcache: error: vLLM 0.99.0 is outside the releases whose MoE "
                           "layout is known") and "Traceback" not in r.stderr
    assert not mark.exists()
    control = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                             env={**env, "EXPERT_CACHE_DISABLE": "1"})
    assert control.returncode == 0 and mark.exists()  # the control run the line advises
    dry = subprocess.run([*cmd[:7], "--dry-run", *cmd[7:]], capture_output=True, text=True,
                         timeout=120, env=env)
    assert dry.returncode == 0 and "warning: vLLM 0.99.0 is outside" in dry.stderr
    size = subprocess.run([sys.executable, "-m", "expertcache_cli", "size", "--model", MODEL,
                           "--vram", "24", "--json"], capture_output=True, text=True,
                          timeout=120, env=env)
    import json

    assert size.returncode == 0  # sized all the same, and told
    notes = json.loads(size.stdout)["notes"]
    assert any(n.startswith("vLLM 0.99.0 is outside") and "`serve` refuses" in n
               for n in notes), notes


def test_an_extensible_kv_cache_beside_the_planned_kv_bytes_is_refused_before_launch():
    """vLLM 0.34 raises at start on --enable-extensible-kv-cache with
    --kv-cache-memory-bytes (config/vllm.py: "which kv_cache_memory_bytes overrides"), which
    an offloaded plan passes: serve says it in one line instead."""
    args = ["--max-num-seqs", "4", "--max-model-len", "8192"]
    with pytest.raises(UserError, match="--enable-extensible-kv-cache: vLLM refuses it"):
        _plan(vllm_args=[*args, "--enable-extensible-kv-cache"], launcher=[sys.executable])
    fits = _plan(vllm_args=[*args, "--enable-extensible-kv-cache"], launcher=[sys.executable],
                 vram=141)  # nothing offloaded, no KV bytes handed: vLLM's own choice
    assert "--kv-cache-memory-bytes" not in fits.argv
