"""The vLLM releases whose source the tool and the plugin were read against, and the one
test of a version string against them.

One range for both: the plugin arms only a MoE layout it has read (`plugin.compat`), and
`size`, `plan` and `serve` pad batches by the capture rule of the same releases
(`capture`). `serve` and `baseline` check the installed release before starting anything,
so that a newer vLLM than the plugin knows fails at the command line, not silently inside
the server (where the plugin would decline every layer).
"""

from __future__ import annotations

from . import installed_vllm
from .installed_vllm import parse_version

#: inclusive (major, minor) range of the vLLM releases whose source was read
OLDEST_KNOWN = (0, 26)
NEWEST_KNOWN = (0, 34)


def known_range() -> str:
    """``"0.26-0.34"``: the range, as messages name it."""
    return f"{OLDEST_KNOWN[0]}.{OLDEST_KNOWN[1]}-{NEWEST_KNOWN[0]}.{NEWEST_KNOWN[1]}"


def pip_pin() -> str:
    """The pip requirement that installs a known release (``vllm>=0.26,<0.35``)."""
    return (f"vllm>={OLDEST_KNOWN[0]}.{OLDEST_KNOWN[1]},"
            f"<{NEWEST_KNOWN[0]}.{NEWEST_KNOWN[1] + 1}")


def version_refusal(text: str) -> str | None:
    """Why this vLLM version is refused, or None when its layout is known."""
    v = parse_version(text)
    if v is None:
        return f"cannot read the vLLM version {text!r}"
    if not OLDEST_KNOWN <= v[:2] <= NEWEST_KNOWN:
        return f"vLLM {text} is outside the releases whose MoE layout is known ({known_range()}.x)"
    return None


def installed_refusal() -> str | None:
    """`version_refusal` of the vLLM installed here; None where it is known, or where there
    is none (the commands that need one say that themselves)."""
    found = installed_vllm.text()
    return version_refusal(found) if found is not None else None
