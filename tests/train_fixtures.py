"""Fixtures for the training tests: tiny base model dirs, prepared rows, a rollout batch.

A randomly initialised base never writes a `\\boxed{}` answer, so every reward is 0, every advantage 0 and
training never moves it: `build_boxing_base` teaches a base to answer `\\boxed{7}` or `\\boxed{8}` at random
(seconds of supervised training), so that with gold answers of 7 (`write_prepared(answer="7")`) groups
have reward variance and the senior really learns.

`FakeBatch` has the shape of `tandem.rollout.core.RolloutBatch` (owner mask, the senior's sampling log-probs)
for tests that script the rollouts themselves, where what the engine would sample does not matter.

`SMALL` is the model section of a tiny Qwen3 (32 wide, 2 layers) that tests build with `ModelConfig(**SMALL)`.
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
    cfg = ModelConfig(hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=0,
                      intermediate_size=2 * hidden, max_position=512)
    save_model(build_tiny_model(tok, cfg, seed=seed), tok, out_dir)
    return out_dir


def build_boxing_base(out_dir: Path, steps: int = 60, seed: int = 0) -> Path:
    """A tiny base that answers every problem with `\\boxed{7}` or `\\boxed{8}`, about half and half."""
    import torch

    from tandem.config import ModelConfig
    from tandem.data.prompts import user_message
    from tandem.models import load_model, load_tokenizer, pretrain, save_model

    out_dir = build_base(out_dir, seed=seed)
    model, tok = load_model(out_dir), load_tokenizer(out_dir)
    pairs = [(user_message(p.problem), "\\boxed{%d}" % (7 + i % 2)) for i, p in enumerate(generate(64, 2, 3, seed=11))]
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=0, intermediate_size=128,
                      max_position=512, pretrain_steps=steps, pretrain_batch_size=8, pretrain_lr=0.01)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pretrain(model, tok, pairs, cfg, progress=False, seed=seed)
    finally:
        torch.set_num_threads(threads)
    save_model(model, tok, out_dir)
    return out_dir


def write_prepared(prepared_dir: Path, n_train: int = 64, n_val: int = 16, answer: str | None = None) -> None:
    """data/prepared/{train,val}.jsonl rows in the prepare stage's shape (id, problem, answer, prompt, ...);
    `answer` replaces every gold answer (see `build_boxing_base`)."""
    import json

    from tandem.data.prompts import user_message

    prepared_dir.mkdir(parents=True, exist_ok=True)
    probs = generate(n_train + n_val, 2, 3, seed=7)
    for name, rows in (("train", probs[:n_train]), ("val", probs[n_train:])):
        with open(prepared_dir / f"{name}.jsonl", "w") as f:
            for p in rows:
                f.write(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer if answer is None else answer,
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


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), children first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(k) for k in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


SMALL = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=0, intermediate_size=64,
             max_position=512)
