"""``--plot``: decode tok/s per arm, showing every restart, so the spread is visible.

Each arm gets its runs as small points, its restart rates as larger points (one colour
per restart) and the mean of restart rates with its 95% interval. A reader sees at once
whether restarts disagree more than runs do.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..plotting import image_path, pyplot, save_figure
from .summary import Summary, measured_runs, restart_rates


def plot(summary: Summary, records: list[dict[str, Any]], path: str | Path) -> Path:
    """Write the figure to ``image_path(path)``, whole or not at all; returns that path.
    Needs the ``plot`` extra."""
    out = image_path(path)
    plt = pyplot()
    df, _ = measured_runs(records)
    arms = [a for a in summary.arms if a.restarts > 0]
    if not arms:
        raise UserError("--plot: the results file holds no measured runs")
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(arms), 4.2))
    cmap = plt.get_cmap("tab10")
    restarts = sorted({int(r) for r in df["restart"].dropna().unique()})
    for x, a in enumerate(arms):
        sub = df[df["arm"] == a.arm]
        rates = restart_rates(sub)
        for r in restarts:
            rs = sub[sub["restart"] == r]["tok_s"].dropna()
            if rs.empty:
                continue
            off = (r - (len(restarts) - 1) / 2) * 0.12
            colour = cmap(r % 10)
            ax.scatter([x + off] * len(rs), rs, s=8, color=colour, alpha=0.45, linewidths=0)
            ax.scatter(
                [x + off],
                [float(rates[r])],
                s=40,
                color=colour,
                edgecolors="black",
                linewidths=0.5,
                label=f"restart {r}" if x == 0 else None,
            )
        yerr = None if not math.isfinite(a.ci_half) else [[a.ci_half], [a.ci_half]]
        ax.errorbar(
            [x + 0.38],
            [a.mean_tok_s],
            yerr=yerr,
            fmt="D",
            color="black",
            capsize=4,
            markersize=5,
            label="mean, 95% interval" if x == 0 else None,
        )
    ax.set_xticks(range(len(arms)))
    ax.set_xticklabels([a.arm for a in arms])
    ax.set_ylabel("decode tok/s")
    model = (summary.meta or {}).get("model")
    ax.set_title(f"expertcache baseline{': ' + str(model) if model else ''}", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return save_figure(plt, fig, out)
