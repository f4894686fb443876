"""vLLM's Marlin MoE experts armed on CPU stand-ins (`marlin_standins`) of every format
vLLM runs on them (GPTQ with and without act order, AWQ, compressed-tensors W4A16, NVFP4,
MXFP4) in 0.26's and 0.33's layout: the slot path gives the stock path's output bit for
bit on random routings, every mirrored tensor (the packed small ones included) holds its
expert's source bytes, the per-call state (block order, expert count) is the stock one,
and a layout or module the plugin does not know is declined, never armed. Skipped where
torch is missing."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="no torch: the Marlin arming tests need torch")

import marlin_standins as ms  # noqa: E402
from plugin_standins import FakeModel  # noqa: E402
from ref_slotcache import RefSlotCache  # noqa: E402

from expertcache_cli.config import CacheConfig  # noqa: E402
from expertcache_cli.plugin import marlin, session  # noqa: E402
from expertcache_cli.plugin.arming import ARM, DECLINE, plan_layer, summary_line  # noqa: E402
from expertcache_cli.plugin.runtime import ArmedLayer  # noqa: E402
from expertcache_cli.plugin.small import SMALL_ROW  # noqa: E402


@pytest.fixture(autouse=True)
def _marlin_armed(monkeypatch):
    """Marlin arming is opt-in (EXPERT_CACHE_MARLIN=1) for the formats not yet served from
    slots (MXFP4 is armed by default): these tests are about what it does for every format,
    asked for (the default is tested on its own)."""
    monkeypatch.setenv("EXPERT_CACHE_MARLIN", "1")


S = 6  # slots of the stand-in's 12 experts
FORMATS = [("gptq", "0.26", False), ("gptq", "0.26", True), ("awq", "0.26", False),
           ("w4a16", "0.33", False), ("nvfp4", "0.33", False), ("nvfp4", "0.26", False),
           ("mxfp4", "0.33", False)]


@pytest.mark.parametrize(("method", "fmt", "armed"), [
    ("GptOssMxfp4MoEMethod", "mxfp4", True), ("Mxfp4MoEMethod", "mxfp4", True),
    ("AutoGPTQMoEMethod", "gptq", True), ("AutoAWQMoEMethod", "awq", True),
    ("CompressedTensorsWNA16MarlinMoEMethod", "w4a16", True),
    ("ModelOptNvFp4FusedMoE", "nvfp4", True), ("MarlinMoEMethod", "mxfp4", False)])
def test_unset_arms_the_formats_served_from_slots_and_declines_the_rest(method, fmt, armed,
                                                                        monkeypatch):
    """With EXPERT_CACHE_MARLIN unset the format is read from the quant method's class name:
    MXFP4, NVFP4 and the W4A16 family (served from slots on a GPU) are armed, a method not
    known is declined with the reason and the switch that arms them; =0 declines the
    served ones too."""
    monkeypatch.delenv("EXPERT_CACHE_MARLIN")
    layer = ms.RoutedExperts(fmt, "0.33" if fmt != "gptq" else "0.26")
    layer.quant_method.__class__ = type(method, (ms.MarlinMoEMethod,), {})
    d = plan_layer(layer, CacheConfig(slots=S))
    if armed:
        assert d.action == ARM, d.reason
        monkeypatch.setenv("EXPERT_CACHE_MARLIN", "0")
        d = plan_layer(layer, CacheConfig(slots=S))
        assert d.action == DECLINE and "EXPERT_CACHE_MARLIN=0 keeps" in d.reason
    else:
        assert d.action == DECLINE
        assert f"vLLM runs {method}'s experts on Marlin" in d.reason
        assert d.reason.endswith("EXPERT_CACHE_MARLIN=1 arms it")


@pytest.fixture(autouse=True)
def _patched():
    """The plugin's block remap installed in the stand-in marlin module, as arm_model
    installs it in vLLM's."""
    assert session._patch_marlin(ms.MODULE) is None
    yield


def _arm(layer, slots=S, wide_inserts=None, spread=False):
    """``layer`` armed on the reference cache; ``spread``: the side row's compact copies
    filled by the installs (`SmallTensors.spread_targets`, as `session` arms it), else
    unpacked after each step."""
    d = plan_layer(layer, CacheConfig(slots=slots))
    assert d.action == ARM, d.reason
    small = session._small_for(layer, d, "cpu")
    specs = {s.name: (s.shape, s.dtype) for s in d.specs}
    if small is not None:
        specs[SMALL_ROW] = ((small.row_bytes,), torch.uint8)
    cache = RefSlotCache(d.num_experts, d.num_slots, specs, wide_inserts=wide_inserts,
                         spread={SMALL_ROW: small.spread_targets()} if spread else None)
    scratch = None
    if wide_inserts is not None:
        from expertcache_cli.device.scratch import Scratch, torch_copiers

        scratch = Scratch(d.num_experts, {s.name: (s.shape, s.dtype) for s in d.specs},
                          "cpu", copier=torch_copiers)
    order = marlin.BlockOrder(d.num_experts) if d.marlin else None
    armed = ArmedLayer(layer, d, cache, index=0, scratch=scratch, small=small,
                       block_order=order)
    armed.install()
    return armed


