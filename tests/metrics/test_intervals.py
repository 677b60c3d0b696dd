"""The hierarchical bootstrap and verdicts against naive loops and hand-checked cases."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.metrics.intervals import (Interval, bootstrap_interval, paired_difference, point_estimate, verdict,
                                      within_noise)


def _values(rng, S=3, sizes=(5, 7), shift=0.0):
    return {f"b{i}": rng.random((S, P)) + shift for i, P in enumerate(sizes)}


def test_point_estimate_matches_naive_loop():
    rng = np.random.default_rng(1)
    v = _values(rng)
    v["b0"][1, 2] = np.nan  # a missing value is left out of its seed's mean
    naive_seeds = []
    for s in range(3):
        per_bench = []
        for arr in v.values():
            xs = [x for x in arr[s] if not np.isnan(x)]
            per_bench.append(sum(xs) / len(xs))
        naive_seeds.append(sum(per_bench) / len(per_bench))
    assert point_estimate(v) == pytest.approx(sum(naive_seeds) / 3)


def test_bootstrap_matches_a_naive_loop_with_the_same_draws():
    rng = np.random.default_rng(2)
    v = _values(rng)
    n_boot = 50
    got = bootstrap_interval(v, n_boot=n_boot, seed=7)
    # Replay the same draws in plain Python: seeds first, then per benchmark its problems.
    draw = np.random.default_rng(7)
    seeds_NS = draw.integers(0, 3, size=(n_boot, 3))
    probs = {b: draw.integers(0, arr.shape[1], size=(n_boot, 3, arr.shape[1])) for b, arr in v.items()}
    stats = []
    for n in range(n_boot):
        per_seed = []
        for j in range(3):
            s = seeds_NS[n, j]
            per_seed.append(np.mean([np.mean([v[b][s, p] for p in probs[b][n, j]]) for b in v]))
        stats.append(np.mean(per_seed))
    lo, hi = np.quantile(stats, [0.025, 0.975])
    assert got.low == pytest.approx(lo) and got.high == pytest.approx(hi)
    assert got.low <= got.estimate <= got.high


def test_paired_difference_is_tighter_than_unpaired_and_centred():
    rng = np.random.default_rng(3)
    base = _values(rng, S=3, sizes=(40, 40))
    shifted = {b: arr + 0.05 for b, arr in base.items()}  # same problems, constant improvement
    d = paired_difference(shifted, base, n_boot=400)
    assert d.estimate == pytest.approx(0.05)
    assert d.low == pytest.approx(0.05) and d.high == pytest.approx(0.05)  # paired: the noise cancels exactly
    a, b = bootstrap_interval(shifted, n_boot=400), bootstrap_interval(base, n_boot=400)
    assert (a.high - a.low) > 0.01 and (b.high - b.low) > 0.01


def test_interval_covers_the_truth_most_of_the_time():
    # Coverage check on synthetic data whose true mean is known (0.5): a 95% interval should miss rarely.
    misses = 0
    for t in range(40):
        rng = np.random.default_rng(100 + t)
        v = {"b": rng.binomial(1, 0.5, size=(4, 60)).astype(float)}
        iv = bootstrap_interval(v, n_boot=300, seed=t)
        misses += not (iv.low <= 0.5 <= iv.high)
    assert misses <= 8


def test_pairing_needs_matching_shapes():
    rng = np.random.default_rng(4)
    with pytest.raises(ValueError, match="shapes differ"):
        paired_difference(_values(rng, sizes=(5, 7)), _values(rng, sizes=(5, 8)))
    with pytest.raises(ValueError, match="different benchmarks"):
        paired_difference({"a": np.ones((2, 3))}, {"b": np.ones((2, 3))})


@pytest.mark.parametrize("low,high,direction,margin,expected", [
    (0.01, 0.05, "greater", 0, "holds"),
    (-0.05, -0.01, "greater", 0, "does not hold"),
    (-0.01, 0.05, "greater", 0, "inconclusive"),
    (-0.05, -0.01, "less", 0, "holds"),
    (0.01, 0.05, "less", 0, "does not hold"),
    (-0.02, 0.02, "equivalent", 0.03, "holds"),
    (0.04, 0.09, "equivalent", 0.03, "does not hold"),
    (-0.02, 0.05, "equivalent", 0.03, "inconclusive"),
])
def test_verdicts(low, high, direction, margin, expected):
    assert verdict(low, high, direction, margin) == expected


def test_verdict_rejects_nonsense():
    with pytest.raises(ValueError, match="margin"):
        verdict(-0.1, 0.1, "equivalent", 0.0)
    with pytest.raises(ValueError, match="empty"):
        verdict(0.2, 0.1, "greater")
    with pytest.raises(ValueError, match="direction"):
        verdict(0.0, 0.1, "bigger")


def test_within_noise():
    assert within_noise(Interval(0.01, -0.02, 0.04)) and not within_noise(Interval(0.03, 0.01, 0.05))
