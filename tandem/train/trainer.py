"""One arm end to end on trl's `GRPOTrainer`: the trl config, the trainer subclass, `train_arm`.

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
import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import TrainerCallback

from tandem.config import TrainConfig
from tandem.errors import DiskFullError, NonFiniteLossError, disk_full_error
from tandem.geometry import BatchGeometry
from tandem.guards import NonFiniteGuard
from tandem.rollout.request import RolloutSettings
from tandem.train.arms import run_fingerprint
from tandem.train.callbacks import JuniorGuard, PhaseTimer, ProgressBar, StopAfter, Validation
from tandem.checkpoints import STAGING_PREFIX, STEP_PREFIX
from tandem.checkpoints import (clean_arm_dir, commit_dir, complete_checkpoints, latest_checkpoint, read_state,
                                resume_checkpoint, write_state)
from tandem.rollout.factory import rollout_engine
from tandem.train.one_call import step_engine
from tandem.threads import torch_threads
from tandem.train.checkpoints import wipe_arm_dir
from tandem.train.numerics import weights_hash
from tandem.train.run import ArmRun, world_size
from tandem.train.reward import CorrectnessReward
from tandem.train.rollout import TandemRollout, sampling_params
from tandem.train.stats import StepStats
from tandem.train.summary import SKIPPED_KEY, all_updates_skipped, first_value, summarize

STEP_KEY = "tandem/step"  # the training step (rollout batch) of a log entry; trl's "step" counts updates


# --------------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------------

def merge_rank_stats(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """One step's diagnostics from every process's own: times take the slowest process (the step waits for
    it), other values the mean over the processes that have a finite value (each rolled out an equal share)."""
    out: dict[str, float] = {}
    for key in sorted({k for d in per_rank for k in d}):
        vals = [float(d[key]) for d in per_rank if key in d and math.isfinite(float(d[key]))]
        out[key] = (max(vals) if key.startswith("time/") else sum(vals) / len(vals)) if vals else float("nan")
    return out


# --------------------------------------------------------------------------------------------------
# trl's config and the trainer subclass
# --------------------------------------------------------------------------------------------------

def precision_kwargs(train: TrainConfig, junior) -> dict:
    """GRPOConfig's precision settings: `train.precision` on this device (tandem/precision.py decides: fp32, or
    fp32 master weights with bf16 autocast on CUDA), with trl's reference copy in the junior's dtype."""
    from tandem.precision import trainer_precision_kwargs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return trainer_precision_kwargs(train, device, str(junior.dtype).removeprefix("torch."))


def grpo_config(run: ArmRun, precision: dict | None = None):
    """trl's GRPOConfig for one arm: one rollout batch of prompts_per_step x group_size per step, cut by the
    run's geometry into `geometry.updates` optimizer updates of accumulated micro-batches, written to
    `run.arm_dir`. `precision`: GRPOConfig keywords (see `precision_kwargs`; default fp32)."""
    from trl import GRPOConfig

    from tandem.precision import OPTIMIZER

    spec, train, geo, seed = run.spec, run.train, run.geometry, run.seed
    report_to = run.report_to or "none"
    return GRPOConfig(
        output_dir=str(run.arm_dir), run_name=spec.name, seed=seed, data_seed=seed,
        use_cpu=not torch.cuda.is_available(), **(precision or {"bf16": False, "fp16": False}),
        activation_checkpointing=train.gradient_checkpointing,
        per_device_train_batch_size=geo.micro_batch_size, gradient_accumulation_steps=geo.grad_accum,
        generation_batch_size=geo.rollout_rows, num_generations=spec.group_size, num_iterations=1,
        # trl counts optimizer updates; a tandem step is one rollout batch of `geo.updates` updates
        max_steps=geo.to_updates(train.steps), warmup_steps=geo.to_updates(train.warmup_steps),
        save_steps=geo.to_updates(train.save_every), logging_steps=geo.to_updates(1),
        learning_rate=train.learning_rate, lr_scheduler_type=train.lr_schedule, optim=OPTIMIZER,
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


class _UsedModelInitKwargs(logging.Filter):
    """Drops trl's false "model_init_kwargs will be ignored" record (see where it is installed)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "`model_init_kwargs` will be ignored" not in record.getMessage()


