"""The registered verdict rules of the study (studies/registration.md): smallest effects of interest, Holm, what
an interval excludes.

A registered claim (`RegisteredClaim`, one entry of the registration's `claims:`) is a one-sided test of a
linear contrast between arms at one checkpoint on one measure:

- `greater` / `less`: a - b > 0 / < 0, with a smallest effect of interest (SESOI) stated as an absolute
  difference (`sesoi`), a share of arm b's value (`sesoi_relative`) or a share of b's total-variation distance
  1 - overlap (`sesoi_tv_relative`); `threshold` turns it into a signed bound on the difference;
- `keeps_gain`: a keeps at least `keep` of b's gain over the base, (a - base) - keep (b - base) > 0; the
  share is built into the contrast, so its bound is 0.

`evaluate` computes a row: the estimate, its crossed-bootstrap interval, the one-sided bootstrap p-value, the
seed-level t-interval, every involved arm's value, and for keeps_gain the kept share of the gain with its
interval. `holm_adjust` adjusts the family's p-values; `decide` gives the verdict:

- holds: adjusted p < alpha **and** the estimate meets the SESOI;
- does not hold: the interval's end in the claimed direction falls short of the SESOI (for keeps_gain: the
  interval lies below 0), so an effect of the registered size is excluded;
- inconclusive: otherwise.

`excludes` says in words what the interval rules out, and `not_robust` flags a row whose seed t-interval and
bootstrap interval disagree about excluding 0. Numpy only; the study's I/O lives in tasks/study/recompute.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from tandem.metrics.intervals import (Values, arm_stats, contrast_estimate, contrast_seed_values_M, p_one_sided,
                                      percentile_interval, point_estimate, seed_t_interval)

TESTS = ("keeps_gain", "greater", "less")
BASE = "base"
SESOI_KINDS = ("sesoi", "sesoi_relative", "sesoi_tv_relative")
METRIC_WORDS = {"kl_mean": "KL to the base (own text)", "junior_ce": "junior cross-entropy (own text)",
                "overlap": "overlap (own text)", "common/kl_mean": "KL to the base (common text)",
                "common/overlap": "overlap (common text)", "compact_share": "compact share"}


def metric_words(metric: str) -> str:
    """A measure in words: "step/pass@1" -> "step pass@1", "kl_mean" -> "KL to the base (own text)"."""
    return METRIC_WORDS.get(metric, metric.replace("/", " "))


def sig(x: float, digits: int = 3, sign: bool = False) -> str:
    """`x` with `digits` significant digits, trailing zeros kept (one format for every magnitude)."""
    return f"{x:{'+' if sign else ''}#.{digits}g}".rstrip(".") if math.isfinite(x) else "nan"


@dataclass(frozen=True)
class RegisteredClaim:
    """One registered comparison (the registration's `claims:` entries, or a secondary row derived from one)."""

    id: str
    claim: str
    statement: str
    metric: str
    test: str
    a: str
    b: str
    keep: float | None = None
    sesoi: float | None = None
    sesoi_relative: float | None = None
    sesoi_tv_relative: float | None = None
    checkpoint: str = "final"

    def __post_init__(self) -> None:
        if self.test not in TESTS:
            raise ValueError(f"claim {self.id}: test {self.test!r} is none of {', '.join(TESTS)}")
        given = [k for k in SESOI_KINDS if getattr(self, k) is not None]
        if self.test == "keeps_gain":
            if self.keep is None or not 0 < self.keep <= 1:
                raise ValueError(f"claim {self.id}: keeps_gain needs keep in (0, 1], got {self.keep}")
            if given:
                raise ValueError(f"claim {self.id}: keeps_gain takes no {given[0]} (the share is the keep)")
        elif len(given) > 1:
            raise ValueError(f"claim {self.id}: give at most one of {', '.join(SESOI_KINDS)}, got {given}")
        for k in given:
            if not getattr(self, k) >= 0:
                raise ValueError(f"claim {self.id}: {k} must be >= 0")

    @classmethod
    def from_dict(cls, d: Mapping, **changes) -> "RegisteredClaim":
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"claim {d.get('id', '?')}: unknown keys {unknown}")
        return cls(**{**{k: d[k] for k in d}, **changes})

    @property
    def direction(self) -> str:
        return "less" if self.test == "less" else "greater"

    @property
    def coefficients(self) -> dict[str, float]:
        """The contrast as {arm: coefficient}."""
        if self.test == "keeps_gain":
            return {self.a: 1.0, self.b: -self.keep, BASE: self.keep - 1.0}
        return {self.a: 1.0, self.b: -1.0}

    @property
    def arms(self) -> tuple[str, ...]:
        return tuple(self.coefficients)

    @property
    def comparison(self) -> str:
        if self.test == "keeps_gain":
            return f"({self.a} - {BASE}) - {self.keep:g} ({self.b} - {BASE})"
        return f"{self.a} - {self.b}"

    def sesoi_rule(self) -> tuple[str, float]:
        """(kind, registered value): kind is absolute, relative, tv_relative or none."""
        for k, kind in zip(SESOI_KINDS, ("absolute", "relative", "tv_relative")):
            if getattr(self, k) is not None:
                return kind, float(getattr(self, k))
        return "none", 0.0

    def threshold(self, b_value: float) -> float:
        """The SESOI as a signed bound on the difference (>= it for greater, <= it for less); 0 for keeps_gain."""
        kind, r = self.sesoi_rule()
        size = {"absolute": r, "relative": r * abs(b_value), "tv_relative": r * (1.0 - b_value), "none": 0.0}[kind]
        return -size if self.direction == "less" else size