def _routing(rng, tokens):
    ids = np.stack([rng.choice(ms.E, ms.TOPK, replace=False) for _ in range(tokens)])
    return torch.from_numpy(ids.astype(np.int32)), torch.rand(tokens, ms.TOPK)


def _x(tokens):
    return torch.randn(tokens, ms.K).to(torch.bfloat16)


@pytest.mark.parametrize("fmt, layout, act_order", FORMATS)
def test_the_slot_path_gives_the_stock_bits_and_every_slot_holds_its_expert(
        fmt, layout, act_order):
    stock = ms.RoutedExperts(fmt, layout, act_order, seed=3)
    cached = ms.RoutedExperts(fmt, layout, act_order, seed=3)
    armed = _arm(cached)
    d = armed.decision
    assert (d.kernel, d.layout) == ("MarlinExperts", layout)
    full_w13 = cached.w13_weight.data_ptr()
    rng = np.random.default_rng(3)
    served = 0
    for step in range(40):
        tokens = (1, 2, 3, 1, 4)[step % 5]  # 4 tokens x top-2 = 8 ids > 6 slots: read through
        x, (ids, w) = _x(tokens), _routing(rng, tokens)
        want = stock.forward_modular(x=x.clone(), topk_weights=w, topk_ids=ids)
        got = cached.forward_modular(x=x, topk_weights=w, topk_ids=ids)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        served += tokens * ms.TOPK <= S
        # the layer is whole again after every call
        assert cached.w13_weight.data_ptr() == full_w13 and cached.global_num_experts == ms.E
    assert armed.checked["slots"] == 0.0 and "forward_modular" in cached.__dict__
    slot_ptrs = {t.data_ptr() for t in armed.cache.slots.values()}
    on_slots = [c for c in cached.calls if c["w13"] in slot_ptrs]
    # the first call swept every expert through the slots first, each step on the stock
    # path too, and found the stock bits
    sweep = armed.sweep_result.paths
    assert [(p.path, p.covered, p.worst) for p in sweep] == [("slots", ms.E, 0.0)]
    assert len(on_slots) == served + sweep[0].steps
    # each slot-bound call: the expert ids as vLLM routed them, the layer reporting S experts
    assert all(c["global_num_experts"] == S and int(c["ids"].max()) < ms.E for c in on_slots)
    assert any(int(c["ids"].max()) >= S for c in on_slots)  # expert ids, not slot ids
    audit = armed.audit()
    assert audit.ok, audit.problems
    assert audit.occupied == S and audit.tensors == len(d.specs) + len(d.small) + bool(d.small)


def test_the_layouts_and_what_each_format_mirrors():
    """0.26's layout: act order's g_idx and sort indices rebound through the kernel's
    aliases when filled, left alone when empty; 0.33's: none of them. compressed-tensors'
    load-only shape record is not mirrored; NVFP4's 4-byte global scales are packed."""
    gptq = plan_layer(ms.RoutedExperts("gptq", "0.26", act_order=True), CacheConfig(slots=S))
    assert gptq.layout == "0.26"
    assert sorted(a for _, a, _ in gptq.aliases) == sorted(marlin.ACT_ORDER_ATTRS)
    assert {"w13_qweight", "w13_scales", "w13_qzeros", "w13_g_idx",
            "w13_g_idx_sort_indices"} <= {s.name for s in gptq.specs}
    plain = plan_layer(ms.RoutedExperts("gptq", "0.26"), CacheConfig(slots=S))
    assert plain.aliases == [] and "w13_g_idx" not in {s.name for s in plain.specs}
    ct = plan_layer(ms.RoutedExperts("w4a16", "0.33"), CacheConfig(slots=S))
    assert ct.layout == "0.33" and not ct.small
    assert {s.name for s in ct.specs} == {"w13_weight_packed", "w2_weight_packed",
                                         "w13_weight_scale", "w2_weight_scale"}
    nv = plan_layer(ms.RoutedExperts("nvfp4", "0.33"), CacheConfig(slots=S))
    assert [s.name for s in nv.small] == ["w13_weight_scale_2", "w2_weight_scale_2"]
    assert "w13_input_scale" not in {s.name for s in nv.specs}
    line = summary_line([nv], CacheConfig(slots=S), "0.33.0")
    assert "w13_weight_scale_2[float32 1, packed, spread]" in line
    assert "experts kernel MarlinExperts (vLLM 0.33 layout, blocks kept in expert order)" in line
    mx = plan_layer(ms.RoutedExperts("mxfp4", "0.33"), CacheConfig(slots=S))
    assert {"w13_bias", "w2_bias", "w13_weight_scale"} <= {s.name for s in mx.specs}