def _make_trainer_class():
    """Subclass trl's GRPOTrainer lazily (importing trl costs seconds; keep `import tandem.train` cheap)."""
    import warnings

    from trl import GRPOTrainer

    # trl 1.16 still calls transformers' deprecated alias once per step; the warning says nothing about this run
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
    # trl warns at WARNING that `model_init_kwargs` are ignored for an instantiated model, but it does use them:
    # they load the KL reference model in the junior's dtype (tandem.precision). A healthy run logs no warning.
    trl_log = logging.getLogger("trl.trainer.grpo_trainer")
    if not any(isinstance(f, _UsedModelInitKwargs) for f in trl_log.filters):
        trl_log.addFilter(_UsedModelInitKwargs())

    class TandemGRPOTrainer(GRPOTrainer):
        """GRPOTrainer + tandem diagnostics in every training log + atomic `step-<N>` checkpoints."""

        def __init__(self, *args, step_stats: StepStats, tandem_state: dict, geometry: BatchGeometry,
                     on_save: Callable[[Path], None] | None = None, **kwargs):
            self.step_stats = step_stats
            self.on_save = on_save  # called by the main process with each complete step-<N> folder
            self.tandem_state = dict(tandem_state)
            self.geometry = geometry
            self._skipped_logged = 0  # NonFiniteGuard's skipped updates already in a step's log (SKIPPED_KEY)
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
                logs[STEP_KEY] = self.geometry.step_of(self.state.global_step)
                guard = next((cb for cb in self.callback_handler.callbacks if isinstance(cb, NonFiniteGuard)), None)
                if guard is not None:  # the updates of this step skipped as non-finite (all_updates_skipped)
                    skipped = len(guard.skipped_steps)
                    logs[SKIPPED_KEY] = skipped - self._skipped_logged
                    self._skipped_logged = skipped
            super().log(logs, start_time)

        def create_model_card(self, *args, **kwargs):
            return None  # a hub model card per checkpoint folder is noise here


        def _save_checkpoint(self, model, trial):
            updates = self.state.global_step
            staging = Path(self._get_output_dir(trial=trial)) / f"{STAGING_PREFIX}{updates}"
            saved = None  # the committed step-<N> folder, on the main process
            try:
                super()._save_checkpoint(model, trial)  # every rank writes its part (its RNG state at least)
                step = self.geometry.step_of(updates)
                self.accelerator.wait_for_everyone()  # every rank's files are in the staging folder
                if self.accelerator.is_main_process:
                    state = {**self.tandem_state, "step": step, "optimizer_updates": updates,
                             "prompts_seen": step * self.tandem_state["prompts_per_step"],
                             "saved_at": time.time(), "complete": True}
                    write_state(staging, state)  # with the checksum of every file, verified on every later read
                    saved = staging.parent / f"{STEP_PREFIX}{step}"
                    commit_dir(staging, saved)
            except Exception as e:
                # torch's writer reports a full disk as "basic_ios::clear: iostream error": say what happened
                full = disk_full_error(e, staging.parent)
                if full is not None:
                    raise DiskFullError(staging, full.free) from e
                raise
            if saved is not None and self.on_save is not None:
                self.on_save(saved)  # its errors are its own, not this disk's (outside the disk-full translation)
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


def train_arm(run: ArmRun) -> ArmResult:
    """Train one arm (`ArmRun`: the senior, a fresh copy of the base, next to the frozen junior, another copy).

    Checkpoints land in `run.arm_dir/step-<N>/`; with `train.resume == "auto"` the run continues from the last
    complete checkpoint of the same run (same fingerprint), and checkpoints of a different run are removed
    first. Under `accelerate launch` every process calls this; the main process alone removes stale
    checkpoints and publishes new ones.
    """
    if not run.train_rows:
        raise ValueError("train_arm needs at least one training row")
    missing = [k for k in ("prompt", "answer") if k not in run.train_rows[0]]
    if missing:
        raise ValueError(f"training rows lack {missing}: expected prepared rows (id, problem, answer, prompt)")
    run.spec  # an unknown arm or an arm the settings do not allow fails here, before any work
    with torch_threads(run.train.cpu_threads):  # rollouts included: tiny models gain nothing from more threads
        return _train_arm(run)


