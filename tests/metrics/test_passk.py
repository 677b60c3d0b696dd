"""pass@k against brute-force enumeration of every size-k subset of the samples."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tandem.metrics.passk import macro_mean, mean_pass_at_k, pass_at_k, pass_at_k_P


def _brute(n: int, c: int, k: int) -> float:
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_subset_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_1_is_the_fraction_correct_and_edges():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 1, 8) == 1.0
    # stable for large n where binomials overflow floats
    assert pass_at_k(2000, 10, 100) == pytest.approx(1 - math.comb(1990, 100) / math.comb(2000, 100), rel=1e-9)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_benchmark_mean_and_ragged_problems():
    scores = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0]]
    got = mean_pass_at_k(scores, [1, 2])
    for k in (1, 2):
        want = np.mean([_brute(len(s), sum(s), k) for s in scores])
        assert got[k] == pytest.approx(want)
    assert pass_at_k_P([1, 2], [4, 4], 2).tolist() == pytest.approx([_brute(4, 1, 2), _brute(4, 2, 2)])
    assert mean_pass_at_k([], [1]) == {1: None}


def test_macro_mean_is_unweighted_and_skips_undefined():
    assert macro_mean({"a": 0.2, "b": 0.6}) == pytest.approx(0.4)
    assert macro_mean({"a": 0.2, "b": None, "c": float("nan")}) == pytest.approx(0.2)
    assert macro_mean({}) is None
