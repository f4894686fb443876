"""Summarise a results file the way the measurement deserves.

The unit of replication is the server process: runs inside one server agree far more
closely than servers do (the AMD original saw 0.02 tok/s within a server against 1.5 tok/s
between restarts). So an arm's number is the mean of its restarts' rates (each its runs'
decoded tokens over their decode time), its interval
comes from the spread between restarts, and the within-server spread is shown beside it
only to make the difference visible.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

#: Two-sided 95% Student t quantiles for 1..30 degrees of freedom.
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)

#: Between-restart spread above this multiple of the within-server spread gets a warning.
SPREAD_RATIO_WARN = 3.0
#: Without an interval, arms closer than this relative difference count as the same.
SAME_REL = 0.02
MIN_RESTARTS = 3


def t975(df: int) -> float:
    """Student t quantile for a two-sided 95% interval (no scipy needed)."""
    if df < 1:
        return math.nan
    if df <= len(_T975):
        return _T975[df - 1]
    return 1.96 + 2.4 / df  # within 0.002 of the exact value for df > 30


@dataclass
class ArmSummary:
    """One arm's row of the summary; NaN where the data cannot say."""

    arm: str
    restarts: int
    runs: int
    mean_tok_s: float
    between_sd: float
    within_sd: float
    ci_low: float
    ci_high: float
    ttft_s: float
    ratio_resident: float = math.nan
    ratio_offload: float = math.nan
    recovered: float = math.nan
    failed_servers: int = 0
    restart_rates: list[float] = field(default_factory=list)
    counters: dict[str, float] | None = None

    @property
    def ci_half(self) -> float:
        return (self.ci_high - self.ci_low) / 2


@dataclass
class Summary:
    arms: list[ArmSummary]
    warnings: list[str]
    failures: list[dict[str, Any]]
    superseded_runs: int = 0
    bursty_runs: dict[str, int] = field(default_factory=dict)
    meta: dict[str, Any] | None = None

    def arm(self, name: str) -> ArmSummary | None:
        return next((a for a in self.arms if a.arm == name), None)

    def to_dict(self) -> dict[str, Any]:
        def clean(v: Any) -> Any:
            if isinstance(v, float) and not math.isfinite(v):
                return None
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, list):
                return [clean(x) for x in v]
            return v

        return clean(
            {
                "arms": [asdict(a) for a in self.arms],
                "warnings": self.warnings,
                "failures": self.failures,
                "superseded_runs": self.superseded_runs,
                "bursty_runs": self.bursty_runs,
            }
        )


def measured_runs(records: list[dict[str, Any]], drop_bursty: bool = True):
    """The runs the summary uses, as a DataFrame, and how many were superseded.

    For each (arm, restart) only the latest server's runs count: a block interrupted and
    run again on resume must not mix two server processes. Runs whose tokens arrived in
    bursts (``bursty``) timed the delivery, not the decode, and are left out unless
    ``drop_bursty`` is False; the caller counts them from the ``bursty`` column.
    """
    import pandas as pd

    runs = [r for r in records if r.get("kind") == "run"]
    latest: dict[tuple[Any, Any], Any] = {}
    for r in runs:
        latest[(r.get("arm"), r.get("restart"))] = r.get("server_id")
    kept = [r for r in runs if latest[(r.get("arm"), r.get("restart"))] == r.get("server_id")]
    cols = ["arm", "restart", "run", "server_id", "tok_s", "ttft_s", "tokens", "bursty",
            "decode_s", "e2e_s"]  # fmt: skip
    df = pd.DataFrame([{c: r.get(c) for c in cols} for r in kept], columns=cols)
    for c in ("tok_s", "ttft_s", "decode_s", "e2e_s"):
        df[c] = pd.to_numeric(df[c], errors="coerce")
    suspect = df["bursty"].fillna(False).astype(bool) | _held_back(df, records)
    df["bursty"] = suspect & _rushed(df, suspect)
    if drop_bursty:
        df = df[~df["bursty"]]
    return df, len(runs) - len(kept)


#: A run is "held back" when most of its request went on waiting for the first token ...
HELD_WINDOW_SHARE = 0.5
#: ... and that wait was this many times its server's quickest first token.
HELD_TTFT_FACTOR = 3.0
#: A suspect run (held back, or the client saw the whole answer arrive in one burst) is
#: left out only when its rate also beats its arm's usual rate by this factor: the rush.
RUSH_RATE_FACTOR = 1.5


