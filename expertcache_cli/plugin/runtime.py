"""The armed layer at run time: the shape gate, the cache step, the rebinding.

For every armed `RoutedExperts` the plugin replaces the instance's ``forward_modular``
(the call the `MoERunner` makes after the router chose ``topk_ids``) with
`ArmedLayer.forward_modular`:

- a step carrying more ids than slots (``tokens x top_k > S``: prefill, big batches)
  goes to the stock method untouched (it reads the host copies in place), or, with a
  scratch (``EXPERT_CACHE_WIDE=staged|staged-install``), `SlotCache.step_wide` updates
  the cache, `scratch.Scratch.stage` copies the step's routed experts into the scratch
  (hits from slots, the rest from host, each once) and the stock method runs on the
  scratch with the ids unchanged;
- otherwise `SlotCache.step` installs the missing experts into slots and returns the
  ids in slot space (CUDA-graph padding rows: where vLLM says which they are, its V2
  marks or its V1 count of real rows, handed to the manager, which leaves them out itself,
  else masked in torch first: five launches a layer fewer, `padding.PaddingReader`);
  for the duration of the stock call the layer's per-expert parameters are the slot
  buffers and the kernel's quant config is the one the quant method itself built from
  them (so scales, zero points and biases follow the weights), then everything is put
  back. Per-expert tensors too small for the gather's slabs come from the layer's packed
  side row (`small`): their compact copies written by the gather itself as it installs
  the row (spread), or, where the cache does not spread it, unpacked after the step.
  vLLM's Marlin experts get the ids in expert space instead, and the step runs on the
  block list their call builds, rewriting it to slots (`marlin`): the stock reduction
  order, so the stock bits.

Nothing here reads a device value on the host, and every pointer handed to the kernels
is fixed when the layer is armed, so vLLM's CUDA graphs capture the whole thing. Python
runs only when vLLM runs eagerly or captures; a replayed graph repeats the kernels.

The slot path can never take a server down: an exception anywhere in it (the cache step,
the staging, or the stock experts call on slot buffers) puts that layer back on the stock
path for good, with the reason logged, and the call is served from there.

And each path proves itself, on every expert, before it serves (`ArmedLayer.sweep`): at
a layer's first eager call, before the call itself is served, synthetic steps walk every
expert of the layer through the slots (``ceil(E / (t x top_k))`` steps of ``t = S //
top_k`` tokens, no more than that call's, each routing ``t x top_k`` distinct experts, so
every expert is gathered into a slot and computed from it once) and, with a scratch, wide
steps route every expert through the scratch; each step also runs on the stock path (the
host copies, read in place: no device copy of them) on the same synthetic input, and
every token row must agree (`row_differences` within `CHECK_TOLERANCE`). vLLM's own
warm-up could not do this: its dummy runs route every row to the same top_k experts. Then
the cache is emptied and its counters put back, so serving starts from the state a fresh
cache has. A path that differs takes the layer back to the stock path before it served
anything. The real call is then checked too, once a path (its first `CHECK_ROWS` tokens
against the stock path, skipped while capturing or while outputs are all zeros, given up
after `CHECK_ATTEMPTS`), for what a synthetic routing does not exercise: vLLM's padding
rows, its shared experts. New weights (`reset`) sweep again, at once where the layer has
seen a call.

A CUDA graph captured through the slot path replays its kernels whatever the plugin does
later, so a layer that fails once its cache path is in a captured graph cannot be moved
back to the stock path: the server stops with one line (`CacheFault`) rather than serve a
path known to be wrong. The startup sweep runs before vLLM captures (its profile run is
eager), so this arises only after capture: new weights that the sweep finds served wrong,
or a cache call that raises in a later eager step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .arming import Decision, is_empty, is_tensor
from .compat import wrap_once
from .padding import capturing as _capturing
from .padding import mask_reader
from .small import SMALL_ROW

log = logging.getLogger("vllm.expertcache")

#: relative L2 difference allowed between a path's first output and the stock path's. The
#: same kernel on the same bytes gives 0; a variant kernel for host-resident weights (vLLM
#: 0.33) differs at rounding level (~1e-3); a wrong expert, scale or bias gives ~1.
CHECK_TOLERANCE = 0.02
#: inconclusive first calls (captured, or all-zero outputs) before a path stops checking
CHECK_ATTEMPTS = 16
#: token rows the check's reference call computes: the path's whole output is kept, but
#: the stock path runs again only on its first rows. At vLLM's profile step (2,048 tokens
#: or more) the full reference added its activations to the peak that sizes the KV cache
#: (source in docs/design.md, measured constants).
CHECK_ROWS = 256
#: seed of the sweep's synthetic inputs (the same steps on every tensor-parallel rank)
SWEEP_SEED = 0
#: sweep every expert at a layer's first eager call (False only where a bench measures
#: what serving costs without any check; a user never runs without it)
SWEEP = True
#: paths whose first agreeing check this process has announced at INFO (one line, not one
#: a layer)
_ANNOUNCED: dict[str, bool] = {}


def _pairs(got: Any, want: Any) -> list[tuple[Any, Any]] | None:
    """The tensors of two outputs of the experts call, paired (a tensor, or a tuple/list of
    them: shared experts); None where they are not alike or hold none."""
    import torch

    pairs: list[tuple[Any, Any]] = []

    def collect(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape:
                return False
            pairs.append((a, b))
            return True
        if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
            return all(collect(x, y) for x, y in zip(a, b))
        return a is None and b is None

    return pairs if collect(got, want) and pairs else None


def output_difference(got: Any, want: Any, keep_rows: Any = None) -> float | None:
    """The relative L2 difference ``|got - want| / |want|`` over every tensor of two
    outputs of the experts call (a tensor, or a tuple/list of them: shared experts), over
    the rows ``keep_rows`` marks (padded rows are garbage on both paths); ``inf`` when
    ``got`` has non-finite values ``want`` has not; None when there is nothing to compare
    (a type we do not know, like 0.33's deferred-reduction output, or all zeros)."""
    import torch

    pairs = _pairs(got, want)
    if pairs is None:
        return None
    num = den = 0.0
    for a, b in pairs:
        a, b = a.float(), b.float()
        if keep_rows is not None and a.dim() >= 1 and a.shape[0] == keep_rows.shape[0]:
            a, b = a[keep_rows], b[keep_rows]
        if bool((~torch.isfinite(a) & torch.isfinite(b)).any()):
            return float("inf")
        num += float((a - b).nan_to_num().square().sum())
        den += float(b.nan_to_num().square().sum())
    if den == 0.0:
        return None if num == 0.0 else float("inf")
    return (num / den) ** 0.5


def row_differences(got: Any, want: Any, rows: int) -> tuple[Any, Any] | None:
    """Per token row, the relative L2 difference of two outputs of the experts call (over
    every tensor whose leading dimension is the ``rows`` tokens), and which rows the
    reference computed anything for (a row of zeros proves nothing). Device tensors, no
    sync: ``(diff[rows] float, covered[rows] bool)``; a row with non-finite values the
    reference has not differs by ``inf``. None when there is nothing to compare.

    Why per row and not over the step: one wrong expert among a step's ``t x top_k``
    shifts its own row by about ``1/sqrt(top_k)`` but the step's norm by ``sqrt(t)`` less,
    which a wide synthetic step would dilute under the tolerance."""
    import torch

    pairs = _pairs(got, want)
    pairs = [(a, b) for a, b in pairs or () if a.dim() >= 1 and a.shape[0] == rows]
    if not pairs:
        return None
    num = torch.zeros(rows, dtype=torch.float32, device=pairs[0][1].device)
    den, bad = num.clone(), torch.zeros(rows, dtype=torch.bool, device=num.device)
    for a, b in pairs:
        a, b = a.float().reshape(rows, -1), b.float().reshape(rows, -1)
        bad |= (~torch.isfinite(a) & torch.isfinite(b)).any(dim=1)
        num += (a - b).nan_to_num().square().sum(dim=1)
        den += b.nan_to_num().square().sum(dim=1)
    diff = torch.where(den > 0, (num / den.clamp_min(1e-30)).sqrt(),
                       torch.where(num > 0, float("inf"), 0.0))
    return torch.where(bad, float("inf"), diff), den > 0


def _real(t: Any) -> bool:
    """A tensor holding values (not a meta or fake tensor of a trace): what a sweep and a
    check can run on."""
    import torch

    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return False
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - every torch vLLM 0.26+ runs on has it
        return True
    return not is_fake(t)


def _first_rows(out: Any, n: int, rows: int) -> Any:
    """An experts call's output cut to its first ``rows`` token rows (every tensor whose
    leading dimension is the step's ``n`` tokens; tuples and lists kept)."""
    if rows == n:
        return out
    if isinstance(out, (tuple, list)):
        return type(out)(_first_rows(o, n, rows) for o in out)
    shape = getattr(out, "shape", None)
    return out[:rows] if shape is not None and len(shape) >= 1 and shape[0] == n else out


def _cloned(out: Any) -> Any:
    """An experts call's output with every tensor copied (tuples and lists kept)."""
    if isinstance(out, (tuple, list)):
        return type(out)(_cloned(o) for o in out)
    return out.clone() if hasattr(out, "clone") and hasattr(out, "shape") else out


def iter_tensors(obj: Any, depth: int = 3) -> Iterable[Any]:
    """Every tensor reachable from a quant config (dataclass fields, attributes, tuples)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth <= 0 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item, depth - 1)
        return
    if isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item, depth - 1)
        return
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None), depth - 1)
        return
    if hasattr(obj, "__dict__") and not callable(obj):
        for item in vars(obj).values():
            yield from iter_tensors(item, depth - 1)


#: the expert count the stock kernels should size their tiles for while a slot-bound call
#: runs (thread-local: set and cleared around the stock call in `ArmedLayer`)
_TILE_EXPERTS = threading.local()

#: module whose ``try_get_optimal_moe_config`` the known experts kernels call by name
TRITON_EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.experts.triton_moe"


def full_expert_tiles(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM's Triton tile lookup so a slot-bound call gets the model's own tiles.

    vLLM picks the fused-MoE tiles from tuned files keyed by the leading dimension of the
    weight tensors. Bound to slots, that dimension is ``S``, for which no tuned file
    exists (vLLM ships ``E=128,N=768,...H200.json`` but no ``E=32``), so the stock call
    would fall back to generic tiles. The work is the same tokens on the same number of
    distinct experts whichever way they are numbered, so the tiles tuned for the real
    expert count are the right ones: while `ArmedLayer` serves from slots the lookup sees
    ``E``. Outside that window (every other layer, read-through steps) nothing changes.
    """

    def try_get_optimal_moe_config(w1_shape: Any, w2_shape: Any, *args: Any, **kwargs: Any):
        e = getattr(_TILE_EXPERTS, "value", None)
        if e is not None:
            w1_shape = (e, *tuple(w1_shape)[1:])
            w2_shape = (e, *tuple(w2_shape)[1:])
        return orig(w1_shape, w2_shape, *args, **kwargs)

    try_get_optimal_moe_config.__wrapped__ = orig  # type: ignore[attr-defined]
    return try_get_optimal_moe_config


def full_expert_configs(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM's tuned-file lookup ``get_moe_configs(E, N, ...)`` as `full_expert_tiles`
    wraps the tile lookup: inside a slot-bound call it is asked for ``E``, not ``S``.

    Why: vLLM 0.34's `TritonExperts.apply` (block FP8 [128, 128], Hopper) also calls it
    by name for the down projection's ``..._down.json`` (``USE_TMA``: the sorted-A TMA
    path); keyed by ``w1.size(0)``, a slot-bound call would find none and take the other
    down-projection kernel."""

    def get_moe_configs(E: int, *args: Any, **kwargs: Any) -> Any:
        e = getattr(_TILE_EXPERTS, "value", None)
        return orig(E if e is None else e, *args, **kwargs)

    get_moe_configs.__wrapped__ = orig  # type: ignore[attr-defined]
    return get_moe_configs


def patch_tile_lookup(module: Any) -> bool:
    """Install `full_expert_tiles` on ``module`` once, and `full_expert_configs` where the
    module calls ``get_moe_configs`` itself (0.34); False when it has no tile lookup."""
    if not wrap_once(module, "try_get_optimal_moe_config", full_expert_tiles):
        return False
    wrap_once(module, "get_moe_configs", full_expert_configs)  # absent before 0.34
    return True


def tensor_wide_act_scale(quant_config: Any) -> bool:
    """Whether the experts kernel derives its second GEMM's activation scale at run time
    from the whole step (dynamic per-tensor FP8 or INT8): vLLM 0.34 reduces it over the
    rows whose ids are >= 0 (`FusedMoEQuantConfig.act_scale_is_tensor_wide`, TritonExperts'
    ``masked_amax_scale``). Releases without that method (0.26-0.33) reduce over every row,
    padding included, on the stock path as on the slots: nothing to keep apart there."""
    method = getattr(quant_config, "act_scale_is_tensor_wide", None)
    if quant_config is None or not callable(method):
        return False
    return bool(method(getattr(quant_config, "a2_scale", None)))


class ArmError(RuntimeError):
    """Arming one layer failed; the layer stays on the stock path (message is logged)."""


class CacheFault(SystemExit):
    """A layer failed after its cache path went into a captured CUDA graph: the server
    stops, with this one line (module docstring). A SystemExit, because vLLM turns an
    Exception raised in a worker call (a weight update's RPC) into an error reply and
    serves on; a SystemExit ends the engine (0.26 and 0.33: ``run_engine_core`` and the
    worker processes let it through), and its message is the line printed."""


@dataclasses.dataclass(frozen=True)
class Probe:
    """What a real call of the layer looks like (learnt at its first eager call): the
    sweep builds its synthetic steps in these shapes and dtypes, which vLLM's runner
    decides (hidden size after its padding and transforms, the ids' dtype per kernel)."""

    hidden: tuple[int, ...]
    #: the call's token rows: no sweep step is wider (vLLM sized its scratch for them)
    rows: int
    x_dtype: Any
    weights_dtype: Any
    ids_dtype: Any
    top_k: int
    device: Any


@dataclasses.dataclass
class PathSweep:
    """What one path's sweep found: how many experts were computed on it and compared
    (rows whose reference is not all zeros), the largest row difference, the experts of
    the first row over the tolerance (empty: none), its steps; ``why``: it could not
    compare (and so certifies nothing)."""

    path: str
    num_experts: int
    covered: int = 0
    worst: float = 0.0
    bad_experts: list[int] = dataclasses.field(default_factory=list)
    steps: int = 0
    why: str = ""

    @property
    def agreed(self) -> bool:
        return not self.why and not self.bad_experts


@dataclasses.dataclass
class Sweep:
    """One layer's sweep (`ArmedLayer.sweep`): each path's result and the wall time it
    took, device work included (it ends on a sync)."""

    paths: list[PathSweep]
    seconds: float
    failed: bool = False


class ArmedLayer:
    """One `RoutedExperts` with a `SlotCache` in front of its offloaded experts."""

    def __init__(
        self,
        layer: Any,
        decision: Decision,
        cache: Any,
        *,
        index: int,
        recorder: Any | None = None,
        decode_tokens: int | None = None,
        scratch: Any | None = None,
        padding: Callable[[int], Any] | None = None,
        small: Any | None = None,
        block_order: Any | None = None,
    ) -> None:
        import torch

        self.layer = layer
        self.decision = decision
        self.cache = cache
        self.index = index
        self.recorder = recorder
        #: tensors gathered one by one, and those moved in the packed side row (`small`)
        self.names = [s.name for s in decision.specs]
        self.small = small
        self.small_names = list(small.names) if small is not None else []
        #: the side row's compact copies need `small.unpack` after a step: the cache does
        #: not spread the row into exactly them as it installs it (`SmallTensors.
        #: spread_targets`; a cache built without, or a row whose words do not allow it)
        self.unpack_small = small is not None and (
            (getattr(cache, "spread", None) or {}).get(SMALL_ROW) != small.spread_targets())
        #: everything rebound for a slot-bound call
        self.bound_names = self.names + self.small_names
        #: Marlin: the slot step deferred to the built block list (`marlin.BlockOrder`);
        #: None: the kernel takes slot-space ids
        self.block_order = block_order
        #: every name a mirrored Parameter is registered under, its own first: vLLM's WNA16
        #: methods (0.33's moe_wna16 on Triton too) set ``layer.w13_weight =
        #: layer.w13_qweight``, and the experts call reads ``layer.w13_weight``; rebinding
        #: one name would leave the kernel on the full host tensor with slot ids
        params = layer._parameters
        self.param_names = {n: [n] + [m for m, p in params.items() if p is params[n] and m != n]
                            for n in self.bound_names}
        # Slot buffers wrapped once as Parameters: a registered parameter can only be
        # replaced by a Parameter, and wrapping shares storage (same pointer forever).
        self.slot_params = {
            n: torch.nn.Parameter(cache.slots[n], requires_grad=False) for n in self.names
        }
        for n in self.small_names:  # the compact copies, spread or unpacked (`small`)
            self.slot_params[n] = torch.nn.Parameter(small.slots[n], requires_grad=False)
        #: device counter of read-through steps (wide steps on the stock path)
        dev = cache.slots[self.names[0]].device
        self.read_through = torch.zeros(1, dtype=torch.int64, device=dev)
        #: tokens of the widest decode batch (max_num_seqs, padded to its CUDA graph):
        #: a read-through step no wider is a decode step the sizing trap let through,
        #: counted apart from prefill (which reads through by design)
        self.decode_tokens = decode_tokens
        self.read_through_decode = torch.zeros(1, dtype=torch.int64, device=dev)
        self._stock: Callable[..., Any] = layer.forward_modular
        self.slot_quant_config = self._build_quant_config(self.slot_params, "slot buffers")
        #: ids < 0 (rows vLLM's router left unrouted: its padding marks) stay < 0 on the
        #: slot path where the kernel reduces a dynamic per-tensor activation scale over
        #: the routed rows only (`tensor_wide_act_scale`): the stock call skips those rows,
        #: and a padded row computed on slot 0 would move every real row's scale
        self.keep_unrouted = (block_order is None
                              and tensor_wide_act_scale(self.slot_quant_config))
        #: wide steps staged through a scratch shared with other layers (None: in place)
        self.scratch = scratch
        self.scratch_params: dict[str, Any] = {}
        self.scratch_quant_config = None
        #: device counters: wide steps staged, experts they fetched from host
        self.staged = torch.zeros(1, dtype=torch.int64, device=dev)
        self.staged_fetched = torch.zeros(1, dtype=torch.int64, device=dev)
        if scratch is not None:
            self.scratch_params = {
                n: torch.nn.Parameter(scratch.buffers[n], requires_grad=False)
                for n in self.names
            }
            for n in self.small_names:  # indexed by expert id: the full device copies
                self.scratch_params[n] = torch.nn.Parameter(small.full[n],
                                                            requires_grad=False)
            self.scratch_quant_config = self._build_quant_config(self.scratch_params,
                                                                 "the scratch")
        self._failed = False
        #: read(n): the step's padded rows (`padding`; by default the V2 runner's marks),
        #: None where vLLM does not say
        self._padding = padding if padding is not None else mask_reader()
        #: per path ("slots", "scratch"): None until its first output was checked against
        #: the stock path, then the relative difference; attempts left while inconclusive
        self.checked: dict[str, float | None] = {"slots": None, "scratch": None}
        self._check_attempts = {"slots": CHECK_ATTEMPTS, "scratch": CHECK_ATTEMPTS}
        #: the shapes of a real call, learnt at the first eager one (what a sweep builds)
        self.probe: Probe | None = None
        #: the last sweep of every expert (`sweep`); None: due (at the next eager call,
        #: or at once after new weights where the probe is known)
        self.sweep_result: Sweep | None = None
        #: a cache path of this layer is in a captured CUDA graph: failing now stops
        self.captured = False
        #: told after each sweep (the session's one summary line)
        self.on_swept: Callable[[ArmedLayer], None] | None = None

    # -- rebinding ---------------------------------------------------------------
    def _alias_owner(self, role: str) -> Any:
        return self._experts() if role == "experts" else self.layer.quant_method

    def _swap_in(self, bound: dict[str, Any] | None = None) -> dict[str, Any]:
        """Bind the layer's per-expert parameters, and the kernel attributes that alias
        them (`Decision.aliases`), to ``bound``; returns what to put back."""
        params = self.layer._parameters
        bound = self.slot_params if bound is None else bound
        saved: dict[str, Any] = {}  # parameter names, and "role.attr" for kernel aliases
        try:
            for n in self.bound_names:
                for m in self.param_names[n]:
                    saved[m] = params[m]
                    params[m] = bound[n]
            for role, attr, pname in self.decision.aliases:
                owner = self._alias_owner(role)
                saved[f"{role}.{attr}"] = getattr(owner, attr)
                setattr(owner, attr, bound[pname])
        except Exception:  # half-bound is worse than unbound: put back what was swapped
            self._swap_out(saved)
            raise
        return saved

    def _swap_out(self, saved: dict[str, Any]) -> None:
        """Put back what `_swap_in` swapped (all of it, or the part it got to)."""
        params = self.layer._parameters
        for key, value in reversed(saved.items()):
            if "." in key:  # a kernel attribute (parameter names have no dots)
                role, attr = key.split(".", 1)
                setattr(self._alias_owner(role), attr, value)
            else:
                params[key] = value

    def _experts(self) -> Any:
        return self.layer.quant_method.moe_kernel.fused_experts

    def _layer_tensors(self) -> dict[str, tuple[int, int, tuple[int, ...]]]:
        """(object, pointer, shape) of every Parameter and plain tensor attribute of the
        layer: what a quant-config rebuild must leave as it found it."""
        out = {}
        for n, p in self.layer._parameters.items():
            if p is not None:
                out[n] = (id(p), p.data_ptr(), tuple(p.shape))
        for n, v in vars(self.layer).items():
            if is_tensor(v):
                out[n] = (id(v), v.data_ptr(), tuple(v.shape))
        return out

    def _build_quant_config(self, bound: dict[str, Any], what: str) -> Any:
        """The quant method's own config, rebuilt while the layer holds ``bound`` (the slot
        buffers, or the scratch).

        Refused when anything per-expert in it still points at full (host) storage:
        that tensor would be indexed by slot ids and read the wrong expert (and, for the
        scratch, read host memory in place, the very thing staging avoids).
        """
        qm = self.layer.quant_method
        full_ptrs = {self.layer._parameters[n].data_ptr() for n in self.bound_names}
        slot_ptrs = {p.data_ptr() for p in bound.values()}
        before = self._layer_tensors()
        saved = self._swap_in(bound)
        try:
            qc = qm.get_fused_moe_quant_config(self.layer)
        except Exception as exc:
            raise ArmError(
                f"{type(qm).__name__}.get_fused_moe_quant_config failed on {what} "
                f"({exc.__class__.__name__}: {exc})"
            ) from exc
        finally:
            self._swap_out(saved)
        # vLLM 0.34's config builders may write into the layer (oracle/fp8.py and
        # oracle/nvfp4.py: replace_parameter of g1_alphas, refill_derived of _a1_gscale):
        # built on the slots, that would leave the stock path S-row tensors
        after = self._layer_tensors()
        changed = sorted(k for k in before.keys() | after.keys()
                         if before.get(k) != after.get(k))
        if changed:
            raise ArmError(
                f"{type(qm).__name__}.get_fused_moe_quant_config changed the layer's own "
                f"tensors ({', '.join(changed)}) while it held {what}")
        if qc is None:
            old = getattr(self._experts(), "quant_config", None)
            if old is not None:
                raise ArmError("quant method returned no quant config while the kernel has one")
            return None
        e = self.decision.num_experts
        rows = {p.shape[0] for p in bound.values() if p.dim() >= 1}  # S (slots) or E (scratch)
        for t in iter_tensors(qc):
            if is_empty(t):
                continue  # nothing in it to read by expert id
            ptr = t.data_ptr()
            if ptr in full_ptrs:
                raise ArmError("the rebuilt quant config still points at full expert storage")
            if t.dim() >= 1 and t.shape[0] == e and ptr not in slot_ptrs:
                raise ArmError(
                    f"the quant config holds a per-expert tensor {tuple(t.shape)} that is "
                    "not mirrored"
                )
            if t.dim() >= 1 and t.shape[0] in rows and ptr not in slot_ptrs:
                # a cast or copy of a slot buffer, made now: it would keep the empty slots
                # of arming time while the real ones fill
                raise ArmError(
                    f"the quant config holds a tensor {tuple(t.shape)} shaped like {what} "
                    f"but not one of them (a copy made at arming would stay empty)"
                )
        return qc

    # -- the hook ----------------------------------------------------------------
    def install(self) -> None:
        # An instance attribute shadows the class method; the runner looks it up per call.
        self.layer.forward_modular = self.forward_modular

    def uninstall(self) -> None:
        if self.layer.__dict__.get("forward_modular") == self.forward_modular:
            del self.layer.__dict__["forward_modular"]

    def forward_modular(
        self,
        x: Any,
        topk_weights: Any,
        topk_ids: Any,
        shared_experts: Any = None,
        shared_experts_input: Any = None,
    ) -> Any:
        """vLLM's `RoutedExperts.forward_modular`, served from slots when the step fits."""

        def stock(ids: Any, x: Any = x) -> Any:
            # a call on the first rows only (the first-call check's reference) takes the
            # weights and shared-experts input of those rows
            n = ids.shape[0]
            part = n != topk_weights.shape[0]
            return self._stock(
                x=x, topk_weights=topk_weights[:n] if part else topk_weights, topk_ids=ids,
                shared_experts=shared_experts,
                shared_experts_input=(shared_experts_input[:n]
                                      if part and hasattr(shared_experts_input, "shape")
                                      else shared_experts_input),
            )

        import torch

        capturing = _capturing()
        if (SWEEP and self.sweep_result is None and not self._failed and not capturing
                and _real(x) and _real(topk_ids)):
            # the first eager call: every expert through each path before any is served
            self.probe = Probe(tuple(x.shape[1:]), max(1, int(x.shape[0])), x.dtype,
                               topk_weights.dtype, topk_ids.dtype, int(topk_ids.shape[1]),
                               x.device)
            self.sweep()
        wide = not self.cache.fits(topk_ids.numel())
        # where vLLM says which rows are padding (V2's marks, V1's count inside a graph),
        # the manager reads it itself: no mask, no torch.where, no scalar fills, five
        # launches a layer fewer (the trace and wide steps still mask in torch)
        rows_of = getattr(self._padding, "rows", None)
        rows = (rows_of(topk_ids.shape[0]) if rows_of is not None and not wide
                and not self._failed and self.recorder is None else None)
        if rows is not None:
            return self._captured_if(capturing, self._checked_call(
                "slots", stock, x, topk_ids, rows.get("pad_rows"),
                lambda: self._slots(topk_ids, topk_ids, None, stock, rows)))
        pad = self._padding(topk_ids.shape[0]) if self._padding is not None else None
        ids = topk_ids if pad is None else torch.where(pad.unsqueeze(1), -1, topk_ids)
        if self.recorder is not None:
            self.recorder.record(self.index, ids)
        if wide and self.scratch is not None and not self._failed:
            return self._captured_if(capturing, self._checked_call(
                "scratch", stock, x, topk_ids, pad, lambda: self._staged(ids, topk_ids, stock)))
        if self._failed or wide:
            self.read_through.add_(1)
            if self.decode_tokens is not None and topk_ids.shape[0] <= self.decode_tokens:
                self.read_through_decode.add_(1)
            return stock(topk_ids)
        return self._captured_if(capturing, self._checked_call(
            "slots", stock, x, topk_ids, pad, lambda: self._slots(ids, topk_ids, pad, stock)))

    def _captured_if(self, capturing: bool, out: Any) -> Any:
        """``out``, noting that a cache path of this layer is now in a captured graph
        (where it served the call: a failure during capture served the stock path)."""
        if capturing and not self._failed:
            self.captured = True
        return out

    # -- the sweep ---------------------------------------------------------------
    def _counters(self) -> list[Any]:
        """Every device counter a sweep's synthetic steps move (put back after it)."""
        return [self.cache.stats, self.read_through, self.read_through_decode, self.staged,
                self.staged_fetched]

    def sweep(self) -> Sweep | None:
        """Every expert of the layer through each of its paths, against the stock path
        (module docstring); then the cache emptied and its counters put back. A path that
        differs, raises or cannot be compared takes the layer back to the stock path
        (`_fail`: a `CacheFault` once captured). None where no call was seen yet (the
        shapes are unknown: the sweep waits for the first eager call) or the layer failed.

        Syncs the device once a path (the comparison's verdict); costs ``2 x ceil(E / (t x
        top_k))`` experts calls of ``t`` rows a path (`_sweep_path`), every expert's bytes
        read from the host twice a path (the gather or staging, the stock call), and the
        rows' outputs as scratch."""
        if self.probe is None or self._failed or not SWEEP:
            return None
        start = time.perf_counter()
        saved = [t.clone() for t in self._counters()]
        paths: list[PathSweep] = []
        try:
            for path in ("slots", "scratch") if self.scratch is not None else ("slots",):
                paths.append(self._sweep_path(path))
                if self._failed or not paths[-1].agreed:
                    break
        except CacheFault:
            raise
        except Exception as exc:  # the sweep itself: nothing proven, nothing served
            paths.append(PathSweep("sweep", self.decision.num_experts,
                                   why=f"the check could not run ({exc.__class__.__name__}: "
                                       f"{exc})"))
        finally:
            self.cache.reset()
            for t, v in zip(self._counters(), saved):
                t.copy_(v)
        result = Sweep(paths, time.perf_counter() - start)
        self.sweep_result = result
        bad = next((p for p in paths if not p.agreed), None)
        if bad is not None and not self._failed:
            self._fail(bad.why or (
                f"the {bad.path} path's output differs from the stock path's on experts "
                f"{bad.bad_experts} of a synthetic step (relative difference of a row "
                f"{bad.worst:.3g} > {CHECK_TOLERANCE:g})"))
        result.failed = self._failed
        log.debug("expertcache: %s: swept %s in %.3f s", self.decision.layer_name,
                  "; ".join(f"{p.path}: {p.covered} of {p.num_experts} experts in {p.steps} "
                            f"step(s), largest row difference {p.worst:.3g}" for p in paths),
                  result.seconds)
        if self.on_swept is not None:
            self.on_swept(self)
        return result

    def _sweep_path(self, path: str) -> PathSweep:
        """One path's synthetic steps and their verdict (`sweep`)."""
        import torch

        probe = self.probe
        assert probe is not None
        e, k = self.decision.num_experts, probe.top_k
        result = PathSweep(path, e)
        # steps as wide as a slot step may be (slots), or every expert at once (a wide
        # step through the scratch); never wider than the call the probe saw
        t = self.decision.num_slots // k if path == "slots" else math.ceil(e / k)
        if t == 0:  # no step fits: the slot path never serves, nothing to prove
            result.covered = e
            return result
        t = min(t, CHECK_ROWS, probe.rows)
        steps = math.ceil(e / (t * k))
        dev = probe.device
        gen = torch.Generator(device=dev).manual_seed(SWEEP_SEED)
        weights = torch.full((t, k), 1.0 / k, dtype=probe.weights_dtype, device=dev)
        diffs, covered, routed = [], [], []
        for step in range(steps):
            ids = (torch.arange(step * t * k, (step + 1) * t * k, device=dev) % e)
            ids = ids.view(t, k).to(probe.ids_dtype)
            x = torch.randn((t, *probe.hidden), generator=gen, device=dev).to(probe.x_dtype)
            x_ref = x.clone()  # the reference must see the input the path saw

            def stock(call_ids: Any, x: Any = x) -> Any:
                n = call_ids.shape[0]
                return self._stock(x=x[:n], topk_weights=weights[:n], topk_ids=call_ids,
                                   shared_experts=None, shared_experts_input=None)

            out = (self._slots(ids, ids, None, stock) if path == "slots"
                   else self._staged(ids, ids, stock))
            if self._failed:  # it raised: said, and the layer is on the stock path
                result.why = f"the {path} path raised during the check"
                return result
            out = _cloned(out)  # a kernel may hand out a workspace the next call reuses
            rows = row_differences(out, stock(ids, x=x_ref), t)
            if rows is None:
                result.why = (f"the check cannot compare the {path} path's output "
                              f"({type(out).__name__}) with the stock path's")
                return result
            diffs.append(rows[0])
            covered.append(rows[1])
            routed.append(ids)
            result.steps += 1
        d = torch.stack(diffs).cpu()  # the one sync of this path
        c = torch.stack(covered).cpu()
        r = torch.stack(routed).cpu().long()
        result.covered = len({i for i in r[c].reshape(-1).tolist() if 0 <= i < e})
        result.worst = float(d.max())
        bad = (d > CHECK_TOLERANCE).nonzero()
        if len(bad):
            result.bad_experts = sorted(r[bad[0][0], bad[0][1]].tolist())
        return result

    def audit(self) -> Any:
        """The slots against their experts' sources and the table against the slots
        (`audit.audit_slots`); syncs the device: for shutdown, not the serving path."""
        from ..device.audit import audit_slots

        slots, sources = dict(self.cache.slots), self._sources()
        if self.small is not None:  # and what the kernel reads of the side row: the
            params = self.layer._parameters  # compact copies, against vLLM's own tensors
            for n in self.small_names:
                slots[n], sources[n] = self.small.slots[n], params[n]
        return audit_slots(self.cache.table, self.cache.slot_expert, slots, sources)

    def reset(self) -> None:
        """The experts behind the slots changed (a reload, a weight transfer, a wake from
        sleep): empty the slots, rebuild the packed side row from the new tensors, rebuild
        the slot-bound (and scratch-bound) quant configs (a reload reruns the quant
        method's ``process_weights_after_loading``, which may build a new kernel and
        config), and prove each path again: a new sweep (which the caller runs at once
        where a call was seen, `Session.invalidate`) and the real-call check at the next
        eager call. Raises `ArmError`
        where the quant method no longer builds a config on the slots: the caller puts the
        layer back on the stock path."""
        self.cache.reset()
        if self.small is not None:
            params = self.layer._parameters
            self.small.refresh({n: params[n] for n in self.small_names})
        if self._failed:
            return
        self.slot_quant_config = self._build_quant_config(self.slot_params, "slot buffers")
        if self.scratch is not None:
            self.scratch_quant_config = self._build_quant_config(self.scratch_params,
                                                                 "the scratch")
        self.checked = {"slots": None, "scratch": None}
        self._check_attempts = {"slots": CHECK_ATTEMPTS, "scratch": CHECK_ATTEMPTS}
        self.sweep_result = None  # the caller sweeps now where the probe is known

    def start_serving(self) -> None:
        """vLLM's warm-up is over: empty the slots and zero the counters (`Session.
        serving_starts` says why). Device work only; no pointer a graph holds changes."""
        self.cache.reset()
        for t in self._counters():
            t.zero_()

    def disarm(self, why: str) -> None:
        """Put the layer back on the stock path for good, saying why (not in a call)."""
        self._fail(why)

    def _fail(self, why: str) -> None:
        """The layer goes back to the stock path for good, saying why; or, where its cache
        path is in a captured CUDA graph (which would go on replaying it), the server
        stops with one line (`CacheFault`)."""
        name = self.decision.layer_name
        if self.captured:
            line = (f"expertcache: {name}: {why}; its cache path is in vLLM's captured CUDA "
                    "graphs, which replay it whatever the plugin does now: the server stops "
                    "rather than serve it (EXPERT_CACHE_DISABLE=1 serves without the cache; "
                    "with --enforce-eager a failing layer goes back to the stock path)")
            log.critical("%s", line)
            raise CacheFault(line)
        self._failed = True
        log.error("expertcache: %s: %s; layer back on the stock path", name, why)
        self.uninstall()

    def _sources(self) -> dict[str, Any]:
        """The gathered tensors as the layer holds them now (host copies, read fresh: vLLM's
        offloader moves them after loading), and the packed side row; KeyError if one was
        unregistered."""
        params = self.layer._parameters
        out = {n: params[n] for n in self.names}
        if self.small is not None:
            out[SMALL_ROW] = self.small.source
        return out

    def _unpack_small(self) -> None:
        """The compact copies of the small tensors from their gathered slot rows, where the
        cache's gather did not write them itself (`unpack_small`)."""
        if self.unpack_small:
            self.small.unpack(self.cache.slots[SMALL_ROW])

    def _slots(self, ids: Any, topk_ids: Any, pad: Any, stock: Callable[..., Any],
               rows: dict[str, Any] | None = None) -> Any:
        """A step that fits: install the misses, run the stock call bound to the slots
        (``rows``: the padded rows for the manager to read, `PaddingReader.rows`)."""
        import torch

        if self.block_order is not None:
            # Marlin: the call keeps the expert ids (every row, padded ones too, as the
            # stock call sees them); the step runs where it has built its block list, and
            # rewrites that list to slots (`marlin`). The sources are read now: bound, the
            # layer's parameters are the slots
            try:
                sources = self._sources()
            except Exception as exc:  # refuse at the first call, never break serving
                return self._disarm("cache step", exc, stock, topk_ids)

            def step(blocks: Any) -> None:
                self.cache.step(ids, sources, remap=False, blocks=blocks, **(rows or {}))
                self._unpack_small()

            return self._bound_call(stock, topk_ids, self.slot_params,
                                    self.slot_quant_config, self.decision.num_experts,
                                    topk_ids, "cache step and experts call on slots",
                                    slot_step=step)
        try:
            call_ids = self.cache.step(ids, self._sources(), **(rows or {}))
            if pad is not None:  # padded rows pass any valid slot; vLLM drops them
                call_ids = torch.where(pad.unsqueeze(1), 0, call_ids)
            if self.keep_unrouted:
                call_ids = torch.where(topk_ids < 0, topk_ids, call_ids)
            self._unpack_small()
        except Exception as exc:  # refuse at the first call, never break serving
            return self._disarm("cache step", exc, stock, topk_ids)
        return self._bound_call(stock, call_ids, self.slot_params, self.slot_quant_config,
                                self.decision.num_experts, topk_ids, "experts call on slots")

    def _checked_call(self, path: str, stock: Callable[..., Any], x: Any, topk_ids: Any,
                      pad: Any, run: Callable[[], Any]) -> Any:
        """``run()`` (the slot or scratch path), and at the path's first eager call its
        output checked against the stock path's on the same step (module docstring)."""
        if (self.checked[path] is not None or self._check_attempts[path] <= 0
                or not hasattr(x, "clone") or _capturing()):
            return run()
        x_saved = x.clone()  # the stock reference must see the input the path saw
        out = run()
        if self._failed:  # the path already fell back (and served the stock result)
            return out
        # kept apart: a kernel may hand out a view of a workspace the next call reuses
        out = _cloned(out)
        n = x_saved.shape[0]
        rows = min(n, CHECK_ROWS)
        # the reference on the first rows only: its activations add to the peak of vLLM's
        # profile step (2,048+ tokens), which sizes the KV cache (module docstring)
        want = stock(topk_ids[:rows], x=x_saved[:rows].clone() if rows < n else x_saved)
        keep = None if pad is None else ~pad[:rows]
        diff = output_difference(_first_rows(out, n, rows), want, keep)
        if diff is None:
            self._check_attempts[path] -= 1
            if self._check_attempts[path] == 0:
                log.debug("expertcache: %s: %s path not checked (%d inconclusive calls)",
                          self.decision.layer_name, path, CHECK_ATTEMPTS)
            return out
        self.checked[path] = diff
        if diff > CHECK_TOLERANCE:
            self._fail(f"the {path} path's output differs from the stock path's on the same "
                       f"step (relative difference {diff:.3g} > {CHECK_TOLERANCE:g})")
            return want if rows == n else stock(topk_ids, x=x_saved)
        first = not _ANNOUNCED.get(path)
        _ANNOUNCED[path] = True
        (log.info if first else log.debug)(
            "expertcache: %s: the %s path agreed with the stock path at its first call "
            "(relative difference %.3g)%s", self.decision.layer_name, path, diff,
            "; every armed layer is checked once, the count is logged at shutdown"
            if first else "")
        return out

    def _staged(self, ids: Any, topk_ids: Any, stock: Callable[[Any], Any]) -> Any:
        """A wide step through the scratch (module docstring); the stock path on failure."""
        try:
            sources = self._sources()
            self.cache.step_wide(ids, sources)
            self._unpack_small()  # installs reached the slots: their compact copies too
            self.scratch.stage(ids, self.cache.table, self.cache.slots, sources)
            self.staged.add_(1)
            self.staged_fetched.add_(self.scratch.counts[1])
        except Exception as exc:  # refuse at the first call, never break serving
            return self._disarm("staged wide step", exc, stock, topk_ids)
        # the scratch is indexed by expert id: the ids (padded rows too) go in unchanged,
        # and the tile lookup sees the real expert count without help
        return self._bound_call(stock, topk_ids, self.scratch_params, self.scratch_quant_config,
                                None, topk_ids, "experts call on the scratch")

    def _disarm(self, what: str, exc: Exception, stock: Callable[[Any], Any],
                topk_ids: Any) -> Any:
        """A cache call failed: say so once, put the layer back on the stock path for good
        (`_fail`), and serve this call from it."""
        self._fail(f"{what} failed ({exc.__class__.__name__}: {exc})")
        return stock(topk_ids)

    def _bound_call(self, stock: Callable[[Any], Any], ids: Any, bound: dict[str, Any],
                    quant_config: Any, tile_experts: int | None, topk_ids: Any,
                    what: str, slot_step: Callable[[Any], None] | None = None) -> Any:
        """The stock call with the layer's per-expert tensors and quant config bound to
        ``bound`` for exactly its duration; if it raises, the layer is disarmed and the
        call served from the stock path on ``topk_ids``. ``slot_step``: Marlin bound to
        the slot buffers, the cache step to run on the block list the call builds, with
        the slot count as the layer's expert count (`marlin`)."""
        qm = self.layer.quant_method
        experts = self._experts()
        old_qc, old_mqc = experts.quant_config, qm.moe_quant_config
        order = self.block_order if slot_step is not None else None
        old_global = getattr(self.layer, "global_num_experts", None)
        try:
            saved = self._swap_in(bound)
        except Exception as exc:  # the layer changed under us: back to the stock path
            return self._disarm(what, exc, stock, topk_ids)
        _TILE_EXPERTS.value = tile_experts
        try:
            if quant_config is not None:
                experts.quant_config = quant_config
                qm.moe_quant_config = quant_config
            if order is not None:
                self.layer.global_num_experts = self.decision.num_slots
                order.bind(slot_step)
            out = stock(ids)
            if order is not None and not order.ran:
                raise RuntimeError("vLLM's Marlin call built no block list (unknown Marlin "
                                   "layout): its slots were not filled")
            return out
        except Exception as exc:  # never break serving: back to the stock path
            failed = exc
        finally:
            _TILE_EXPERTS.value = None
            if order is not None:
                order.unbind()
                self.layer.global_num_experts = old_global
            self._swap_out(saved)
            experts.quant_config, qm.moe_quant_config = old_qc, old_mqc
        return self._disarm(what, failed, stock, topk_ids)
