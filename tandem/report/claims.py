"""The claims section of a report: the claims table, an error-bar figure and the within-noise warnings.

Input is the list of rows of `tandem.metrics.claims.evaluate_claims` (one per comparison, each arm's estimate
with its 95% interval, the paired difference with its interval and the verdict). Two tables: the verdicts with
the differences (narrow enough for a Prefect artifact), then each measure's per-arm estimates. Used at the top of the
pipeline report (one seed: the intervals cover problem sampling only) and of the study report (several seeds).
"""

from __future__ import annotations

from typing import Sequence

from tandem.report.document import Estimate, Section, Table
from tandem.report.figures import _subplots, arm_color, arm_label, to_png
from tandem.report.render import decimals_for, format_with

ARMS = ("base", "tandem", "grpo", "kl_reg")
METRIC_LABELS = {"kl_mean": "KL to base (nats/token)", "junior_ce": "junior cross-entropy (nats/token)",
                 "overlap": "junior-senior overlap"}


def metric_label(metric: str) -> str:
    return METRIC_LABELS.get(metric, metric)


ARM_HEADERS = {"base": "base", "tandem": "tandem", "grpo": "GRPO", "kl_reg": "KL-Reg"}


def _estimate(row: dict, arm: str) -> Estimate | None:
    v, ci = row.get(arm), row.get(f"{arm}_ci")
    if v is None:
        return None
    return Estimate(v, ci[0], ci[1]) if ci else Estimate(v)


def _difference(row: dict) -> Estimate | None:
    if row.get("difference") is None:
        return None
    return Estimate(row["difference"], row["ci_low"], row["ci_high"], signed=True)


def difference_text(row: dict) -> str:
    """'+0.020 [-0.030, +0.070]': the paired difference with its interval, in one number format."""
    d = _difference(row)
    return "\u2013" if d is None else format_with(d, decimals_for([d.value, d.low, d.high]))


def claims_table(rows: Sequence[dict], seeds: int) -> Table:
    """One line per comparison, the verdict and the difference first: claim, metric, comparison, verdict,
    difference [95% CI] (the arms' own estimates are in `estimates_table`)."""
    headers = ["claim", "metric", "comparison", "verdict", "difference [95% CI]"]
    body = [[r["claim"], metric_label(r["metric"]), r["comparison"], r["verdict"], _difference(r)] for r in rows]
    level = ("bootstrap over seeds and problems" if seeds > 1
             else "bootstrap over problems only: one seed, so training noise is not in these intervals")
    note = (f"{seeds} seed(s); differences are estimates [95% interval] ({level}). A verdict is decided by the "
            "interval of the paired difference alone: 'holds' when it excludes the claim's negation, 'does not "
            "hold' when it excludes the claim, 'inconclusive' otherwise. Equivalence claims use a margin of "
            + ", ".join(sorted({f"{r['margin']:g}" for r in rows if r.get("margin")})) + ".")
    # each row is another measure: its difference gets its own number format
    return Table("Claims: tandem against GRPO and KL-Reg", headers, body, note, row_groups=((4,),))


def estimates_table(rows: Sequence[dict], seeds: int) -> Table:
    """Each measure of the claims once: every measured arm's estimate [95% interval], one number format per row."""
    arms = [a for a in ARMS if any(r.get(a) is not None for r in rows)]
    by_metric = {r["metric"]: r for r in reversed(rows)}  # the first row of each measure
    metrics = list(dict.fromkeys(r["metric"] for r in rows))
    body = [[metric_label(m)] + [_estimate(by_metric[m], a) for a in arms] for m in metrics]
    return Table("Claims: each arm's estimate [95% interval]", ["measure"] + [ARM_HEADERS.get(a, a) for a in arms],
                 body, f"{seeds} seed(s); the base is step 0, each arm its last checkpoint.",
                 row_groups=(tuple(range(1, len(arms) + 1)),))


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
                   "claim from its negation): " + "; ".join(f"{r['metric']} {r['comparison']} {difference_text(r)}"
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
    sec.tables.append(estimates_table(rows, seeds))
    png = claims_figure(rows)
    if png is not None:
        sec.figures.append(Figure("claims-intervals", "Each arm's estimate with its 95% interval (error bars), per "
                                  "measure of the claims table.", png))
    return sec