def _held_back(df, records: list[dict[str, Any]]):
    """Runs whose first token waited unusually long and whose decode window was short.

    A starved API process (or client) delays the first token and then hands over the
    backlog at once: TTFT jumps and the first-to-last window shrinks. Suspect a run when
    its decode window is under half its request time and its TTFT is several times the
    quickest of the same server (warm-up included); a long prompt slows every TTFT of a
    server alike and is not suspected. Whether it is left out is `_rushed`'s call.
    """
    quickest: dict[Any, float] = {}
    for r in records:
        if r.get("kind") in ("run", "warmup") and isinstance(r.get("ttft_s"), (int, float)):
            sid = r.get("server_id")
            quickest[sid] = min(quickest.get(sid, math.inf), float(r["ttft_s"]))
    floor = df["server_id"].map(quickest).astype(float)
    share = df["decode_s"] / (df["ttft_s"] + df["decode_s"])
    return ((share < HELD_WINDOW_SHARE) & (df["ttft_s"] > HELD_TTFT_FACTOR * floor)).fillna(False)


def _rushed(df, suspect):
    """Suspect runs whose rate is the rush of a backlog, not a decode.

    A held-back backlog arrives far faster than the arm ever decodes (the CPU example:
    604-19,739 "tok/s" against ~130). A slow first token followed by a decode at the arm's
    usual rate measured the decode and counts (vLLM compiling a Triton kernel for the first
    prefix-cached prefill of a fresh machine: TTFT 0.72 s, then 585 tok/s like its peers).
    "Usual" is the median of the arm's unsuspected runs, or of all its runs when every one
    is suspect.
    """
    clean = df["tok_s"].where(~suspect)
    usual = clean.groupby(df["arm"]).transform("median")
    usual = usual.fillna(df.groupby("arm")["tok_s"].transform("median"))
    return (df["tok_s"] > RUSH_RATE_FACTOR * usual).fillna(False)


def restart_rates(sub):
    """Each restart's decode rate: its runs' decoded tokens over their summed decode time.

    Runs take the prompts in turn, and where their requests differ (a real workload, or a
    routing trace whose recorded requests reuse experts differently) so do their rates: a
    server that decodes one request at 150 tok/s and two at 68 has served 84 tok/s, not the
    95 a mean of the three rates says. Runs without a decode time (older files) count by
    their rate alone, each as one.
    """
    import numpy as np

    timed = sub["decode_s"].where((sub["decode_s"] > 0) & np.isfinite(sub["tok_s"]))
    tokens = (sub["tok_s"] * timed).groupby(sub["restart"]).sum(min_count=1)
    seconds = timed.groupby(sub["restart"]).sum(min_count=1)
    return (tokens / seconds).fillna(sub.groupby("restart")["tok_s"].mean())


def summarise(records: list[dict[str, Any]], meta: dict[str, Any] | None = None) -> Summary:
    """Per-arm statistics, ratios and the warnings a careful reader would raise."""
    all_df, superseded = measured_runs(records, drop_bursty=False)
    bursty = {str(k): int(v) for k, v in all_df[all_df["bursty"]].groupby("arm").size().items()}
    df = all_df[~all_df["bursty"]]
    arm_order: list[str] = list((meta or {}).get("arms") or [])
    for name in df["arm"].tolist():
        if name not in arm_order:
            arm_order.append(name)
    failures = [
        {k: r.get(k) for k in ("arm", "restart", "phase", "reason", "log", "server_id")}
        for r in records
        if r.get("kind") == "server" and r.get("status") == "failed"
    ]
    # Per arm: the counters of its latest server, preferring the server's final line
    # (written at shutdown) over the last periodic one seen during a run.
    last_counters: dict[str, dict[str, Any]] = {}
    plugin: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("kind") in ("run", "counters") and r.get("counters"):
            last_counters[r["arm"]] = r["counters"]
        if r.get("kind") == "counters" and r.get("plugin"):
            plugin.setdefault(r["arm"], []).append(r["plugin"])

    arms: list[ArmSummary] = []
    for name in arm_order:
        sub = df[df["arm"] == name]
        n_failed = sum(1 for f in failures if f["arm"] == name)
        if sub.empty:
            arms.append(
                ArmSummary(
                    name,
                    0,
                    0,
                    math.nan,
                    math.nan,
                    math.nan,
                    math.nan,
                    math.nan,
                    math.nan,
                    failed_servers=n_failed,
                )
            )
            continue
        grouped = sub.groupby("restart")["tok_s"]
        rates = restart_rates(sub)
        variances = grouped.var(ddof=1).dropna()
        n = int(rates.size)
        mean = float(rates.mean())
        between = float(rates.std(ddof=1)) if n >= 2 else math.nan
        within = float(math.sqrt(variances.mean())) if variances.size else math.nan
        half = t975(n - 1) * between / math.sqrt(n) if n >= 2 else math.nan
        arms.append(
            ArmSummary(
                arm=name,
                restarts=n,
                runs=int(sub.shape[0]),
                mean_tok_s=mean,
                between_sd=between,
                within_sd=within,
                ci_low=mean - half,
                ci_high=mean + half,
                ttft_s=float(sub["ttft_s"].mean()),
                failed_servers=n_failed,
                restart_rates=[float(x) for x in rates.tolist()],
                counters=last_counters.get(name),
            )
        )

    by = {a.arm: a for a in arms}
    res, off = by.get("resident"), by.get("offload")
    for a in arms:
        if res and res.mean_tok_s > 0:
            a.ratio_resident = a.mean_tok_s / res.mean_tok_s
        if off and off.mean_tok_s > 0:
            a.ratio_offload = a.mean_tok_s / off.mean_tok_s
        # A share of a penalty that the data cannot tell from zero would be noise.
        if a.arm not in ("resident", "offload") and res and off and not indistinguishable(res, off):
            gap = res.mean_tok_s - off.mean_tok_s
            if gap > 0:
                a.recovered = (a.mean_tok_s - off.mean_tok_s) / gap

    summary = Summary(
        arms=arms,
        warnings=[],
        failures=failures,
        superseded_runs=superseded,
        bursty_runs=bursty,
        meta=meta,
    )
    summary.warnings = _warnings(summary, meta) + _coverage_warnings(plugin)
    return summary