def _train_arm(run: ArmRun) -> ArmResult:
    ranks = _Ranks()
    spec, train, senior, junior, arm_dir = run.spec, run.train, run.senior, run.junior, run.arm_dir
    geo = run.geometry  # fail on a batch that does not split before any work
    arm_dir.mkdir(parents=True, exist_ok=True)
    shared = {p.data_ptr() for p in senior.parameters()} & {p.data_ptr() for p in junior.parameters()}
    if shared:
        raise ValueError("senior and junior share parameters: load the junior as a separate copy of the base")
    for m in (junior,) if run.base is None else (junior, run.base):
        for p in m.parameters():
            p.requires_grad_(False)
        m.eval()
    guard = JuniorGuard(junior)
    # the run is its weights: the junior's, and the senior's base when that is another model
    weights_key = guard.before if run.base is None else f"{guard.before}:{weights_hash(run.base)}"
    fingerprint = run_fingerprint(spec, train, run.rollout, run.seed, weights_key)
    removed: list[str] = []
    resume_from = None
    if ranks.is_main:
        removed = clean_arm_dir(arm_dir, fingerprint) if train.resume == "auto" else wipe_arm_dir(arm_dir)
        # the main process verifies the resume point (every file against its recorded checksum) for all ranks
        resume_from = resume_checkpoint(arm_dir, fingerprint) if train.resume == "auto" else None
    ranks.barrier()  # every rank picks its resume point after the main process has cleaned up
    if not ranks.is_main and train.resume == "auto":
        resume_from = latest_checkpoint(arm_dir, fingerprint)
    done_before = read_state(resume_from)["step"] if resume_from else 0

    t0 = time.perf_counter()
    distributed = "NO" if ranks.world == 1 else None
    if done_before >= train.steps:  # a finished run: nothing to train, the history is in its last checkpoint
        history = json.loads((resume_from / "trainer_state.json").read_text())["log_history"]
        guard.on_train_end(None, None, None)
    else:
        trainer = build_trainer(replace(run, report_to=run.report_to or train.report_to), fingerprint, guard)
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
        history = list(trainer.state.log_history)
        distributed = trainer.accelerator.distributed_type.value  # MULTI_CPU / MULTI_GPU (DDP), FSDP, ...
        if train.sharding == "fsdp" and distributed != "FSDP":
            raise RuntimeError(f"train.sharding is fsdp but accelerate trained with {distributed}: launch through "
                               "the train stage on GPUs (accelerate enables FSDP on accelerator devices only)")
        if guard.after is None:
            guard.on_train_end(None, None, None)
    ranks.barrier()
    if all_updates_skipped(history, geo.updates):  # the weights never moved: refuse before anything is published
        n = sum(1 for h in history if "loss" in h and "step" in h)
        raise NonFiniteLossError(
            f"train: arm {run.arm}: every optimizer update of the run ({n} steps x {geo.updates}) was skipped because "
            f"its loss or gradient was NaN or infinite (train.nonfinite_loss: skip), so the weights never changed and "
            f"nothing is published. Check the base model (non-finite or wrongly cast weights), model.dtype and "
            f"train.precision, or lower train.learning_rate, then rerun")
    ckpts = [p.name for _, p in complete_checkpoints(arm_dir)]
    summary = summarize(run.arm, history, spec, train)
    summary.update({
        "wall_seconds_this_run": time.perf_counter() - t0, "resumed_from": resume_from.name if resume_from else None,
        "removed_stale": removed, "checkpoints": ckpts, "fingerprint": fingerprint,
        "junior_hash_before": guard.before, "junior_hash_after": guard.after,
        "junior_unchanged": guard.before == guard.after,
        "val_accuracy_initial": first_value(history, "val/accuracy_initial"),
        "world_size": ranks.world, "distributed": distributed, "updates_per_batch": geo.updates, "micro_batch_size": geo.micro_batch_size,
        "grad_accum": geo.grad_accum,
    })
    return ArmResult(run.arm, summary, history, ckpts)


