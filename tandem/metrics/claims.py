"""The paper's four claims as paired comparisons between arms, each decided by its bootstrap interval.

A measure is one value per (seed, problem) for each arm and benchmark (`Measures`: arm -> metric -> benchmark
-> array `values_MP`), e.g. a problem's solo pass@1, or the mean per-token KL to the base of its solo
completions. `CLAIMS` lists the comparisons that test the paper's claims; `evaluate_claims` computes, for each,
every arm's estimate with its 95% interval, the paired difference (arm a minus arm b, resampled with the same
seeds and problems for both arms) with its interval, and a verdict decided by that interval alone
(`tandem.metrics.intervals.verdict`). A claim whose arms were not measured is reported as not measured rather
than left out, so a table of claims always has the same rows.

These verdicts read the interval alone: no smallest effect of interest and no multiplicity correction, so a
negligible difference whose interval clears 0 "holds". They serve the pipeline report's one-seed readout; the
registered study's rules (smallest effects, Holm, what an interval excludes) are in tandem.metrics.verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from tandem.metrics.intervals import Direction, bootstrap_interval, paired_difference, verdict, within_noise

Measures = Mapping[str, Mapping[str, Mapping[str, np.ndarray]]]  # arm -> metric -> benchmark -> values_MP
ARMS = ("tandem", "grpo", "kl_reg")
# Solo skill "matches" when the difference in pass@1 lies within +-0.05 (5 points of accuracy). A fixed
# convention for a one-run readout, not calibrated to the run: at toy scale it can be most of GRPO's own gain
# over the base, so a "match" here does not say tandem kept GRPO's skill. The registered study tests a share of
# the gain instead (studies/registration.yaml, C1; tandem.metrics.verdicts).
EQUIVALENCE_MARGIN = 0.05


@dataclass(frozen=True)
class Claim:
    """One comparison: `metric` of arm `a` minus arm `b`, expected `direction` (and `margin` for equivalence)."""

    claim: str
    statement: str
    metric: str
    a: str
    b: str
    direction: Direction
    margin: float = 0.0

    @property
    def comparison(self) -> str:
        return f"{self.a} - {self.b}"


def claims_for(max_k: int, margin: float = EQUIVALENCE_MARGIN) -> tuple[Claim, ...]:
    """The claims table (pass@k rows use the largest evaluated k, `max_k`)."""
    rows = [
        Claim("1. solo skill", f"tandem senior matches the GRPO senior on solo pass@1 (within {margin:g})",
              "solo/pass@1", "tandem", "grpo", "equivalent", margin),
    ]
    if max_k > 1:
        rows.append(Claim("1. solo skill", f"tandem senior matches the GRPO senior on solo pass@{max_k} "
                          f"(within {margin:g})", f"solo/pass@{max_k}", "tandem", "grpo", "equivalent", margin))
    rows += [
        Claim("2. handoff robustness", "with the frozen junior under the step schedule, the tandem senior scores "
              "higher than the GRPO senior", "step/pass@1", "tandem", "grpo", "greater"),
        Claim("3. drift", "the tandem senior stays closer to the base (lower per-token KL to the base)",
              "kl_mean", "tandem", "grpo", "less"),
        Claim("4. legibility", "lower junior cross-entropy on the tandem senior's reasoning", "junior_ce",
              "tandem", "grpo", "less"),
        Claim("4. legibility", "higher junior-senior distribution overlap on the tandem senior's reasoning",
              "overlap", "tandem", "grpo", "greater"),
        Claim("4. legibility", "KL-Reg narrows drift (lower per-token KL than GRPO)", "kl_mean", "kl_reg", "grpo",
              "less"),
        Claim("4. legibility", "KL-Reg does not match tandem training on handoff robustness", "step/pass@1",
              "tandem", "kl_reg", "greater"),
    ]
    return tuple(rows)


def _has(measures: Measures, arm: str, metric: str) -> bool:
    return arm in measures and metric in measures[arm] and len(measures[arm][metric]) > 0


def arm_summary(measures: Measures, metric: str, n_boot: int, seed: int) -> dict[str, dict | None]:
    """Every arm's estimate and interval of `metric` ({arm: {estimate, ci_low, ci_high}}; None if unmeasured)."""
    return {arm: (bootstrap_interval(measures[arm][metric], n_boot=n_boot, seed=seed).as_dict()
                  if _has(measures, arm, metric) else None) for arm in measures}


def arm_intervals(measures: Measures, n_boot: int = 2000, seed: int = 0) -> dict[str, dict[str, tuple[float, float]]]:
    """Every measured arm's and metric's 95% interval: {arm: {metric: (low, high)}}, for the report's tables and
    figures (error bars next to the values they already show)."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for arm, per_metric in measures.items():
        for metric, values in per_metric.items():
            if values:
                iv = bootstrap_interval(values, n_boot=n_boot, seed=seed)
                out.setdefault(arm, {})[metric] = (iv.low, iv.high)
    return out


def evaluate_claims(measures: Measures, claims: tuple[Claim, ...], n_boot: int = 2000, seed: int = 0) -> list[dict]:
    """One JSON-ready row per claim: claim, statement, metric, comparison, the three arms' estimates (and the
    base's, when measured) with intervals, difference, ci_low, ci_high, direction, margin, verdict, within_noise."""
    rows = []
    for c in claims:
        arms = arm_summary(measures, c.metric, n_boot, seed)
        row: dict = {"claim": c.claim, "statement": c.statement, "metric": c.metric, "comparison": c.comparison,
                     "direction": c.direction, "margin": c.margin if c.direction == "equivalent" else None}
        for arm in ARMS + ("base",):
            a = arms.get(arm)
            row[arm] = a["estimate"] if a else None
            row[f"{arm}_ci"] = [a["ci_low"], a["ci_high"]] if a else None
        if _has(measures, c.a, c.metric) and _has(measures, c.b, c.metric):
            d = paired_difference(measures[c.a][c.metric], measures[c.b][c.metric], n_boot=n_boot, seed=seed)
            row.update(difference=d.estimate, ci_low=d.low, ci_high=d.high,
                       verdict=verdict(d.low, d.high, c.direction, c.margin), within_noise=within_noise(d))
        else:
            missing = [x for x in (c.a, c.b) if not _has(measures, x, c.metric)]
            row.update(difference=None, ci_low=None, ci_high=None, verdict="not measured", within_noise=None,
                       missing=missing)
        rows.append(row)
    return rows


def seeds_of(measures: Measures) -> int:
    """The number of seeds behind the measures (the first axis of every array; they must agree)."""
    n = {v.shape[0] for m in measures.values() for per_b in m.values() for v in per_b.values()}
    if len(n) > 1:
        raise ValueError(f"measures disagree on the number of seeds: {sorted(n)}")
    return n.pop() if n else 0
