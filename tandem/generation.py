"""One generation-and-scoring path: the base stage's accuracy, train-time validation and the evaluate stage.

    settings = RolloutSettings(ScheduleSpec("solo"), sampling)
    records = generate_and_score(engine, tokenizer, rows, settings, Draws(8, seed=0), score_fn=...)
    accuracy(model, tokenizer, messages, golds, SoloDecode(temperature=0.0))   # solo accuracy of one model

Every caller samples through `tandem.rollout.engine.TandemEngine` (built by `tandem.rollout.factory`), whose
noise is counter-based (`tandem.rollout.sampling`): each draw is a function of (seed, row id, position), and a
row's id is its index in the problem-major expansion (problem 0 samples 0..n-1, problem 1, ...). So the
accuracies in `metrics/base.json`, the validation curve and `metrics/eval.json` come from the same sampler,
and a result does not depend on how rows are split into batches (up to floating-point effects of batch shape).
Scoring is `tandem.rewards.score_many` unless a `score_fn` is given.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from tandem.rollout.core import SamplingParams
from tandem.rollout.request import RolloutSettings
from tandem.rollout.schedule import ScheduleSpec

ScoreFn = Callable[[list[str], list[str]], list[float]]


@dataclass(frozen=True)
class Draws:
    """How many completions each row gets and the seed they are drawn from."""

    n_samples: int = 1
    seed: int = 0


@dataclass(frozen=True)
class SoloDecode:
    """How `accuracy` decodes: greedy when `temperature` is 0 (one sample per message), else temperature sampling
    (nucleus `top_p` and `top_k` where set; 1.0 and 0 = off) with `n_samples` per message; `batch_size` rows per
    generation call."""

    max_new_tokens: int = 160
    temperature: float = 0.0
    batch_size: int = 64
    seed: int = 0
    n_samples: int = 1
    top_p: float = 1.0
    top_k: int = 0


def stable_seed(*parts: Any) -> int:
    """A 31-bit seed derived from `parts` (same on every machine and Python run, unlike `hash`)."""
    return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:4], "big") & 0x7FFFFFFF


def encode_prompts(rows: Sequence[dict], tokenizer) -> list[list[int]]:
    """Token ids of each row's rendered prompt (chat template when the tokenizer has one, no extra specials)."""
    from tandem.data.prompts import render_prompt

    return [list(tokenizer(render_prompt(r["prompt"], tokenizer), add_special_tokens=False)["input_ids"])
            for r in rows]


def cut_at_eos(ids: Sequence[int], owner: Sequence[int], eos_ids: Iterable[int]) -> tuple[list[int], list[int]]:
    """Keep tokens up to and including the first EOS (a defensive cut; engines normally stop there)."""
    eos = set(eos_ids)
    for i, t in enumerate(ids):
        if t in eos:
            return list(ids[: i + 1]), list(owner[: i + 1])
    return list(ids), list(owner)


def eos_token_ids(tokenizer, model=None) -> list[int]:
    """EOS ids of the tokenizer and the model's generation config and config: where the engine stops too."""
    from tandem.rollout.core import collect_eos_ids

    return collect_eos_ids(tokenizer, model)


def default_score_fn(workers: int = 1, timeout: float = 5.0) -> ScoreFn:
    """`tandem.rewards.score_many` with the given workers and timeout."""
    def score(texts: list[str], golds: list[str]) -> list[float]:
        from tandem.rewards import score_many

        return score_many(texts, golds, timeout=timeout, workers=workers)
    return score


