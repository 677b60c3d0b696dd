"""Teacher-forced log-probabilities of saved completions, in bounded memory.

One chunked implementation serves training (the KL-to-base diagnostic, `token_logprobs_B`) and the analysis
(`tandem.evaluation.teacher_forced_stats`, which needs whole distributions). A 150k vocabulary times every
position of a batch does not fit, so logits are never formed for a whole batch at once: rows are grouped
`batch_size` at a time (by length, right-padded so every row starts at position 0), the models return hidden
states, and the LM head is applied to at most `chunk_tokens` completion positions per row at a time.

Position P-1+t of a row with a P-token prompt predicts completion token t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch


def right_pad_BL(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_BL, attention_BL) of right-padded rows (naive: one list per row, padded with `pad_id`)."""
    L = max(len(s) for s in seqs)
    ids_BL = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    attn_BL = torch.zeros((len(seqs), L), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids_BL[b, :len(s)] = torch.tensor(list(s), dtype=torch.long)
        attn_BL[b, :len(s)] = 1
    return ids_BL, attn_BL


def completion_positions_BT(prompt_len_B: torch.Tensor, comp_len_B: torch.Tensor, width: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(pos_BT, mask_BT): the position that predicts completion token t of row b, and whether t is real.

    Naive: `pos[b][t] = P_b - 1 + t` for t < T_b; padding slots point at P_b - 1 (any valid position).
    """
    T = int(comp_len_B.max()) if comp_len_B.numel() else 0
    t_T = torch.arange(T, device=prompt_len_B.device)
    mask_BT = t_T[None, :] < comp_len_B[:, None]
    pos_BT = (prompt_len_B[:, None] - 1 + t_T[None, :]).clamp(max=width - 1)
    return torch.where(mask_BT, pos_BT, prompt_len_B[:, None] - 1), mask_BT


def hidden_and_head(model, input_ids_BL: torch.Tensor, attn_BL: torch.Tensor):
    """Final hidden states and the LM head, so logits are formed only where asked; models without the split
    return their logits and no head."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is not None and head is not None:
        return decoder(input_ids=input_ids_BL, attention_mask=attn_BL).last_hidden_state, head
    return model(input_ids=input_ids_BL, attention_mask=attn_BL).logits, None


def logp_at_BTV(hidden_or_logits_BLD: torch.Tensor, head, pos_BT: torch.Tensor,
                temperature: float = 1.0) -> torch.Tensor:
    """Float32 log_softmax(logits / temperature) at the gathered positions (the head applied when given)."""
    D = hidden_or_logits_BLD.shape[-1]
    x_BTD = hidden_or_logits_BLD.gather(1, pos_BT[..., None].expand(*pos_BT.shape, D))
    logits_BTV = head(x_BTD) if head is not None else x_BTD
    logits_BTV = logits_BTV.float()
    if temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    return logits_BTV.log_softmax(-1)


@dataclass
class LogpChunk:
    """Completion tokens `t0 .. t0 + n` of the rows `rows` (indices into the caller's lists).

    `logp_BTV[m]` is model m's log-distribution at those positions (None for a model given as None),
    `targets_BT` the completion tokens, `mask_BT` which (row, t) are real tokens.
    """

    rows: list[int]
    t0: int
    logp_BTV: list[torch.Tensor | None]
    targets_BT: torch.Tensor
    mask_BT: torch.Tensor


def iter_logp_chunks(models: Sequence, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                     batch_size: int = 32, pad_id: int = 0, chunk_tokens: int = 256, temperature: float = 1.0,
                     progress: Callable[[int], None] | None = None) -> Iterator[LogpChunk]:
    """Teacher-force every model on each (prompt, completion) and yield the log-distributions chunk by chunk.

    `models` entries may be None (skipped, e.g. "the senior is the base"); at least one must be a model.
    Rows with an empty completion yield nothing. `progress(n)` is called with the rows finished per batch.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if batch_size < 1 or chunk_tokens < 1:
        raise ValueError(f"batch_size and chunk_tokens must be >= 1, got {batch_size} and {chunk_tokens}")
    device = next(next(m for m in models if m is not None).parameters()).device
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]) + len(completion_ids[i]))
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        idx = [i for i in batch if len(completion_ids[i]) > 0]
        if idx:
            for p in (prompt_ids[i] for i in idx):
                if not p:
                    raise ValueError("every prompt needs at least one token (its last position predicts the first)")
            ids_BL, attn_BL = right_pad_BL([list(prompt_ids[i]) + list(completion_ids[i]) for i in idx], pad_id)
            ids_BL, attn_BL = ids_BL.to(device), attn_BL.to(device)
            P_B = torch.tensor([len(prompt_ids[i]) for i in idx], device=device)
            T_B = torch.tensor([len(completion_ids[i]) for i in idx], device=device)
            pos_BT, mask_BT = completion_positions_BT(P_B, T_B, ids_BL.shape[1])
            y_BT = ids_BL.gather(1, (pos_BT + 1).clamp(max=ids_BL.shape[1] - 1))
            states = [hidden_and_head(m, ids_BL, attn_BL) if m is not None else None for m in models]
            for t0 in range(0, pos_BT.shape[1], chunk_tokens):
                sl = slice(t0, t0 + chunk_tokens)
                yield LogpChunk(idx, t0, [logp_at_BTV(s[0], s[1], pos_BT[:, sl], temperature) if s is not None
                                          else None for s in states], y_BT[:, sl], mask_BT[:, sl])
        if progress is not None:
            progress(len(batch))


@torch.no_grad()
def token_logprobs_B(model, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                     temperature: float = 1.0, pad_id: int = 0, batch_size: int = 32,
                     chunk_tokens: int = 256) -> list[list[float]]:
    """Log-prob under `model` (logits / temperature) of every completion token, one list per row.

    Naive: for each row, one forward pass over prompt + completion and
    `log_softmax(logits[P - 1 + t] / temperature)[completion[t]]` for every t.
    """
    out: list[list[float]] = [[] for _ in prompt_ids]
    for ch in iter_logp_chunks([model], prompt_ids, completion_ids, batch_size, pad_id, chunk_tokens, temperature):
        lp_BT = ch.logp_BTV[0].gather(-1, ch.targets_BT[..., None]).squeeze(-1).cpu()
        n_B = ch.mask_BT.sum(-1).tolist()
        for b, i in enumerate(ch.rows):
            out[i].extend(lp_BT[b, :n_B[b]].tolist())
    return out
