"""Fixtures for the training tests: a tiny randomly initialised base model dir, prepared rows, a rollout batch.

`FakeBatch` has the shape of `tandem.rollout.core.RolloutBatch` (owner mask, the senior's sampling log-probs)
for tests that script the rollouts themselves, where what the engine would sample does not matter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
