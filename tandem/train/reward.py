"""trl's reward function for tandem training: correctness of the whole joint completion."""

from __future__ import annotations

import time
from typing import Callable

from tandem.train.numerics import zero_variance_fraction
from tandem.train.stats import StepStats


class CorrectnessReward:
    """trl reward function: 1.0 when the joint completion's last `\\boxed{}` matches the row's `answer`."""

    __name__ = "correct"  # trl names its reward metrics after this (rewards/correct/mean)

    def __init__(self, stats: StepStats, group_size: int, timeout: float = 5.0, workers: int = 1,
                 score_fn: Callable[..., list[float]] | None = None):
        self.stats, self.group_size, self.timeout, self.workers = stats, group_size, timeout, workers
        self.score_fn = score_fn

    def __call__(self, prompts, completions, answer, **kwargs) -> list[float]:
        t0 = time.perf_counter()
        if self.score_fn is None:
            from tandem.rewards import score_many
            self.score_fn = score_many
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        rewards = [float(r) for r in self.score_fn(texts, list(answer), timeout=self.timeout,
                                                   workers=self.workers)]
        self.stats.add_time("reward", time.perf_counter() - t0)
        self.stats.values["tandem/zero_variance_groups"] = zero_variance_fraction(rewards, self.group_size)
        return rewards

