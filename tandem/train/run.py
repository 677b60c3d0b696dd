"""`ArmRun`: everything one arm's training run reads, in one object (models, rows, settings, output folder, hooks).

`train_arm(run)` trains it, `build_trainer(run, ...)` builds its trainer; the arm's `spec` and its batch
`geometry` (the step clock, `tandem.geometry.BatchGeometry`) are derived from it once, on first use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Sequence

from tandem.config import RolloutConfig, TrainConfig
from tandem.geometry import BatchGeometry
from tandem.train.arms import ArmSpec, arm_spec


def world_size() -> int:
    """Processes of this training run (accelerate/torchrun set WORLD_SIZE in each of them)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class ArmRun:
    """One arm's training run: train `senior` (a fresh copy of the base) next to the frozen `junior` (another copy).

    `train_rows`/`val_rows` are prepared rows (id, answer, prompt = the user message); checkpoints land in
    `arm_dir/step-<N>/`. `report_to` defaults to `train.report_to` in `train_arm` (to none in `build_trainer`).
    `engine` defaults to the factory's engine for `rollout`; `score_fn` replaces math-verify scoring (tests);
    `stop_after` ends the run after that many steps of this call (benchmarks); `weight_roots` are directories a
    vLLM rollout service started here may load weights from (the run's output root), besides the junior's.
    `base` is the senior's frozen base when the junior is a model of its own (`junior.source` other than base):
    the reference of the KL-to-base diagnostic and of kl_reg; None when the junior is the base itself.
    `on_save` is called by the main process with each checkpoint folder once it is complete (`step-<N>/`), e.g. to
    copy the resume state to a store that outlives the worker; None: nothing.
    """

    arm: str
    senior: Any
    junior: Any
    tokenizer: Any
    train_rows: Sequence[dict]
    train: TrainConfig
    rollout: RolloutConfig
    arm_dir: Path
    seed: int = 0
    val_rows: Sequence[dict] = ()
    report_to: str | None = None
    engine: Any = None
    score_fn: Callable[..., list[float]] | None = None
    progress: bool = True
    stop_after: int | None = None
    weight_roots: Sequence[str | os.PathLike] = ()
    base: Any = None  # the senior's base when the junior is another model (the KL-to-base reference); None: the junior
    on_save: Callable[[Path], None] | None = None

    def __post_init__(self):
        object.__setattr__(self, "arm_dir", Path(self.arm_dir))

    @cached_property
    def spec(self) -> ArmSpec:
        return arm_spec(self.arm, self.train, self.rollout)

    @cached_property
    def geometry(self) -> BatchGeometry:
        """The cut of one rollout batch over this run's processes; raises ValueError when it does not split."""
        return BatchGeometry.of(self.train, self.spec.group_size, world_size())
