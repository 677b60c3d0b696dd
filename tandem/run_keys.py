"""What shapes a run, stated once: the settings keys that define a training arm's trajectory and an evaluation result.

Training (`train@<arm>`): every `train` and `rollout` setting falls in exactly one group (tests/test_run_keys.py
checks that a new setting is placed):
- `TRAJECTORY_KEYS` change what an arm learns. The resume fingerprint (`tandem.train.arms.run_fingerprint`)
  hashes them, with the arm's definition, the seed and the base weights: a checkpoint resumes only a run with
  the same values.
- `RESUMABLE_KEYS` shape how a run is carried out or recorded (checkpoint cadence, validation, engine, threads,
  tracking, the memory plan): the train stage reads them, so DVC declares them, but a checkpoint resumes
  across a change of them.
- `ARM_DEFINITION_KEYS` are what one arm's definition reads beyond those (`tandem.train.arms.arm_spec`: the
  tandem arm's schedule). DVC's `foreach` cannot give one arm params of its own (no nested `${}`), so every
  arm declares them.
- `RUNTIME_KEYS` change no output of an arm: the list of the other arms, where the rollout service runs, and
  how the `train.num_processes` processes are spread over machines (the same ranks and rows on one machine or
  several; verified bit for bit with gloo on loopback, tests/tasks/test_multi_machine.py).
  They are never declared, so adding an arm or moving the service leaves every trained arm up to date.

`train_stage_params()` is the `params:` list of `train@<arm>` in dvc.yaml, which `scripts/dvc_deps.py --write`
writes (and `--check` verifies) as it does the code deps.

Evaluation: `EVAL_RESULT_KEYS` (result field -> the params key it comes from) are the settings that shape the
sampled distribution of one evaluation result; `EVAL_MODE_ONLY` names the ones that matter in one mode only,
`EVAL_STREAM_KEYS` the ones that change the random stream but not the quantity estimated. The result cache's
key (`tandem.evaluation.EvalSettings.key_fields`), the settings recorded in `metrics/eval.json` and the
promotion gate's comparability fingerprint (`tandem.report.promotion.settings_fingerprint`) all derive from them.
"""

from __future__ import annotations

from functools import reduce
from typing import Any

# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------

TRAJECTORY_KEYS: dict[str, tuple[str, ...]] = {
    "train": ("steps", "prompts_per_step", "group_size", "learning_rate", "warmup_steps", "clip_epsilon",
              "kl_beta", "temperature", "max_new_tokens", "loss_type", "lr_schedule", "max_grad_norm",
              "gradient_checkpointing", "kl_rows", "micro_batch_size", "updates_per_batch", "num_processes",
              "sharding", "precision"),
    "rollout": ("p_senior", "max_gap_tokens", "max_rounds"),
}

RESUMABLE_KEYS: dict[str, tuple[str, ...]] = {
    "train": ("save_every", "resume", "report_to", "wandb_mode", "wandb_project", "val_every", "val_problems",
              "score_workers", "score_timeout", "cpu_threads", "nonfinite_loss", "gpu_memory_gib",
              "max_prompt_tokens"),
    "rollout": ("backend", "batch_size", "vllm_dtype", "vllm_max_model_len", "vllm_gpu_memory",
                "vllm_enforce_eager", "vllm_cpu_kv_cache_gb", "vllm_weight_transport"),
}

ARM_DEFINITION_KEYS: dict[str, tuple[str, ...]] = {"rollout": ("schedule",)}

RUNTIME_KEYS: dict[str, tuple[str, ...]] = {
    "train": ("arms", "num_machines", "shared_storage"),
    "rollout": ("vllm_url", "vllm_python", "vllm_host", "vllm_port", "vllm_start_timeout", "vllm_layout",
                "vllm_devices"),
}

# what else the train stage reads: the seed (fingerprinted), where outputs live, and how the base is loaded
TRAIN_STAGE_OTHER_KEYS = ("seed", "out_root", "model.dtype", "model.source", "model.trust_remote_code",
                          "junior.source")

TRAIN_KEY_GROUPS = {"trajectory": TRAJECTORY_KEYS, "resumable": RESUMABLE_KEYS,
                    "arm definition": ARM_DEFINITION_KEYS, "runtime": RUNTIME_KEYS}


def dotted(group: dict[str, tuple[str, ...]]) -> list[str]:
    """`{"train": ("steps",)}` -> `["train.steps"]`, in the order written."""
    return [f"{section}.{k}" for section, keys in group.items() for k in keys]


def train_stage_params() -> list[str]:
    """The params keys `train@<arm>` declares in dvc.yaml: every setting the stage reads but the runtime keys."""
    keys = dotted(TRAJECTORY_KEYS) + dotted(ARM_DEFINITION_KEYS) + dotted(RESUMABLE_KEYS)
    return list(TRAIN_STAGE_OTHER_KEYS) + sorted(keys)


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------

EVAL_RESULT_KEYS: dict[str, str] = {
    "n_samples": "evaluate.n_samples",
    "temperature": "evaluate.temperature",
    "top_p": "evaluate.top_p",
    "top_k": "evaluate.top_k",
    "max_new_tokens": "evaluate.max_new_tokens",
    "max_rounds": "evaluate.max_rounds",
    "p_senior": "rollout.p_senior",
    "max_gap_tokens": "rollout.max_gap_tokens",
    "seed": "seed",
}
EVAL_MODE_ONLY: dict[str, str] = {"max_rounds": "step", "p_senior": "word", "max_gap_tokens": "word"}
EVAL_STREAM_KEYS = ("seed",)  # two results under different seeds estimate the same pass@k


def eval_result_fields(mode: str | None = None) -> tuple[str, ...]:
    """The result fields that key a result of `mode` (None: of any mode), in `EVAL_RESULT_KEYS` order."""
    return tuple(k for k in EVAL_RESULT_KEYS if mode is None or EVAL_MODE_ONLY.get(k, mode) == mode)


def eval_estimate_fields() -> tuple[str, ...]:
    """The result fields that change what a pass@k estimates: two runs are comparable only when all agree."""
    return tuple(k for k in EVAL_RESULT_KEYS if k not in EVAL_STREAM_KEYS)


def setting(params: Any, key: str) -> Any:
    """The value of dotted settings key `key` (`rollout.p_senior`) in a `tandem.config.Params`."""
    return reduce(getattr, key.split("."), params)
