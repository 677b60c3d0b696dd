"""Drift of a trained senior from the base: per-token KL, per-token log-ratio, per-type aggregation.

`logp_s_BTV` / `logp_b_BTV` are the senior's and the base's log-probabilities (natural log, temperature 1) at
the positions of the senior's own completions; `targets_BT` the sampled tokens; `mask_BT` real positions.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def kl_BT(logp_p_BTV: torch.Tensor, logp_q_BTV: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_v p(v) (log p(v) - log q(v)) at each position, in nats (naive: loop over v).

    Terms with p(v) = 0 contribute 0 (the 0 log 0 convention), also where q(v) = 0.
    """
    p_BTV = logp_p_BTV.exp()
    diff_BTV = torch.where(p_BTV > 0, logp_p_BTV - logp_q_BTV, torch.zeros_like(p_BTV))
    return (p_BTV * diff_BTV).sum(-1)


def token_logratio_BT(logp_p_BTV: torch.Tensor, logp_q_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """log p(y_t) - log q(y_t) for the sampled token y_t (naive: index both tables in a loop)."""
    idx = targets_BT.long().unsqueeze(-1)
    return (logp_p_BTV.gather(-1, idx) - logp_q_BTV.gather(-1, idx)).squeeze(-1)


def per_type_sums_V(values_BT: torch.Tensor, targets_BT: torch.Tensor, mask_BT: torch.Tensor,
                    vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and count of `values_BT` grouped by token type `targets_BT` over masked-in positions.

    Naive: a dict token -> (sum, count) filled by a loop over positions. Returns float64 sums and int64 counts.
    """
    m = mask_BT.bool()
    ids = targets_BT[m].long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"per_type_sums_V: token ids must lie in [0, {vocab_size}), "
                         f"got [{int(ids.min())}, {int(ids.max())}]")
    sum_V = torch.zeros(vocab_size, dtype=torch.float64).index_add_(0, ids, values_BT[m].double())
    count_V = torch.zeros(vocab_size, dtype=torch.int64).index_add_(0, ids, torch.ones_like(ids))
    return sum_V, count_V


def top_types(sum_V: torch.Tensor, count_V: torch.Tensor, k: int, min_count: int = 1) -> list[int]:
    """Token ids with at least `min_count` occurrences ranked by mean value (sum/count), descending; at most k.

    Ties break by the smaller id, so the ranking is deterministic. Naive: sort a list of (-mean, id).
    """
    ok_V = count_V >= max(min_count, 1)
    ids = torch.nonzero(ok_V).flatten().tolist()
    means = (sum_V[ok_V] / count_V[ok_V]).tolist()
    order = sorted(zip(means, ids), key=lambda t: (-t[0], t[1]))
    return [i for _, i in order[:k]]


def quantiles(values: np.ndarray, qs: Sequence[float]) -> dict[str, float | None]:
    """Linear-interpolation quantiles keyed by the quantile's string form; None for an empty array."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return {str(q): None for q in qs}
    return {str(q): float(np.quantile(values, q)) for q in qs}


def histogram_counts(values: np.ndarray, edges: np.ndarray) -> list[int]:
    """Counts in bins [e_i, e_{i+1}) (the last bin closed and also holding every value above the top edge).

    Values below the first edge go to the first bin (KL is >= 0 but float error can make it -1e-9).
    Naive: for each value, find its bin by a linear scan.
    """
    values = np.asarray(values, dtype=np.float64)
    edges = np.asarray(edges, dtype=np.float64)
    n_bins = len(edges) - 1
    if n_bins < 1:
        raise ValueError("histogram_counts needs at least two edges")
    idx = np.searchsorted(edges, values, side="right") - 1
    idx = np.clip(idx, 0, n_bins - 1)
    return np.bincount(idx, minlength=n_bins).astype(int).tolist()