@pytest.mark.parametrize("layout, damage, needle", [
    ("0.26", lambda ex: delattr(ex, "w2_g_idx"), "neither vLLM 0.26's nor 0.33's Marlin"),
    ("0.26", lambda ex: delattr(ex, "is_k_full"), "neither vLLM 0.26's nor 0.33's"),
    ("0.33", lambda ex: delattr(ex, "activation_config"), "no activation_config: neither"),
    ("0.33", lambda ex: setattr(ex, "quant_config", object()), "quant config lacks w1_scale"),
])
def test_a_marlin_layout_of_neither_release_is_declined(layout, damage, needle):
    layer = ms.RoutedExperts("gptq" if layout == "0.26" else "w4a16", layout)
    damage(layer.quant_method.moe_kernel.fused_experts)
    d = plan_layer(layer, CacheConfig(slots=S))
    assert d.action == DECLINE and needle in d.reason


def test_slot_ids_would_change_marlins_reduction_order():
    """Why Marlin gets expert ids and a remapped block list: with slot ids (the Triton
    way) the blocks sort by slot, the stripes split each reduction elsewhere, and the
    output differs at rounding level (the stand-in rounds each stripe to bf16 to show it;
    the GPU's fp32 partials flip bits more rarely, but they do)."""
    stock = ms.RoutedExperts("gptq", "0.26", seed=5)
    cached = ms.RoutedExperts("gptq", "0.26", seed=5)
    armed = _arm(cached)
    armed.block_order = None  # slot-space ids, as for Triton
    armed.checked["slots"] = 0.0  # (past the first-call check)
    rng = np.random.default_rng(5)
    diffs = []
    for _ in range(30):
        x, (ids, w) = _x(3), _routing(rng, 3)
        want = stock.forward_modular(x=x.clone(), topk_weights=w, topk_ids=ids)
        got = cached.forward_modular(x=x, topk_weights=w, topk_ids=ids)
        diffs.append(float((got.float() - want.float()).norm() / want.float().norm()))
    assert max(diffs) > 0 and max(diffs) < 0.02  # rounding, not a wrong expert


@pytest.mark.parametrize("fmt", ["gptq", "nvfp4"])
def test_wide_steps_staged_through_the_scratch_give_the_stock_bits(fmt):
    """Staged wide steps: the scratch is indexed by expert id, Marlin runs stock on it
    (no remap), the small tensors come from their full device copies."""
    layout = "0.26" if fmt == "gptq" else "0.33"
    stock, cached = ms.RoutedExperts(fmt, layout, seed=7), ms.RoutedExperts(fmt, layout, seed=7)
    armed = _arm(cached, wide_inserts=S)
    rng = np.random.default_rng(7)
    for tokens in (5, 1, 6, 2, 5):
        x, (ids, w) = _x(tokens), _routing(rng, tokens)
        want = stock.forward_modular(x=x.clone(), topk_weights=w, topk_ids=ids)
        got = cached.forward_modular(x=x, topk_weights=w, topk_ids=ids)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert armed.checked == {"slots": 0.0, "scratch": 0.0}
    assert armed.audit().ok


@pytest.mark.parametrize("spread", [False, True], ids=["unpacked", "spread"])
def test_the_packed_scales_follow_a_weight_reload(spread):
    """vLLM reloading the weights (`Session.invalidate`): the slots empty and the packed
    side row is rebuilt from the new tensors, so the next steps serve the new scales
    (spread: the installs after the reload rewrite the compact copies)."""
    stock, cached = ms.RoutedExperts("nvfp4", "0.33", seed=9), ms.RoutedExperts(
        "nvfp4", "0.33", seed=9)
    armed = _arm(cached, spread=spread)
    assert armed.unpack_small is not spread
    rng = np.random.default_rng(9)
    x, (ids, w) = _x(1), _routing(rng, 1)
    cached.forward_modular(x=x, topk_weights=w, topk_ids=ids)
    for layer in (stock, cached):  # the reload: new global scales, in place
        layer.w13_weight_scale_2.data.mul_(3.0)
    armed.reset()
    for _ in range(10):
        x, (ids, w) = _x(2), _routing(rng, 2)
        torch.testing.assert_close(
            cached.forward_modular(x=x, topk_weights=w, topk_ids=ids),
            stock.forward_modular(x=x.clone(), topk_weights=w, topk_ids=ids), rtol=0, atol=0)
    assert armed.audit().ok
    assert "forward_modular" in cached.__dict__  # served from the slots, never given up


