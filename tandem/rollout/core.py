"""Rollout data types and the round driver shared by the catch-up engine and the lockstep reference.

A *round* advances every unfinished row by exactly one token, written by that row's current author. The
driver owns the shared token history (left-padded prompts, then the completion), the schedule, EOS/budget/
rounds handling and the per-token records; a backend only proposes the next token of each active row.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tandem.rollout.sampling import STREAM_SAMPLE, sample_tokens, uniform
from tandem.rollout.schedule import Schedule

FINISH_EOS, FINISH_LENGTH, FINISH_ROUNDS = "eos", "length", "rounds"
_FINISH_NAMES = {1: FINISH_EOS, 2: FINISH_LENGTH, 3: FINISH_ROUNDS}


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings. Training: the trainer's temperature, top_p 1, top_k 0 (log-probs then match trl).

    `temperature` 0 means greedy. `stop_token_ids` end a row like EOS does (finish reason "eos").
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class RolloutBatch:
    """One engine call's output, one entry per input row, in input order."""

    completion_ids: list[list[int]]     # per row, EOS included if emitted
    owner: list[list[int]]              # 1 senior, 0 junior, same lengths
    senior_logprobs: list[list[float]]  # senior's log_softmax(logits/T) on its tokens, 0.0 on junior tokens
    handoffs: list[int]                 # author changes inside the completion
    finish_reason: list[str]            # "eos" | "length" | "rounds"
    timings: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.completion_ids)

    def stats(self) -> dict:
        """Batch diagnostics: senior token share, handoffs per 100 tokens, mean authorship run, mean length."""
        n_tok = sum(len(c) for c in self.completion_ids)
        n_sen = sum(sum(o) for o in self.owner)
        n_hand = sum(self.handoffs)
        n_runs = sum(h + 1 for h, c in zip(self.handoffs, self.completion_ids) if c)
        rows = max(len(self.completion_ids), 1)
        return {
            "senior_fraction": n_sen / n_tok if n_tok else 0.0,
            "handoffs_per_100": 100.0 * n_hand / n_tok if n_tok else 0.0,
            "mean_run_length": n_tok / n_runs if n_runs else 0.0,
            "mean_length": n_tok / rows,
            "tokens": n_tok,
            "eos_fraction": sum(r == FINISH_EOS for r in self.finish_reason) / rows,
        }

    @staticmethod
    def scatter(n_rows: int, parts: Sequence[tuple[Sequence[int], "RolloutBatch"]]) -> "RolloutBatch":
        """One batch of `n_rows` rows from parts generated for row groups: `(rows, part)` puts part's j-th row
        at row `rows[j]` (timings are the caller's to set)."""
        out = RolloutBatch([None] * n_rows, [None] * n_rows, [None] * n_rows, [0] * n_rows,  # type: ignore[list-item]
                           [""] * n_rows)
        for rows, part in parts:
            for j, i in enumerate(rows):
                out.completion_ids[i] = part.completion_ids[j]
                out.owner[i] = part.owner[j]
                out.senior_logprobs[i] = part.senior_logprobs[j]
                out.handoffs[i] = part.handoffs[j]
                out.finish_reason[i] = part.finish_reason[j]
        return out

    @staticmethod
    def concat(parts: Sequence["RolloutBatch"]) -> "RolloutBatch":
        out = RolloutBatch([], [], [], [], [])
        for p in parts:
            out.completion_ids += p.completion_ids
            out.owner += p.owner
            out.senior_logprobs += p.senior_logprobs
            out.handoffs += p.handoffs
            out.finish_reason += p.finish_reason
            for k, v in p.timings.items():
                out.timings[k] = out.timings.get(k, 0.0) + v
        return out


def count_handoffs(owner: Sequence[int]) -> int:
    return sum(1 for a, b in zip(owner, owner[1:]) if a != b)


def left_pad(prompt_ids: Sequence[Sequence[int]], total_len: int, pad_id: int = 0,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, int]:
    """History buffer [B, total_len] with prompts right-aligned at column Pmax; returns (hist, offsets, Pmax).

    Column (slot) `s` of row b holds history position `s - offset_b`; completion position t sits at slot
    Pmax + t for every row, so rounds advance all rows in step.
    """
    lens = [len(p) for p in prompt_ids]
    if not lens or min(lens) < 1:
        raise ValueError("every prompt needs at least one token (a BOS or chat-template prefix)")
    p_max = max(lens)
    hist_BS = torch.full((len(prompt_ids), total_len), pad_id, dtype=torch.int64)
    for b, p in enumerate(prompt_ids):
        hist_BS[b, p_max - len(p):p_max] = torch.as_tensor(list(p), dtype=torch.int64)
    off_B = torch.as_tensor([p_max - n for n in lens], dtype=torch.int64)
    return hist_BS.to(device), off_B.to(device), p_max


@dataclass
class Rounds:
    """What a round driver sets up before the first round: the left-padded history on `device`, the row ids,
    the schedule and one started stepper per model that writes (1 senior, 0 junior)."""

    hist_BS: torch.Tensor
    off_B: torch.Tensor
    p_max: int
    rows_B: torch.Tensor
    sched: Schedule
    device: torch.device
    steppers: dict[int, Any]

    def release(self) -> None:
        for st in self.steppers.values():
            st.release()


