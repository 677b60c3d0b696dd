"""The batch geometry of a training run and its step clock: one rollout batch cut into updates and micro-batches.

A tandem *step* is one rollout batch (a GRPO iteration); trl counts optimizer *updates* (its `global_step`).
With `train.updates_per_batch` U, one step holds U updates. `BatchGeometry.of(train, ...)` derives the cut once
from the train config (as trl's `GRPOConfig.__post_init__` derives `steps_per_generation`), and the conversions
between the two clocks live on it: `to_updates(steps)` (steps -> trl units), `step_of(global_step)` and
`is_step_end(global_step)`. The divisibility rule of the cut is written once, in `split_problems`: the config
reports it as params problems, `batch_geometry` raises it. Pure Python (the memory plan imports it without torch).
"""

from __future__ import annotations

from dataclasses import dataclass


def split_problems(prompts_per_step: int, group_size: int, micro_batch_size: int, updates: int,
                   processes: int) -> list[tuple[str, str]]:
    """(train setting, rule) for every way the rollout batch fails to split; empty when it splits."""
    out: list[tuple[str, str]] = []
    if prompts_per_step % processes:
        out.append(("prompts_per_step", f"must be a multiple of train.num_processes ({processes}): "
                                        "each process rolls out whole prompt groups"))
    per_update = prompts_per_step * group_size / (processes * updates)
    if per_update != int(per_update):
        out.append(("updates_per_batch", "must divide the rows per process (prompts_per_step x group_size / "
                                         "num_processes)"))
    elif micro_batch_size and int(per_update) % micro_batch_size:
        out.append(("micro_batch_size", f"must divide the {per_update:g} rows of one update on one process "
                                        "(prompts_per_step x group_size / num_processes / updates_per_batch)"))
    return out


@dataclass(frozen=True)
class BatchGeometry:
    """How one rollout batch is cut: per process, per optimizer update, per forward/backward; the step clock.

    `rollout_rows` = prompts_per_step x group_size completions per step (global, any number of processes);
    each process holds `rows_per_process` (`prompts_per_process` prompt groups), of which each update uses
    `rows_per_update`, fed through `grad_accum` micro-batches of `micro_batch_size` rows. In trl's terms:
    `generation_batch_size` = rollout_rows, `per_device_train_batch_size` = micro_batch_size,
    `gradient_accumulation_steps` = grad_accum, `steps_per_generation` = updates x grad_accum (derived by trl).
    """

    rollout_rows: int
    processes: int
    updates: int
    rows_per_process: int
    rows_per_update: int
    micro_batch_size: int
    grad_accum: int
    prompts_per_process: int = 0

    @classmethod
    def of(cls, train, group_size: int | None = None, processes: int | None = None) -> "BatchGeometry":
        """The geometry of `train` (a `TrainConfig`) for an arm's `group_size` (default `train.group_size`) on
        `processes` (default `train.num_processes`); raises ValueError when the batch does not split."""
        return batch_geometry(train.prompts_per_step, group_size or train.group_size, train.micro_batch_size,
                              train.updates_per_batch, processes or train.num_processes)

    @property
    def steps_per_generation(self) -> int:
        return self.updates * self.grad_accum

    # the step clock: tandem steps (rollout batches) <-> trl's optimizer updates
    def to_updates(self, steps: int) -> int:
        """`steps` tandem steps in trl's unit (optimizer updates)."""
        return steps * self.updates

    def step_of(self, global_step: int) -> int:
        """The tandem step that trl's `global_step` (updates done) has completed."""
        return global_step // self.updates

    def is_step_end(self, global_step: int) -> bool:
        """Whether `global_step` updates close a tandem step (a whole rollout batch is used)."""
        return global_step % self.updates == 0


def batch_geometry(prompts_per_step: int, group_size: int, micro_batch_size: int = 0, updates: int = 1,
                   processes: int = 1) -> BatchGeometry:
    """The geometry of one step; raises ValueError naming the setting to change when the batch does not split.

    `micro_batch_size` 0 means one micro-batch per update (all of a process's update rows in one forward).
    """
    values = {"prompts_per_step": prompts_per_step, "updates_per_batch": updates, "micro_batch_size": micro_batch_size}
    problems = split_problems(prompts_per_step, group_size, micro_batch_size, updates, processes)
    if problems:
        key, rule = problems[0]
        raise ValueError(f"train.{key} ({values[key]}) {rule}")
    rows = prompts_per_step * group_size
    per_proc = rows // processes
    per_update = per_proc // updates
    micro = micro_batch_size or per_update
    return BatchGeometry(rows, processes, updates, per_proc, per_update, micro, per_update // micro,
                         prompts_per_step // processes)
