"""The GRPO objective that training optimises, written out as small pure tensor functions.

trl's `GRPOTrainer` computes the loss during training (`tandem/train/` feeds it rollouts and rewards); this
module states the same maths so a reader sees it without opening trl, and `tests/test_grpo.py` checks it
against trl's own `compute_loss` on one batch, so a trl upgrade that changes the objective fails a test.
With the settings `tandem.train.grpo_config` passes (scale_rewards "group", loss_type "dapo", one
optimisation pass per rollout batch, one process, no gradient accumulation):

    advantages_B  = (r_b - mean(group of b)) / (std(group of b) + 1e-4)          std with Bessel's correction
    ratio_BT      = exp(logp_BT - old_logp_BT)                                     old = the sampling policy
    objective_BT  = -min(ratio * A_b, clip(ratio, 1 - eps_low, 1 + eps_high) * A_b) + beta * ratio * k3_kl_BT
    loss_mask_BT  = completion_mask_BT & (owner_BT == SENIOR)                      junior tokens get no gradient
    loss          = sum(objective_BT * loss_mask_BT) / sum(loss_mask_BT)           token mean over the batch

The KL term (kl_reg arm only) is weighted by the importance ratio: trl 1.16's `use_bias_correction_kl`
defaults to True and the project keeps it, which makes the KL gradient the unbiased reverse-KL gradient
(DeepSeek-V3.2); the ratio is 1 in value on-policy but still carries a gradient.

`logp_BT` are log-probabilities of the sampled tokens under the current senior at the sampling temperature
(log_softmax(logits / T)); trl recomputes them from the model, the engine records `old_logp_BT` while
sampling. Axes: B rows (prompts x group), T completion positions, G group size.
"""

from __future__ import annotations

import torch

SENIOR = 1  # owner id of a senior token (0 = junior), as in tandem.rollout
STD_EPS = 1e-4  # trl adds it to the group std before dividing


def group_advantages_B(rewards_B: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """Group-normalised advantages of rewards laid out group by group (rows b*G .. b*G + G - 1 share a prompt).

    `scale`: "group" divides by each group's std + 1e-4 (the project's setting), "batch" by the whole batch's
    std + 1e-4, "none" only subtracts the group mean. Naive equivalent::

        for g in range(0, B, G):
            grp = rewards[g:g + G]
            mu, sd = statistics.mean(grp), statistics.stdev(grp)
            adv[g:g + G] = [(r - mu) / (sd + 1e-4) for r in grp]
    """
    B = rewards_B.shape[0]
    if group_size < 1 or B % group_size:
        raise ValueError(f"{B} rewards do not split into groups of {group_size}")
    r_PG = rewards_B.reshape(-1, group_size)
    centred_B = (r_PG - r_PG.mean(-1, keepdim=True)).reshape(B)
    if scale == "none":
        return centred_B
    if scale == "group":
        std_B = (r_PG.std(-1, unbiased=True, keepdim=True).expand_as(r_PG).reshape(B) if group_size > 1
                 else torch.zeros_like(rewards_B))
    elif scale == "batch":
        std_B = rewards_B.std(unbiased=True).expand(B) if B > 1 else torch.zeros_like(rewards_B)
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return centred_B / (std_B + STD_EPS)


def loss_mask_BT(completion_mask_BT: torch.Tensor, owner_BT: torch.Tensor) -> torch.Tensor:
    """1.0 where a real completion token was written by the senior, else 0.0 (naive: `m and o == SENIOR`)."""
    return (completion_mask_BT.bool() & (owner_BT == SENIOR)).float()


def clipped_objective_BT(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages_B: torch.Tensor,
                         epsilon_low: float = 0.2, epsilon_high: float | None = None) -> torch.Tensor:
    """PPO's clipped surrogate per token, negated into a loss.

    Naive equivalent, per (b, t): `ratio = exp(lp - old)`; `-min(ratio * A[b], clip(ratio, 1 - lo, 1 + hi) * A[b])`.
    With `old_logp == logp` (on-policy, one pass) the value is -A[b] and the gradient that of -A[b] * logp.
    """
    hi = epsilon_low if epsilon_high is None else epsilon_high
    ratio_BT = torch.exp(logp_BT - old_logp_BT)
    adv_B1 = advantages_B.unsqueeze(-1)
    return -torch.minimum(ratio_BT * adv_B1, torch.clamp(ratio_BT, 1 - epsilon_low, 1 + hi) * adv_B1)


def k3_kl_BT(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per sampled token: exp(d) - d - 1 with d = ref - logp.

    Naive equivalent: `[[math.exp(r - l) - (r - l) - 1 for l, r in zip(lrow, rrow)] for ...]`. Unbiased for
    KL(pi || ref) when the tokens are sampled from pi, and >= 0 for every token. trl's KL penalty uses the same.
    """
    d_BT = ref_logp_BT - logp_BT
    return torch.exp(d_BT) - d_BT - 1.0


def token_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean over the masked tokens of the whole batch ("dapo" aggregation): long completions weigh more.

    Naive: `sum(v * m for all b, t) / max(sum(m), 1)`.
    """
    return (values_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1.0)


def grpo_loss(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages_B: torch.Tensor,
              mask_BT: torch.Tensor, epsilon: float = 0.2, beta: float = 0.0,
              ref_logp_BT: torch.Tensor | None = None, kl_bias_correction: bool = True) -> torch.Tensor:
    """The scalar loss of one batch: token mean over `mask_BT` of the clipped objective plus, when beta > 0,
    beta * k3 KL to the reference (times the importance ratio when `kl_bias_correction`, trl's default)."""
    per_token_BT = clipped_objective_BT(logp_BT, old_logp_BT, advantages_B, epsilon)
    if beta != 0.0:
        if ref_logp_BT is None:
            raise ValueError("beta != 0 needs the reference model's log-probs (ref_logp_BT)")
        kl_BT = k3_kl_BT(logp_BT, ref_logp_BT)
        if kl_bias_correction:
            kl_BT = kl_BT * torch.exp(logp_BT - old_logp_BT)
        per_token_BT = per_token_BT + beta * kl_BT
    return token_mean(per_token_BT, mask_BT)