def start_rounds(pair: Any, request: Any, device: torch.device | str | None,
                 make_stepper: Callable[[Any], Any]) -> Rounds:
    """The set-up shared by the catch-up kernel and the lockstep reference for one `RolloutRequest` over a
    `ModelPair`: history buffer, schedule, and `make_stepper(model)` for each model the schedule needs,
    started on the history (`stepper.start(hist_BS, off_B, p_max)`). `device` None = the senior's."""
    s = request.settings
    dev = torch.device(device) if device is not None else next(pair.senior.parameters()).device
    total = max(len(p) for p in request.prompts) + s.sampling.max_new_tokens
    hist_BS, off_B, p_max = left_pad(request.prompts, total, device=dev)
    rows_B = torch.as_tensor(list(request.row_ids), dtype=torch.int64, device=dev)
    sched = Schedule(s.schedule, pair.tables.to(dev), request.seed, rows_B)
    steppers: dict[int, Any] = {}
    if s.needs_senior:
        steppers[1] = make_stepper(pair.senior)
    if s.needs_junior:
        if pair.junior is None:
            raise ValueError(f"schedule {s.schedule.kind!r} needs a junior model")
        steppers[0] = make_stepper(pair.junior)
    for st in steppers.values():
        st.start(hist_BS, off_B, p_max)
    return Rounds(hist_BS, off_B, p_max, rows_B, sched, dev, steppers)


# propose(t, slot, active_B, author_B, hist_BS) -> (tokens_B, senior_logprobs_B), values at active rows only
Proposer = Callable[[int, int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def sample_rows(logits_RV: torch.Tensor, sampling: SamplingParams, seed: int, row_ids_R: torch.Tensor,
                t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample position t of rows R with the noise of (seed, row id, t)."""
    u_R = uniform(seed, STREAM_SAMPLE, row_ids_R, t)
    return sample_tokens(logits_RV, u_R.to(logits_RV.device), sampling.temperature, sampling.top_k,
                         sampling.top_p)


def run_rounds(hist_BS: torch.Tensor, p_max: int, sched: Schedule, sampling: SamplingParams,
               eos_ids: Sequence[int], propose: Proposer, progress: bool = False) -> RolloutBatch:
    """Drive rounds until every row hit EOS, the token budget or the rounds cap; collect per-token records."""
    B, T = hist_BS.shape[0], sampling.max_new_tokens
    dev = hist_BS.device
    eos_E = torch.as_tensor(sorted(set(int(e) for e in eos_ids)), dtype=torch.int64, device=dev)
    done_B = torch.zeros(B, dtype=torch.bool, device=dev)
    finish_B = torch.zeros(B, dtype=torch.int64, device=dev)
    length_B = torch.zeros(B, dtype=torch.int64, device=dev)
    owner_BT = torch.zeros(B, T, dtype=torch.int64, device=dev)
    logp_BT = torch.zeros(B, T, dtype=torch.float64, device=dev)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=T, desc="rollout", leave=False)
    for t in range(T):
        active_B = ~done_B
        if not bool(active_B.any()):
            break
        slot = p_max + t
        author_B = sched.author_B
        tok_B, lp_B = propose(t, slot, active_B, author_B, hist_BS)
        tok_B = torch.where(active_B, tok_B, hist_BS[:, slot])
        hist_BS[:, slot] = tok_B
        owner_BT[:, t] = (author_B & active_B).to(torch.int64)
        logp_BT[:, t] = torch.where(active_B & author_B, lp_B.to(torch.float64), 0.0)
        length_B += active_B.to(torch.int64)
        rounds_B = sched.advance(tok_B, t) & active_B
        eos_B = torch.isin(tok_B, eos_E) & active_B if eos_E.numel() else torch.zeros_like(active_B)
        last = t + 1 == T
        new_finish_B = torch.where(eos_B, 1, torch.where(torch.full_like(eos_B, last), 2,
                                                         torch.where(rounds_B, 3, 0)))
        new_finish_B = torch.where(active_B, new_finish_B, 0)
        finish_B = torch.where(new_finish_B > 0, new_finish_B, finish_B)
        done_B = done_B | (new_finish_B > 0)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    lengths = length_B.tolist()
    comp = hist_BS[:, p_max:p_max + T].tolist()
    owners, lps = owner_BT.tolist(), logp_BT.tolist()
    ids_out, own_out, lp_out, hand, fin = [], [], [], [], []
    for b, n in enumerate(lengths):
        ids_out.append(comp[b][:n])
        own_out.append(owners[b][:n])
        lp_out.append(lps[b][:n])
        hand.append(count_handoffs(own_out[-1]))
        fin.append(_FINISH_NAMES.get(int(finish_B[b]), FINISH_LENGTH))
    return RolloutBatch(ids_out, own_out, lp_out, hand, fin)


def _eos_list(x: Any) -> list[int]:
    if x is None:
        return []
    if isinstance(x, int):
        return [x]
    return [int(i) for i in x]


def collect_eos_ids(tokenizer: Any, *models: Any) -> list[int]:
    """EOS ids: the tokenizer's plus every model's generation/config EOS (either model may end a rollout)."""
    ids = set(_eos_list(getattr(tokenizer, "eos_token_id", None)))
    for m in models:
        if m is None:
            continue
        if isinstance(m, (str, os.PathLike)):  # a model directory (the vLLM service loads it itself)
            for name in ("generation_config.json", "config.json"):
                f = Path(m) / name
                if f.is_file():
                    ids |= set(_eos_list(json.loads(f.read_text()).get("eos_token_id")))
            continue
        gc = getattr(m, "generation_config", None)
        ids |= set(_eos_list(getattr(gc, "eos_token_id", None)))
        ids |= set(_eos_list(getattr(getattr(m, "config", None), "eos_token_id", None)))
    return sorted(ids)
