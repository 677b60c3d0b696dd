"""The claims section of a report: the claims table, an error-bar figure and the within-noise warnings.

Input is the list of rows of `tandem.metrics.claims.evaluate_claims` (one per comparison, each arm's estimate
with its 95% interval, the paired difference with its interval and the verdict). Used at the top of the
pipeline report (one seed: the intervals cover problem sampling only) and of the study report (several seeds).
"""

from __future__ import annotations

from typing import Sequence

from tandem.report.document import Section, Table
from tandem.report.figures import _subplots, arm_color, arm_label, to_png
from tandem.report.render import format_cell

ARMS = ("base", "tandem", "grpo", "kl_reg")
METRIC_LABELS = {"kl_mean": "KL to base (nats/token)", "junior_ce": "junior cross-entropy (nats/token)",
                 "overlap": "junior-senior overlap"}


def metric_label(metric: str) -> str:
    return METRIC_LABELS.get(metric, metric)


def _ci(row: dict, arm: str) -> str:
    v, ci = row.get(arm), row.get(f"{arm}_ci")
    if v is None:
        return "\u2013"
    return f"{format_cell(v)} [{format_cell(ci[0])}, {format_cell(ci[1])}]" if ci else format_cell(v)


def signed(x: float) -> str:
    """A difference with its sign, keeping 3 significant digits for small ones (KL differences are ~1e-4)."""
    return f"{x:+.3g}" if x != 0 and abs(x) < 1e-2 else f"{x:+.3f}"


def _difference(row: dict) -> str:
    if row.get("difference") is None:
        return "\u2013"
    return f"{signed(row['difference'])} [{signed(row['ci_low'])}, {signed(row['ci_high'])}]"


def claims_table(rows: Sequence[dict], seeds: int) -> Table:
    """One line per comparison: claim, metric, comparison, the arms with intervals, difference, verdict."""
    headers = ["claim", "metric", "comparison", "tandem", "GRPO", "KL-Reg", "difference [95% CI]", "verdict"]
    body = [[r["claim"], metric_label(r["metric"]), r["comparison"], _ci(r, "tandem"), _ci(r, "grpo"),
             _ci(r, "kl_reg"), _difference(r), r["verdict"]] for r in rows]
    level = ("bootstrap over seeds and problems" if seeds > 1
             else "bootstrap over problems only: one seed, so training noise is not in these intervals")
    note = (f"{seeds} seed(s); values are estimates [95% interval] ({level}). A verdict is decided by the "
            "interval of the paired difference alone: 'holds' when it excludes the claim's negation, 'does not "
            "hold' when it excludes the claim, 'inconclusive' otherwise. Equivalence claims use a margin of "
            + ", ".join(sorted({f"{r['margin']:g}" for r in rows if r.get("margin")})) + ".")
    return Table("Claims: tandem against GRPO and KL-Reg", headers, body, note)


def noise_warnings(rows: Sequence[dict], seeds: int) -> list[str]:
    """Plain-language warnings: every comparison whose interval contains 0, and a single seed."""
    out = []
    if seeds <= 1:
        out.append("WARNING: one training seed. These intervals only cover which problems were drawn; a second "
                   "training run can move every number by more than they show. Read this run as a demo of the "
                   "pipeline, not as evidence for or against a claim (`tandem study` runs several seeds).")
    # inconclusive = within noise: for a greater/less claim the interval contains 0 (the arms are not told
    # apart); for an equivalence claim it straddles the margin
    noisy = [r for r in rows if r.get("verdict") == "inconclusive"]
    if noisy:
        out.append("WARNING: within noise, so no conclusion (the interval of the difference does not separate the "
                   "claim from its negation): " + "; ".join(f"{r['metric']} {r['comparison']} {_difference(r)}"
                                                             for r in noisy) + ".")
    return out


def claims_figure(rows: Sequence[dict]) -> bytes | None:
    """Each distinct metric as one panel: every measured arm's estimate with its 95% interval as error bars."""
    metrics = list(dict.fromkeys(r["metric"] for r in rows))
    by_metric = {m: next(r for r in rows if r["metric"] == m) for m in metrics}
    metrics = [m for m in metrics if any(by_metric[m].get(a) is not None for a in ARMS)]
    if not metrics:
        return None
    fig, axes = _subplots(len(metrics), (2.6 * len(metrics), 3.0))
    for ax, m in zip(axes, metrics):
        r = by_metric[m]
        arms = [a for a in ARMS if r.get(a) is not None]
        for i, a in enumerate(arms):
            v, ci = r[a], r.get(f"{a}_ci") or [r[a], r[a]]
            lo, hi = v - ci[0], ci[1] - v
            ax.errorbar([i], [v], yerr=[[max(lo, 0.0)], [max(hi, 0.0)]], fmt="o", color=arm_color(a), capsize=4)
        ax.set_xticks(range(len(arms)), [arm_label(a) for a in arms], rotation=30, fontsize=8)
        ax.set_title(metric_label(m), fontsize=9)
        ax.set_xlim(-0.5, len(arms) - 0.5)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return to_png(fig)


def claims_section(rows: Sequence[dict], seeds: int, title: str = "Claims") -> Section:
    """The section placed first in a report: warnings, the table and the error-bar figure."""
    from tandem.report.document import Figure

    sec = Section(title, paragraphs=noise_warnings(rows, seeds))
    verdicts = [r["verdict"] for r in rows]
    sec.paragraphs.append(", ".join(f"{verdicts.count(v)} {v}" for v in
                                    ("holds", "does not hold", "inconclusive", "not measured") if v in verdicts)
                          + f" ({len(rows)} comparisons).")
    sec.tables.append(claims_table(rows, seeds))
    png = claims_figure(rows)
    if png is not None:
        sec.figures.append(Figure("claims-intervals", "Each arm's estimate with its 95% interval (error bars), per "
                                  "measure of the claims table.", png))
    return sec
