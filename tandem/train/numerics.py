"""Small pure tensor functions of training: the k3 KL, the zero-variance share, teacher-forced log-probs, a weights hash."""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch


def k3_kl_BT(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per sampled token: exp(d) - d - 1 with d = ref - logp.

    Naive equivalent: `[[math.exp(r - l) - (r - l) - 1 for l, r in zip(lrow, rrow)] for ...]`. Unbiased for
    KL(pi || ref) when the tokens are sampled from pi, and >= 0 for every token. trl's KL penalty uses the same.
    """
    d_BT = ref_logp_BT - logp_BT
    return torch.exp(d_BT) - d_BT - 1.0


def zero_variance_fraction(rewards_B: Sequence[float], group_size: int) -> float:
    """Share of prompt groups (consecutive runs of `group_size` rewards) whose rewards are all equal.

    Such groups have zero advantage everywhere: they cost compute and teach nothing.
    """
    if group_size < 1 or len(rewards_B) % group_size:
        raise ValueError(f"{len(rewards_B)} rewards do not split into groups of {group_size}")
    groups = [rewards_B[i:i + group_size] for i in range(0, len(rewards_B), group_size)]
    return sum(max(g) == min(g) for g in groups) / max(len(groups), 1)


@torch.no_grad()
def token_logprobs_B(model, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                     temperature: float, pad_id: int) -> list[list[float]]:
    """Log-prob under `model` (logits / temperature) of every completion token, one list per row.

    Rows are right-padded so every row starts at position 0 (no position shift from padding).
    """
    seqs = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
    width = max(len(s) for s in seqs)
    ids_BT = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn_BT = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids_BT[b, :len(s)] = torch.tensor(s)
        attn_BT[b, :len(s)] = 1
    device = next(model.parameters()).device
    logits_BTV = model(input_ids=ids_BT.to(device), attention_mask=attn_BT.to(device)).logits.float()
    logp_BTV = torch.log_softmax(logits_BTV / temperature, dim=-1)
    out = []
    for b, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        pos_T = torch.arange(len(p) - 1, len(p) + len(c) - 1, device=device)
        tgt_T = torch.tensor(list(c), dtype=torch.long, device=device)
        out.append(logp_BTV[b, pos_T, tgt_T].tolist())
    return out


def weights_hash(model) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes) in name order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