def holm_adjust(p: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values: the i-th smallest becomes max over j <= i of min(1, (m - j + 1) p_(j)).

    Rejecting every hypothesis whose adjusted p is below alpha is Holm's procedure at family-wise level alpha.
    """
    m = len(p)
    order = sorted(range(m), key=lambda i: (p[i], i))
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(p[i])))
        out[i] = running
    return out


def decide(p_adjusted: float, alpha: float, estimate: float, low: float, high: float, direction: str,
           threshold: float) -> str:
    """The registered verdict: holds / does not hold / inconclusive (see the module docstring)."""
    if not low <= high:
        raise ValueError(f"interval [{low}, {high}] is empty")
    if direction == "greater":
        if p_adjusted < alpha and estimate >= threshold:
            return "holds"
        return "does not hold" if high < threshold else "inconclusive"
    if direction == "less":
        if p_adjusted < alpha and estimate <= threshold:
            return "holds"
        return "does not hold" if low > threshold else "inconclusive"
    raise ValueError(f"direction must be greater or less, got {direction!r}")


def not_robust(boot: tuple[float, float], seed_t: tuple[float, float] | None) -> bool | None:
    """True when the seed-level t-interval and the bootstrap interval disagree about excluding 0."""
    if seed_t is None:
        return None
    excl = [lo > 0 or hi < 0 for lo, hi in (boot, seed_t)]
    return excl[0] != excl[1]


def excludes(c: RegisteredClaim, low: float, high: float, b_value: float, kept: Mapping | None = None) -> str:
    """What the interval rules out, in words (for rows that do not hold or are inconclusive)."""
    if c.test == "keeps_gain":
        share = ""
        if kept and _finite(kept.get("estimate"), *(kept.get("ci") or [None])):
            e, (lo, hi) = kept["estimate"], kept["ci"]
            share = f"{c.a} keeps {100 * e:.0f}% [{100 * lo:.0f}%, {100 * hi:.0f}%] of {c.b}'s gain over the {BASE}; "
            return share + f"keeping more than {100 * hi:.0f}% of it is excluded"
        return (f"the contrast's interval ends at {sig(high, sign=True)}: keeping more than "
                f"{100 * c.keep:.0f}% of {c.b}'s gain is {'excluded' if high < 0 else 'not excluded'}")
    what = metric_words(c.metric)
    if c.direction == "greater":
        if high <= 0:
            return f"any {what} gain of {c.a} over {c.b} is excluded (the interval ends at {sig(high, sign=True)})"
        rel = _relative(c, high, b_value)
        return f"a {what} gain of {c.a} over {c.b} above {sig(high, sign=True)}{rel} is excluded"
    if low >= 0:
        return f"any {what} reduction of {c.a} against {c.b} is excluded (the interval starts at {sig(low, sign=True)})"
    rel = _relative(c, -low, b_value)
    return f"a {what} reduction of {c.a} against {c.b} larger than {sig(-low)}{rel} is excluded"


def _finite(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def _relative(c: RegisteredClaim, size: float, b_value: float) -> str:
    kind, _ = c.sesoi_rule()
    if kind == "relative" and b_value:
        return f" ({100 * size / abs(b_value):.0f}% of {c.b}'s {sig(b_value)})"
    if kind == "tv_relative" and 1 - b_value > 0:
        return f" ({100 * size / (1 - b_value):.0f}% of {c.b}'s 1 - overlap, {sig(1 - b_value)})"
    return ""


def evaluate(c: RegisteredClaim, arms: Mapping[str, Values], n_boot: int, level: float, seed: int) -> dict:
    """One row's numbers on `arms` ({arm: values}, the same seeds and problems for every arm of the contrast):
    estimate, ci, p_one_sided, seed_t, threshold, every arm's estimate with its interval, and for keeps_gain the
    kept share of the gain (`kept_share`, the percentile interval of its per-replicate ratio)."""
    coefs = c.coefficients
    stats = arm_stats({a: arms[a] for a in coefs}, n_boot, seed)
    stat_W = sum(k * stats[a] for a, k in coefs.items())
    est = contrast_estimate(arms, coefs)
    lo, hi = percentile_interval(stat_W, level)
    st = seed_t_interval(contrast_seed_values_M(arms, coefs), level)
    b_value = point_estimate(arms[c.b])
    row = {"estimate": est, "ci": [lo, hi], "seed_t": [st.low, st.high] if st else None,
           "p_one_sided": p_one_sided(stat_W, c.direction), "threshold": c.threshold(b_value),
           "arms": {a: {"estimate": point_estimate(arms[a]), "ci": list(percentile_interval(stats[a], level))}
                    for a in coefs}}
    if c.test == "keeps_gain":
        gain_a = point_estimate(arms[c.a]) - point_estimate(arms[BASE])
        gain_b = b_value - point_estimate(arms[BASE])
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio_W = (stats[c.a] - stats[BASE]) / (stats[c.b] - stats[BASE])
        glo, ghi = percentile_interval(stats[c.b] - stats[BASE], level)
        row["kept_share"] = {"estimate": gain_a / gain_b if gain_b else math.nan,
                             "ci": list(percentile_interval(ratio_W, level)),
                             "gain_b": gain_b, "gain_b_ci": [glo, ghi],
                             # a share of a gain that may be 0 is unstable: say when b's gain is not told from 0
                             "gain_b_excludes_0": bool(glo > 0 or ghi < 0)}
    return row
