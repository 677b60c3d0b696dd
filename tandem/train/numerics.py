"""Small pure functions of training: the zero-variance share and a weights hash (the k3 KL lives in tandem.grpo,
teacher-forced log-probs in tandem.logprobs)."""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch



def zero_variance_fraction(rewards_B: Sequence[float], group_size: int) -> float:
    """Share of prompt groups (consecutive runs of `group_size` rewards) whose rewards are all equal.

    Such groups have zero advantage everywhere: they cost compute and teach nothing.
    """
    if group_size < 1 or len(rewards_B) % group_size:
        raise ValueError(f"{len(rewards_B)} rewards do not split into groups of {group_size}")
    groups = [rewards_B[i:i + group_size] for i in range(0, len(rewards_B), group_size)]
    return sum(max(g) == min(g) for g in groups) / max(len(groups), 1)


def weights_hash(model) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes) in name order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