def generate_and_score(engine, tokenizer, rows: Sequence[dict], settings: RolloutSettings, draws: Draws,
                       score_fn: ScoreFn, eos_ids: Sequence[int] = (),
                       progress: Callable[[int], None] | None = None) -> list[dict]:
    """Generate `draws.n_samples` completions per row (`id`, `prompt` = user message, `answer`) with `settings`
    (schedule, sampling, caps) and score them; one record per sample, problem-major.

    Rows are generated `settings.batch_size` at a time (all at once when 0), all with `stable_seed(draws.seed)` and
    their global index as row id. A record holds id, sample, prompt_ids, completion_ids (EOS included), owner,
    text (special tokens dropped), answer, score, finish_reason and handoffs. `progress(n)` gets the rows
    finished per batch.
    """
    batch_size, n_samples = settings.batch_size or 64, draws.n_samples
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    prompts = encode_prompts(rows, tokenizer)
    flat = [(p, s) for p in range(len(rows)) for s in range(n_samples)]
    call_seed = stable_seed(draws.seed)
    records: list[dict] = []
    for start in range(0, len(flat), batch_size):
        chunk = flat[start:start + batch_size]
        batch = engine.generate(settings.request([prompts[p] for p, _ in chunk], seed=call_seed,
                                                 row_ids=range(start, start + len(chunk))))
        for j, (p, s) in enumerate(chunk):
            ids, owner = cut_at_eos(batch.completion_ids[j], batch.owner[j], eos_ids)
            records.append({
                "id": rows[p]["id"], "sample": s, "prompt_ids": prompts[p], "completion_ids": ids,
                "owner": [int(o) for o in owner],
                "text": tokenizer.decode(ids, skip_special_tokens=True), "answer": rows[p]["answer"],
                "score": None, "finish_reason": batch.finish_reason[j], "handoffs": int(batch.handoffs[j]),
            })
        if progress is not None:
            progress(len(chunk))
    scores = score_fn([r["text"] for r in records], [str(r["answer"]) for r in records])
    for r, sc in zip(records, scores):
        r["score"] = float(sc)
    return records


def accuracy_of(records: Sequence[dict]) -> dict:
    """Accuracy of scored records: mean over problems (in order of first appearance) of the per-problem mean
    score, the per-problem means, mean/max completion tokens (EOS included) and the share that ended on EOS."""
    if not records:
        raise ValueError("accuracy needs at least one record")
    by_problem: dict[Any, list[float]] = {}
    for r in records:
        by_problem.setdefault(r["id"], []).append(float(r["score"]))
    per = [sum(v) / len(v) for v in by_problem.values()]
    lengths = [len(r["completion_ids"]) for r in records]
    return {"accuracy": sum(per) / len(per), "per_problem": per, "mean_tokens": sum(lengths) / len(lengths),
            "max_tokens": max(lengths), "finished": sum(r["finish_reason"] == "eos" for r in records) / len(records)}


def accuracy(model, tokenizer, messages: Sequence[str], golds: Sequence[str], decode: SoloDecode = SoloDecode(),
             score_fn: ScoreFn | None = None, engine=None) -> dict:
    """Solo accuracy of `model` on user `messages` with gold answers, decoded as `decode` says; the `accuracy_of`
    dict.

    `score_fn` defaults to `default_score_fn()` (one worker), `engine` to an hf-backend engine over `model` alone.
    """
    if len(messages) != len(golds):
        raise ValueError(f"{len(messages)} messages but {len(golds)} gold answers")
    if not messages:
        raise ValueError("accuracy needs at least one message")
    if engine is None:
        from tandem.rollout.factory import make_engine

        engine = make_engine(model, None, tokenizer, "hf")
    rows = [{"id": i, "prompt": m, "answer": str(g)} for i, (m, g) in enumerate(zip(messages, golds))]
    if decode.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {decode.batch_size}")
    sampling = SamplingParams(temperature=decode.temperature, top_p=decode.top_p, top_k=decode.top_k,
                              max_new_tokens=decode.max_new_tokens)
    settings = RolloutSettings(ScheduleSpec("solo"), sampling, batch_size=decode.batch_size)
    draws = Draws(decode.n_samples if decode.temperature > 0 else 1, decode.seed)
    records = generate_and_score(engine, tokenizer, rows, settings, draws, score_fn or default_score_fn(),
                                 eos_ids=eos_token_ids(tokenizer, model))
    return accuracy_of(records)
