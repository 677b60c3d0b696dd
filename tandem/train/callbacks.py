"""Trainer callbacks of tandem training: phase timing, in-training validation, the junior guard, a progress bar.

Callbacks fire per optimizer update; a training step (one rollout batch) may hold several updates, so the
step-level ones read the run's step clock (`tandem.geometry.BatchGeometry`): they act on the update that
closes a step (`is_step_end`) and count steps with `step_of`.
"""

from __future__ import annotations

import time
from typing import Sequence

from transformers import TrainerCallback

from tandem.geometry import BatchGeometry
from tandem.train.numerics import weights_hash
from tandem.train.stats import StepStats


class PhaseTimer(TrainerCallback):
    """Wall time of each training step by phase: rollout, reward, kl, advantage, update.

    The trainer times the whole scoring pass (`generate` = rollout + reward + kl + advantage, where advantage
    holds trl's old/reference log-prob passes and the group normalisation); `update` is the rest of the step:
    every micro-batch's forward/backward and the U optimizer updates.
    """

    def __init__(self, stats: StepStats, geometry: BatchGeometry):
        self.stats, self.geometry, self._t0 = stats, geometry, None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.geometry.is_step_end(state.global_step):  # the last step is complete: this update opens one
            self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._t0 is None or not self.geometry.is_step_end(state.global_step):
            return
        total = time.perf_counter() - self._t0
        ph = self.stats.phase_s
        generate = ph.pop("generate", 0.0)
        inner = sum(v for k, v in ph.items() if k in ("rollout", "reward", "kl"))
        ph["advantage"] = max(generate - inner, 0.0)
        ph["update"] = max(total - max(generate, inner), 0.0)
        ph["step"] = total
        self._t0 = None


class Validation(TrainerCallback):
    """Solo greedy accuracy of the senior on held-out `rows` (prepared: prompt, answer) every `train.val_every`
    steps (and before the first step), `batch_size` rows per generation call."""

    def __init__(self, stats: StepStats, tokenizer, rows: Sequence[dict], train, geometry: BatchGeometry,
                 batch_size: int = 64):
        self.stats, self.tokenizer, self.geometry = stats, tokenizer, geometry
        self.messages, self.golds = [r["prompt"] for r in rows], [str(r["answer"]) for r in rows]
        self.every, self.max_new_tokens, self.batch_size, self.score_workers = (
            train.val_every, train.max_new_tokens, batch_size, train.score_workers)
        self.initial: float | None = None

    def _measure(self, model) -> float:
        from tandem.generation import SoloDecode, accuracy, default_score_fn

        return float(accuracy(model, self.tokenizer, self.messages, self.golds,
                              SoloDecode(max_new_tokens=self.max_new_tokens, batch_size=self.batch_size),
                              default_score_fn(self.score_workers))["accuracy"])

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:  # the base's accuracy: the reference every later value is read against
            self.initial = self._measure(model)
            self.stats.values["val/accuracy_initial"] = self.initial

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if not self.geometry.is_step_end(state.global_step):
            return
        if self.geometry.step_of(state.global_step) % self.every == 0 or state.global_step == state.max_steps:
            t0 = time.perf_counter()
            self.stats.values["val/accuracy"] = self._measure(model)
            self.stats.add_time("val", time.perf_counter() - t0)


class JuniorGuard(TrainerCallback):
    """Hash the junior before training and check it after: the tandem partner must never change."""

    def __init__(self, junior, expected: str | None = None):
        self.junior = junior
        self.before = expected or weights_hash(junior)
        self.after: str | None = None

    def on_train_end(self, args, state, control, **kwargs):
        self.after = weights_hash(self.junior)
        if self.after != self.before:
            raise RuntimeError(f"the frozen junior changed during training (hash {self.before[:12]} -> "
                               f"{self.after[:12]}): it must share no parameters with the senior")


class ProgressBar(TrainerCallback):
    """A compact terminal progress bar (replaces transformers' dict-per-step printout)."""

    def __init__(self, desc: str, enabled: bool = True):
        self.desc, self.enabled, self.bar = desc, enabled, None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.enabled and state.is_world_process_zero:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc=self.desc, dynamic_ncols=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is None or not logs or "loss" not in logs:
            return
        self.bar.n = state.global_step
        post = {"reward": logs.get("reward"), "senior": logs.get("tandem/senior_fraction"),
                "s/step": logs.get("time/step"), "val": logs.get("val/accuracy")}
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in post.items() if isinstance(v, (int, float))})

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.n = state.global_step
            self.bar.close()
            self.bar = None



class StopAfter(TrainerCallback):
    """End training after `n` optimizer updates of this call (benchmarks time a few steps of a long run)."""

    def __init__(self, n: int):
        self.n, self.start = n, None

    def on_step_end(self, args, state, control, **kwargs):
        self.start = state.global_step - 1 if self.start is None else self.start
        if state.global_step - self.start >= self.n:
            control.should_training_stop = True