def build_trainer(run: ArmRun, fingerprint: str, guard: JuniorGuard):
    """The `TandemGRPOTrainer` of one arm with its rollout function, reward and callbacks (not yet trained);
    `fingerprint` identifies the run in its checkpoints, `guard` holds the junior's hash before training."""
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback

    from tandem.data.prompts import render_prompt

    spec, train, rollout, tokenizer, junior, seed = run.spec, run.train, run.rollout, run.tokenizer, run.junior, run.seed
    geo = run.geometry
    stats = StepStats()
    ds = Dataset.from_list([{"prompt": render_prompt(r["prompt"], tokenizer), "answer": str(r["answer"]),
                             "id": str(r.get("id", i))} for i, r in enumerate(run.train_rows)])
    settings = RolloutSettings.from_config(rollout, sampling_params(train), kind=spec.schedule)
    rollout_fn = TandemRollout(run, settings, stats)
    reward = CorrectnessReward(stats, spec.group_size, train.score_timeout, train.score_workers, run.score_fn)
    callbacks: list[TrainerCallback] = [PhaseTimer(stats, geo), guard, NonFiniteGuard(train.nonfinite_loss)]
    if train.val_every > 0 and run.val_rows:
        callbacks.append(Validation(stats, tokenizer, list(run.val_rows)[:train.val_problems or None], train,
                                    geo, rollout.batch_size))
    if rollout.backend == "vllm":  # push the senior to the rollout service after every optimizer step
        from tandem.rollout.vllm.sync import VLLMWeightSync

        callbacks.append(VLLMWeightSync(lambda: rollout_fn.engine, stats))
    callbacks.append(ProgressBar(spec.name, enabled=run.progress))
    if run.stop_after is not None:
        callbacks.append(StopAfter(geo.to_updates(run.stop_after)))
    args = grpo_config(run, precision=precision_kwargs(train, junior))
    state0 = {"arm": spec.name, "fingerprint": fingerprint, "junior_hash": guard.before, "seed": seed,
              "prompts_per_step": train.prompts_per_step, "group_size": spec.group_size,
              "schedule": spec.schedule, "beta": spec.beta, "data_seed": seed, "train_rows": len(ds),
              "updates_per_batch": geo.updates, "world_size": geo.processes}
    trainer = _make_trainer_class()(
        model=run.senior, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tokenizer,
        rollout_func=rollout_fn, callbacks=callbacks, step_stats=stats, tandem_state=state0, geometry=geo,
        on_save=run.on_save)
    for cb in (ProgressCallback, PrinterCallback):  # one compact bar (ProgressBar) instead of a dict per step
        trainer.remove_callback(cb)
    junior.to(trainer.args.device)  # trl placed the senior; the junior decodes next to it
    if run.engine is None:  # built after trl moved the senior, so the engine sees both models on their device
        rollout_fn.engine = step_engine(lambda: rollout_engine(run.senior, junior, tokenizer, rollout, live=True,
                                                               roots=run.weight_roots,
                                                               trainer_processes=run.train.num_processes),
                                        rollout, trainer.accelerator)
    base_hash = guard.before if run.base is None else weights_hash(run.base)
    if run.base is not None:
        run.base.to(trainer.args.device)
    if trainer.ref_model is not None and weights_hash(trainer.ref_model) != base_hash:
        # trl loads the KL reference from the senior's own path: it must be the base the junior copies
        raise RuntimeError("the kl_reg reference model differs from the frozen base: load the senior from the "
                           "base directory, so that trl's reference is the base")
    return trainer
