"""Tandem GRPO training on trl's `GRPOTrainer`: arms, rollout function, reward, callbacks, atomic checkpoints.

trl owns the GRPO maths (group-normalised advantages, PPO clip, token-mean loss, the optional k3 KL to a
reference model) and the loop; this package feeds it. By concern:

- `arms`        - the arms (`tandem`, `grpo`, `kl_reg`, `grpo_g16`) and the run fingerprint.
- `numerics`    - small pure tensor functions (k3 KL, zero-variance share, teacher-forced log-probs, weights hash).
- `stats`       - `StepStats`, the per-step diagnostics and phase times shared by the parts below.
- `rollout`     - `TandemRollout` (trl's `rollout_func`: one engine call per step and process, env_mask = the
                  owner mask), the gather of sharded weights around a rollout (the engine comes from
                  `tandem.rollout.factory.rollout_engine`).
- `reward`      - `CorrectnessReward`, the reward of the whole joint completion.
- `callbacks`   - phase timing, in-training validation, the junior guard, the progress bar.
- `checkpoints` - fsync'd `checkpoint-<N>` -> `step-<N>` commits and the discovery of complete checkpoints.
- `run`         - `ArmRun`, everything one arm's training run reads, with its spec and batch geometry.
- `trainer`     - trl's config, the trainer subclass and `train_arm` (the loop, top to bottom, is described
                  there); the batch geometry and the step clock they share are `tandem.geometry`.
- `summary`     - the run summary and the per-step table.

The names below are the package's public interface (`from tandem.train import train_arm`); the checkpoint
layout, the k3 KL and the log-prob function are imported from where they are defined (`tandem.checkpoints`,
`tandem.grpo`, `tandem.logprobs`).
"""

from tandem.train.arms import TANDEM_SCHEDULES, ArmSpec, arm_spec, run_fingerprint
from tandem.train.callbacks import JuniorGuard, PhaseTimer, ProgressBar, StopAfter, Validation
from tandem.train.checkpoints import wipe_arm_dir
from tandem.train.numerics import weights_hash, zero_variance_fraction
from tandem.train.reward import CorrectnessReward
from tandem.train.rollout import TandemRollout, full_weights, sampling_params
from tandem.train.stats import StepStats
from tandem.train.summary import PHASES, TABLE_COLUMNS, step_rows, summarize
from tandem.train.run import ArmRun, world_size
from tandem.train.trainer import ArmResult, build_trainer, grpo_config, train_arm

__all__ = [
    "TANDEM_SCHEDULES", "ArmSpec", "arm_spec", "run_fingerprint",
    "JuniorGuard", "PhaseTimer", "ProgressBar", "StopAfter", "Validation",
    "wipe_arm_dir", "weights_hash", "zero_variance_fraction",
    "CorrectnessReward", "TandemRollout", "full_weights", "sampling_params", "StepStats",
    "PHASES", "TABLE_COLUMNS", "step_rows", "summarize",
    "ArmRun", "ArmResult", "build_trainer", "grpo_config", "train_arm", "world_size",
]
