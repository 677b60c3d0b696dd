"""Evaluation helpers: checkpoints, content hashes, result keys, one benchmark run, batched teacher forcing.

Stage plumbing (paths, JSON/CSV tables) lives in `tasks/evaluate.py` and `tasks/analyze.py`, the result
cache on disk, the unit planner and the model cache in `tandem/eval_cache.py`; this module holds what a
notebook would import (an arm's checkpoints are enumerated by `tandem.checkpoints.list_checkpoints`): hash a
model directory's weights (`content_hash`), key a result by everything that determines its distribution
(`result_key`, over `tandem.run_keys.EVAL_RESULT_KEYS`), generate and score `n` samples per problem of one
benchmark in one mode (`run_benchmark`, over the shared `tandem.generation` path), summarise them
(`summarize_benchmark`), and teacher-force a senior and the base on saved completions (`teacher_forced_stats`,
over `tandem.logprobs`). Definitions: docs/metrics.md.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from tandem.rollout.request import RolloutSettings

from tandem.checkpoints import weight_files as checkpoint_weight_files
from tandem.generation import Draws, generate_and_score
from tandem.logprobs import iter_logp_chunks
from tandem.metrics.drift import kl_BT, token_logratio_BT
from tandem.metrics.legibility import overlap_BT, token_nll_BT
from tandem.metrics.passk import mean_pass_at_k
from tandem.rollout.schedule import ScheduleSpec
from tandem.run_keys import eval_result_fields

FORMAT_VERSION = 2  # bump when a stored record or summary changes shape: old cache entries stop matching
MODES = ("solo", "step", "word")


# --------------------------------------------------------------------------------------------------
# Checkpoints and hashes
# --------------------------------------------------------------------------------------------------

def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The weight files of a model directory (`tandem.checkpoints.weight_files`); raises when there are none."""
    files = checkpoint_weight_files(model_dir)
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors (or *.bin) weight files to hash; is this a model "
                                f"directory?")
    return files


_HASH_MEMO: dict[tuple, str] = {}


def content_hash(model_dir: str | os.PathLike) -> str:
    """SHA-256 over the weight files in name order, each contributing its name and bytes (hex digest).

    Memoised per process on (path, name, size, mtime) so a 4B model is read once per run.
    """
    files = weight_files(model_dir)
    memo_key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if memo_key in _HASH_MEMO:
        return _HASH_MEMO[memo_key]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    _HASH_MEMO[memo_key] = h.hexdigest()
    return _HASH_MEMO[memo_key]


def rows_hash(rows: Sequence[dict]) -> str:
    """SHA-256 of the benchmark rows that matter for a result: id, prompt and answer, in order."""
    payload = [[r["id"], r["prompt"], r["answer"]] for r in rows]
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


# --------------------------------------------------------------------------------------------------
# Settings and keys
# --------------------------------------------------------------------------------------------------

SCHEDULE_FIELDS = frozenset(f.name for f in fields(ScheduleSpec))


