"""Figures: where they are written (checked first, whole or not at all) and the plan's plot.

matplotlib is the ``plot`` extra; it is imported only when a figure is drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import UserError
from .files import atomic_write, check_output

#: image formats the figure is written in (matplotlib's Agg backend writes all of them)
FORMATS = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp", ".eps", ".ps", ".tif", ".tiff")


def image_path(path: str | Path) -> Path:
    """The file `plot` will write for ``path``: a name without a suffix gets ``.png`` (what
    matplotlib would write, so the name we report is the one on disk); checked to be
    writable before any work, and an unknown suffix is refused."""
    out = Path(path)
    if not out.suffix:
        out = out.with_name(out.name + ".png")
    if out.suffix.lower() not in FORMATS:
        raise UserError(f"--plot {path}: unknown image format {out.suffix!r} "
                        f"(use one of {', '.join(FORMATS)})")
    return check_output(out, "--plot")


def pyplot() -> Any:
    """matplotlib's pyplot on the file backend, or one line saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'expertcache[plot]'") from None
    return plt


def plot_prediction(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Predicted tok/s against slots, one line per policy; budgets that do not fit hollow."""
    plt = pyplot()
    out = image_path(path)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for policy in sorted({r["policy"] for r in rows}):
        mine = [r for r in rows if r["policy"] == policy]
        xs = [r["slots"] for r in mine]
        ax.plot(xs, [r["predicted_tok_s"] for r in mine], marker="o", label=policy)
        hollow = [r for r in mine if not r["fits"]]
        if hollow:
            ax.scatter([r["slots"] for r in hollow], [r["predicted_tok_s"] for r in hollow],
                       s=60, facecolors="white", edgecolors="black", zorder=3,
                       label="does not fit" if policy == min(r["policy"] for r in rows) else None)
    ax.set_xlabel("slots per MoE layer")
    ax.set_ylabel("predicted decode tok/s")
    ax.set_title("expertcache plan", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(plt, fig, out)


def save_figure(plt: Any, fig: Any, out: Path) -> Path:
    """Lay out and write ``fig`` to ``out`` whole (atomically), then close it."""
    fig.tight_layout()
    try:
        atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=120))
    except (OSError, ValueError) as exc:
        raise UserError(f"--plot: cannot write {out}: {exc}") from None
    finally:
        plt.close(fig)
    return out
