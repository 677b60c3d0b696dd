"""Evaluation helpers: checkpoints, content hashes, result keys, one benchmark run, batched teacher forcing.

Stage plumbing (paths, caching on disk, JSON/CSV tables) lives in `tasks/evaluate.py` and
`tasks/analyze.py`; this module holds what a notebook would import: enumerate an arm's checkpoints
(`list_checkpoints`), hash a model directory's weights (`content_hash`), key a result by everything that
determines its distribution (`result_key`), generate and score `n` samples per problem of one benchmark
in one mode (`run_benchmark`), summarise them (`summarize_benchmark`), and teacher-force a senior and the
base on saved completions (`teacher_forced_stats`). Definitions: docs/metrics.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from tandem.metrics.drift import kl_BT, token_logratio_BT
from tandem.metrics.legibility import overlap_BT, token_nll_BT
from tandem.metrics.passk import mean_pass_at_k

FORMAT_VERSION = 1  # bump when a stored record or summary changes shape: old cache entries stop matching
MODES = ("solo", "step", "word")
_STEP_DIR = re.compile(r"^step-(\d+)$")


# --------------------------------------------------------------------------------------------------
# Checkpoints and hashes
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Checkpoint:
    """One model to evaluate: an arm's step (0 = the base model) and its directory."""

    arm: str
    step: int
    path: Path

    @property
    def name(self) -> str:
        return f"step-{self.step}"


def list_checkpoints(checkpoints_dir: str | os.PathLike, arm: str, base_dir: str | os.PathLike) -> list[Checkpoint]:
    """The base as step 0, then every complete `<checkpoints_dir>/<arm>/step-<N>/` in increasing N.

    Training renames a finished checkpoint into place, so a directory named `step-<N>` is complete; hidden
    temporary siblings (`.step-<N>.*`) and other names are ignored. An arm never trained has only step 0.
    """
    out = [Checkpoint(arm, 0, Path(base_dir))]
    arm_dir = Path(checkpoints_dir) / arm
    if arm_dir.is_dir():
        found = []
        for d in arm_dir.iterdir():
            m = _STEP_DIR.match(d.name)
            if m and d.is_dir() and int(m.group(1)) > 0:
                found.append(Checkpoint(arm, int(m.group(1)), d))
        out.extend(sorted(found, key=lambda c: c.step))
    return out


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The files whose bytes define the model: `*.safetensors`, else `*.bin` (sorted by name)."""
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors")) or sorted(d.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"{d}: no *.safetensors (or *.bin) weight files to hash; is this a model directory?")
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

@dataclass(frozen=True)
class EvalSettings:
    """Everything that shapes the sampled distribution of one evaluation (plus batch size, which does not)."""

    n_samples: int = 8
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    max_new_tokens: int = 160
    max_rounds: int = 150
    p_senior: float = 0.5
    max_gap_tokens: int = 32
    seed: int = 0
    batch_size: int = 64

    def key_fields(self, mode: str) -> dict:
        """The settings that enter the result key of `mode` (batch size never does)."""
        out = {k: v for k, v in asdict(self).items()
               if k in ("n_samples", "temperature", "top_p", "top_k", "max_new_tokens", "seed")}
        if mode == "step":
            out["max_rounds"] = self.max_rounds
        if mode == "word":
            out.update(p_senior=self.p_senior, max_gap_tokens=self.max_gap_tokens)
        return out


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


def stable_seed(*parts: Any) -> int:
    """A 31-bit seed derived from `parts` (same on every machine and Python run, unlike `hash`)."""
    return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:4], "big") & 0x7FFFFFFF


# --------------------------------------------------------------------------------------------------
# Generation and scoring of one benchmark in one mode
# --------------------------------------------------------------------------------------------------

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
    """EOS ids from the model's generation config (may list several) and the tokenizer."""
    ids: set[int] = set()
    gc = getattr(model, "generation_config", None)
    e = getattr(gc, "eos_token_id", None)
    if e is not None:
        ids.update(e if isinstance(e, (list, tuple)) else [e])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def run_benchmark(engine, tokenizer, rows: Sequence[dict], mode: str, settings: EvalSettings, sampling: Any,
                  seed: int, score_fn: Callable[[list[str], list[str]], list[float]], eos_ids: Sequence[int] = (),
                  progress: Callable[[int], None] | None = None) -> list[dict]:
    """Generate `settings.n_samples` completions per row in `mode` and score them; one record per sample.

    `sampling` is the engine's `SamplingParams` built from `settings`. Rows are expanded problem-major
    (problem 0 samples 0..n-1, problem 1, ...) and generated in chunks of `settings.batch_size`; each row
    carries its global index as `row_ids`, and each chunk gets its own seed. `progress(n)` is called with
    the number of rows finished after each chunk.
    """
    if mode not in MODES:
        raise ValueError(f"unknown evaluation mode {mode!r}; expected one of {MODES}")
    n = settings.n_samples
    prompts = encode_prompts(rows, tokenizer)
    flat = [(p, s) for p in range(len(rows)) for s in range(n)]
    records: list[dict] = []
    for start in range(0, len(flat), settings.batch_size):
        chunk = flat[start:start + settings.batch_size]
        batch = engine.generate(
            [prompts[p] for p, _ in chunk], schedule=mode, sampling=sampling, seed=stable_seed(seed, start),
            p_senior=settings.p_senior, max_gap_tokens=settings.max_gap_tokens, max_rounds=settings.max_rounds,
            row_ids=list(range(start, start + len(chunk))))
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


