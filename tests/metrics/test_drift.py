"""KL, log-ratios, per-type aggregation, ranking, quantiles and histograms against naive loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tandem.metrics.drift import (histogram_counts, kl_BT, per_type_sums_V, quantiles, token_logratio_BT,
                                  top_types)


def test_kl_of_a_model_with_itself_is_zero_and_matches_naive_loop():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(2, 3, 7, generator=g, dtype=torch.float64).log_softmax(-1)
    q = torch.randn(2, 3, 7, generator=g, dtype=torch.float64).log_softmax(-1)
    assert kl_BT(p, p).abs().max().item() == pytest.approx(0.0, abs=1e-12)
    got = kl_BT(p, q)
    for i in range(2):
        for t in range(3):
            naive = sum(math.exp(p[i, t, v]) * (p[i, t, v] - q[i, t, v]) for v in range(7))
            assert got[i, t].item() == pytest.approx(float(naive))
    assert (got > 0).all()


def test_kl_zero_probability_terms_contribute_nothing():
    p = torch.tensor([[[0.5, 0.5, 0.0]]], dtype=torch.float64).log()
    q = torch.tensor([[[0.25, 0.25, 0.5]]], dtype=torch.float64).log()
    assert kl_BT(p, q).item() == pytest.approx(math.log(2))
    # q = 0 where p > 0 makes KL infinite, not NaN
    assert math.isinf(kl_BT(q, p).item())


def test_token_logratio_matches_naive_indexing_and_is_zero_for_same_model():
    g = torch.Generator().manual_seed(2)
    p = torch.randn(2, 4, 5, generator=g).log_softmax(-1)
    q = torch.randn(2, 4, 5, generator=g).log_softmax(-1)
    y = torch.randint(0, 5, (2, 4), generator=g)
    got = token_logratio_BT(p, q, y)
    for i in range(2):
        for t in range(4):
            assert got[i, t].item() == pytest.approx((p[i, t, y[i, t]] - q[i, t, y[i, t]]).item(), abs=1e-6)
    assert token_logratio_BT(p, p, y).abs().max().item() == 0.0


def test_per_type_sums_match_a_dict_loop_and_respect_the_mask():
    vals = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    ids = torch.tensor([[0, 2, 2, 1], [2, 0, 3, 3]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    s, c = per_type_sums_V(vals, ids, mask, vocab_size=5)
    naive: dict[int, list[float]] = {}
    for i in range(2):
        for t in range(4):
            if mask[i, t]:
                naive.setdefault(int(ids[i, t]), []).append(float(vals[i, t]))
    for v in range(5):
        assert s[v].item() == pytest.approx(sum(naive.get(v, [])))
        assert c[v].item() == len(naive.get(v, []))
    with pytest.raises(ValueError, match="token ids"):
        per_type_sums_V(vals, ids, mask, vocab_size=3)


def test_top_types_ranks_by_mean_with_min_count_and_caps_at_k():
    s = torch.tensor([10.0, 3.0, 5.0, 0.0, 100.0], dtype=torch.float64)
    c = torch.tensor([5, 1, 2, 0, 1])
    assert top_types(s, c, k=10, min_count=1) == [4, 1, 2, 0]  # means 2, 3, 2.5, -, 100
    assert top_types(s, c, k=10, min_count=2) == [2, 0]
    assert top_types(s, c, k=1, min_count=1) == [4]
    # ties break by id
    assert top_types(torch.tensor([1.0, 1.0]), torch.tensor([1, 1]), k=2) == [0, 1]


def test_quantiles_and_histogram_against_naive():
    rng = np.random.default_rng(0)
    v = rng.exponential(size=101)
    q = quantiles(v, [0.5, 0.9])
    assert q["0.5"] == pytest.approx(sorted(v)[50])
    assert quantiles(np.array([]), [0.5]) == {"0.5": None}
    edges = np.linspace(0, 2, 5)
    got = histogram_counts(np.concatenate([v, [-1e-9, 50.0]]), edges)
    naive = [0] * 4
    for x in np.concatenate([v, [-1e-9, 50.0]]):
        b = 0
        for i in range(4):
            if x >= edges[i]:
                b = i
        naive[b] += 1
    assert got == naive and sum(got) == 103
