"""Uncertainty for multi-seed comparisons: a crossed bootstrap over seeds and problems, seed-level t-intervals.

A study measures one value per (seed, problem) for each arm: a problem's pass@1 (from its samples), a
reasoning chain's mean per-token KL to the base, its junior cross-entropy, ... The quantity of interest is the
mean over seeds of the per-seed macro mean over benchmarks of the mean over problems (`point_estimate`).

Every seed answers the same problems: problems are **crossed** with seeds, not nested in them. The crossed
percentile bootstrap follows that design: each replicate draws the seeds with replacement and, per benchmark,
**one** set of problems that every drawn seed shares. (Drawing problems anew for each seed slot, the `nested`
scheme, averages the problem effect common to all seeds over M independent draws and under-counts its variance
by about a factor M: arm-level intervals come out too narrow; tests/metrics/test_intervals.py measures both.)

A comparison between arms is a linear contrast of their statistics, `sum_arm coef[arm] * stat(arm)`: a paired
difference (a minus b: {a: 1, b: -1}) or the keep-a-share-of-the-gain contrast (tandem - base) - 0.8 (grpo -
base) = {tandem: 1, grpo: -0.8, base: -0.2}. Every arm is resampled with the same draws (the draws depend only
on the bootstrap seed and the shapes), which is what makes a paired interval tighter than two intervals side by
side. One-sided bootstrap p-values count the replicates on the wrong side of 0, with the +1 correction.

A seed-level t-interval (the per-seed macro values of the contrast, df = M - 1) is the robustness check beside
the bootstrap: with few seeds a percentile bootstrap over seeds shrinks their spread by (M - 1) / M.

Shapes: one array `values_MP` per benchmark, `M` seeds x `P` problems of that benchmark; `NaN` marks a
problem with no value for that seed (it is left out of that seed's mean). Every function here is numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Mapping

import numpy as np

Direction = Literal["greater", "less", "equivalent"]
Scheme = Literal["crossed", "nested"]
Values = Mapping[str, np.ndarray]  # benchmark -> values_MP
VERDICTS = ("holds", "does not hold", "inconclusive")


@dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided interval."""

    estimate: float
    low: float
    high: float

    def as_dict(self) -> dict:
        return {"estimate": self.estimate, "ci_low": self.low, "ci_high": self.high}


def seed_means_M(values: Values) -> np.ndarray:
    """Each seed's macro mean over benchmarks of its mean over problems (NaNs left out): shape (M,).

    Naive equivalent: m_s = mean over benchmarks b of (mean of values[b][s, p] over the p with a value).
    """
    return np.mean(np.stack([np.nanmean(values[b], axis=1) for b in sorted(values)]), axis=0)


def point_estimate(values: Values) -> float:
    """Mean over seeds of the macro mean over benchmarks of the mean over problems (NaNs left out)."""
    return float(np.mean(seed_means_M(values)))


def n_seeds(values: Values) -> int:
    s = {v.shape[0] for v in values.values()}
    if len(s) != 1:
        raise ValueError(f"every benchmark needs the same number of seeds, got {sorted(s)}")
    return s.pop()


@dataclass(frozen=True)
class Draws:
    """Bootstrap index draws: seeds (n_boot x M) and, per benchmark, problems: (n_boot x P_b) when crossed (one
    draw shared by every seed slot), (n_boot x M x P_b) when nested (a draw per seed slot)."""

    scheme: str
    seeds_WM: np.ndarray
    problems: dict[str, np.ndarray]
    _counts: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def n_boot(self) -> int:
        return int(self.seeds_WM.shape[0])

    def counts_WP(self, benchmark: str) -> np.ndarray:
        """Crossed draws as counts: how often replicate n drew problem p of `benchmark` (float, n_boot x P)."""
        if benchmark not in self._counts:
            idx = self.problems[benchmark]
            W, P = idx.shape
            self._counts[benchmark] = np.bincount((idx + P * np.arange(W)[:, None]).ravel(),
                                                  minlength=W * P).reshape(W, P).astype(np.float64)
        return self._counts[benchmark]


