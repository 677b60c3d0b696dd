"""Unbiased pass@k (Chen et al. 2021) per problem, per benchmark, and macro-averaged over benchmarks.

pass@k of one problem with n samples of which c are correct is 1 - C(n-c, k) / C(n, k): the probability
that a size-k subset drawn without replacement from the n samples holds at least one correct sample.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k), computed as a stable product (naive: enumerate all size-k subsets)."""
    if not (0 <= c <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not (1 <= k <= n):
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k_P(correct_P: Sequence[int], n_P: Sequence[int], k: int) -> np.ndarray:
    """Per-problem pass@k for problems with `n_P[i]` samples of which `correct_P[i]` are correct."""
    if len(correct_P) != len(n_P):
        raise ValueError(f"pass_at_k_P: {len(correct_P)} correct counts but {len(n_P)} sample counts")
    return np.array([pass_at_k(int(n), int(c), k) for c, n in zip(correct_P, n_P)], dtype=np.float64)


def mean_pass_at_k(scores_PN: Sequence[Sequence[float]], ks: Sequence[int]) -> dict[int, float | None]:
    """Benchmark pass@k: mean over problems of per-problem pass@k; `scores_PN[p]` holds 0/1 sample scores.

    A score counts as correct when it is >= 0.5 (scores are 0/1; the threshold only guards float noise).
    Returns None for a k when there are no problems.
    """
    if len(scores_PN) == 0:
        return {k: None for k in ks}
    n_P = [len(s) for s in scores_PN]
    c_P = [sum(1 for x in s if x >= 0.5) for s in scores_PN]
    return {k: float(pass_at_k_P(c_P, n_P, k).mean()) for k in ks}


def macro_mean(values: Mapping[str, float | None]) -> float | None:
    """Unweighted mean over benchmarks, skipping undefined (None/NaN) entries; None when nothing is defined."""
    ok = [float(v) for v in values.values() if v is not None and not math.isnan(float(v))]
    return float(sum(ok) / len(ok)) if ok else None
