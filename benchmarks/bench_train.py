"""`tandem bench train`: mean optimizer-step time of the `tandem` and `grpo` arms, measured in one process.

Both arms train from the same base on the same prompts with the same settings (`params.train`, `params.rollout`)
for a few steps in a throwaway directory; the first step of each is left out (one-off warm-up). Reports the
mean step time per arm, its split by phase (rollout, reward, kl, update) and `tandem_over_grpo`, the cost of
a tandem step relative to a solo GRPO step (the paper reports about 1.8-2x with lockstep decoding; the
catch-up engine targets <= 1.25). Run as `tandem bench train [--params FILE] [--json]`.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from tandem.config import Params

PHASES = ("rollout", "reward", "kl", "advantage", "update")


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def bench_train(params: Params, steps: int = 6, base_dir: str | None = None, arms: tuple[str, ...] = ("tandem", "grpo"),
                engine_factory=None) -> dict:
    """Time `steps` optimizer steps of each arm (the first one excluded from the means).

    `base_dir` defaults to `<out_root>/models/base`; training prompts come from
    `<out_root>/data/prepared/train.jsonl`. `engine_factory(senior, junior, tokenizer)` overrides the engine.
    """
    from tandem.models import load_model, load_tokenizer
    from tandem.train import ArmRun, step_rows, train_arm

    if steps < 2:
        raise ValueError("bench_train needs steps >= 2 (the first step is warm-up and is left out)")
    root = Path(params.out_root)
    base = Path(base_dir) if base_dir else root / "models" / "base"
    data = root / "data" / "prepared" / "train.jsonl"
    for p, stage in ((base / "config.json", "base"), (data, "prepare")):
        if not p.exists():
            raise FileNotFoundError(f"bench train: {p} does not exist (run the {stage} stage first)")
    rows = _read_jsonl(data)
    train = replace(params.train, steps=steps, val_every=0, report_to="none", resume="never", save_every=10**6)
    tok = load_tokenizer(base, params.model.trust_remote_code)
    out: dict = {"steps_timed": steps - 1, "prompts_per_step": train.prompts_per_step,
                 "group_size": train.group_size, "max_new_tokens": train.max_new_tokens}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tandem-bench-train-") as tmp:
        for arm in arms:
            senior = load_model(base, params.model.dtype, params.model.trust_remote_code)
            junior = load_model(base, params.model.dtype, params.model.trust_remote_code)
            engine = engine_factory(senior, junior, tok) if engine_factory else None
            res = train_arm(ArmRun(arm, senior, junior, tok, rows, train, params.rollout, Path(tmp) / arm,
                                   seed=params.seed, engine=engine, progress=False))
            timed = step_rows(res.log_history)[1:]
            mean = lambda key: sum(r[key] or 0.0 for r in timed) / len(timed)  # noqa: E731
            out[f"{arm}_step_s"] = mean("time_step")
            out[f"{arm}_step_s_median"] = statistics.median(r["time_step"] for r in timed)
            out[f"{arm}_step_s_each"] = [round(r["time_step"], 3) for r in timed]
            for ph in PHASES:
                out[f"{arm}_{ph}_s"] = mean(f"time_{ph}")
            out[f"{arm}_joint_length"] = mean("joint_length")
            out[f"{arm}_senior_fraction"] = mean("senior_fraction")
    if "tandem" in arms and "grpo" in arms:
        out["tandem_over_grpo"] = out["tandem_step_s"] / out["grpo_step_s"]
        # The median ratio resists the step-time spikes of a shared machine.
        out["tandem_over_grpo_median"] = out["tandem_step_s_median"] / out["grpo_step_s_median"]
        # Rollout lengths differ between arms (the junior writes half of a tandem rollout), so the cost per
        # generated token is the fairer engine comparison.
        out["tandem_over_grpo_rollout_per_token"] = (
            (out["tandem_rollout_s"] / max(out["tandem_joint_length"], 1e-9))
            / (out["grpo_rollout_s"] / max(out["grpo_joint_length"], 1e-9)))
    out["wall_s"] = time.perf_counter() - t_all
    return out