def indistinguishable(a: ArmSummary, b: ArmSummary) -> bool:
    """Whether two arms' means differ by less than the noise says they could.

    With restart intervals on both: the 95% interval of the difference (Welch-style,
    degrees of freedom of the smaller arm) contains zero. Without: within 2%.
    """
    if not (math.isfinite(a.mean_tok_s) and math.isfinite(b.mean_tok_s)):
        return False
    diff = abs(a.mean_tok_s - b.mean_tok_s)
    if math.isfinite(a.between_sd) and math.isfinite(b.between_sd):
        se = math.sqrt(a.between_sd**2 / a.restarts + b.between_sd**2 / b.restarts)
        df = min(a.restarts, b.restarts) - 1
        return diff <= t975(df) * se
    scale = max(abs(a.mean_tok_s), abs(b.mean_tok_s))
    return scale == 0 or diff / scale < SAME_REL


def is_cache_arm(name: str) -> bool:
    """``cache:S...`` and ``plan:FILE`` arms run the plugin."""
    return name.startswith(("cache", "plan:"))


def _coverage_warnings(plugin: dict[str, list[dict[str, Any]]]) -> list[str]:
    """A cache arm is only the cache's number if the cache served every MoE layer: say
    where some ran on the stock path (declined at startup, or fallen back while serving)."""
    out = []
    for arm, states in plugin.items():
        short = [s for s in states if s["armed"] < s["moe_layers"]]
        if short:
            s = short[0]
            out.append(f"{arm}: the plugin armed {s['armed']} of {s['moe_layers']} MoE layers "
                       f"in {len(short)} of {len(states)} server(s); the rest ran on the stock "
                       "path (their reasons are in the server log)")
        fell = sum(s["fell_back"] for s in states)
        if fell:
            out.append(f"{arm}: {fell} layer(s) went back to the stock path while serving "
                       "(search the server logs for 'layer back on the stock path')")
    return out


