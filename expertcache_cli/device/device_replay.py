"""Replay a routing trace through the real manager kernel (``replay --device cuda``).

Why: the CPU engines prove the rules; this proves the kernels that will run in vLLM
count the same misses on a whole trace. The trace is uploaded once, every layer gets its
own device state, and each layer-step is one manager launch on one stream: no host sync
until the per-layer install counters are read at the very end. The shape gate of
`LayerCache.forward` is applied from the host copy of the trace (a layer-step whose count
of valid ids exceeds the slots is skipped entirely, as the plugin would), so it costs no
device read either.
"""

from __future__ import annotations

import numpy as np

from ..rules.budget import ONLINE_POLICIES
from ..rules.policy import Policy, gate_widths
from . import binding


def device_replay(
    ids: np.ndarray,
    num_experts: int,
    policy: str | Policy,
    slots: int,
    decay: int = 0,
    max_inserts: int | None = None,
    device: int | None = None,
    widths: np.ndarray | None = None,
) -> list[int]:
    """Installs per layer for ``ids[T, L, W]`` under ``policy`` with ``slots`` slots.

    Equal, layer by layer, to the installs of `LayerCache.forward` over the same trace.
    ``widths[T, L]`` is what the shape gate sees (`policy.gate_widths`; default: the
    valid ids).
    """
    import torch

    ids = np.asarray(ids)
    if ids.ndim != 3:
        raise ValueError(f"trace ids must be [T, L, W], got shape {ids.shape}")
    t_steps, n_layers, width = ids.shape
    code = binding.policy_code(policy)
    max_inserts = slots if max_inserts is None else min(int(max_inserts), slots)  # > S: no cap
    binding.check_manage_config(num_experts, slots, decay, slots, max_inserts)
    if device is None:
        device = torch.cuda.current_device()
    dev = torch.device("cuda", device)
    kernels = binding.get_kernels(device)

    if widths is None:
        widths = gate_widths(ids, num_experts)
    served = np.asarray(widths) <= slots  # the plugin's shape gate
    ids32 = np.clip(ids, -1, np.iinfo(np.int32).max).astype(np.int32)  # padding stays < 0
    # layer-major so that each layer's served rows can be addressed by pointer arithmetic
    trace = torch.from_numpy(np.ascontiguousarray(ids32.transpose(1, 0, 2))).to(dev)
    base = trace.data_ptr()
    row_bytes = width * 4

    n = n_layers
    table = torch.full((n, num_experts), -1, dtype=torch.int32, device=dev)
    slot_expert = torch.full((n, slots), -1, dtype=torch.int32, device=dev)
    prio = torch.zeros((n, slots), dtype=torch.int64, device=dev)
    step = torch.zeros((n, 1), dtype=torch.int64, device=dev)
    miss_expert = torch.empty((n, slots), dtype=torch.int32, device=dev)
    miss_slot = torch.empty((n, slots), dtype=torch.int32, device=dev)
    miss_count = torch.zeros((n, 1), dtype=torch.int32, device=dev)
    stats = torch.zeros((n, 2), dtype=torch.int64, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    for layer in range(n_layers):
        launch = binding.ManageLauncher(
            kernels,
            table=table[layer].data_ptr(), slot_expert=slot_expert[layer].data_ptr(),
            prio=prio[layer].data_ptr(), step=step[layer].data_ptr(),
            miss_expert=miss_expert[layer].data_ptr(), miss_slot=miss_slot[layer].data_ptr(),
            miss_count=miss_count[layer].data_ptr(), stats=stats[layer].data_ptr(),
            num_experts=num_experts, num_slots=slots, policy=code, decay=decay,
            max_distinct=slots, max_inserts=max_inserts,
        )
        layer_base = base + layer * t_steps * row_bytes
        for t in np.flatnonzero(served[:, layer]):
            launch(layer_base + int(t) * row_bytes, width, False, 0, stream)
    return [int(x) for x in stats[:, 1].cpu().tolist()]


def compare_with_engine(trace, policies, budgets, decay, max_inserts, report) -> dict:
    """Run the real kernels over the trace and compare installs with the CPU engine."""
    rows = []
    per_layer = report.per_layer
    for pol in policies:
        if pol not in ONLINE_POLICIES:
            continue  # Belady needs the future: there is no kernel for it
        for s in budgets:
            dev = device_replay(trace.topk_ids, trace.num_experts, pol, s, decay, max_inserts,
                                widths=trace.gate_widths())
            cpu = per_layer[(per_layer["policy"] == pol.name.lower()) & (per_layer["slots"] == s)]
            cpu_installs = [int(x) for x in cpu.sort_values("layer")["installs"]]
            rows.append(
                {
                    "policy": pol.name.lower(),
                    "slots": s,
                    "device_installs": int(sum(dev)),
                    "cpu_installs": int(sum(cpu_installs)),
                    "match": list(map(int, dev)) == cpu_installs,
                }
            )
    return {"rows": rows, "match": all(r["match"] for r in rows)}
