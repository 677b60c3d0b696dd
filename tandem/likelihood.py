"""How likely a model is to write a reference solution under a decoding: a pass rate without sampling.

Sampled once per problem at the evaluation's decoding (temperature, top-k, nucleus), a model writes a given
reference solution with probability exp(sum of the decoding's log-probabilities of its tokens), computed
exactly from one teacher-forced forward pass (`tandem.rollout.sampling.decoding_logprobs_BT`). Summed over
the reference written in each style of the corpus (disjoint texts), it is the probability that one sample is
one of the reference solutions: a lower bound on that sample's pass rate (a sample can reach the right answer
by another text), with no sampling noise and no decoding loop. Its mean over problems follows solo pass@1 of
the evaluation across bases (docs/results.md), which greedy accuracy does not; the level stop of the tiny
base's pretraining can end on it (`model.pretrain_level_decoding: likelihood`).

    reference_pass_rate(model, tokenizer, messages, [[verbose, terse], ...], temperature=0.7, top_k=20, top_p=0.8)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Decoding:
    """The decoding whose draws are scored: temperature (0 = greedy), top-k (0 = off), nucleus mass (1 = off)."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0


def sequence_logprob_B(logits_BTV: torch.Tensor, labels_BT: torch.Tensor, decoding: Decoding) -> torch.Tensor:
    """Per row, the sum over scored positions (labels not -100, unshifted as `tandem.models.collate` writes
    them) of the decoding's log-probability of the label, read off the logits one position earlier."""
    from tandem.rollout.sampling import decoding_logprobs_BT

    logits = logits_BTV[:, :-1].float()
    target_BT = labels_BT[:, 1:]
    scored_BT = target_BT != -100
    lp_BT = decoding_logprobs_BT(logits, target_BT.clamp(min=0), decoding.temperature, decoding.top_k,
                                 decoding.top_p)
    return torch.where(scored_BT, lp_BT, torch.zeros_like(lp_BT)).sum(dim=-1)


def reference_logprobs(model, tokenizer, messages: Sequence[str], references: Sequence[Sequence[str]],
                       decoding: Decoding, batch_size: int = 64) -> list[list[float]]:
    """For each user message and each of its reference solutions (followed by the end of sequence), the log of
    the probability that one draw of `decoding` writes it (`sequence_logprob_B`; -inf where a token falls
    outside the decoding's top-k or nucleus), from right-padded batches of `batch_size` sequences."""
    from tandem.models import collate, encode_examples

    if len(messages) != len(references):
        raise ValueError(f"{len(messages)} messages but {len(references)} reference lists")
    if not messages or any(not refs for refs in references):
        raise ValueError("reference_logprobs needs at least one message and one reference per message")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    examples = encode_examples(tokenizer, [(m, ref) for m, refs in zip(messages, references) for ref in refs])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    flat: list[float] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for lo in range(0, len(examples), batch_size):
                batch = collate(examples[lo:lo + batch_size], pad)
                logits_BTV = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                flat += sequence_logprob_B(logits_BTV, batch["labels"], decoding).tolist()
    finally:
        model.train(was_training)
    out, at = [], 0
    for refs in references:
        out.append(flat[at:at + len(refs)])
        at += len(refs)
    return out


def reference_pass_rate(model, tokenizer, messages: Sequence[str], references: Sequence[Sequence[str]],
                        decoding: Decoding, batch_size: int = 64) -> dict:
    """For each user message, the probability that one draw of `decoding` writes one of its reference
    solutions: the sum over `references[i]` (distinct texts, so disjoint draws) of exp(`reference_logprobs`).
    Returns {"pass_rate": mean over messages, "per_problem": [...]}."""
    per = [sum(math.exp(lp) for lp in lps)
           for lps in reference_logprobs(model, tokenizer, messages, references, decoding, batch_size)]
    return {"pass_rate": sum(per) / len(per), "per_problem": per}