def _warnings(s: Summary, meta: dict[str, Any] | None) -> list[str]:
    out: list[str] = []
    measured = [a for a in s.arms if a.restarts > 0]
    if measured:
        fewest = min(a.restarts for a in measured)
        if fewest < MIN_RESTARTS:
            out.append(
                f"only {fewest} restart(s) for some arm: the between-restart spread, and so "
                f"the interval, is poorly known; use --restarts {MIN_RESTARTS} or more"
            )
    for a in measured:
        if (
            math.isfinite(a.between_sd)
            and math.isfinite(a.within_sd)
            and a.between_sd > SPREAD_RATIO_WARN * a.within_sd
        ):
            times = f", {a.between_sd / a.within_sd:.3g}x" if a.within_sd > 0 else ""
            out.append(
                f"{a.arm}: runs inside one server agree (sd {a.within_sd:.3g} tok/s) far more "
                f"than servers do (sd {a.between_sd:.3g} tok/s between restarts{times}): a "
                "single-server comparison would be overconfident; trust the restart rates"
            )
    names = {a.arm for a in measured}
    off = s.arm("offload")
    res = s.arm("resident")
    if "offload" not in names and any(is_cache_arm(a.arm) for a in measured):
        out.append(
            "no offload control arm: nothing shows whether the cache is engaged; add 'offload'"
        )
    if off and off.restarts:
        for a in measured:
            if is_cache_arm(a.arm) and indistinguishable(a, off):
                out.append(
                    f"{a.arm} is indistinguishable from the offload control "
                    f"({a.mean_tok_s:.4g} vs {off.mean_tok_s:.4g} tok/s): the cache is probably "
                    "not engaged (slot budget below max_num_seqs x top_k, experts not offloaded "
                    "with --cpu-offload-params experts, or the plugin missing from the server's "
                    "environment); check the plugin's startup line in the server log"
                )
        if res and res.restarts and indistinguishable(res, off):
            out.append(
                f"offload is indistinguishable from resident ({off.mean_tok_s:.4g} vs "
                f"{res.mean_tok_s:.4g} tok/s): the experts were probably not offloaded, so "
                "this baseline shows no penalty for a cache to win back"
            )
    runs_wanted = (meta or {}).get("runs")
    if runs_wanted:
        df_short = [
            a for a in measured if a.runs + s.bursty_runs.get(a.arm, 0) < a.restarts * runs_wanted
        ]
        for a in df_short:
            out.append(
                f"{a.arm}: {a.runs} runs over {a.restarts} restart(s), fewer than "
                f"{runs_wanted} per restart: the file is incomplete; continue it with --resume"
            )
    if s.failures:
        out.append(
            f"{len(s.failures)} server(s) failed (see 'failures' and their log tails); "
            "their arms have fewer restarts than asked"
        )
    if s.bursty_runs:
        detail = ", ".join(f"{n} of {arm}" for arm, n in s.bursty_runs.items())
        out.append(
            f"left out {sum(s.bursty_runs.values())} run(s) ({detail}) whose tokens arrived in "
            "bursts: the server's API process or this client was starved of CPU, so their "
            "rate timed delivery, not decoding; give the machine spare cores"
        )
    if s.superseded_runs:
        out.append(
            f"{s.superseded_runs} run(s) from interrupted servers were superseded by a rerun "
            "of the same block and are not counted"
        )
    return out


def _fmt(v: float, spec: str = ".4g") -> str:
    return "-" if v is None or not math.isfinite(v) else format(v, spec)


#: baseline report's columns and what is left out first when the terminal is narrow
#: (`tables.Table`'s ``keep``: lowest first): at 80 columns the rate, its interval, the
#: restarts behind it, the share won back and the hit rate stay; the spreads behind the
#: interval go first
REPORT_COLUMNS = (("arm", 9), ("restarts", 5), ("runs", 2), ("tok/s", 9), ("95% interval", 8),
                  ("between sd", 1), ("within sd", 0), ("TTFT s", 1), ("x resident", 3),
                  ("x offload", 6), ("recovered", 7), ("hit rate", 4))


def render(s: Summary, console=None) -> None:
    """A table of the summary, then the warnings and failures. The table is `tables.Table`,
    as `replay`'s: no value is ever cut; at 80 columns, or in a pipe (rich assumes 80 unless
    COLUMNS says otherwise), the least important columns are left out and named."""
    from rich.console import Console
    from rich.markup import escape

    from ..tables import Table

    console = console or Console()
    t = Table(title="decode tok/s: mean of restart rates (95% interval from restarts)")
    for col, keep in REPORT_COLUMNS:
        t.add_column(col, justify="left" if col == "arm" else "right", keep=keep)
    for a in s.arms:
        hit = None
        if a.counters:
            hit = a.counters.get("hit_rate")
        t.add_row(
            a.arm,
            str(a.restarts),
            str(a.runs),
            _fmt(a.mean_tok_s),
            "-" if not math.isfinite(a.ci_half) else f"{_fmt(a.ci_low)} .. {_fmt(a.ci_high)}",
            _fmt(a.between_sd, ".3g"),
            _fmt(a.within_sd, ".3g"),
            _fmt(a.ttft_s, ".3g"),
            _fmt(a.ratio_resident, ".3f"),
            _fmt(a.ratio_offload, ".3f"),
            "-" if not math.isfinite(a.recovered) else f"{a.recovered * 100:.1f}%",
            "-" if hit is None else f"{float(hit) * 100:.1f}%",
        )
    console.print(t)
    for f in s.failures:
        text = f"{f['arm']} restart {f['restart']} ({f['phase']}): {f['reason']}"
        if f.get("log"):
            text += f"  log: {f['log']}"
        console.print("[red]failed[/red] " + escape(text))
    for w in s.warnings:
        console.print("[yellow]warning:[/yellow] " + escape(w))
