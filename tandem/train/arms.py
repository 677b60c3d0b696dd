"""The training arms and the run fingerprint: what distinguishes one arm, and what makes two runs the same run."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from tandem.config import ARMS, RolloutConfig, TrainConfig
from tandem.run_keys import TRAJECTORY_KEYS

TANDEM_SCHEDULES = ("word", "step", "token")


@dataclass(frozen=True)
class ArmSpec:
    """What distinguishes one arm: rollout schedule, group size and KL weight toward the base."""

    name: str
    schedule: str
    group_size: int
    beta: float


def arm_spec(arm: str, train: TrainConfig, rollout: RolloutConfig) -> ArmSpec:
    """The settings of `arm`; every other setting is shared, so arms differ only where the paper says."""
    if arm == "tandem":
        if rollout.schedule not in TANDEM_SCHEDULES:
            raise ValueError(f"arm 'tandem' needs a tandem schedule ({', '.join(TANDEM_SCHEDULES)}), "
                             f"but rollout.schedule is {rollout.schedule!r}")
        return ArmSpec(arm, rollout.schedule, train.group_size, 0.0)
    if arm == "grpo":
        return ArmSpec(arm, "solo", train.group_size, 0.0)
    if arm == "kl_reg":
        if train.kl_beta <= 0:
            raise ValueError("arm 'kl_reg' needs train.kl_beta > 0 (it is solo GRPO plus the KL penalty)")
        return ArmSpec(arm, "solo", train.group_size, train.kl_beta)
    if arm == "grpo_g16":
        return ArmSpec(arm, "solo", 16, 0.0)
    raise ValueError(f"unknown arm {arm!r}; choose from {list(ARMS)}")


def run_fingerprint(spec: ArmSpec, train: TrainConfig, rollout: RolloutConfig, seed: int, base_hash: str) -> str:
    """Hash of every setting that changes the trajectory (`tandem.run_keys.TRAJECTORY_KEYS`), the arm's
    definition, the seed and the base weights: a checkpoint resumes only a run with the same one."""
    sections = {"train": train, "rollout": rollout}
    t, r = ({k: getattr(sections[name], k) for k in TRAJECTORY_KEYS[name]} for name in ("train", "rollout"))
    blob = json.dumps({"arm": asdict(spec), "train": t, "rollout": r, "seed": seed, "base": base_hash},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