@pytest.mark.parametrize("layout", ["0.33", "0.26"])
def test_spread_scales_need_no_unpack_and_give_the_stock_bits(layout, monkeypatch):
    """NVFP4's two 4-byte global scales, spread by the installs into the compact copies
    the kernel reads (kernel ABI 6): no copy after any step, the stock bits on slots and
    through the scratch, and every compact copy its slot's expert's scale (the audit)."""
    stock = ms.RoutedExperts("nvfp4", layout, seed=11)
    cached = ms.RoutedExperts("nvfp4", layout, seed=11)
    armed = _arm(cached, wide_inserts=S, spread=True)
    assert not armed.unpack_small and armed.small.spread_targets() is not None

    def unpack(packed):
        raise AssertionError("unpack ran with the spread on")

    monkeypatch.setattr(armed.small, "unpack", unpack)
    rng = np.random.default_rng(11)
    for step in range(30):
        tokens = (1, 2, 3, 5)[step % 4]  # 5 tokens x top-2 > 6 slots: the scratch
        x, (ids, w) = _x(tokens), _routing(rng, tokens)
        torch.testing.assert_close(
            cached.forward_modular(x=x, topk_weights=w, topk_ids=ids),
            stock.forward_modular(x=x.clone(), topk_weights=w, topk_ids=ids), rtol=0, atol=0)
    assert armed.checked == {"slots": 0.0, "scratch": 0.0}
    audit = armed.audit()
    assert audit.ok and audit.occupied == S, audit.problems


def test_the_block_step_acts_only_inside_a_slot_bound_call():
    """Bound, vLLM's block builder hands its list to the bound step once (which rewrites it
    in place, as the manager does) and refuses a second list; unbound it is vLLM's own."""
    from expertcache_cli.device.binding import block_slots

    ids = torch.tensor([[3, 9], [9, 0]], dtype=torch.int32)
    plain = ms.MODULE.moe_align_block_size(ids, 8, ms.E, None, ignore_invalid_experts=True)
    assert plain[1][:3].tolist() == [0, 3, 9]  # vLLM's own: expert ids, ascending
    table = torch.full((ms.E,), -1, dtype=torch.int32)
    table[[0, 3, 9]] = torch.tensor([4, 1, 2], dtype=torch.int32)
    order = marlin.BlockOrder(ms.E)
    seen = []
    order.bind(lambda blocks: seen.append(blocks.copy_(block_slots(blocks, table))))
    try:
        sorted_ids, blocks, padded = ms.MODULE.moe_align_block_size(ids, 8, S)
        assert order.ran and len(seen) == 1
        with pytest.raises(RuntimeError, match="second block list"):
            ms.MODULE.moe_align_block_size(ids, 8, S)
    finally:
        order.unbind()
    assert torch.equal(sorted_ids, plain[0]) and int(padded) == int(plain[2])
    assert blocks[:3].tolist() == [4, 1, 2]  # the same blocks, each on its expert's slot
    assert (blocks[3:] == 4).all()  # vLLM's filler (expert 0) stays a valid slot
    again = ms.MODULE.moe_align_block_size(ids, 8, ms.E, None, ignore_invalid_experts=True)
    assert torch.equal(again[1], plain[1])  # unbound: vLLM's own again


def test_a_marlin_call_that_builds_no_block_list_goes_back_to_the_stock_path(monkeypatch):
    """A slot-bound Marlin call whose kernel never asks for a block list would read slots
    nothing filled: the layer is refused at that call, which the stock path serves."""
    stock = ms.RoutedExperts("gptq", "0.26", seed=3)
    cached = ms.RoutedExperts("gptq", "0.26", seed=3)
    armed = _arm(cached)
    monkeypatch.setattr(ms.MODULE, "moe_align_block_size",
                        ms.MODULE.moe_align_block_size.__wrapped__)  # the wrapper bypassed
    x, (ids, w) = _x(2), _routing(np.random.default_rng(3), 2)
    torch.testing.assert_close(
        cached.forward_modular(x=x, topk_weights=w, topk_ids=ids),
        stock.forward_modular(x=x.clone(), topk_weights=w, topk_ids=ids), rtol=0, atol=0)
    assert armed._failed


