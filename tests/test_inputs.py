"""`planning/inputs.py`: which source of each of `plan`'s inputs wins, the one line when
none is given, and exit 2 at the command line."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from expertcache_cli.errors import DeviceUnavailable, UserError
from expertcache_cli.planning import inputs, planner
from expertcache_cli.rules.policy import Wide
from expertcache_cli.rules.trace import load
from expertcache_cli.sizing.cards import parse_vram

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "demo-qwen3-30b-a3b-tasks.npz"
PROBE = ROOT / "bench" / "results" / "probe-link-h200.json"
BASELINE = ROOT / "bench" / "results" / "baseline.jsonl"
QWEN = ROOT / "tests" / "configs" / "qwen3-30b-a3b.json"
RTX_4090 = parse_vram("rtx-4090")[1]


@pytest.fixture(scope="module")
def trace():
    return load(TRACE)


@pytest.fixture
def no_gpu(monkeypatch):
    from expertcache_cli.device import kernel_check

    def none(*a, hint="", **k):
        raise DeviceUnavailable(f"no CUDA device visible: {hint}")

    monkeypatch.setattr(kernel_check, "device_arch", none)


def _never(*a, **k):
    raise AssertionError("read a source that does not win")


# --------------------------------------------------------------------------- both rates given


def test_missing_rates_are_named_in_one_line_before_any_work(no_gpu, monkeypatch):
    with pytest.raises(UserError) as both:
        inputs.check_given(None, None, None, None)
    msg = str(both.value)
    assert msg.startswith("plan needs, on this machine with no GPU, the link rate (--probe FILE")
    assert "--link-gbps G" in msg and "and the resident rate (--resident-tok-s R" in msg
    assert "\n" not in msg
    with pytest.raises(UserError, match="no GPU, the link rate") as link:
        inputs.check_given(None, None, 300.0, None)
    assert "resident" not in str(link.value)
    with pytest.raises(UserError, match="^plan needs the resident rate"):
        inputs.check_given(50.0, None, None, None)
    inputs.check_given(None, PROBE, None, BASELINE)  # both given: nothing to say
    # a card named by --vram gives its usual link (an estimate): only the resident is missing
    with pytest.raises(UserError, match="^plan needs the resident rate"):
        inputs.check_given(None, None, None, None, RTX_4090)
    from expertcache_cli.device import kernel_check

    monkeypatch.setattr(kernel_check, "device_arch", lambda *a, **k: (90, "H200"))
    with pytest.raises(UserError, match="^plan needs the resident rate"):
        inputs.check_given(None, None, None, None)  # a GPU measures the link


@pytest.mark.parametrize("given, words", [
    ((50.0, PROBE, 300.0, None), "give --link-gbps or --probe, not both"),
    ((50.0, None, 300.0, BASELINE), "give --resident-tok-s or --baseline, not both"),
])
def test_two_sources_of_one_rate_are_refused(given, words):
    with pytest.raises(UserError, match=words):
        inputs.check_given(*given)


# --------------------------------------------------------------------------- the link


def test_a_given_link_wins_over_a_card_and_is_said_to_be_given():
    assert inputs.link_rate(25.0, None, None, RTX_4090) == (25.0, "given (--link-gbps)", None)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_given_link_must_be_a_positive_number(bad):
    with pytest.raises(UserError, match="--link-gbps must be a positive number"):
        inputs.link_rate(bad, None, None)


def test_a_saved_probe_wins_over_a_card():
    assert inputs.link_rate(None, PROBE, None, RTX_4090) == planner.read_probe(PROBE)


def test_a_card_with_no_link_given_gives_its_usual_link_as_an_estimate(no_gpu, monkeypatch):
    from expertcache_cli import probe
    from expertcache_cli.sizing.cards import typical_link_gbps

    monkeypatch.setattr(probe, "probe_link", _never)  # the card's link, not this machine's
    rate, src, step = inputs.link_rate(None, None, "qwen3-30b-a3b", RTX_4090)
    assert rate == typical_link_gbps(RTX_4090) and step is None
    assert src.startswith("typical for the RTX 4090 on PCIe 4.0 x16") and "an estimate" in src


def _measured(monkeypatch, impl: str = "kernel", step_us: float = 3.7):
    """A GPU that answers the gather and the step (the measurement itself replaced)."""
    from expertcache_cli import probe
    from expertcache_cli.device import binding, kernel_check

    calls = {}
    monkeypatch.setattr(kernel_check, "device_arch", lambda *a, **k: (90, "H200"))
    monkeypatch.setattr(binding, "select", lambda *a: calls.setdefault("select", a))

    def probe_link(**kw):
        calls["probe"] = kw
        rows = [probe.Rate(f"gather_{n}", n << 20, 1e-3, g, 3, 0.01)
                for n, g in ((1, 20.0), (8, 48.0), (32, 51.0))]
        return SimpleNamespace(gather=rows, model={"top_k": 8}, gather_impl=impl, errors=[],
                               step_us=step_us, device_name="NVIDIA H200")

    monkeypatch.setattr(probe, "probe_link", probe_link)
    return calls


def test_with_nothing_given_the_link_is_measured_here_with_the_step(monkeypatch):
    calls = _measured(monkeypatch)
    rate, src, step = inputs.link_rate(None, None, "qwen3-30b-a3b")
    assert rate == 48.0 and src == "measured now on NVIDIA H200 (the gather, gather_8)"
    assert step[0] == 3.7 and "every expert a hit" in step[1]
    assert calls["probe"]["model"] == "qwen3-30b-a3b"
    assert calls["probe"]["only"] == ("gather", "step")
    assert "select" not in calls  # the library reads no environment: its caller selects
    # no step measured: the prediction prices none, and says so (`prediction_inputs`)
    _measured(monkeypatch, step_us=0.0)
    assert inputs.link_rate(None, None, None)[2] is None


def test_plan_measures_the_link_with_the_kernels_the_environment_selects(monkeypatch):
    """At the command line the environment's kernels (``EXPERT_CACHE_LIB``,
    ``EXPERT_CACHE_PDL``) are handed to the binding before the link is measured."""
    from typer.testing import CliRunner

    from expertcache_cli.cli import app
    from expertcache_cli.device import binding

    calls = _measured(monkeypatch)
    # selected before the measurement loads any kernel
    monkeypatch.setattr(binding, "select", lambda *a: calls.setdefault(
        "select", (a, "probe" in calls)))
    r = CliRunner().invoke(app, ["plan", "--resident-tok-s", "100", "--json"],
                           env={"EXPERT_CACHE_PDL": "0", "EXPERT_CACHE_LIB": ""})
    assert r.exit_code == 0, r.output
    assert calls["select"] == ((None, False), False)  # the kernels the environment selects
    assert calls["probe"]["only"] == ("gather", "step")


def test_a_measurement_with_the_torch_stand_in_is_refused(monkeypatch):
    _measured(monkeypatch, impl="FALLBACK: torch index_select over a UVA view")
    with pytest.raises(UserError, match="could not be measured here.*give --link-gbps or "
                       "--probe"):
        inputs.link_rate(None, None, None)


def test_with_no_gpu_a_measurement_says_what_to_give(no_gpu):
    with pytest.raises(DeviceUnavailable, match="plan needs the link rate"):
        inputs.link_rate(None, None, None)


# --------------------------------------------------------------------------- the resident rate


def test_a_given_resident_rate_wins_and_the_baseline_is_read_only_when_it_is_the_source():
    assert inputs.resident_rate(300.0, None, _never) == (300.0, "given (--resident-tok-s)")
    read = []

    def reader(path):
        read.append(path)
        return 605.1, f"baseline {path}"

    assert inputs.resident_rate(None, BASELINE, reader) == (605.1, f"baseline {BASELINE}")
    assert read == [BASELINE]
    from expertcache_cli.baseline.runner import resident_from_baseline

    rate, src = inputs.resident_rate(None, BASELINE, resident_from_baseline)
    assert rate == pytest.approx(600.9, abs=0.1) and "resident arm" in src


def test_no_resident_rate_is_one_line_saying_how_to_give_it():
    with pytest.raises(UserError, match=r"^plan needs the resident rate \(--resident-tok-s R"):
        inputs.resident_rate(None, None, _never)


@pytest.mark.parametrize("bad", [0.0, -5.0, float("nan")])
def test_a_given_resident_rate_must_be_positive(bad):
    with pytest.raises(UserError, match="--resident-tok-s must be positive"):
        inputs.resident_rate(bad, None, _never)


# --------------------------------------------------------------------------- the model, the bytes


def test_the_model_must_route_as_the_trace_does(trace):
    assert inputs.plan_model(None, trace) is None
    m = inputs.plan_model(str(QWEN), trace)
    assert (m.num_experts, m.top_k) == (trace.num_experts, trace.top_k)
    with pytest.raises(UserError, match="--model mixtral-8x7b: 8 experts top-2, the trace has "
                       "128 top-8$"):
        inputs.plan_model("mixtral-8x7b", trace)
    demo = load(ROOT / "traces" / "real-qwen3-30b-a3b-k6.npz")
    with pytest.raises(UserError, match="the bundled demo, recorded at 6 experts a token"):
        inputs.plan_model("qwen3-30b-a3b", demo, demo=True)


def test_the_models_expert_bytes_win_over_the_traces(trace):
    m = inputs.plan_model("qwen3-30b-a3b-w8a8", trace)
    assert m.bytes_per_expert != trace.expert_bytes
    assert inputs.expert_bytes(m, "qwen3-30b-a3b-w8a8", trace) == (
        m.bytes_per_expert, "--model qwen3-30b-a3b-w8a8 (preset)")
    assert inputs.expert_bytes(None, None, trace) == (trace.expert_bytes,
                                                      "the trace's expert_bytes")
    with pytest.raises(UserError, match="^the trace does not say how big an expert is: give "
                       "--model M$"):
        inputs.expert_bytes(None, None, dataclasses.replace(trace, expert_bytes=None))


def test_a_card_needs_a_model_and_no_card_fits_everything(trace):
    from expertcache_cli.planning import serving

    srv = serving.server([], vllm_version="0.33")
    assert inputs.card_slots(None, None, Wide.IN_PLACE, srv, None) is None
    with pytest.raises(UserError, match=r"^--vram needs --model \(what to put on the card\)$"):
        inputs.card_slots(None, "24", Wide.IN_PLACE, srv, None)
    m = inputs.plan_model("qwen3-30b-a3b-w8a8", trace)
    assert inputs.card_slots(m, "24", Wide.IN_PLACE, srv, None) == planner.card_fits(
        m, "24", Wide.IN_PLACE, srv, None)


def test_the_step_comes_with_the_link_that_measured_it():
    measured = inputs.prediction_inputs((100, "b"), (50.0, "l", (3.7, "s")), (300.0, "r"))
    assert (measured.step_us, measured.step_source) == (3.7, "s")
    given = inputs.prediction_inputs((100, "b"), (50.0, "l", None), (300.0, "r"))
    assert given.step_us == 0.0 and given.step_source.startswith("not measured")
    assert (given.bytes_per_expert, given.link_gbps, given.resident_tok_s) == (100, 50.0, 300.0)


# --------------------------------------------------------------------------- budgets, serve


def test_given_budgets_win_and_must_be_below_the_traces_experts(trace):
    assert inputs.budgets([16, 32], trace, fits_upto=8) == [16, 32]  # given: not clipped
    with pytest.raises(UserError, match="^--slots 128 is not below the trace's 128 experts"):
        inputs.budgets([16, 128], trace, None)


def test_the_default_grid_runs_from_top_k_to_what_the_card_fits(trace):
    card = inputs.budgets(None, trace, fits_upto=85)
    assert card[0] == trace.top_k and card[-1] == 85
    assert card == planner.slot_grid(trace.num_experts, trace.top_k, 85)
    anywhere = inputs.budgets(None, trace, fits_upto=None)
    assert anywhere[0] == trace.top_k and anywhere[-1] == trace.num_experts - 1
    assert inputs.budgets(None, trace, fits_upto=trace.top_k - 1) == []  # plan_trace refuses


def test_the_serve_command_names_a_model_directory_else_sizes_from_the_spec(tmp_path):
    assert inputs.serve_model(str(tmp_path)) == str(tmp_path)
    assert inputs.serve_model("qwen3-30b-a3b-w8a8") == "MODEL --size-from qwen3-30b-a3b-w8a8"
    assert inputs.serve_model(str(QWEN)) == f"MODEL --size-from {QWEN}"
    assert inputs.serve_model(None) == "MODEL"


def test_the_plans_model_is_named_by_the_model_else_the_trace(trace):
    m = inputs.plan_model("qwen3-30b-a3b-w8a8", trace)
    facts = inputs.model_facts(m, trace, m.bytes_per_expert, 23.99, RTX_4090, 85)
    assert facts["name"] == m.name and facts["card"] == RTX_4090.describe()
    assert facts["max_slots"] == 85 and facts["num_moe_layers"] == trace.num_layers
    bare = inputs.model_facts(None, trace, 7, None, None, None)
    assert bare["name"] == trace.model and bare["card"] is None and bare["bytes_per_expert"] == 7


# --------------------------------------------------------------------------- at the command line


def _plan(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expertcache_cli", "plan", *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args, words", [
    (["--link-gbps", "50", "--probe", str(PROBE), "--resident-tok-s", "300"],
     "give --link-gbps or --probe, not both"),
    (["--link-gbps", "50", "--resident-tok-s", "300", "--baseline", str(BASELINE)],
     "give --resident-tok-s or --baseline, not both"),
    (["--link-gbps", "50"], "plan needs the resident rate (--resident-tok-s R"),
    (["--link-gbps", "nan", "--resident-tok-s", "300"], "--link-gbps must be a positive number"),
    (["--link-gbps", "50", "--resident-tok-s", "0"], "--resident-tok-s must be positive"),
    (["--link-gbps", "50", "--resident-tok-s", "300", "--vram", "24"], "--vram needs --model"),
    (["--link-gbps", "50", "--resident-tok-s", "300", "--slots", "16,128"],
     "--slots 128 is not below the trace's 128 experts"),
    (["--link-gbps", "50", "--resident-tok-s", "300", "--model", "mixtral-8x7b"],
     "--model mixtral-8x7b: 8 experts top-2"),
    (["--probe", str(BASELINE), "--resident-tok-s", "300"], "--probe"),
    (["--link-gbps", "50", "--baseline", str(PROBE)], "not a JSON record"),
])
def test_each_refused_input_is_one_line_and_exit_2(tmp_path, args, words):
    r = _plan(str(TRACE), *args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("expertcache: error: "), r.stderr
    assert words in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_a_trace_without_expert_bytes_needs_a_model_at_the_command_line(tmp_path, trace):
    from expertcache_cli.rules.trace import save

    bare = save(dataclasses.replace(trace, expert_bytes=None), tmp_path / "bare.npz")
    r = _plan(str(bare), "--link-gbps", "50", "--resident-tok-s", "300")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "expertcache: error: the trace does not say how big an expert is: give --model M"]
    ok = _plan(str(bare), "--link-gbps", "50", "--resident-tok-s", "300", "--model", str(QWEN),
               "--slots", "32", "--json")
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    assert data["model"]["bytes_per_expert"] == inputs.plan_model(str(QWEN), trace).bytes_per_expert
    assert data["link_source"] == "given (--link-gbps)"


def test_plan_sizes_an_online_quantised_model_as_size_does(tmp_path, trace):
    """`--quantization fp8` after `--` has vLLM quantise a bf16 model while loading: `plan`
    prices its misses and fits its slots at the fp8 bytes a slot holds, the numbers `size`
    gives for the same flags (it priced bf16 bytes, twice as many, and fewer slots)."""
    from expertcache_cli.sizing import sizing

    bf16 = inputs.plan_model(str(QWEN), trace)
    fp8 = inputs.plan_model(str(QWEN), trace, vllm_quantization="fp8")
    assert (bf16.quant, fp8.quant) == ("bf16", "fp8")
    assert fp8.bytes_per_expert < bf16.bytes_per_expert
    size = sizing.plan(str(QWEN), 24, max_model_len=8192, vllm_quantization="fp8")
    r = _plan(str(TRACE), "--link-gbps", "50", "--resident-tok-s", "300", "--model", str(QWEN),
              "--vram", "24", "--json", "--", "--max-model-len", "8192", "--quantization",
              "fp8", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    model = json.loads(r.stdout)["model"]
    assert model["bytes_per_expert"] == fp8.bytes_per_expert == size.bytes_per_expert
    assert model["max_slots"] == size.max_slots


def test_under_tensor_parallelism_a_miss_costs_one_ranks_share_of_the_expert(tmp_path, trace):
    """`-tp 2` after `--`: every rank holds half of each expert and gathers that half over
    its own link, so `plan` prices a miss at the rank's share (it priced the whole expert,
    twice the time), and says so where it names the bytes."""
    m = inputs.plan_model(str(QWEN), trace)
    whole, _ = inputs.expert_bytes(m, str(QWEN), trace)
    share, source = inputs.expert_bytes(m, str(QWEN), trace, tensor_parallel=2)
    assert share == m.per_rank(2).bytes_per_expert and 2 * share == whole
    assert "one of 2 tensor-parallel ranks' share" in source
    r = _plan(str(TRACE), "--link-gbps", "50", "--resident-tok-s", "300", "--model", str(QWEN),
              "--slots", "32", "--json", "--", "-tp", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"]["bytes_per_expert"] == share
