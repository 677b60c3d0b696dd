"""Fixtures for the training tests: a tiny byte-level tokenizer, a tiny Qwen3 model dir, prepared rows, a fake engine.

The fake engine follows the `tandem.rollout.engine` contract (a `RolloutBatch` with owner mask and the senior's
sampling log-probs) with a deliberately naive loop (one full forward per token, authorship by a seeded coin per
token), so the trainer wiring can be tested on its own; tests switch to the real engine when it is importable.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.data.synthetic import generate


def build_base(out_dir: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A randomly initialised tiny Qwen3 base (project tokenizer and shape, 2 layers) saved as a HF model dir."""
    from tandem.config import ModelConfig
    from tandem.models import build_tiny_model, save_model, train_tokenizer

    out_dir = Path(out_dir)
    probs = generate(300, 2, 4, seed=123)
    tok = train_tokenizer([p.problem + "\n\n" + p.solution for p in probs], vocab_size=300)
    cfg = ModelConfig(hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2,
                      intermediate_size=2 * hidden, max_position=512)
    save_model(build_tiny_model(tok, cfg, seed=seed), tok, out_dir)
    return out_dir


def write_prepared(prepared_dir: Path, n_train: int = 64, n_val: int = 16) -> None:
    """data/prepared/{train,val}.jsonl rows in the prepare stage's shape (id, problem, answer, prompt, ...)."""
    import json

    from tandem.data.prompts import user_message

    prepared_dir.mkdir(parents=True, exist_ok=True)
    probs = generate(n_train + n_val, 2, 3, seed=7)
    for name, rows in (("train", probs[:n_train]), ("val", probs[n_train:])):
        with open(prepared_dir / f"{name}.jsonl", "w") as f:
            for p in rows:
                f.write(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer,
                                    "prompt": user_message(p.problem), "source": p.source,
                                    "n_steps": p.n_steps, "solution": p.solution}) + "\n")


@dataclass
class FakeBatch:
    """The `RolloutBatch` contract: completion ids, owner (1 senior), senior sampling log-probs, handoffs."""

    completion_ids: list[list[int]]
    owner: list[list[int]]
    senior_logprobs: list[list[float]]
    handoffs: list[int]
    finish_reason: list[str]

    def stats(self) -> dict:
        n = sum(len(c) for c in self.completion_ids)
        s = sum(sum(o) for o in self.owner)
        runs = sum(h + 1 for h, c in zip(self.handoffs, self.completion_ids) if c)
        return {"senior_fraction": s / max(n, 1), "handoffs_per_100": 100 * sum(self.handoffs) / max(n, 1),
                "mean_run_length": n / max(runs, 1), "mean_length": n / max(len(self.completion_ids), 1)}


class FakeEngine:
    """Naive tandem sampler: every token from a full forward of its author; a seeded coin picks the author."""

    def __init__(self, senior, junior, tokenizer, backend="hf", device=None):
        self.senior, self.junior, self.tokenizer = senior, junior, tokenizer
        self.calls: list[dict] = []

    @torch.no_grad()
    def generate(self, prompt_ids, schedule, sampling, seed, p_senior=0.5, max_gap_tokens=32, max_rounds=150,
                 row_ids=None, batch_size=None, progress=False):
        self.calls.append({"n": len(prompt_ids), "schedule": schedule, "seed": seed})
        eos = self.tokenizer.eos_token_id
        out = FakeBatch([], [], [], [], [])
        for r, prompt in enumerate(prompt_ids):
            rng = random.Random(f"{seed}-{r}")
            gen = torch.Generator().manual_seed(seed * 1000 + r)
            ids, own, lps, hand, prev = list(prompt), [], [], 0, None
            for _ in range(sampling.max_new_tokens):
                senior = schedule == "solo" or (schedule != "junior" and rng.random() < p_senior)
                model = self.senior if senior else self.junior
                logits = model(torch.tensor([ids])).logits[0, -1].float() / sampling.temperature
                logp = torch.log_softmax(logits, -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                hand += int(prev is not None and prev != senior)
                prev = senior
                ids.append(tok)
                own.append(int(senior))
                lps.append(float(logp[tok]) if senior else 0.0)
                if tok == eos:
                    break
            out.completion_ids.append(ids[len(prompt):])
            out.owner.append(own)
            out.senior_logprobs.append(lps)
            out.handoffs.append(hand)
            out.finish_reason.append("eos" if ids[-1] == eos else "length")
        return out


@dataclass(frozen=True)
class FakeSamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128


def engine_module():
    """The real `tandem.rollout.engine` when it exists; otherwise a stand-in module holding the fakes."""
    import importlib
    import sys
    import types

    try:
        return importlib.import_module("tandem.rollout.engine")
    except ModuleNotFoundError:
        mod = types.ModuleType("tandem.rollout.engine")
        mod.SamplingParams, mod.TandemEngine, mod.RolloutBatch = FakeSamplingParams, FakeEngine, FakeBatch
        sys.modules["tandem.rollout.engine"] = mod
        return mod
