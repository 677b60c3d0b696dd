"""Fixtures for the evaluate/analyze tests: a tiny base, a fake checkpoint tree, benchmark files, an engine.

The engine is the real `tandem.rollout.engine.TandemEngine` when it is importable; otherwise `NaiveEngine`, a
deliberately simple sampler that follows the engine contract (one full forward per token, a seeded coin per
token picks the author in tandem schedules) so the stage plumbing can be tested on its own.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.data.prompts import user_message
from tandem.data.synthetic import generate

ARMS = ("tandem", "grpo", "kl_reg")


def build_tree(root: Path, steps=(2, 4), n_problems: int = 3, benchmarks=("arith-short", "arith-long"),
               hidden: int = 32, seed: int = 0) -> Path:
    """out_root with models/base, models/checkpoints/<arm>/step-N (perturbed copies), data/prepared/eval."""
    from tandem.config import ModelConfig
    from tandem.models import build_tiny_model, load_model, load_tokenizer, save_model, train_tokenizer

    root = Path(root)
    probs = generate(200, 2, 4, seed=123)
    tok = train_tokenizer([p.problem + "\n\n" + p.solution for p in probs], vocab_size=300)
    cfg = ModelConfig(hidden_size=hidden, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=2 * hidden, max_position=512)
    base_dir = root / "models" / "base"
    save_model(build_tiny_model(tok, cfg, seed=seed), tok, base_dir)
    tok = load_tokenizer(base_dir)
    for a, arm in enumerate(ARMS):
        for step in steps:
            m = load_model(base_dir)
            g = torch.Generator().manual_seed(1000 * a + step)
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.05 * (a + 1) * step * torch.randn(p.shape, generator=g) * p.std().clamp_min(1e-3))
            save_model(m, tok, root / "models" / "checkpoints" / arm / f"step-{step}")
    eval_dir = root / "data" / "prepared" / "eval"
    eval_dir.mkdir(parents=True, exist_ok=True)
    for i, b in enumerate(benchmarks):
        with open(eval_dir / f"{b}.jsonl", "w") as f:
            for p in generate(n_problems, 2 + i, 3 + i, seed=50 + i, prefix=b):
                f.write(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer,
                                    "prompt": user_message(p.problem), "source": b}) + "\n")
    return root


def small_params(root: Path, **evaluate):
    from tandem.config import params_from_dict

    ev = {"n_samples": 4, "ks": [1, 2, 4], "max_new_tokens": 16, "batch_size": 8, "progress": False,
          "score_workers": 1}
    ev.update(evaluate)
    return params_from_dict({"out_root": str(root), "train": {"arms": list(ARMS)}, "evaluate": ev,
                             "analyze": {"top_drift_tokens": 20, "min_type_count": 2, "kl_bins": 8,
                                         "batch_size": 16}})


@dataclass
class Batch:
    completion_ids: list[list[int]]
    owner: list[list[int]]
    senior_logprobs: list[list[float]]
    handoffs: list[int]
    finish_reason: list[str]

    def stats(self) -> dict:
        n = sum(len(c) for c in self.completion_ids)
        return {"senior_fraction": sum(sum(o) for o in self.owner) / max(n, 1)}


class NaiveEngine:
    """The engine contract by brute force: each token from a full forward of its author (top-k, no top-p)."""

    def __init__(self, senior, junior, tokenizer, backend="hf", device=None):
        self.senior, self.junior, self.tokenizer = senior, junior, tokenizer

    @torch.no_grad()
    def generate(self, prompt_ids, schedule, sampling, seed, p_senior=0.5, max_gap_tokens=32, max_rounds=150,
                 row_ids=None, batch_size=None, progress=False):
        eos = self.tokenizer.eos_token_id
        out = Batch([], [], [], [], [])
        for r, prompt in enumerate(prompt_ids):
            rid = row_ids[r] if row_ids is not None else r
            rng = random.Random(f"{seed}-{rid}")
            g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
            ids, owner, lps = [], [], []
            author = 1 if schedule in ("solo", "step") else int(rng.random() < p_senior)
            reason = "length"
            for _ in range(sampling.max_new_tokens):
                model = self.senior if author == 1 else self.junior
                logits = model(torch.tensor([list(prompt) + ids])).logits[0, -1].float()
                logp = (logits / sampling.temperature).log_softmax(-1)
                probs = logp.exp()
                if sampling.top_k:
                    kth = probs.topk(min(sampling.top_k, probs.numel())).values[-1]
                    probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
                tok = int(torch.multinomial(probs / probs.sum(), 1, generator=g))
                ids.append(tok)
                owner.append(author)
                lps.append(float(logp[tok]) if author == 1 else 0.0)
                if tok == eos:
                    reason = "eos"
                    break
                if schedule not in ("solo", "junior"):
                    author = int(rng.random() < p_senior)
            out.completion_ids.append(ids)
            out.owner.append(owner)
            out.senior_logprobs.append(lps)
            out.handoffs.append(sum(1 for a, b in zip(owner, owner[1:]) if a != b))
            out.finish_reason.append(reason)
        return out


def engine_class():
    """The real engine when it exists, else the naive one."""
    try:
        from tandem.rollout.engine import TandemEngine
        return TandemEngine
    except ImportError:
        return NaiveEngine


@dataclass(frozen=True)
class NaiveSampling:
    """The engine's `SamplingParams` fields, for use with `NaiveEngine`."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128


def use_engine(monkeypatch, counter: list | None = None, fail_after: int | None = None):
    """Point tasks.evaluate at the real engine (or the naive one); count generate calls, optionally crash.

    `counter` collects (schedule, n_rows) per call; after `fail_after` calls the next raises RuntimeError.
    """
    import tasks.evaluate as ev

    cls = engine_class()
    if cls is NaiveEngine:
        monkeypatch.setattr(ev, "make_sampling", lambda s: NaiveSampling(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens))
    real_make = getattr(ev.make_engine, "original", ev.make_engine)  # never wrap a wrapper

    def make(senior, junior, tokenizer, params):
        eng = cls(senior, junior, tokenizer) if cls is NaiveEngine else real_make(senior, junior, tokenizer, params)
        inner = eng.generate

        def generate(prompt_ids, schedule, *a, **k):
            if counter is not None:
                if fail_after is not None and len(counter) >= fail_after:
                    raise RuntimeError("simulated crash in the middle of evaluate")
                counter.append((schedule, len(prompt_ids)))
            return inner(prompt_ids, schedule, *a, **k)

        eng.generate = generate
        return eng

    make.original = real_make
    monkeypatch.setattr(ev, "make_engine", make)
    return cls
