"""Turn planning for the vLLM rollout service: which tokens each vLLM request may decode, and which it keeps.

Pure Python over the schedule state machine (`schedule.RowSchedule`); no vLLM import, so it runs (and is
tested) in the pipeline's environment and inside the service's own vLLM environment alike. The service
(`tandem/rollout/vllm_service.py`) calls `run_turns` with a function that runs one batched `LLM.generate`
per model.

How a rollout runs. Every row is a turn-based loop. In each round, every active row gets one *turn* from its
current author; each model runs ONE batched generate over the rows it authors, each request's prompt being
the row's full token history as ids (prompt + every token so far, whoever wrote it). Automatic prefix caching
finds the history's cached prefix, so only the partner's tokens since this model's last turn (and the last
partial KV block) are prefilled: that is the catch-up.

No decoded token is thrown away. Each turn is asked to stop exactly where authorship *may* change, using
vLLM's own stop conditions, so the last decoded token is the last one the turn may keep:
- `word`: stop at every word-start token (`stop_token_ids` = the word-start table plus EOS) and at the gap
  cap (`max_tokens` = tokens left before the `max_gap_tokens` redraw). The redraw after that token may pick
  the same author again (probability `p_senior` for the senior): the row then simply gets another turn from
  the same model next round, whose prompt is fully cached but for the last partial block.
- `token`: the redraw noise is a pure function of (seed, row, position), so the run length is known before
  decoding: `max_tokens` = positions until the first redraw that picks the other model (pre-drawn handoff).
- `step`: stop at tokens that can end a step (a blank-line token, or any token starting with a newline, the
  second half of a two-token blank line); a newline that did not complete a blank line just continues.
- `solo` / `junior`: one turn per row, the whole budget.
Every turn also stops at EOS and at the remaining budget. `walk_turn` replays the schedule over the returned
tokens and cuts after the first token that ends the row or hands authorship over; with the stops above that
is always the last token, which the service checks (`decoded` vs `kept` in its statistics).

Sampling noise is vLLM's own, seeded per request from (seed, row, turn start): reproducible on one setup and
one vLLM version, not token-identical to the `hf` backend (same distribution).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from tandem.rollout.core import FINISH_EOS, FINISH_LENGTH, FINISH_ROUNDS, RolloutBatch, count_handoffs
from tandem.rollout.sampling import STREAM_REDRAW, mix32_int, uniform_int
from tandem.rollout.schedule import RowSchedule
from tandem.rollout.vocab import TokenTables

STREAM_VLLM_SEED = 3


def request_seed(seed: int, row_id: int, t: int) -> int:
    """Per-request vLLM seed for the turn of row `row_id` starting at completion position t (31-bit)."""
    h = 0x243F6A88
    for v in (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, STREAM_VLLM_SEED, row_id & 0xFFFFFFFF, t & 0xFFFFFFFF):
        h = mix32_int(h ^ v)
    return h & 0x7FFFFFFF


def walk_turn(state: RowSchedule, tokens: Sequence[int], t0: int, budget: int, eos: set[int]
              ) -> tuple[int, str | None]:
    """How many of a turn's `tokens` (starting at completion position t0) to keep, and the finish reason if the
    row ends within them. Advances `state` over the kept tokens.

    Keeps tokens up to and including the first one that ends the row (EOS, budget, rounds cap) or hands
    authorship to the other model; a turn may also end without either (a stop token after which the redraw
    picked the same author, or vLLM's `max_tokens`).
    """
    author = state.author
    for i, tok in enumerate(tokens):
        t = t0 + i
        rounds_done = state.advance(int(tok), t)
        if int(tok) in eos:
            return i + 1, FINISH_EOS
        if t + 1 >= budget:
            return i + 1, FINISH_LENGTH
        if rounds_done:
            return i + 1, FINISH_ROUNDS
        if state.author != author:
            return i + 1, None
    return len(tokens), None


@dataclass(frozen=True)
class Turn:
    """One vLLM request: decode at most `max_tokens`, stopping after any token of the named stop set."""

    max_tokens: int
    stops: str  # "eos" | "word" | "step": which stop-id set (always including EOS)


def token_run_length(state: RowSchedule, t0: int, limit: int) -> int:
    """`token` schedule: tokens the current author writes from position t0 before the redraw hands over
    (capped at `limit`). The redraw after position t is uniform(seed, REDRAW, row, t) < p_senior."""
    for i in range(limit):
        drawn = int(uniform_int(state.seed, STREAM_REDRAW, state.row_id, t0 + i) < state.p_senior)
        if drawn != state.author:
            return i + 1
    return limit


def plan_turn(state: RowSchedule, t0: int, left: int) -> Turn:
    """The request for the next turn of a row at completion position t0 with `left` tokens of budget."""
    kind = state.kind
    if kind in ("word", "token") and state.p_senior in (0.0, 1.0):
        return Turn(left, "eos")  # every redraw picks the same author: one turn
    if kind == "word":
        return Turn(max(1, min(left, state.max_gap - state.gap)), "word")
    if kind == "token":
        return Turn(token_run_length(state, t0, left), "eos")
    if kind == "step":
        return Turn(left, "step")
    return Turn(left, "eos")


def stop_sets(tables: TokenTables, eos_ids: Sequence[int]) -> dict[str, list[int]]:
    """Stop-id sets per `Turn.stops`: EOS alone, word starts + EOS, possible step ends + EOS."""
    eos = sorted({int(e) for e in eos_ids})
    word = tables.word_start_V.nonzero().flatten().tolist()
    step = (tables.step_end_V | tables.starts_newline_V).nonzero().flatten().tolist()
    return {"eos": eos, "word": sorted(set(word) | set(eos)), "step": sorted(set(step) | set(eos))}


# generate_turns(author, requests) -> [(tokens, logprobs or None)], one per request, in order.
# A request is (history_ids, Turn, vllm_seed, want_logprobs).
TurnRunner = Callable[[int, list[tuple[list[int], Turn, int, bool]]], list[tuple[list[int], list[float] | None]]]


def run_turns(prompts: list[list[int]], rows: list[int], schedule: str, tables: TokenTables, budget: int,
              seed: int, eos: Sequence[int], p_senior: float, max_gap_tokens: int, max_rounds: int,
              generate_turns: TurnRunner) -> tuple[RolloutBatch, dict]:
    """Roll out every prompt with turns; returns the batch and {decoded, kept, turns, rounds} counts."""
    B, eos_set = len(prompts), {int(e) for e in eos}
    states = [RowSchedule(schedule, tables, seed, r, p_senior, max_gap_tokens, max_rounds) for r in rows]
    comp: list[list[int]] = [[] for _ in range(B)]
    owner: list[list[int]] = [[] for _ in range(B)]
    logp: list[list[float]] = [[] for _ in range(B)]
    finish: list[str | None] = [None] * B
    stats = {"decoded": 0, "kept": 0, "turns": 0, "rounds": 0}
    while any(f is None for f in finish):
        stats["rounds"] += 1
        for m in (1, 0):
            todo = [b for b in range(B) if finish[b] is None and states[b].author == m]
            if not todo:
                continue
            reqs = []
            for b in todo:
                t0 = len(comp[b])
                reqs.append((list(prompts[b]) + comp[b], plan_turn(states[b], t0, budget - t0),
                             request_seed(seed, rows[b], t0), m == 1))
            outs = generate_turns(m, reqs)
            if len(outs) != len(todo):
                raise RuntimeError(f"vllm service: {len(outs)} turn results for {len(todo)} requests")
            for b, (toks, lps) in zip(todo, outs):
                toks = [int(x) for x in toks]
                t0 = len(comp[b])
                n, why = walk_turn(states[b], toks, t0, budget, eos_set)
                if n == 0 and why is None:
                    raise RuntimeError(f"vllm service: empty turn for row {rows[b]} at position {t0}")
                stats["decoded"] += len(toks)
                stats["kept"] += n
                stats["turns"] += 1
                comp[b] += toks[:n]
                owner[b] += [m] * n
                if m == 1:
                    if lps is None or len(lps) < n:
                        raise RuntimeError("vllm service: the senior's turn came back without log-probs")
                    logp[b] += [float(x) for x in lps[:n]]
                else:
                    logp[b] += [0.0] * n
                finish[b] = why
    batch = RolloutBatch(comp, owner, logp, [count_handoffs(o) for o in owner],
                         [f or FINISH_LENGTH for f in finish])
    return batch, stats
