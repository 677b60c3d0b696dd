"""Fixtures for the evaluate/analyze tests: a tiny base, a fake checkpoint tree, benchmark files, and a hook on
the real rollout engine that counts (or breaks) its generate calls; `fake_model_dir` writes a model directory
that passes the loading checks without a real model (for tests that never load it)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tandem.data.prompts import user_message
from tandem.data.synthetic import generate

ARMS = ("tandem", "grpo", "kl_reg")


def build_tree(root: Path, steps=(2, 4), n_problems: int = 3, benchmarks=("arith-short", "arith-long"),
               hidden: int = 32, seed: int = 0) -> Path:
    """out_root with models/base, models/checkpoints/<arm>/step-N (perturbed copies), data/prepared/eval."""
    from tandem.checkpoints import step_name, write_state
    from tandem.config import ModelConfig
    from tandem.models import build_tiny_model, load_model, load_tokenizer, save_model, train_tokenizer

    root = Path(root)
    probs = generate(200, 2, 4, seed=123)
    tok = train_tokenizer([p.problem + "\n\n" + p.solution for p in probs], vocab_size=300)
    cfg = ModelConfig(hidden_size=hidden, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=0,
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
            d = root / "models" / "checkpoints" / arm / step_name(step)
            save_model(m, tok, d)
            write_state(d, {"arm": arm, "step": step})  # the marker that makes it a complete checkpoint
    eval_dir = root / "data" / "prepared" / "eval"
    eval_dir.mkdir(parents=True, exist_ok=True)
    for i, b in enumerate(benchmarks):
        with open(eval_dir / f"{b}.jsonl", "w") as f:
            for p in generate(n_problems, 2 + i, 3 + i, seed=50 + i, prefix=b):
                f.write(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer,
                                    "prompt": user_message(p.problem), "source": b, "solution": p.solution}) + "\n")
    return root


TINY_CONFIG = {"model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 300, "tie_word_embeddings": True}


def safetensors_bytes(payload: bytes) -> bytes:
    """A well-formed safetensors file holding `payload` as one uint8 tensor."""
    import struct

    header = json.dumps({"w": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}}).encode()
    return struct.pack("<Q", len(header)) + header + payload


def fake_model_dir(d: Path, weights: bytes = b"w", state: dict | None = None, marker: bool = True) -> Path:
    """A model directory that passes `check_model_dir` (config, tokenizer, a well-formed weight file holding
    `weights`); with `marker`, a complete checkpoint (`tandem_state.json` with `state` and the checksums)."""
    from tandem.checkpoints import write_state

    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors").write_bytes(safetensors_bytes(weights))
    if marker:
        write_state(d, state or {})
    return d


def small_params(root: Path, **evaluate):
    from tandem.config import params_from_dict

    ev = {"n_samples": 4, "ks": [1, 2, 4], "max_new_tokens": 16, "batch_size": 8, "progress": False,
          "score_workers": 1}
    ev.update(evaluate)
    return params_from_dict({"out_root": str(root), "train": {"arms": list(ARMS)}, "evaluate": ev,
                             "analyze": {"top_drift_tokens": 20, "min_type_count": 2, "kl_bins": 8,
                                         "batch_size": 16}})


def use_engine(monkeypatch, counter: list | None = None, fail_after: int | None = None) -> None:
    """Wrap the engine tasks.evaluate builds: `counter` collects (schedule, n_rows) per generate call, and
    after `fail_after` calls the next one raises RuntimeError (a crash in the middle of the stage)."""
    import tasks.evaluate as ev

    real_make = getattr(ev.rollout_engine, "original", ev.rollout_engine)  # never wrap a wrapper

    def make(senior, junior, tokenizer, rollout, **kw):
        eng = real_make(senior, junior, tokenizer, rollout, **kw)
        inner = eng.generate

        def generate(request):
            if counter is not None:
                if fail_after is not None and len(counter) >= fail_after:
                    raise RuntimeError("simulated crash in the middle of evaluate")
                counter.append((request.schedule.kind, len(request)))
            return inner(request)

        eng.generate = generate
        return eng

    make.original = real_make
    monkeypatch.setattr(ev, "rollout_engine", make)
