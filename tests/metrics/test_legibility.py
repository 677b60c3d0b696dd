"""Cross-entropy, overlap and masked means against naive loops on tiny hand-made distributions."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.metrics.legibility import masked_row_mean_B, overlap_BT, token_nll_BT


def _logp(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def test_overlap_identical_is_one_and_disjoint_is_zero():
    p = _logp([[[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    q = _logp([[[0.0, 0.0, 0.0, 1.0], [0.25, 0.25, 0.25, 0.25]]])
    assert overlap_BT(p, p).flatten().tolist() == pytest.approx([1.0, 1.0])
    got = overlap_BT(p, q)
    assert got[0, 0].item() == pytest.approx(0.0, abs=1e-12)  # disjoint supports
    assert got[0, 1].item() == pytest.approx(1.0)


def test_overlap_matches_naive_loop_and_total_variation():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, 5, generator=g, dtype=torch.float64).log_softmax(-1)
    b = torch.randn(2, 3, 5, generator=g, dtype=torch.float64).log_softmax(-1)
    got = overlap_BT(a, b)
    for i in range(2):
        for t in range(3):
            naive = sum(min(math.exp(a[i, t, v]), math.exp(b[i, t, v])) for v in range(5))
            tv = 0.5 * sum(abs(math.exp(a[i, t, v]) - math.exp(b[i, t, v])) for v in range(5))
            assert got[i, t].item() == pytest.approx(naive)
            assert got[i, t].item() == pytest.approx(1 - tv)
    assert torch.allclose(overlap_BT(a, b), overlap_BT(b, a))


def test_token_nll_matches_naive_indexing():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(2, 4, 6, generator=g).log_softmax(-1)
    y = torch.randint(0, 6, (2, 4), generator=g)
    got = token_nll_BT(logp, y)
    for i in range(2):
        for t in range(4):
            assert got[i, t].item() == pytest.approx(-logp[i, t, y[i, t]].item())
    # a certain prediction costs 0 nats, a uniform one log V
    assert token_nll_BT(_logp([[[1.0, 0.0]]]), torch.tensor([[0]])).item() == pytest.approx(0.0)
    assert token_nll_BT(_logp([[[0.25] * 4]]), torch.tensor([[3]])).item() == pytest.approx(math.log(4))


def test_masked_row_mean():
    x = torch.tensor([[1.0, 2.0, 9.0], [4.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    got = masked_row_mean_B(x, m)
    assert got[:2].tolist() == pytest.approx([1.5, 4.0])
    assert math.isnan(got[2].item())