@dataclass(frozen=True)
class EvalSettings:
    """Everything that shapes the sampled distribution of one evaluation (plus batch size, which does not)."""

    n_samples: int = 8
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    max_new_tokens: int = 160
    # the tandem modes' schedule settings (p_senior, max_gap_tokens, max_rounds); each mode sets the kind
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    seed: int = 0
    batch_size: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, ScheduleSpec):
            raise TypeError(f"schedule must be a ScheduleSpec, got {type(self.schedule).__name__}")

    @classmethod
    def of(cls, values: dict[str, Any], batch_size: int) -> "EvalSettings":
        """From result fields (`tandem.run_keys.EVAL_RESULT_KEYS`' names -> values): the `ScheduleSpec` fields
        among them form `schedule` (its kind the default; each mode sets its own)."""
        spec = ScheduleSpec(**{k: v for k, v in values.items() if k in SCHEDULE_FIELDS})
        rest = {k: v for k, v in values.items() if k not in SCHEDULE_FIELDS}
        return cls(**rest, schedule=spec, batch_size=batch_size)

    def value(self, name: str) -> Any:
        """One result field's value (`tandem.run_keys.EVAL_RESULT_KEYS`): a schedule setting or one of these."""
        return getattr(self.schedule, name) if name in SCHEDULE_FIELDS else getattr(self, name)

    def rollout_settings(self, mode: str, sampling: Any) -> "RolloutSettings":
        """The engine's settings for `mode` (a schedule) with the `SamplingParams` built from these settings."""
        from tandem.rollout.request import RolloutSettings

        return RolloutSettings(replace(self.schedule, kind=mode), sampling, self.batch_size)

    def sampling(self):
        """The engine's `SamplingParams` for evaluation decoding."""
        from tandem.rollout.engine import SamplingParams

        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens)

    def key_fields(self, mode: str) -> dict:
        """The settings that enter the result key of `mode` (`tandem.run_keys.EVAL_RESULT_KEYS`; batch size
        never does)."""
        return {k: self.value(k) for k in eval_result_fields(mode)}


def result_key(model_hash: str, mode: str, benchmark: str, bench_rows_hash: str, settings: EvalSettings,
               junior_hash: str | None = None) -> str:
    """SHA-256 naming one (checkpoint weights, mode, benchmark rows, settings) result; see docs/metrics.md."""
    if mode not in MODES:
        raise ValueError(f"unknown evaluation mode {mode!r}; expected one of {MODES}")
    if mode != "solo" and not junior_hash:
        raise ValueError(f"mode {mode!r} pairs the checkpoint with the junior: junior_hash is required")
    payload = {"format": FORMAT_VERSION, "model": model_hash, "mode": mode, "benchmark": benchmark,
               "rows": bench_rows_hash, "settings": settings.key_fields(mode)}
    if mode != "solo":
        payload["junior"] = junior_hash
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------------------------
# Generation and scoring of one benchmark in one mode
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Decoder:
    """What generates an evaluation's samples: the rollout engine, its tokenizer and the stop token ids."""

    engine: Any
    tokenizer: Any
    eos_ids: Sequence[int] = ()


def run_benchmark(decoder: Decoder, rows: Sequence[dict], mode: str, settings: EvalSettings, seed: int,
                  score_fn: Callable[[list[str], list[str]], list[float]],
                  progress: Callable[[int], None] | None = None) -> list[dict]:
    """Generate `settings.n_samples` completions per row in `mode` and score them; one record per sample.

    Sampling follows `settings` (`EvalSettings.sampling`); the path is `tandem.generation.generate_and_score`,
    the same as the base stage's accuracy and train-time validation.
    """
    if mode not in MODES:
        raise ValueError(f"unknown evaluation mode {mode!r}; expected one of {MODES}")
    return generate_and_score(decoder.engine, decoder.tokenizer, rows,
                              settings.rollout_settings(mode, settings.sampling()), Draws(settings.n_samples, seed),
                              score_fn, decoder.eos_ids, progress)


def summarize_benchmark(records: Sequence[dict], ks: Sequence[int]) -> dict:
    """pass@k for each k (grouped by problem id, in order of first appearance) and generation statistics."""
    by_problem: dict[str, list[float]] = {}
    for r in records:
        by_problem.setdefault(r["id"], []).append(float(r["score"]))
    usable_ks = [k for k in ks if all(len(s) >= k for s in by_problem.values())]
    if len(usable_ks) != len(ks):
        missing = sorted(set(ks) - set(usable_ks))
        raise ValueError(f"pass@k needs at least k samples per problem; k={missing} exceeds some problem's count")
    passk = mean_pass_at_k(list(by_problem.values()), ks)
    lengths = [len(r["completion_ids"]) for r in records]
    shares = [sum(r["owner"]) / len(r["owner"]) for r in records if r["owner"]]
    reasons: dict[str, int] = {}
    for r in records:
        reasons[r["finish_reason"]] = reasons.get(r["finish_reason"], 0) + 1
    out: dict[str, Any] = {"n_problems": len(by_problem), "n_generations": len(records)}
    out.update({f"pass@{k}": passk[k] for k in ks})
    out["senior_share"] = float(np.mean(shares)) if shares else None
    out["handoffs"] = float(np.mean([r["handoffs"] for r in records])) if records else None
    out["mean_tokens"] = float(np.mean(lengths)) if lengths else None
    out["finish_reasons"] = dict(sorted(reasons.items()))
    return out


