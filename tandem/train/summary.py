"""Summaries of a training run and its per-step table, from trl's log history."""

from __future__ import annotations

import math
from typing import Sequence

from tandem.config import TrainConfig
from tandem.train.arms import ArmSpec


PHASES = ("rollout", "reward", "kl", "advantage", "update")  # the timed parts of a step, in loop order
# in each step's log: how many of its optimizer updates `tandem.guards.NonFiniteGuard` skipped (NaN/inf gradients)
SKIPPED_KEY = "tandem/skipped_updates"

TABLE_COLUMNS = {
    "step": "step", "reward_mean": "reward", "reward_std": "reward_std", "senior_fraction": "tandem/senior_fraction",
    "handoffs": "tandem/handoffs", "handoffs_per_100": "tandem/handoffs_per_100",
    "joint_length": "tandem/joint_length", "zero_variance_groups": "tandem/zero_variance_groups",
    "kl_to_base": "tandem/kl_to_base", "trl_kl": "kl", "loss": "loss", "entropy": "entropy",
    "grad_norm": "grad_norm", "learning_rate": "learning_rate", "clip_ratio": "clip_ratio/region_mean",
    "time_rollout": "time/rollout", "time_reward": "time/reward", "time_kl": "time/kl",
    "time_advantage": "time/advantage", "time_update": "time/update", "time_step": "time/step",
    "val_accuracy": "val/accuracy",
}


def step_rows(history: Sequence[dict]) -> list[dict]:
    """One row per training step (the training logs of trl's log history), in the table's columns.

    trl logs once per step (`logging_steps` = updates per step); its "step" counts optimizer updates, the
    table's counts training steps (rollout batches), recorded by the trainer under `tandem/step`.
    """
    rows = {}
    for h in history:
        if "loss" in h and "step" in h:
            step = int(h.get("tandem/step", h["step"]))
            rows[step] = {col: h.get(key) for col, key in TABLE_COLUMNS.items()}
            rows[step]["step"] = step
    return [rows[k] for k in sorted(rows)]


def all_updates_skipped(history: Sequence[dict], updates_per_step: int) -> bool:
    """Whether every optimizer update of a run was skipped as non-finite (`train.nonfinite_loss: skip`): each
    training step's log records `SKIPPED_KEY` and it covers all `updates_per_step` updates. Such a run never
    changed the weights, so its checkpoints are the base under a trained name (or NaN, from a NaN base). A log
    without the key (written before it was recorded) counts as trained; an empty history is no such run."""
    rows = [h for h in history if "loss" in h and "step" in h]
    return bool(rows) and all(isinstance(h.get(SKIPPED_KEY), (int, float)) and h[SKIPPED_KEY] >= updates_per_step
                              for h in rows)


def first_value(history: Sequence[dict], key: str):
    for h in history:
        if h.get(key) is not None:
            return h[key]
    return None


def _mean(xs: Sequence[float | None]) -> float | None:
    v = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(v) / len(v) if v else None


def summarize(arm: str, history: Sequence[dict], spec: ArmSpec, train: TrainConfig) -> dict:
    """Summary of a run from its log history: rewards early/late, tandem diagnostics, step time by phase.

    Step times leave out the first step of the history (it pays one-off warm-up costs).
    """
    rows = step_rows(history)
    k = max(1, len(rows) // 5)
    timed = rows[1:] if len(rows) > 1 else rows
    val = [r["val_accuracy"] for r in rows if r["val_accuracy"] is not None]
    return {
        "arm": arm, "schedule": spec.schedule, "group_size": spec.group_size, "beta": spec.beta,
        "steps": len(rows), "steps_planned": train.steps, "prompts_per_step": train.prompts_per_step,
        "reward_first": _mean([r["reward_mean"] for r in rows[:k]]),
        "reward_last": _mean([r["reward_mean"] for r in rows[-k:]]),
        "reward_mean": _mean([r["reward_mean"] for r in rows]),
        "senior_fraction": _mean([r["senior_fraction"] for r in rows]),
        "handoffs_per_completion": _mean([r["handoffs"] for r in rows]),
        "joint_length": _mean([r["joint_length"] for r in rows]),
        "zero_variance_groups": _mean([r["zero_variance_groups"] for r in rows]),
        "kl_to_base_last": _mean([r["kl_to_base"] for r in rows[-k:]]),
        "loss_finite": all(r["loss"] is not None and math.isfinite(r["loss"]) for r in rows),
        "val_accuracy_last": val[-1] if val else None,
        "val_accuracy_best": max(val) if val else None,
        "step_seconds": _mean([r["time_step"] for r in timed]),
        "phase_seconds": {p: _mean([r[f"time_{p}"] for r in timed]) for p in PHASES},
    }
