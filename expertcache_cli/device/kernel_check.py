"""Is there a GPU the kernels can run on, and do they run right on it?

`expertcache build-kernels` asks both before and after building: which architecture to
compile for (from the device, through torch), and one manager + gather step on the
device checked field by field against the reference rules.
"""

from __future__ import annotations

from ..errors import DeviceUnavailable, UserError


def device_arch(device: int, hint: str = "pass --arch (e.g. --arch 90) to compile without one"
                ) -> tuple[int, str]:
    """(SM arch as 90, device name) of CUDA device ``device``; one line when there is none,
    ending with ``hint`` (what the caller's user can do instead)."""
    try:
        import torch
    except ImportError:
        raise DeviceUnavailable(
            f"torch is not installed, so no GPU can be detected: {hint}"
        ) from None
    if not torch.cuda.is_available():
        raise DeviceUnavailable(
            f"no CUDA device visible (torch.cuda.is_available() is False): {hint}"
        )
    if device >= torch.cuda.device_count():
        raise UserError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor, torch.cuda.get_device_name(device)


def self_test(device: int) -> str:
    """One manager + gather step on the device, checked against the reference."""
    import numpy as np
    import torch

    from ..rules.policy import LayerCache
    from .slotcache import SlotCache

    src = torch.arange(16 * 8, dtype=torch.int16).reshape(16, 8).pin_memory()
    cache = SlotCache(16, 4, {"w": ((8,), torch.int16)}, device=device, name="self-test")
    ids = np.array([[3, 9], [9, -1]], dtype=np.int32)
    out = cache.step(torch.from_numpy(ids).to(f"cuda:{device}"), {"w": src})
    ref = LayerCache(16, 4)
    res = ref.step(ids)
    st = cache.state()
    ok = (
        st["misses"] == res.misses
        and np.array_equal(out.cpu().numpy(), ref.remap(ids))
        and all(torch.equal(cache.slots["w"][s].cpu(), src[e]) for e, s in res.misses)
    )
    if not ok:
        raise UserError(f"self-test FAILED on cuda:{device}: kernels disagree with the reference")
    return f"self-test passed on cuda:{device} ({cache.backend})"