# --------------------------------------------------------------------------------------------------
# Teacher forcing: senior vs base on saved completions
# --------------------------------------------------------------------------------------------------

STAT_NAMES = ("junior_nll", "overlap", "kl", "logratio")


@torch.inference_mode()
def teacher_forced_stats(senior, base, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                         batch_size: int = 32, pad_id: int = 0, chunk_tokens: int = 256,
                         progress: Callable[[int], None] | None = None) -> list[dict[str, np.ndarray]]:
    """Per-token statistics of each completion under the senior and the base (= the frozen junior).

    For row i with tokens y_1..y_T after prompt x, returns float32 arrays of length T:
    `junior_nll` = -log p_b(y_t | h_t), `overlap` = sum_v min(p_s, p_b), `kl` = KL(p_s || p_b),
    `logratio` = log p_s(y_t) - log p_b(y_t), all at temperature 1. `senior=None` means the senior is the
    base itself (overlap 1, KL and log-ratio 0 exactly, one forward pass). Batching and chunking:
    `tandem.logprobs.iter_logp_chunks`.
    """
    out = [{k: np.zeros(len(c), dtype=np.float32) for k in STAT_NAMES} for c in completion_ids]
    for ch in iter_logp_chunks([base, senior], prompt_ids, completion_ids, batch_size, pad_id, chunk_tokens,
                               progress=progress):
        logp_b, logp_s = ch.logp_BTV
        y = ch.targets_BT
        cols = {"junior_nll": token_nll_BT(logp_b, y)}
        if logp_s is None:
            cols["overlap"] = torch.ones_like(cols["junior_nll"])
        else:
            cols.update(overlap=overlap_BT(logp_s, logp_b), kl=kl_BT(logp_s, logp_b),
                        logratio=token_logratio_BT(logp_s, logp_b, y))
        n_B = ch.mask_BT.sum(-1).tolist()
        for name, v_BT in cols.items():
            v_BT = v_BT.float().cpu().numpy()
            for b, i in enumerate(ch.rows):
                out[i][name][ch.t0:ch.t0 + n_B[b]] = v_BT[b, :n_B[b]]
    return out



def teacher_forced_pair_stats(senior, base, junior, prompt_ids: Sequence[Sequence[int]],
                              completion_ids: Sequence[Sequence[int]], batch_size: int = 32, pad_id: int = 0,
                              progress: Callable[[int], None] | None = None) -> list[dict[str, np.ndarray]]:
    """`teacher_forced_stats` when the junior is a model of its own (`junior` not None): legibility
    (`junior_nll`, `overlap`) against the junior, drift (`kl`, `logratio`) against the senior's base, and
    `kl_junior` = KL(p_s || p_junior). With `junior` None (the junior is the base) it is `teacher_forced_stats`.
    Naive: the two calls, with the junior's columns taken from the second."""
    drift = teacher_forced_stats(senior, base, prompt_ids, completion_ids, batch_size=batch_size, pad_id=pad_id,
                                 progress=progress)
    if junior is None:
        return drift
    leg = teacher_forced_stats(senior if senior is not None else base, junior, prompt_ids, completion_ids,
                               batch_size=batch_size, pad_id=pad_id)
    for d, j in zip(drift, leg):
        d["junior_nll"], d["overlap"], d["kl_junior"] = j["junior_nll"], j["overlap"], j["kl"]
    return drift