def draws(values: Values, n_boot: int, seed: int = 0, scheme: Scheme = "crossed") -> Draws:
    """Index draws for data shaped like `values`; the same (shapes, n_boot, seed, scheme) give the same draws, so
    every arm of a comparison is resampled identically. Benchmarks are drawn in sorted order."""
    if scheme not in ("crossed", "nested"):
        raise ValueError(f"scheme must be crossed or nested, got {scheme!r}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    M = n_seeds(values)
    key = (tuple((b, values[b].shape) for b in sorted(values)), n_boot, seed, scheme)
    if key in _DRAWS:
        return _DRAWS[key]
    rng = np.random.default_rng(seed)
    seeds_WM = rng.integers(0, M, size=(n_boot, M))
    problems = {}
    for b in sorted(values):
        P = values[b].shape[1]
        problems[b] = rng.integers(0, P, size=(n_boot, P) if scheme == "crossed" else (n_boot, M, P))
    if len(_DRAWS) >= 16:  # a study has a handful of shapes; keep the cache small
        _DRAWS.pop(next(iter(_DRAWS)))
    _DRAWS[key] = Draws(scheme, seeds_WM, problems)
    return _DRAWS[key]


_DRAWS: dict[tuple, Draws] = {}  # the same inputs give the same draws: compute them once


def boot_stats_W(values: Values, d: Draws) -> np.ndarray:
    """`point_estimate` on every bootstrap replicate: shape (n_boot,). A replicate in which a seed slot has no
    value left on some benchmark is NaN (left out by the interval and the p-value).

    Crossed: the mean of seed m over replicate w's problems is sum_p W[w, p] x[m, p] / sum_p W[w, p] ok[m, p],
    W the draw counts; einsum's own loops (not BLAS) keep the summation order the same on every machine.
    Nested: seed slot j of replicate w is seed seeds_WM[w, j] on its own problem draw.
    """
    if set(values) != set(d.problems):
        raise ValueError(f"draws are for benchmarks {sorted(d.problems)}, values have {sorted(values)}")
    per_bench = []
    with np.errstate(invalid="ignore", divide="ignore"):
        for b in sorted(values):
            v = np.asarray(values[b], dtype=np.float64)
            ok = ~np.isnan(v)
            x = np.where(ok, v, 0.0)
            if d.scheme == "crossed":
                w_WP = d.counts_WP(b)
                sums_WM = np.einsum("wp,mp->wm", w_WP, x)
                n_WM = float(v.shape[1]) if ok.all() else np.einsum("wp,mp->wm", w_WP, ok.astype(np.float64))
                per_bench.append(np.take_along_axis(sums_WM / n_WM, d.seeds_WM, axis=1))
            else:
                # np.take rather than fancy indexing: the same gather, several times faster
                flat = d.seeds_WM[:, :, None] * v.shape[1] + d.problems[b]
                per_bench.append(np.take(x.ravel(), flat).sum(axis=2) / np.take(ok.ravel(), flat).sum(axis=2))
    return np.mean(np.mean(np.stack(per_bench), axis=0), axis=1)


def _check_same_shapes(arms: Mapping[str, Values]) -> Values:
    names = list(arms)
    first = arms[names[0]]
    for n in names[1:]:
        if set(arms[n]) != set(first):
            raise ValueError(f"arms were measured on different benchmarks: {sorted(first)} vs {sorted(arms[n])}")
        for b in first:
            if arms[n][b].shape != first[b].shape:
                raise ValueError(f"benchmark {b}: shapes differ ({first[b].shape} vs {arms[n][b].shape}); a "
                                 "paired comparison needs the same seeds and problems for every arm")
    return first


def contrast_estimate(arms: Mapping[str, Values], coefs: Mapping[str, float]) -> float:
    """sum_arm coefs[arm] * point_estimate(arms[arm])."""
    return float(sum(c * point_estimate(arms[a]) for a, c in coefs.items()))


def contrast_seed_values_M(arms: Mapping[str, Values], coefs: Mapping[str, float]) -> np.ndarray:
    """The contrast on each seed's macro values: shape (M,)."""
    return sum(c * seed_means_M(arms[a]) for a, c in coefs.items())


def arm_stats(arms: Mapping[str, Values], n_boot: int, seed: int = 0, scheme: Scheme = "crossed"
              ) -> dict[str, np.ndarray]:
    """Every arm's bootstrap statistics under one set of draws: {arm: (n_boot,)}."""
    first = _check_same_shapes(arms)
    d = draws(first, n_boot, seed, scheme)
    return {a: boot_stats_W(v, d) for a, v in arms.items()}


def contrast_stats_W(arms: Mapping[str, Values], coefs: Mapping[str, float], n_boot: int, seed: int = 0,
                     scheme: Scheme = "crossed") -> np.ndarray:
    """The contrast on every bootstrap replicate, all arms resampled with the same draws: (n_boot,)."""
    missing = [a for a in coefs if a not in arms]
    if missing:
        raise ValueError(f"contrast names arms with no values: {missing}")
    stats = arm_stats({a: arms[a] for a in coefs}, n_boot, seed, scheme)
    return sum(c * stats[a] for a, c in coefs.items())


def percentile_interval(stats_W: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The (1 - level) / 2 and (1 + level) / 2 quantiles of the finite replicates."""
    ok = stats_W[np.isfinite(stats_W)]
    if ok.size == 0:
        return math.nan, math.nan
    lo, hi = np.quantile(ok, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def p_one_sided(stats_W: np.ndarray, direction: Literal["greater", "less"]) -> float:
    """One-sided bootstrap p-value of the claim "contrast > 0" (greater) or "< 0" (less): the share of finite
    replicates on the wrong side of 0 (a replicate at exactly 0 counts as wrong), with the +1 correction,
    (1 + #wrong) / (n + 1), so it is never 0. Naive: count in a loop."""
    ok = stats_W[np.isfinite(stats_W)]
    if direction == "greater":
        wrong = int(np.count_nonzero(ok <= 0))
    elif direction == "less":
        wrong = int(np.count_nonzero(ok >= 0))
    else:
        raise ValueError(f"direction must be greater or less, got {direction!r}")
    return (1 + wrong) / (ok.size + 1)


def bootstrap_interval(values: Values, n_boot: int = 2000, level: float = 0.95, seed: int = 0,
                       scheme: Scheme = "crossed") -> Interval:
    """Point estimate and percentile interval of `point_estimate(values)`."""
    lo, hi = percentile_interval(boot_stats_W(values, draws(values, n_boot, seed, scheme)), level)
    return Interval(point_estimate(values), lo, hi)


def contrast_interval(arms: Mapping[str, Values], coefs: Mapping[str, float], n_boot: int = 2000,
                      level: float = 0.95, seed: int = 0, scheme: Scheme = "crossed") -> Interval:
    """Estimate and percentile interval of a linear contrast between arms (same draws for every arm)."""
    lo, hi = percentile_interval(contrast_stats_W(arms, coefs, n_boot, seed, scheme), level)
    return Interval(contrast_estimate(arms, coefs), lo, hi)


def paired_difference(a: Values, b: Values, n_boot: int = 2000, level: float = 0.95, seed: int = 0,
                      scheme: Scheme = "crossed") -> Interval:
    """Estimate and interval of point_estimate(a) - point_estimate(b), both arms resampled with the same draws."""
    return contrast_interval({"a": a, "b": b}, {"a": 1.0, "b": -1.0}, n_boot, level, seed, scheme)


# --------------------------------------------------------------------------------------------------
# Seed-level t-interval
# --------------------------------------------------------------------------------------------------

def t_abs_cdf(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with an integer `df` >= 1 (Abramowitz & Stegun 26.7.3-4, a finite series)."""
    if df < 1 or int(df) != df:
        raise ValueError(f"df must be a positive integer, got {df}")
    t = abs(float(t))
    if math.isinf(t):
        return 1.0
    theta = math.atan(t / math.sqrt(df))
    c2, s, c = math.cos(theta) ** 2, math.sin(theta), math.cos(theta)
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        return min(1.0, s * total)
    if df == 1:
        return 2 * theta / math.pi
    term, total = 1.0, 1.0
    for k in range(1, (df - 1) // 2):
        term *= c2 * (2 * k) / (2 * k + 1)
        total += term
    return min(1.0, 2 / math.pi * (theta + s * c * total))


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with integer `df` (bisection on `t_abs_cdf`; |error| < 1e-10)."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p == 0.5:
        return 0.0
    target = abs(2 * p - 1)  # P(|T| <= q) for the upper quantile q
    lo, hi = 0.0, 1.0
    while t_abs_cdf(hi, df) < target:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_abs_cdf(mid, df) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    q = (lo + hi) / 2
    return q if p > 0.5 else -q


def seed_t_interval(values_M: np.ndarray, level: float = 0.95) -> Interval | None:
    """mean +- t_{(1+level)/2, M-1} * sd / sqrt(M) over per-seed values; None with fewer than two seeds."""
    x = np.asarray(values_M, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size < 2:
        return None
    m = float(np.mean(x))
    half = t_quantile((1 + level) / 2, x.size - 1) * float(np.std(x, ddof=1)) / math.sqrt(x.size)
    return Interval(m, m - half, m + half)


# --------------------------------------------------------------------------------------------------
# Interval-only verdicts (the pipeline report's one-seed claims)
# --------------------------------------------------------------------------------------------------

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
