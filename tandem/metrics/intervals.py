"""Uncertainty for multi-seed comparisons: a hierarchical bootstrap over seeds and problems, and verdicts.

A study measures one value per (seed, problem) for each arm: a problem's pass@1 (the fraction of its samples
that were correct), a reasoning chain's mean per-token KL to the base, its junior cross-entropy, ... The
quantity of interest is the mean over seeds of the per-seed macro mean over benchmarks of the mean over
problems. Its 95% interval comes from a percentile bootstrap that resamples at both levels, as the variation
does: seeds (training runs) with replacement, then, within each drawn seed, each benchmark's problems with
replacement. A paired difference (arm a minus arm b) uses the same draws for both arms, which is what makes
it tighter than the two intervals side by side: both arms answered the same problems under the same seeds.

Shapes: one array `values_SP` per benchmark, `S` seeds x `P` problems of that benchmark; `NaN` marks a
problem with no value for that seed (it is left out of that seed's mean).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

import numpy as np

Direction = Literal["greater", "less", "equivalent"]
VERDICTS = ("holds", "does not hold", "inconclusive")


@dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided bootstrap interval."""

    estimate: float
    low: float
    high: float

    def as_dict(self) -> dict:
        return {"estimate": self.estimate, "ci_low": self.low, "ci_high": self.high}


def point_estimate(values: Mapping[str, np.ndarray]) -> float:
    """Mean over seeds of the macro mean over benchmarks of the mean over problems (NaNs left out).

    Naive equivalent: for each seed s, m_s = mean over benchmarks b of (mean of values[b][s, p] over p);
    return the mean of m_s over s.
    """
    per_bench_S = np.stack([np.nanmean(v, axis=1) for v in values.values()])  # (benchmarks, S)
    return float(np.mean(np.mean(per_bench_S, axis=0)))


def _draws(values: Mapping[str, np.ndarray], n_boot: int, rng: np.random.Generator):
    """Bootstrap index draws shared by every arm: seeds (n_boot x S), then problems per benchmark
    (n_boot x S x P_b), so a paired difference resamples both arms identically."""
    n_seeds = {v.shape[0] for v in values.values()}
    if len(n_seeds) != 1:
        raise ValueError(f"every benchmark needs the same number of seeds, got {sorted(n_seeds)}")
    (S,) = n_seeds
    seeds_NS = rng.integers(0, S, size=(n_boot, S))
    problems = {b: rng.integers(0, v.shape[1], size=(n_boot, S, v.shape[1])) for b, v in values.items()}
    return seeds_NS, problems


def _boot_stats(values: Mapping[str, np.ndarray], seeds_NS: np.ndarray, problems: Mapping[str, np.ndarray]) -> np.ndarray:
    """The statistic on every bootstrap draw: (n_boot,)."""
    per_bench = []
    for b, v in values.items():
        rows_NSP = v[seeds_NS[:, :, None], problems[b]]  # draw n: seed slot j -> seed seeds_NS[n, j], its problems
        per_bench.append(np.nanmean(rows_NSP, axis=2))    # (n_boot, S)
    return np.mean(np.mean(np.stack(per_bench), axis=0), axis=1)


def _check_pair(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> None:
    if set(a) != set(b):
        raise ValueError(f"arms were measured on different benchmarks: {sorted(a)} vs {sorted(b)}")
    for k in a:
        if a[k].shape != b[k].shape:
            raise ValueError(f"benchmark {k}: shapes differ ({a[k].shape} vs {b[k].shape}); a paired "
                             "difference needs the same seeds and problems for both arms")


def bootstrap_interval(values: Mapping[str, np.ndarray], n_boot: int = 2000, level: float = 0.95,
                       seed: int = 0) -> Interval:
    """Point estimate and percentile interval of `point_estimate(values)` under the hierarchical bootstrap."""
    rng = np.random.default_rng(seed)
    seeds_NS, problems = _draws(values, n_boot, rng)
    stats_N = _boot_stats(values, seeds_NS, problems)
    lo, hi = np.nanquantile(stats_N, [(1 - level) / 2, (1 + level) / 2])
    return Interval(point_estimate(values), float(lo), float(hi))


def paired_difference(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], n_boot: int = 2000,
                      level: float = 0.95, seed: int = 0) -> Interval:
    """Estimate and interval of point_estimate(a) - point_estimate(b), both arms resampled with the same draws."""
    _check_pair(a, b)
    rng = np.random.default_rng(seed)
    seeds_NS, problems = _draws(a, n_boot, rng)
    diff_N = _boot_stats(a, seeds_NS, problems) - _boot_stats(b, seeds_NS, problems)
    lo, hi = np.nanquantile(diff_N, [(1 - level) / 2, (1 + level) / 2])
    return Interval(point_estimate(a) - point_estimate(b), float(lo), float(hi))


def verdict(low: float, high: float, direction: Direction, margin: float = 0.0) -> str:
    """The verdict on a claim about a difference, decided by its interval alone.

    - "greater" (the claim: difference > 0): holds when low > 0, does not hold when high < 0.
    - "less" (difference < 0): holds when high < 0, does not hold when low > 0.
    - "equivalent" (|difference| <= margin): holds when the interval lies inside [-margin, margin], does not
      hold when it lies entirely outside it.
    Anything else is inconclusive: the interval does not separate the claim from its negation.
    """
    if not low <= high:
        raise ValueError(f"interval [{low}, {high}] is empty")
    if direction == "greater":
        return "holds" if low > 0 else "does not hold" if high < 0 else "inconclusive"
    if direction == "less":
        return "holds" if high < 0 else "does not hold" if low > 0 else "inconclusive"
    if direction == "equivalent":
        if margin <= 0:
            raise ValueError("an equivalence claim needs a margin > 0: the largest difference that still counts as equal")
        if -margin <= low and high <= margin:
            return "holds"
        return "does not hold" if (high < -margin or low > margin) else "inconclusive"
    raise ValueError(f"direction must be one of greater, less, equivalent; got {direction!r}")


def within_noise(interval: Interval) -> bool:
    """True when the interval of a difference contains 0: the comparison does not tell the arms apart."""
    return interval.low <= 0.0 <= interval.high
