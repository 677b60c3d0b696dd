"""Counter-based noise and the sampler, each against a naive reference."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.rollout.sampling import (STREAM_REDRAW, STREAM_SAMPLE, decoding_logprobs_BT, filter_logits, inverse_cdf, mix32, mix32_int,
                                     sample_tokens, uniform, uniform_int)


def test_mix32_matches_scalar_reference():
    xs = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1, 0xDEADBEEF]
    got = mix32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [mix32_int(x) for x in xs]
    assert len(set(got)) == len(xs)  # bijective on these inputs


def test_uniform_matches_scalar_reference_and_is_a_function_of_its_keys():
    rows = torch.tensor([0, 1, 2, 7, 2**33 + 5])
    for seed, stream, pos in [(0, STREAM_SAMPLE, 0), (3, STREAM_SAMPLE, 17), (2**40 + 1, STREAM_REDRAW, 5)]:
        u = uniform(seed, stream, rows, pos)
        assert u.dtype == torch.float64
        assert u.tolist() == [uniform_int(seed, stream, int(r), pos) for r in rows]
        assert torch.equal(u, uniform(seed, stream, rows, pos))
    a = uniform(0, STREAM_SAMPLE, rows, 3)
    for other in (uniform(1, STREAM_SAMPLE, rows, 3), uniform(0, STREAM_REDRAW, rows, 3),
                  uniform(0, STREAM_SAMPLE, rows, 4), uniform(0, STREAM_SAMPLE, rows + 1, 3)):
        assert not torch.equal(a, other)
    with pytest.raises(ValueError):
        uniform(-1, 0, rows, 0)


def test_uniform_looks_uniform():
    u = uniform(5, STREAM_SAMPLE, torch.arange(200_000), 11)
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    hist = torch.histc(u.float(), bins=20, min=0, max=1)
    assert float((hist / 10_000 - 1).abs().max()) < 0.05
    # neighbouring positions are uncorrelated
    v = uniform(5, STREAM_SAMPLE, torch.arange(200_000), 12)
    assert abs(float(torch.corrcoef(torch.stack([u, v]))[0, 1])) < 0.01


def _naive_inverse_cdf(probs: list[float], u: float) -> int:
    total = sum(probs)
    acc = 0.0
    for i, p in enumerate(probs):
        acc += p
        if acc > u * total:
            return i
    return max(i for i, p in enumerate(probs) if p > 0)


def test_inverse_cdf_matches_naive():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(50, 9, generator=g, dtype=torch.float64)
    probs[probs < 0.3] = 0.0
    probs[:, 0] += 1e-3
    u = torch.rand(50, generator=g, dtype=torch.float64)
    got = inverse_cdf(probs, u).tolist()
    assert got == [_naive_inverse_cdf(p, float(x)) for p, x in zip(probs.tolist(), u.tolist())]
    assert all(probs[i, j] > 0 for i, j in enumerate(got))
    # u at the very top never picks a zero-mass id past the last positive one
    top = inverse_cdf(torch.tensor([[0.2, 0.8, 0.0]], dtype=torch.float64), torch.tensor([1.0 - 2**-53]))
    assert top.tolist() == [1]


def _naive_filter(logits: list[float], top_k: int, top_p: float) -> list[bool]:
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    keep = set(range(len(logits)))
    if top_k:
        kth = logits[order[top_k - 1]]
        keep = {i for i in keep if logits[i] >= kth}
    if top_p < 1.0:
        z = [logits[i] if i in keep else -math.inf for i in range(len(logits))]
        m = max(z)
        e = [math.exp(x - m) for x in z]
        s = sum(e)
        mass, kept = 0.0, set()
        for i in sorted(range(len(z)), key=lambda i: -z[i]):
            if mass >= top_p and kept:
                break
            kept.add(i)
            mass += e[i] / s
        keep &= kept
    return [i in keep for i in range(len(logits))]


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (4, 0.5), (1, 1.0), (0, 0.01)])
def test_filter_logits_matches_naive(top_k, top_p):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(20, 12, generator=g, dtype=torch.float64) * 2
    out = filter_logits(logits, top_k, top_p)
    for row, o in zip(logits.tolist(), out):
        assert torch.isfinite(o).tolist() == _naive_filter(row, top_k, top_p)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (0.7, 0, 0.6), (0.5, 4, 0.5),
                                                    (0.0, 0, 1.0), (0.0, 2, 0.5)])
def test_decoding_logprobs_match_a_naive_distribution_per_position(temperature, top_k, top_p):
    """Each id's log-probability under the filtered, renormalised distribution it is drawn from; -inf outside
    it; greedy: 0 at the argmax, -inf elsewhere."""
    g = torch.Generator().manual_seed(2)
    logits_BTV = torch.randn(3, 5, 9, generator=g, dtype=torch.float64) * 2
    ids_BT = torch.randint(0, 9, (3, 5), generator=g)
    ids_BT[0, :] = logits_BTV[0].argmax(-1)  # some ids inside the nucleus
    got_BT = decoding_logprobs_BT(logits_BTV, ids_BT, temperature, top_k, top_p)
    for b in range(3):
        for t in range(5):
            row = logits_BTV[b, t].tolist()
            i = int(ids_BT[b, t])
            if temperature == 0:
                kept = [j for j, k in enumerate(_naive_filter(row, top_k, top_p)) if k]
                want = 0.0 if i == max(kept, key=lambda j: row[j]) else -math.inf
            else:
                keep = _naive_filter([x / temperature for x in row], top_k, top_p)
                z = sum(math.exp(x / temperature) for x, k in zip(row, keep) if k)
                want = math.log(math.exp(row[i] / temperature) / z) if keep[i] else -math.inf
            assert got_BT[b, t].item() == pytest.approx(want, abs=1e-9) if math.isfinite(want) else \
                got_BT[b, t].item() == -math.inf
    with pytest.raises(ValueError, match="temperature"):
        decoding_logprobs_BT(logits_BTV, ids_BT, -0.1)


def test_sample_tokens_frequencies_and_logprobs():
    logits = torch.tensor([[2.0, 0.5, -1.0, 1.0, -3.0]], dtype=torch.float64)
    T = 0.7
    n = 40_000
    u = uniform(9, STREAM_SAMPLE, torch.arange(n), 0)
    ids, lp = sample_tokens(logits.expand(n, -1), u, temperature=T)
    want = torch.softmax(logits[0] / T, -1)
    freq = torch.bincount(ids, minlength=5).double() / n
    assert float((freq - want).abs().max()) < 0.01
    assert torch.allclose(lp, torch.log_softmax(logits[0] / T, -1)[ids])
    # top-k: only the k best ids are ever drawn; the recorded log-prob stays the unfiltered one
    ids_k, lp_k = sample_tokens(logits.expand(n, -1), u, temperature=T, top_k=2)
    assert set(ids_k.tolist()) == {0, 3}
    assert torch.allclose(lp_k, torch.log_softmax(logits[0] / T, -1)[ids_k])
    # greedy
    ids_g, _ = sample_tokens(logits.expand(3, -1), u[:3], temperature=0.0)
    assert ids_g.tolist() == [0, 0, 0]
    with pytest.raises(ValueError):
        sample_tokens(logits, u[:1], temperature=-1.0)
