"""Legibility of the senior's text to the junior: teacher-forced cross-entropy and distribution overlap.

Inputs are log-probabilities over the vocabulary at the completion positions (`logp_BTV`, natural log,
temperature 1) and the completion tokens `targets_BT`; `mask_BT` marks real (non-padding) positions.
"""

from __future__ import annotations

import torch


def token_nll_BT(logp_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """-log p(y_t | h_t) of each target token, in nats (naive: `-logp[b, t, targets[b, t]]` in a loop)."""
    return -logp_BTV.gather(-1, targets_BT.long().unsqueeze(-1)).squeeze(-1)


def overlap_BT(logp_a_BTV: torch.Tensor, logp_b_BTV: torch.Tensor) -> torch.Tensor:
    """sum_v min(p_a(v), p_b(v)) at each position = 1 - total variation (naive: loop over v).

    1 when the two distributions are identical, 0 when their supports are disjoint.
    """
    return torch.minimum(logp_a_BTV, logp_b_BTV).exp().sum(-1)


def masked_row_mean_B(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean of each row over its masked-in positions; NaN for a row with none (naive: per-row Python mean)."""
    m = mask_BT.to(x_BT.dtype)
    count_B = m.sum(-1)
    total_B = (x_BT * m).sum(-1)
    return torch.where(count_B > 0, total_B / count_B.clamp_min(1), torch.full_like(total_B, float("nan")))