def test_marlin_layers_are_declined_where_the_block_remap_cannot_be_installed(monkeypatch):
    """No vLLM Marlin module to patch (here: no vLLM at all), or one that builds its blocks
    otherwise: a Marlin layer is declined with the reason, before anything is allocated,
    never armed with slot buffers its kernel would index by expert id."""
    import types

    other = types.ModuleType("marlin_other")
    other.fused_marlin_moe = lambda *a: None  # builds no block list by that name
    assert "does not build its blocks" in session._patch_marlin(other)
    monkeypatch.setattr(session, "_patch_marlin", lambda: "vLLM's Marlin MoE module is not "
                        "the one read (ImportError: none)")
    layer = ms.RoutedExperts("gptq", "0.26")
    sess = session.arm_model(FakeModel([layer]), CacheConfig(slots=S), "0.26.0")
    assert not sess.armed
    assert sess.decisions[0].action == DECLINE
    assert "Marlin MoE module is not the one read" in sess.decisions[0].reason


def test_arm_model_hands_the_marlin_block_list_to_the_caches_step(monkeypatch):
    """Armed through `arm_model`, a Marlin layer's cache step takes the block list its call
    built (`SlotCache.step` with ``blocks``: one manager launch, on a GPU), once a
    slot-bound call, and the output is the stock path's bit for bit."""
    import expertcache_cli.device.slotcache as slotcache_mod

    class KernelCache(RefSlotCache):
        remaps = 0

        def step(self, *args, blocks=None, **kwargs):
            KernelCache.remaps += blocks is not None
            return super().step(*args, blocks=blocks, **kwargs)

    monkeypatch.setattr(slotcache_mod, "SlotCache", KernelCache)
    # the remap is installed in the stand-in Marlin module (`_patched`), not vLLM's
    monkeypatch.setattr(session, "_patch_marlin", lambda: None)
    stock = ms.RoutedExperts("nvfp4", "0.33", seed=5)
    cached = ms.RoutedExperts("nvfp4", "0.33", seed=5)
    sess = session.arm_model(FakeModel([cached]), CacheConfig(slots=S), "0.33.0")
    assert len(sess.armed) == 1 and sess.armed[0].block_order is not None
    # NVFP4's scales: the cache spreads the side row into the compact copies (no unpack)
    assert sess.armed[0].cache.spread == {SMALL_ROW: sess.armed[0].small.spread_targets()}
    assert not sess.armed[0].unpack_small
    rng = np.random.default_rng(5)
    before = KernelCache.remaps
    calls = 12
    for step in range(calls):
        tokens = (1, 2, 3)[step % 3]  # at most 6 ids: every call on the slots
        x, (ids, w) = _x(tokens), _routing(rng, tokens)
        torch.testing.assert_close(
            cached.forward_modular(x=x, topk_weights=w, topk_ids=ids),
            stock.forward_modular(x=x.clone(), topk_weights=w, topk_ids=ids), rtol=0, atol=0)
    # each call on the slots, and each step of the first call's sweep of every expert
    sweep_steps = sess.armed[0].sweep_result.paths[0].steps
    assert KernelCache.remaps - before == calls + sweep_steps


def test_the_spread_switch_off_arms_the_unpack_with_the_same_bits(monkeypatch):
    """``EXPERT_CACHE_SPREAD=0``: the cache is built without the spread, the layer unpacks
    the side row after each step, and the output stays the stock path's bit for bit."""
    import expertcache_cli.device.slotcache as slotcache_mod

    monkeypatch.setattr(slotcache_mod, "SlotCache", RefSlotCache)
    monkeypatch.setattr(session, "_patch_marlin", lambda: None)
    stock = ms.RoutedExperts("nvfp4", "0.33", seed=6)
    cached = ms.RoutedExperts("nvfp4", "0.33", seed=6)
    sess = session.arm_model(FakeModel([cached]), CacheConfig(slots=S, spread=False), "0.33.0")
    assert len(sess.armed) == 1
    assert not sess.armed[0].cache.spread and sess.armed[0].unpack_small
    rng = np.random.default_rng(6)
    for step in range(9):
        tokens = (1, 2, 3)[step % 3]
        x, (ids, w) = _x(tokens), _routing(rng, tokens)
        torch.testing.assert_close(
            cached.forward_modular(x=x, topk_weights=w, topk_ids=ids),
            stock.forward_modular(x=x.clone(), topk_weights=w, topk_ids=ids), rtol=0, atol=0)
