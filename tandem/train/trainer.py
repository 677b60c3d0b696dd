"""One arm end to end on trl's `GRPOTrainer`: batch geometry, the trl config, the trainer subclass, `train_arm`.

trl owns the GRPO maths (group-normalised advantages, PPO clip, token-mean loss, the optional k3 KL to a
reference model) and the loop. One training step, top to bottom, with the phase each part is timed under
(metric keys `time/<phase>`):

1. rollout   - `TandemRollout` (trl's `rollout_func`): each process rolls out its share of the rollout batch,
               `prompts_per_step / num_processes` prompts x `group_size` completions, with the tandem engine.
2. reward    - `CorrectnessReward` scores every joint completion (trl gathers the rewards of all processes).
   kl        - the KL-to-base diagnostic on a few rows (part of the rollout function).
3. advantage - trl's scoring pass: group-normalised advantages and, when a rollout batch feeds more than one
               update, the old log-probs of the rollout policy (so the PPO ratio can move off 1).
4. update    - `updates_per_batch` optimizer updates, each over `1 / updates_per_batch` of the rollout batch,
               split into micro-batches of `micro_batch_size` rows with gradient accumulation.

The phases 1-3 run inside trl's `_generate_and_score_completions` (timed as a whole by the trainer below, its
parts by the rollout function and the reward); `PhaseTimer` turns the times into the step's breakdown.

A *step* is one rollout batch (a GRPO iteration): `train.steps`, `save_every`, `warmup_steps` and `val_every`
count steps, and checkpoint `step-<N>` holds the weights after N complete steps, i.e. after N x
`updates_per_batch` optimizer updates (trl's `global_step`). Checkpoints are only taken at step boundaries,
so a resumed run starts with a fresh rollout, exactly where the uninterrupted run would.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import TrainerCallback

from tandem.config import RolloutConfig, TrainConfig
from tandem.guards import NonFiniteGuard
from tandem.rollout.request import RolloutSettings
from tandem.train.arms import ArmSpec, arm_spec, run_fingerprint
from tandem.train.callbacks import JuniorGuard, PhaseTimer, ProgressBar, StopAfter, Validation
from tandem.train.checkpoints import (STAGING_PREFIX, STEP_PREFIX, TANDEM_STATE, clean_arm_dir, commit_dir,
                                      complete_checkpoints, latest_checkpoint, wipe_arm_dir)
from tandem.train.numerics import weights_hash
from tandem.train.reward import CorrectnessReward
from tandem.train.rollout import TandemRollout, make_engine, sampling_params
from tandem.train.stats import StepStats
from tandem.train.summary import first_value, summarize

STEP_KEY = "tandem/step"  # the training step (rollout batch) of a log entry; trl's "step" counts updates


# --------------------------------------------------------------------------------------------------
# Batch geometry
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchGeometry:
    """How one rollout batch is cut: per process, per optimizer update, per forward/backward.

    `rollout_rows` = prompts_per_step x group_size completions per step (global, any number of processes);
    each process holds `rows_per_process`, of which each update uses `rows_per_update`, fed through
    `grad_accum` micro-batches of `micro_batch_size` rows. In trl's terms: `generation_batch_size` =
    rollout_rows, `per_device_train_batch_size` = micro_batch_size, `gradient_accumulation_steps` =
    grad_accum, `steps_per_generation` = updates x grad_accum (derived by trl).
    """

    rollout_rows: int
    processes: int
    updates: int
    rows_per_process: int
    rows_per_update: int
    micro_batch_size: int
    grad_accum: int

    @property
    def steps_per_generation(self) -> int:
        return self.updates * self.grad_accum


def batch_geometry(prompts_per_step: int, group_size: int, micro_batch_size: int = 0, updates: int = 1,
                   processes: int = 1) -> BatchGeometry:
    """The geometry of one step; raises ValueError naming the setting to change when the batch does not split.

    `micro_batch_size` 0 means one micro-batch per update (all of a process's update rows in one forward).
    """
    if prompts_per_step % processes:
        raise ValueError(f"train.prompts_per_step ({prompts_per_step}) must be a multiple of train.num_processes "
                         f"({processes}): each process rolls out whole prompt groups")
    rows = prompts_per_step * group_size
    per_proc = rows // processes
    if per_proc % updates:
        raise ValueError(f"the {per_proc} rows per process (prompts_per_step x group_size / num_processes) do not "
                         f"split into train.updates_per_batch = {updates} equal updates")
    per_update = per_proc // updates
    micro = micro_batch_size or per_update
    if per_update % micro:
        raise ValueError(f"train.micro_batch_size ({micro_batch_size}) must divide the {per_update} rows of one "
                         f"update on one process (prompts_per_step x group_size / num_processes / updates_per_batch)")
    return BatchGeometry(rows, processes, updates, per_proc, per_update, micro, per_update // micro)


def merge_rank_stats(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """One step's diagnostics from every process's own: times take the slowest process (the step waits for
    it), other values the mean over the processes that have a finite value (each rolled out an equal share)."""
    out: dict[str, float] = {}
    for key in sorted({k for d in per_rank for k in d}):
        vals = [float(d[key]) for d in per_rank if key in d and math.isfinite(float(d[key]))]
        out[key] = (max(vals) if key.startswith("time/") else sum(vals) / len(vals)) if vals else float("nan")
    return out


def world_size() -> int:
    """Processes of this training run (accelerate/torchrun set WORLD_SIZE in each of them)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# --------------------------------------------------------------------------------------------------
# trl's config and the trainer subclass
# --------------------------------------------------------------------------------------------------

def precision_kwargs(train: TrainConfig, junior) -> dict:
    """GRPOConfig's precision settings: `train.precision` on this device (tandem/precision.py decides: fp32, or
    fp32 master weights with bf16 autocast on CUDA), with trl's reference copy in the junior's dtype."""
    from tandem.precision import trainer_precision_kwargs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return trainer_precision_kwargs(train, device, str(junior.dtype).removeprefix("torch."))


def grpo_config(spec: ArmSpec, train: TrainConfig, out_dir: Path, seed: int, report_to: str,
                run_name: str, bf16: bool = False, processes: int | None = None, precision: dict | None = None):
    """trl's GRPOConfig for one arm: one rollout batch of prompts_per_step x group_size per step, cut by
    `batch_geometry` into `updates_per_batch` optimizer updates of accumulated micro-batches.
    `precision` (GRPOConfig keywords, see `precision_kwargs`) overrides `bf16`."""
    from trl import GRPOConfig

    geo = batch_geometry(train.prompts_per_step, spec.group_size, train.micro_batch_size,
                         train.updates_per_batch, processes or world_size())
    u = geo.updates
    return GRPOConfig(
        output_dir=str(out_dir), run_name=run_name, seed=seed, data_seed=seed,
        use_cpu=not torch.cuda.is_available(), **(precision or {"bf16": bf16, "fp16": False}),
        activation_checkpointing=train.gradient_checkpointing,
        per_device_train_batch_size=geo.micro_batch_size, gradient_accumulation_steps=geo.grad_accum,
        generation_batch_size=geo.rollout_rows, num_generations=spec.group_size, num_iterations=1,
        # trl counts optimizer updates; a tandem step is one rollout batch of `u` updates
        max_steps=train.steps * u, warmup_steps=train.warmup_steps * u, save_steps=train.save_every * u,
        logging_steps=u,
        learning_rate=train.learning_rate, lr_scheduler_type=train.lr_schedule,
        max_grad_norm=train.max_grad_norm, weight_decay=0.0,
        epsilon=train.clip_epsilon, beta=spec.beta, loss_type=train.loss_type, scale_rewards="group",
        temperature=train.temperature, top_p=1.0, top_k=0, max_completion_length=train.max_new_tokens,
        disable_dropout=True, entropy_coef=0.0, mask_truncated_completions=False,
        use_vllm=False,  # the engine generates (its vllm backend holds its own synced copy of the senior)
        save_strategy="steps", save_total_limit=None,
        report_to=[] if report_to == "none" else [report_to], disable_tqdm=True,
        dataloader_num_workers=0, remove_unused_columns=False, shuffle_dataset=True,
        log_completions=False,
        ddp_find_unused_parameters=False,  # every weight takes part in each forward: skip DDP's extra graph walk
    )


def _make_trainer_class():
    """Subclass trl's GRPOTrainer lazily (importing trl costs seconds; keep `import tandem.train` cheap)."""
    import warnings

    from trl import GRPOTrainer

    # trl 1.16 still calls transformers' deprecated alias once per step; the warning says nothing about this run
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)

    class TandemGRPOTrainer(GRPOTrainer):
        """GRPOTrainer + tandem diagnostics in every training log + atomic `step-<N>` checkpoints."""

        def __init__(self, *args, step_stats: StepStats, tandem_state: dict, **kwargs):
            self.step_stats = step_stats
            self.tandem_state = dict(tandem_state)
            self.updates_per_batch = int(tandem_state.get("updates_per_batch", 1))
            super().__init__(*args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            # rollout + reward + kl + advantage (see the module docstring); PhaseTimer splits it up
            with self.step_stats.timed("generate"):
                return super()._generate_and_score_completions(inputs)

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            if self.model.training and "loss" in logs:
                stats = self.step_stats.pop()
                if self.accelerator.num_processes > 1:  # every rank logs the same step together
                    from accelerate.utils import gather_object

                    stats = merge_rank_stats(gather_object([stats]))
                logs.update(stats)
                logs[STEP_KEY] = self.state.global_step // self.updates_per_batch
            super().log(logs, start_time)

        def create_model_card(self, *args, **kwargs):
            return None  # a hub model card per checkpoint folder is noise here

        def _save_checkpoint(self, model, trial):
            super()._save_checkpoint(model, trial)  # every rank writes its part (its RNG state at least)
            updates = self.state.global_step
            step = updates // self.updates_per_batch
            staging = Path(self._get_output_dir(trial=trial)) / f"{STAGING_PREFIX}{updates}"
            self.accelerator.wait_for_everyone()  # every rank's files are in the staging folder
            if self.accelerator.is_main_process:
                state = {**self.tandem_state, "step": step, "optimizer_updates": updates,
                         "prompts_seen": step * self.tandem_state["prompts_per_step"],
                         "saved_at": time.time(), "complete": True}
                (staging / TANDEM_STATE).write_text(json.dumps(state, indent=2) + "\n")
                commit_dir(staging, staging.parent / f"{STEP_PREFIX}{step}")
            self.accelerator.wait_for_everyone()  # no rank runs ahead of a checkpoint still being published

    return TandemGRPOTrainer


# --------------------------------------------------------------------------------------------------
# One arm end to end
# --------------------------------------------------------------------------------------------------

@dataclass
class ArmResult:
    arm: str
    summary: dict
    log_history: list[dict]
    checkpoints: list[str]


class _Ranks:
    """This process's place in a multi-process run (a single process is rank 0 of 1)."""

    def __init__(self):
        self.world = world_size()
        self.state = None
        if self.world > 1:
            from accelerate import PartialState

            # the same state TrainingArguments builds later (a singleton): it opens the process group
            self.state = PartialState(cpu=not torch.cuda.is_available())

    @property
    def is_main(self) -> bool:
        return self.state is None or self.state.is_main_process

    def barrier(self) -> None:
        if self.state is not None:
            self.state.wait_for_everyone()


def train_arm(arm: str, senior, junior, tokenizer, train_rows: Sequence[dict], train: TrainConfig,
              rollout: RolloutConfig, arm_dir: str | os.PathLike, seed: int = 0,
              val_rows: Sequence[dict] = (), report_to: str | None = None, engine=None,
              score_fn: Callable[..., list[float]] | None = None, progress: bool = True,
              stop_after: int | None = None, weight_roots: Sequence[str | os.PathLike] = ()) -> ArmResult:
    """Train one arm from `senior` (a fresh copy of the base) next to the frozen `junior` (another copy).

    `train_rows` are prepared rows (id, answer, prompt = the user message). Checkpoints land in
    `arm_dir/step-<N>/`; with `train.resume == "auto"` the run continues from the last complete checkpoint of
    the same run (same fingerprint), and checkpoints of a different run are removed first. `engine`
    defaults to `make_engine(senior, junior, tokenizer, rollout)`. `stop_after` ends the
    run after that many steps of this call (benchmarks). `weight_roots`: directories a vLLM rollout service
    started here may load weights from (the run's output root), besides the junior's. Under `accelerate launch` every process calls this;
    the main process alone removes stale checkpoints and publishes new ones.
    """
    if not train_rows:
        raise ValueError("train_arm needs at least one training row")
    missing = [k for k in ("prompt", "answer") if k not in train_rows[0]]
    if missing:
        raise ValueError(f"training rows lack {missing}: expected prepared rows (id, problem, answer, prompt)")
    spec = arm_spec(arm, train, rollout)
    threads = torch.get_num_threads()
    if train.cpu_threads > 0:
        # Tiny models gain nothing from a second thread, and OpenMP threads spin badly on an oversubscribed CPU
        torch.set_num_threads(train.cpu_threads)
    try:
        return _train_arm(arm, spec, senior, junior, tokenizer, train_rows, train, rollout, Path(arm_dir), seed,
                          val_rows, report_to, engine, score_fn, progress, stop_after, weight_roots)
    finally:
        torch.set_num_threads(threads)


def _train_arm(arm, spec, senior, junior, tokenizer, train_rows, train, rollout, arm_dir, seed, val_rows,
               report_to, engine, score_fn, progress, stop_after, weight_roots=()) -> ArmResult:
    ranks = _Ranks()
    geo = batch_geometry(train.prompts_per_step, spec.group_size, train.micro_batch_size, train.updates_per_batch,
                         ranks.world)  # fail on a batch that does not split before any work
    arm_dir.mkdir(parents=True, exist_ok=True)
    shared = {p.data_ptr() for p in senior.parameters()} & {p.data_ptr() for p in junior.parameters()}
    if shared:
        raise ValueError("senior and junior share parameters: load the junior as a separate copy of the base")
    for p in junior.parameters():
        p.requires_grad_(False)
    junior.eval()
    guard = JuniorGuard(junior)
    fingerprint = run_fingerprint(spec, train, rollout, seed, guard.before)
    removed: list[str] = []
    if ranks.is_main:
        removed = clean_arm_dir(arm_dir, fingerprint) if train.resume == "auto" else wipe_arm_dir(arm_dir)
    ranks.barrier()  # every rank picks its resume point after the main process has cleaned up
    resume_from = latest_checkpoint(arm_dir, fingerprint) if train.resume == "auto" else None
    done_before = json.loads((resume_from / TANDEM_STATE).read_text())["step"] if resume_from else 0

    t0 = time.perf_counter()
    distributed = "NO" if ranks.world == 1 else None
    if done_before >= train.steps:  # a finished run: nothing to train, the history is in its last checkpoint
        history = json.loads((resume_from / "trainer_state.json").read_text())["log_history"]
        guard.on_train_end(None, None, None)
    else:
        trainer = build_trainer(spec, senior, junior, tokenizer, train_rows, train, rollout, arm_dir, seed,
                                fingerprint, guard, val_rows, report_to or train.report_to, engine, score_fn,
                                progress, stop_after, weight_roots)
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
        history = list(trainer.state.log_history)
        distributed = trainer.accelerator.distributed_type.value  # MULTI_CPU / MULTI_GPU (DDP), FSDP, ...
        if train.sharding == "fsdp" and distributed != "FSDP":
            raise RuntimeError(f"train.sharding is fsdp but accelerate trained with {distributed}: launch through "
                               "the train stage on GPUs (accelerate enables FSDP on accelerator devices only)")
        if guard.after is None:
            guard.on_train_end(None, None, None)
    ranks.barrier()
    ckpts = [p.name for _, p in complete_checkpoints(arm_dir)]
    summary = summarize(arm, history, spec, train)
    summary.update({
        "wall_seconds_this_run": time.perf_counter() - t0, "resumed_from": resume_from.name if resume_from else None,
        "removed_stale": removed, "checkpoints": ckpts, "fingerprint": fingerprint,
        "junior_hash_before": guard.before, "junior_hash_after": guard.after,
        "junior_unchanged": guard.before == guard.after,
        "val_accuracy_initial": first_value(history, "val/accuracy_initial"),
        "world_size": ranks.world, "distributed": distributed, "updates_per_batch": geo.updates, "micro_batch_size": geo.micro_batch_size,
        "grad_accum": geo.grad_accum,
    })
    return ArmResult(arm, summary, history, ckpts)


def build_trainer(spec: ArmSpec, senior, junior, tokenizer, train_rows: Sequence[dict], train: TrainConfig,
                  rollout: RolloutConfig, arm_dir: Path, seed: int, fingerprint: str, guard: JuniorGuard,
                  val_rows: Sequence[dict] = (), report_to: str = "none", engine=None,
                  score_fn: Callable[..., list[float]] | None = None, progress: bool = True,
                  stop_after: int | None = None, weight_roots: Sequence[str | os.PathLike] = ()):
    """The `TandemGRPOTrainer` of one arm with its rollout function, reward and callbacks (not yet trained)."""
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback

    from tandem.data.prompts import render_prompt

    u = train.updates_per_batch
    stats = StepStats()
    ds = Dataset.from_list([{"prompt": render_prompt(r["prompt"], tokenizer), "answer": str(r["answer"]),
                             "id": str(r.get("id", i))} for i, r in enumerate(train_rows)])
    settings = RolloutSettings.from_config(rollout, sampling_params(train), schedule=spec.schedule)
    rollout_fn = TandemRollout(engine, tokenizer, spec, settings, stats, seed, base=junior, kl_rows=train.kl_rows,
                               updates_per_batch=u)
    reward = CorrectnessReward(stats, spec.group_size, train.score_timeout, train.score_workers, score_fn)
    callbacks: list[TrainerCallback] = [PhaseTimer(stats, u), guard, NonFiniteGuard(train.nonfinite_loss)]
    if train.val_every > 0 and val_rows:
        vr = list(val_rows)[:train.val_problems or None]
        callbacks.append(Validation(stats, tokenizer, [r["prompt"] for r in vr], [str(r["answer"]) for r in vr],
                                    train.val_every, train.max_new_tokens, rollout.batch_size,
                                    train.score_workers, updates_per_batch=u))
    if rollout.backend == "vllm":  # push the senior to the rollout service after every optimizer step
        from tandem.rollout.vllm.sync import VLLMWeightSync

        callbacks.append(VLLMWeightSync(lambda: rollout_fn.engine, stats))
    callbacks.append(ProgressBar(spec.name, enabled=progress))
    if stop_after is not None:
        callbacks.append(StopAfter(stop_after * u))
    args = grpo_config(spec, train, arm_dir, seed, report_to, run_name=spec.name,
                       precision=precision_kwargs(train, junior))
    state0 = {"arm": spec.name, "fingerprint": fingerprint, "junior_hash": guard.before, "seed": seed,
              "prompts_per_step": train.prompts_per_step, "group_size": spec.group_size,
              "schedule": spec.schedule, "beta": spec.beta, "data_seed": seed, "train_rows": len(ds),
              "updates_per_batch": u, "world_size": world_size()}
    trainer = _make_trainer_class()(
        model=senior, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tokenizer,
        rollout_func=rollout_fn, callbacks=callbacks, step_stats=stats, tandem_state=state0)
    for cb in (ProgressCallback, PrinterCallback):  # one compact bar (ProgressBar) instead of a dict per step
        trainer.remove_callback(cb)
    junior.to(trainer.args.device)  # trl placed the senior; the junior decodes next to it
    if engine is None:  # built after trl moved the senior, so the engine sees both models on their device
        rollout_fn.engine = make_engine(senior, junior, tokenizer, rollout, live=True, roots=weight_roots)
    if trainer.ref_model is not None and weights_hash(trainer.ref_model) != guard.before:
        # trl loads the KL reference from the senior's own path: it must be the base the junior copies
        raise RuntimeError("the kl_reg reference model differs from the frozen base: load the senior from the "
                           "base directory, so that trl's reference is the base")
    return trainer