def _hidden_and_head(model, input_ids_BL: torch.Tensor, attn_BL: torch.Tensor):
    """Final hidden states and the LM head, so logits are formed only at completion positions (a 150k vocab
    times every prompt position would not fit); falls back to full logits for models without the split."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is not None and head is not None:
        hidden = decoder(input_ids=input_ids_BL, attention_mask=attn_BL).last_hidden_state
        return hidden, head
    return model(input_ids=input_ids_BL, attention_mask=attn_BL).logits, None


@torch.inference_mode()
def teacher_forced_stats(senior, base, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                         batch_size: int = 32, pad_id: int = 0, chunk_tokens: int = 256,
                         progress: Callable[[int], None] | None = None) -> list[dict[str, np.ndarray]]:
    """Per-token statistics of each completion under the senior and the base (= the frozen junior).

    For row i with tokens y_1..y_T after prompt x, returns float32 arrays of length T:
    `junior_nll` = -log p_b(y_t | h_t), `overlap` = sum_v min(p_s, p_b), `kl` = KL(p_s || p_b),
    `logratio` = log p_s(y_t) - log p_b(y_t), all at temperature 1. `senior=None` means the senior is the
    base itself (overlap 1, KL and log-ratio 0 exactly, one forward pass). Rows are batched by length,
    right-padded; logits are formed for at most `chunk_tokens` positions at a time.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    device = next(base.parameters()).device
    out: list[dict[str, np.ndarray] | None] = [None] * len(prompt_ids)
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]) + len(completion_ids[i]))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        empty = [i for i in idx if len(completion_ids[i]) == 0]
        for i in empty:
            out[i] = {k: np.zeros(0, dtype=np.float32) for k in STAT_NAMES}
        idx = [i for i in idx if len(completion_ids[i]) > 0]
        if not idx:
            continue
        seqs = [list(prompt_ids[i]) + list(completion_ids[i]) for i in idx]
        L = max(len(s) for s in seqs)
        ids_BL = torch.full((len(idx), L), pad_id, dtype=torch.long)
        attn_BL = torch.zeros((len(idx), L), dtype=torch.long)
        for b, s in enumerate(seqs):
            ids_BL[b, :len(s)] = torch.tensor(s)
            attn_BL[b, :len(s)] = 1
        ids_BL, attn_BL = ids_BL.to(device), attn_BL.to(device)
        P_B = torch.tensor([len(prompt_ids[i]) for i in idx], device=device)
        T_B = torch.tensor([len(completion_ids[i]) for i in idx], device=device)
        T = int(T_B.max())
        t_T = torch.arange(T, device=device)
        mask_BT = t_T[None, :] < T_B[:, None]
        # position P-1+t predicts completion token t
        pos_BT = (P_B[:, None] - 1 + t_T[None, :]).clamp(max=L - 1)
        pos_BT = torch.where(mask_BT, pos_BT, P_B[:, None] - 1)
        y_BT = ids_BL.gather(1, (pos_BT + 1).clamp(max=L - 1))
        hb, head_b = _hidden_and_head(base, ids_BL, attn_BL)
        hs, head_s = _hidden_and_head(senior, ids_BL, attn_BL) if senior is not None else (None, None)
        stats = {k: torch.zeros(len(idx), T, dtype=torch.float32) for k in STAT_NAMES}
        for t0 in range(0, T, chunk_tokens):
            sl = slice(t0, min(T, t0 + chunk_tokens))
            g = pos_BT[:, sl]
            y = y_BT[:, sl]
            logp_b = _logp_at(hb, head_b, g)
            stats["junior_nll"][:, sl] = token_nll_BT(logp_b, y).float().cpu()
            if senior is None:
                stats["overlap"][:, sl] = 1.0
                continue
            logp_s = _logp_at(hs, head_s, g)
            stats["overlap"][:, sl] = overlap_BT(logp_s, logp_b).float().cpu()
            stats["kl"][:, sl] = kl_BT(logp_s, logp_b).float().cpu()
            stats["logratio"][:, sl] = token_logratio_BT(logp_s, logp_b, y).float().cpu()
        for b, i in enumerate(idx):
            n = int(T_B[b])
            out[i] = {k: stats[k][b, :n].numpy().copy() for k in STAT_NAMES}
        if progress is not None:
            progress(len(idx) + len(empty))
    return out  # type: ignore[return-value]


def _logp_at(hidden_or_logits: torch.Tensor, head, pos_BT: torch.Tensor) -> torch.Tensor:
    """Float32 log-softmax at the gathered positions (applying the LM head when given hidden states)."""
    D = hidden_or_logits.shape[-1]
    x = hidden_or_logits.gather(1, pos_BT[..., None].expand(*pos_BT.shape, D))
    logits = head(x) if head is not None else x
    return logits.float().log_softmax(-1)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with `n` torch intra-op CPU threads (0 = leave as is), restoring the previous count.

    Why: a ~1M-parameter model's matmuls are too small to split, and on a busy 2-core machine two threads
    spin-waiting on each other made generation 40x slower than one thread (measured).
    """
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n:
            torch.set_num_threads(old)
