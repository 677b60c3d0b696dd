"""Counter-based sampling noise and the token sampler shared by every rollout engine.

Every random number a rollout uses is a pure function of (seed, stream, row id, position): a 32-bit integer
hash (`mix32`, Wellons' "lowbias32", bijective) folded over those keys, then two hashes widened to a 53-bit
uniform in (0, 1). There is no generator state, so
- a rollout replays exactly from its seed, whatever the batch split or the order in which rows are computed;
- the catch-up engine and the lockstep reference draw the same number for the same token, which is what
  makes them token-identical (the fast engine is tested against the reference).

Sampling is inverse-CDF: one uniform per token picks the first id whose cumulative (filtered) probability
exceeds it. Temperature, top-k and top-p filter as in transformers' warpers. The recorded log-probability is
log_softmax(logits / T) at the sampled id *without* top-k/top-p, which is what trl recomputes in training
(there top-p = 1 and top-k = 0, so it is exactly the sampling distribution).
"""

from __future__ import annotations

import functools

import torch

MASK32 = 0xFFFFFFFF
STREAM_SAMPLE = 0   # the token draw at a position
STREAM_REDRAW = 1   # the word/token schedule's author redraw after a position
STREAM_FIRST = 2    # the first author of a row
_START = 0x243F6A88  # any non-zero constant: mix32 maps 0 to 0


def mix32_int(x: int) -> int:
    """Scalar reference of `mix32` (pure Python)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    x ^= x >> 16
    return x


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Vectorised lowbias32 on int64 tensors holding values in [0, 2^32).

    Products of two 32-bit numbers overflow int64; torch wraps them modulo 2^64, which keeps the low 32 bits
    exact, and masking right after each product keeps every shift a logical one.
    """
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def _fold(h: torch.Tensor, v: torch.Tensor | int) -> torch.Tensor:
    return mix32(h ^ (v & MASK32))


def uniform(seed: int, stream: int, rows_B: torch.Tensor, pos_B: torch.Tensor | int,
            dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """U(0, 1) per element, a pure function of (seed, stream, row, position); never exactly 0 or 1."""
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    rows_B = rows_B.to(torch.int64)
    pos_B = torch.as_tensor(pos_B, dtype=torch.int64, device=rows_B.device).expand_as(rows_B)
    h = torch.full_like(rows_B, _START)
    for v in (seed & MASK32, (seed >> 32) & MASK32, stream):
        h = _fold(h, v)
    h = _fold(h, rows_B)
    h = _fold(h, rows_B >> 32)
    h = _fold(h, pos_B)
    hi = mix32(h ^ 0x5BD1E995) >> 5   # 27 bits
    lo = mix32(h ^ 0x1B873593) >> 6   # 26 bits
    u = ((hi * (1 << 26) + lo).to(torch.float64) + 0.5) * (2.0 ** -53)
    return u.to(dtype)


def uniform_int(seed: int, stream: int, row: int, pos: int) -> float:
    """Scalar reference of `uniform` (pure Python), for tests."""
    return uniform_at(uniform_prefix(seed, stream, row), pos)


@functools.lru_cache(maxsize=1 << 14)
def uniform_prefix(seed: int, stream: int, row: int) -> int:
    """The hash of (seed, stream, row), the part of `uniform_int` shared by every position of a row: computed
    once per row (the vLLM engine core draws at every word start, and these five folds are most of a draw)."""
    h = _START
    for v in (seed & MASK32, (seed >> 32) & MASK32, stream, row & MASK32, (row >> 32) & MASK32):
        h = mix32_int(h ^ v)
    return h


def uniform_at(h: int, pos: int) -> float:
    """`uniform_int` at position `pos` from the row's `uniform_prefix` h: the last fold and the widening."""
    h = mix32_int(h ^ (pos & MASK32))
    hi = mix32_int(h ^ 0x5BD1E995) >> 5
    lo = mix32_int(h ^ 0x1B873593) >> 6
    return ((hi * (1 << 26) + lo) + 0.5) * (2.0 ** -53)


def filter_logits(logits_BV: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf (at least one token survives).

    The nucleus keeps the smallest set of most likely tokens whose probability reaches `top_p` (ties at the
    top-k threshold are all kept, as transformers does).
    """
    out = logits_BV
    if top_k and top_k > 0 and top_k < out.shape[-1]:
        kth_B1 = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(out, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        mass_before_BV = torch.cumsum(probs_BV, dim=-1) - probs_BV
        drop_sorted_BV = mass_before_BV >= top_p
        drop_sorted_BV[..., 0] = False
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
        out = out.masked_fill(drop_BV, float("-inf"))
    return out


def decoding_logprobs_BT(logits_BTV: torch.Tensor, ids_BT: torch.Tensor, temperature: float, top_k: int = 0,
                         top_p: float = 1.0) -> torch.Tensor:
    """Log-probability of each id under the distribution a decoding draws it from, `logits_BTV[b, t]` being
    the logits the id at (b, t) was drawn with: log_softmax of `filter_logits(logits / temperature)` (so -inf
    outside the top-k and the nucleus). Temperature 0 (greedy): 0 where the id is the filtered argmax, else -inf.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        best_BT = torch.argmax(filter_logits(logits_BTV, top_k, top_p), dim=-1)
        return torch.where(best_BT == ids_BT, 0.0, float("-inf")).to(logits_BTV.dtype)
    filtered_BTV = filter_logits(logits_BTV / temperature, top_k, top_p)
    return torch.log_softmax(filtered_BTV, dim=-1).gather(-1, ids_BT.unsqueeze(-1)).squeeze(-1)


def inverse_cdf(probs_BV: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """Index of the first token whose cumulative probability exceeds u * total (zero-mass ids never win)."""
    cdf_BV = torch.cumsum(probs_BV.to(torch.float64), dim=-1)
    x_B1 = (u_B.to(torch.float64) * cdf_BV[:, -1]).unsqueeze(-1)
    idx_B = torch.searchsorted(cdf_BV, x_B1, right=True).squeeze(-1)
    # u * total can round up to the total: fall back to the last id with mass.
    V = probs_BV.shape[-1]
    last_B = (V - 1) - torch.argmax(torch.flip(probs_BV > 0, dims=[-1]).to(torch.int8), dim=-1)
    return torch.where(idx_B >= V, last_B, torch.minimum(idx_B, last_B))


def sample_tokens(logits_BV: torch.Tensor, u_B: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from `logits_BV` with the uniforms `u_B`; return (ids_B, logprobs_B).

    `logprobs_B` is log_softmax(logits / T) at the drawn id (unfiltered; T = 1 when greedy). Temperature 0
    means greedy (argmax, the noise is unused).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    t = temperature if temperature > 0 else 1.0
    scaled_BV = logits_BV / t if t != 1.0 else logits_BV
    logp_BV = torch.log_softmax(scaled_BV, dim=-1)
    if temperature == 0:
        ids_B = torch.argmax(filter_logits(scaled_BV, top_k, top_p), dim=-1)
    else:
        filtered_BV = filter_logits(scaled_BV, top_k, top_p)
        if filtered_BV is scaled_BV:
            probs_BV = logp_BV.exp()
        else:
            probs_BV = torch.softmax(filtered_BV, dim=-1)
        ids_B = inverse_cdf(probs_BV, u_B)
    return ids_B, logp_BV.gather(-1, ids_B.unsqueeze(-1)).squeeze(-1)
