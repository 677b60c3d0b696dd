"""Tandem GRPO training on trl's `GRPOTrainer`: arms, rollout function, reward, diagnostics, atomic checkpoints.

trl owns the GRPO maths (group-normalised advantages, PPO clip, token-mean loss, the optional k3 KL to a
reference model). This module only feeds it:

- `TandemRollout` is trl's `rollout_func`. trl hands it the prompts already repeated once per generation; it
  tokenises them, calls the tandem engine once for the whole batch and returns `prompt_ids`,
  `completion_ids`, `logprobs` (the senior's sampling log-probs, 0 on junior tokens) and `env_mask` = the
  owner mask. trl multiplies `env_mask` into the loss mask (`completion_mask * tool_mask`), so junior tokens
  shape the context and the reward but get no gradient; `tests/test_train.py` proves it on the gradient.
- `CorrectnessReward` scores the whole joint completion with `tandem.rewards.score_many`.
- `TandemGRPOTrainer` adds the per-step tandem diagnostics to trl's logs (so they reach the progress bar,
  W&B through `report_to`, and `trainer_state.json`), and commits each checkpoint atomically: trl writes
  `checkpoint-<N>/` (a staging name no reader trusts), then a `tandem_state.json` is added and the directory
  is renamed to `step-<N>/` in one `os.replace`. A crash leaves at worst a staging directory, removed on the
  next start; `latest_checkpoint` only ever sees complete checkpoints.
- `train_arm` wires one arm end to end, resuming from the last complete checkpoint of a matching run.

Arms: `tandem` (word schedule), `grpo` (solo rollouts through the same engine, the matched control),
`kl_reg` (solo + trl's `beta` * k3 KL to the frozen base), `grpo_g16` (solo, 16 samples per prompt).

Step phases (metric keys `time/<phase>`): rollout (engine), reward (verifier), kl (the KL-to-base
diagnostic), update (everything else in the optimizer step: trl's log-prob pass, backward, optimizer).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from transformers import TrainerCallback

from tandem.config import ARMS, RolloutConfig, TrainConfig

TANDEM_STATE = "tandem_state.json"
STAGING_PREFIX = "checkpoint-"  # what trl/transformers writes; renamed to step-<N> once complete
STEP_PREFIX = "step-"
TANDEM_SCHEDULES = ("word", "step", "token")


# --------------------------------------------------------------------------------------------------
# Arms
# --------------------------------------------------------------------------------------------------

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
    """Hash of every setting that changes the trajectory: a checkpoint resumes only a run with the same one."""
    skip = {"arms", "save_every", "resume", "report_to", "wandb_mode", "wandb_project", "val_every",
            "val_problems", "score_workers", "score_timeout", "cpu_threads"}
    t = {k: v for k, v in asdict(train).items() if k not in skip}
    r = {k: getattr(rollout, k) for k in ("p_senior", "max_gap_tokens", "max_rounds")}
    blob = json.dumps({"arm": asdict(spec), "train": t, "rollout": r, "seed": seed, "base": base_hash},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------
# Small pure functions
# --------------------------------------------------------------------------------------------------

def k3_kl_BT(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per sampled token: exp(d) - d - 1 with d = ref - logp.

    Naive equivalent: `[[math.exp(r - l) - (r - l) - 1 for l, r in zip(lrow, rrow)] for ...]`. Unbiased for
    KL(pi || ref) when the tokens are sampled from pi, and >= 0 for every token. trl's KL penalty uses the same.
    """
    d_BT = ref_logp_BT - logp_BT
    return torch.exp(d_BT) - d_BT - 1.0


def zero_variance_fraction(rewards_B: Sequence[float], group_size: int) -> float:
    """Share of prompt groups (consecutive runs of `group_size` rewards) whose rewards are all equal.

    Such groups have zero advantage everywhere: they cost compute and teach nothing.
    """
    if group_size < 1 or len(rewards_B) % group_size:
        raise ValueError(f"{len(rewards_B)} rewards do not split into groups of {group_size}")
    groups = [rewards_B[i:i + group_size] for i in range(0, len(rewards_B), group_size)]
    return sum(max(g) == min(g) for g in groups) / max(len(groups), 1)


@torch.no_grad()
def token_logprobs_B(model, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                     temperature: float, pad_id: int, chunk_rows: int = 4) -> list[list[float]]:
    """Log-prob under `model` (logits / temperature) of every completion token, one list per row.

    Rows are right-padded so every row starts at position 0 (no position shift from padding). Rows go through
    the model `chunk_rows` at a time and only completion positions are normalised, so the full-vocabulary
    logits of the whole batch never exist at once (16 rows x 300 tokens x 49k vocabulary is ~1 GB in float32).
    """
    device = next(model.parameters()).device
    out: list[list[float]] = []
    for s0 in range(0, len(prompt_ids), max(chunk_rows, 1)):
        ps, cs = prompt_ids[s0:s0 + chunk_rows], completion_ids[s0:s0 + chunk_rows]
        seqs = [list(p) + list(c) for p, c in zip(ps, cs)]
        width = max(len(s) for s in seqs)
        ids_BT = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        attn_BT = torch.zeros((len(seqs), width), dtype=torch.long)
        for b, s in enumerate(seqs):
            ids_BT[b, :len(s)] = torch.tensor(s)
            attn_BT[b, :len(s)] = 1
        logits_BTV = model(input_ids=ids_BT.to(device), attention_mask=attn_BT.to(device)).logits
        for b, (p, c) in enumerate(zip(ps, cs)):
            pos_T = torch.arange(len(p) - 1, len(p) + len(c) - 1, device=device)
            tgt_T = torch.tensor(list(c), dtype=torch.long, device=device)
            z_TV = logits_BTV[b, pos_T].float() / temperature
            out.append((z_TV.gather(-1, tgt_T[:, None])[:, 0] - torch.logsumexp(z_TV, -1)).tolist())
        del logits_BTV
    return out


def weights_hash(model) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes) in name order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# Per-step diagnostics shared by the rollout function, the reward and the callbacks
# --------------------------------------------------------------------------------------------------

@dataclass
class StepStats:
    """Diagnostics of the step in flight; `pop` hands them to the trainer's log and starts afresh."""

    values: dict[str, float] = field(default_factory=dict)
    phase_s: dict[str, float] = field(default_factory=dict)

    def add_time(self, phase: str, seconds: float) -> None:
        self.phase_s[phase] = self.phase_s.get(phase, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        out = dict(self.values)
        out.update({f"time/{k}": v for k, v in self.phase_s.items()})
        self.values, self.phase_s = {}, {}
        return out


# --------------------------------------------------------------------------------------------------
# trl hooks: rollout function and reward
# --------------------------------------------------------------------------------------------------

class TandemRollout:
    """trl `rollout_func`: one engine call per step over the repeated prompts; env_mask = owner mask.

    `engine` follows `tandem.rollout.engine.TandemEngine` (its senior is the very module trl trains, so
    rollouts always use the current weights). `base` is the frozen base model used for the KL-to-base
    diagnostic on `kl_rows` rows per step (0 turns it off).
    """

    def __init__(self, engine, tokenizer, spec: ArmSpec, sampling, stats: StepStats, seed: int,
                 p_senior: float = 0.5, max_gap_tokens: int = 32, max_rounds: int = 150,
                 batch_size: int | None = None, base=None, kl_rows: int = 16):
        self.engine, self.tokenizer, self.spec, self.sampling = engine, tokenizer, spec, sampling
        self.stats, self.seed = stats, seed
        self.p_senior, self.max_gap_tokens, self.max_rounds, self.batch_size = (
            p_senior, max_gap_tokens, max_rounds, batch_size)
        self.base, self.kl_rows = base, kl_rows
        self._prompt_cache: dict[str, list[int]] = {}

    def step_seed(self, step: int) -> int:
        # Derived from the step, not from a running RNG: a resumed run draws the same rollouts.
        return (self.seed * 1_000_003 + step * 7_919) % (2**31 - 1)

    def _encode(self, prompt: str) -> list[int]:
        if prompt not in self._prompt_cache:
            self._prompt_cache[prompt] = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return self._prompt_cache[prompt]

    def __call__(self, prompts: list, trainer) -> dict[str, Any]:
        if prompts and not isinstance(prompts[0], str):
            raise TypeError("TandemRollout expects prompts rendered to text (see tandem.data.prompts.render_prompt)")
        if len(prompts) % self.spec.group_size:
            raise ValueError(f"{len(prompts)} prompts do not form groups of {self.spec.group_size}: trl must "
                             f"repeat each prompt num_generations times")
        t0 = time.perf_counter()
        prompt_ids = [self._encode(p) for p in prompts]
        was_training = trainer.model.training
        trainer.model.eval()
        try:
            batch = self.engine.generate(prompt_ids, self.spec.schedule, self.sampling,
                                         seed=self.step_seed(trainer.state.global_step), p_senior=self.p_senior,
                                         max_gap_tokens=self.max_gap_tokens, max_rounds=self.max_rounds,
                                         batch_size=self.batch_size)
        finally:
            trainer.model.train(was_training)
        completion_ids, owner, logprobs = (list(map(list, batch.completion_ids)), list(map(list, batch.owner)),
                                           list(map(list, batch.senior_logprobs)))
        if not (len(completion_ids) == len(owner) == len(logprobs) == len(prompts)):
            raise RuntimeError(f"engine returned {len(completion_ids)} completions for {len(prompts)} prompts")
        eos = self.tokenizer.eos_token_id
        for b, ids in enumerate(completion_ids):
            if len(owner[b]) != len(ids) or len(logprobs[b]) != len(ids):
                raise RuntimeError(f"row {b}: owner/logprobs lengths differ from its {len(ids)} tokens")
            if not ids:  # trl reads ids[-1]; an empty completion becomes a lone EOS that trains nothing
                completion_ids[b], owner[b], logprobs[b] = [eos], [0], [0.0]
        self.stats.add_time("rollout", time.perf_counter() - t0)
        st = batch.stats()
        n_tok = sum(len(c) for c in completion_ids)
        self.stats.values.update({
            "tandem/senior_fraction": float(st["senior_fraction"]),
            "tandem/handoffs_per_100": float(st["handoffs_per_100"]),
            "tandem/handoffs": sum(batch.handoffs) / len(prompts),
            "tandem/mean_run_length": float(st["mean_run_length"]),
            "tandem/joint_length": n_tok / len(prompts),
            "tandem/senior_tokens": sum(map(sum, owner)) / len(prompts),
            "tandem/truncated": sum(r != "eos" for r in batch.finish_reason) / len(prompts),
        })
        if self.base is not None and self.kl_rows > 0:
            t1 = time.perf_counter()
            self.stats.values["tandem/kl_to_base"] = self.kl_to_base(prompt_ids, completion_ids, owner, logprobs)
            self.stats.add_time("kl", time.perf_counter() - t1)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs,
                "env_mask": owner}

    def kl_to_base(self, prompt_ids, completion_ids, owner, logprobs) -> float:
        """k3 estimate of KL(senior || base) per senior token, on an even spread of `kl_rows` rows.

        The senior's tokens are sampled from the senior given the shared history, so k3 on them with the
        sampling log-probs is an unbiased estimate of the per-token KL at those positions.
        """
        n = len(prompt_ids)
        rows = sorted({int(i * n / min(self.kl_rows, n)) for i in range(min(self.kl_rows, n))})
        ref = token_logprobs_B(self.base, [prompt_ids[i] for i in rows], [completion_ids[i] for i in rows],
                               self.sampling.temperature, self.tokenizer.pad_token_id)
        tot, cnt = 0.0, 0
        for j, i in enumerate(rows):
            m_T = torch.tensor(owner[i], dtype=torch.float32)
            kl_T = k3_kl_BT(torch.tensor(logprobs[i]), torch.tensor(ref[j]))
            tot += float((kl_T * m_T).sum())
            cnt += int(m_T.sum())
        return tot / cnt if cnt else float("nan")


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


# --------------------------------------------------------------------------------------------------
# Callbacks and the trainer
# --------------------------------------------------------------------------------------------------

class PhaseTimer(TrainerCallback):
    """Wall time of each optimizer step; `update` = step minus the rollout, reward and kl phases."""

    def __init__(self, stats: StepStats):
        self.stats, self._t0 = stats, None

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._t0 is None:
            return
        total = time.perf_counter() - self._t0
        other = sum(v for k, v in self.stats.phase_s.items() if k in ("rollout", "reward", "kl"))
        self.stats.phase_s["update"] = max(total - other, 0.0)
        self.stats.phase_s["step"] = total
        self._t0 = None


class Validation(TrainerCallback):
    """Solo greedy accuracy of the senior on held-out rows every `every` steps (and before the first step)."""

    def __init__(self, stats: StepStats, tokenizer, messages: Sequence[str], golds: Sequence[str], every: int,
                 max_new_tokens: int, batch_size: int = 64, score_workers: int = 1):
        self.stats, self.tokenizer, self.messages, self.golds = stats, tokenizer, list(messages), list(golds)
        self.every, self.max_new_tokens, self.batch_size, self.score_workers = (
            every, max_new_tokens, batch_size, score_workers)
        self.initial: float | None = None

    def _measure(self, model) -> float:
        from tandem.models import accuracy

        return float(accuracy(model, self.tokenizer, self.messages, self.golds, self.max_new_tokens,
                              temperature=0.0, batch_size=self.batch_size,
                              score_workers=self.score_workers)["accuracy"])

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:  # the base's accuracy: the reference every later value is read against
            self.initial = self._measure(model)
            self.stats.values["val/accuracy_initial"] = self.initial

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    # Data on disk before the rename publishes it: a power cut must not leave a named but empty checkpoint.
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def commit_dir(staging: Path, final: Path) -> None:
    """Make `staging` appear as `final` in one rename (replacing an older `final` if any)."""
    _fsync_tree(staging)
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
            super().__init__(*args, **kwargs)

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            if self.model.training and "loss" in logs:
                logs.update(self.step_stats.pop())
            super().log(logs, start_time)

        def create_model_card(self, *args, **kwargs):
            return None  # a hub model card per checkpoint folder is noise here

        def _save_checkpoint(self, model, trial):
            super()._save_checkpoint(model, trial)
            step = self.state.global_step
            staging = Path(self._get_output_dir(trial=trial)) / f"{STAGING_PREFIX}{step}"
            state = {**self.tandem_state, "step": step, "prompts_seen": step * self.tandem_state["prompts_per_step"],
                     "saved_at": time.time(), "complete": True}
            (staging / TANDEM_STATE).write_text(json.dumps(state, indent=2) + "\n")
            commit_dir(staging, staging.parent / f"{STEP_PREFIX}{step}")

    return TandemGRPOTrainer


# --------------------------------------------------------------------------------------------------
# Checkpoint discovery
# --------------------------------------------------------------------------------------------------

def complete_checkpoints(arm_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete `step-<N>` checkpoint under `arm_dir`, by step."""
    arm_dir = Path(arm_dir)
    out = []
    if not arm_dir.is_dir():
        return out
    for p in arm_dir.iterdir():
        if not (p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX):].isdigit()):
            continue
        needed = (TANDEM_STATE, "trainer_state.json", "config.json")
        if all((p / f).exists() for f in needed) and list(p.glob("*.safetensors")):
            out.append((int(p.name[len(STEP_PREFIX):]), p))
    return sorted(out)


def latest_checkpoint(arm_dir: str | os.PathLike, fingerprint: str | None = None) -> Path | None:
    """The last complete checkpoint (of the run with `fingerprint`, when given), or None."""
    for _, p in reversed(complete_checkpoints(arm_dir)):
        if fingerprint is None or json.loads((p / TANDEM_STATE).read_text()).get("fingerprint") == fingerprint:
            return p
    return None


def clean_arm_dir(arm_dir: Path, fingerprint: str) -> list[str]:
    """Remove staging leftovers of a crash and checkpoints of a different run; returns what was removed."""
    removed = []
    if not arm_dir.is_dir():
        return removed
    for p in arm_dir.iterdir():
        stale = p.name.startswith((STAGING_PREFIX, ".old-"))
        if p.is_dir() and p.name.startswith(STEP_PREFIX):
            st = p / TANDEM_STATE
            stale = not st.exists() or json.loads(st.read_text()).get("fingerprint") != fingerprint
        if stale:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


# --------------------------------------------------------------------------------------------------
# One arm end to end
# --------------------------------------------------------------------------------------------------

@dataclass
class ArmResult:
    arm: str
    summary: dict
    log_history: list[dict]
    checkpoints: list[str]


def grpo_config(spec: ArmSpec, train: TrainConfig, out_dir: Path, seed: int, report_to: str,
                run_name: str, bf16: bool = False):
    """trl's GRPOConfig for one arm: one optimizer step per rollout batch of prompts_per_step x group_size."""
    from trl import GRPOConfig

    rows = train.prompts_per_step * spec.group_size
    return GRPOConfig(
        output_dir=str(out_dir), run_name=run_name, seed=seed, data_seed=seed,
        use_cpu=not torch.cuda.is_available(), bf16=bf16, fp16=False,
        activation_checkpointing=train.gradient_checkpointing,
        per_device_train_batch_size=rows, gradient_accumulation_steps=1, num_generations=spec.group_size,
        max_steps=train.steps, learning_rate=train.learning_rate, lr_scheduler_type=train.lr_schedule,
        warmup_steps=train.warmup_steps, max_grad_norm=train.max_grad_norm, weight_decay=0.0,
        epsilon=train.clip_epsilon, beta=spec.beta, loss_type=train.loss_type, scale_rewards="group",
        temperature=train.temperature, top_p=1.0, top_k=0, max_completion_length=train.max_new_tokens,
        num_iterations=1, disable_dropout=True, entropy_coef=0.0, mask_truncated_completions=False,
        use_vllm=False,  # the engine generates (its vllm backend holds its own synced copy of the senior)
        logging_steps=1, save_strategy="steps", save_steps=train.save_every, save_total_limit=None,
        report_to=[] if report_to == "none" else [report_to], disable_tqdm=True,
        dataloader_num_workers=0, remove_unused_columns=False, shuffle_dataset=True,
        log_completions=False,
    )


def train_arm(arm: str, senior, junior, tokenizer, train_rows: Sequence[dict], train: TrainConfig,
              rollout: RolloutConfig, arm_dir: str | os.PathLike, seed: int = 0,
              val_rows: Sequence[dict] = (), report_to: str | None = None, engine=None,
              score_fn: Callable[..., list[float]] | None = None, progress: bool = True,
              stop_after: int | None = None) -> ArmResult:
    """Train one arm from `senior` (a fresh copy of the base) next to the frozen `junior` (another copy).

    `train_rows` are prepared rows (id, answer, prompt = the user message). Checkpoints land in
    `arm_dir/step-<N>/`; with `train.resume == "auto"` the run continues from the last complete checkpoint of
    the same run (same fingerprint), and checkpoints of a different run are removed first. `engine`
    defaults to `make_engine(senior, junior, tokenizer, rollout)`. `stop_after` ends the
    run after that many steps of this call (benchmarks).
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
                          val_rows, report_to, engine, score_fn, progress, stop_after)
    finally:
        torch.set_num_threads(threads)


def _train_arm(arm, spec, senior, junior, tokenizer, train_rows, train, rollout, arm_dir, seed, val_rows,
               report_to, engine, score_fn, progress, stop_after) -> ArmResult:
    arm_dir.mkdir(parents=True, exist_ok=True)
    shared = {p.data_ptr() for p in senior.parameters()} & {p.data_ptr() for p in junior.parameters()}
    if shared:
        raise ValueError("senior and junior share parameters: load the junior as a separate copy of the base")
    for p in junior.parameters():
        p.requires_grad_(False)
    junior.eval()
    guard = JuniorGuard(junior)
    fingerprint = run_fingerprint(spec, train, rollout, seed, guard.before)
    removed = clean_arm_dir(arm_dir, fingerprint) if train.resume == "auto" else _wipe(arm_dir)
    resume_from = latest_checkpoint(arm_dir, fingerprint) if train.resume == "auto" else None
    done_before = json.loads((resume_from / TANDEM_STATE).read_text())["step"] if resume_from else 0

    t0 = time.perf_counter()
    if done_before >= train.steps:  # a finished run: nothing to train, the history is in its last checkpoint
        history = json.loads((resume_from / "trainer_state.json").read_text())["log_history"]
        guard.on_train_end(None, None, None)
    else:
        trainer = build_trainer(spec, senior, junior, tokenizer, train_rows, train, rollout, arm_dir, seed,
                                fingerprint, guard, val_rows, report_to or train.report_to, engine, score_fn,
                                progress, stop_after)
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
        history = list(trainer.state.log_history)
        if guard.after is None:
            guard.on_train_end(None, None, None)
    ckpts = [p.name for _, p in complete_checkpoints(arm_dir)]
    summary = summarize(arm, history, spec, train)
    summary.update({
        "wall_seconds_this_run": time.perf_counter() - t0, "resumed_from": resume_from.name if resume_from else None,
        "removed_stale": removed, "checkpoints": ckpts, "fingerprint": fingerprint,
        "junior_hash_before": guard.before, "junior_hash_after": guard.after,
        "junior_unchanged": guard.before == guard.after,
        "val_accuracy_initial": _first(history, "val/accuracy_initial"),
    })
    return ArmResult(arm, summary, history, ckpts)


def build_trainer(spec: ArmSpec, senior, junior, tokenizer, train_rows: Sequence[dict], train: TrainConfig,
                  rollout: RolloutConfig, arm_dir: Path, seed: int, fingerprint: str, guard: "JuniorGuard",
                  val_rows: Sequence[dict] = (), report_to: str = "none", engine=None,
                  score_fn: Callable[..., list[float]] | None = None, progress: bool = True,
                  stop_after: int | None = None):
    """The `TandemGRPOTrainer` of one arm with its rollout function, reward and callbacks (not yet trained)."""
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback

    from tandem.data.prompts import render_prompt

    stats = StepStats()
    ds = Dataset.from_list([{"prompt": render_prompt(r["prompt"], tokenizer), "answer": str(r["answer"]),
                             "id": str(r.get("id", i))} for i, r in enumerate(train_rows)])
    rollout_fn = TandemRollout(engine, tokenizer, spec, sampling_params(train), stats, seed,
                               p_senior=rollout.p_senior, max_gap_tokens=rollout.max_gap_tokens,
                               max_rounds=rollout.max_rounds, batch_size=rollout.batch_size, base=junior,
                               kl_rows=train.kl_rows)
    reward = CorrectnessReward(stats, spec.group_size, train.score_timeout, train.score_workers, score_fn)
    callbacks: list[TrainerCallback] = [PhaseTimer(stats), guard]
    if train.val_every > 0 and val_rows:
        vr = list(val_rows)[:train.val_problems or None]
        callbacks.append(Validation(stats, tokenizer, [r["prompt"] for r in vr], [str(r["answer"]) for r in vr],
                                    train.val_every, train.max_new_tokens, rollout.batch_size,
                                    train.score_workers))
    callbacks.append(ProgressBar(spec.name, enabled=progress))
    if stop_after is not None:
        callbacks.append(_StopAfter(stop_after))
    args = grpo_config(spec, train, arm_dir, seed, report_to, run_name=spec.name,
                       bf16=torch.cuda.is_available() and senior.dtype == torch.bfloat16)
    state0 = {"arm": spec.name, "fingerprint": fingerprint, "junior_hash": guard.before, "seed": seed,
              "prompts_per_step": train.prompts_per_step, "group_size": spec.group_size,
              "schedule": spec.schedule, "beta": spec.beta, "data_seed": seed, "train_rows": len(ds)}
    trainer = _make_trainer_class()(
        model=senior, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tokenizer,
        rollout_func=rollout_fn, callbacks=callbacks, step_stats=stats, tandem_state=state0)
    for cb in (ProgressCallback, PrinterCallback):  # one compact bar (ProgressBar) instead of a dict per step
        trainer.remove_callback(cb)
    junior.to(trainer.args.device)  # trl placed the senior; the junior decodes next to it
    if engine is None:  # built after trl moved the senior, so the engine sees both models on their device
        rollout_fn.engine = make_engine(senior, junior, tokenizer, rollout)
    if trainer.ref_model is not None and weights_hash(trainer.ref_model) != guard.before:
        # trl loads the KL reference from the senior's own path: it must be the base the junior copies
        raise RuntimeError("the kl_reg reference model differs from the frozen base: load the senior from the "
                           "base directory, so that trl's reference is the base")
    return trainer


class _StopAfter(TrainerCallback):
    def __init__(self, n: int):
        self.n, self.start = n, None

    def on_step_end(self, args, state, control, **kwargs):
        self.start = state.global_step - 1 if self.start is None else self.start
        if state.global_step - self.start >= self.n:
            control.should_training_stop = True


def _wipe(arm_dir: Path) -> list[str]:
    removed = [p.name for p in arm_dir.iterdir()] if arm_dir.is_dir() else []
    for p in arm_dir.iterdir() if arm_dir.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return removed


def make_engine(senior, junior, tokenizer, rollout: RolloutConfig):
    """The rollout engine of training, configured from the `rollout` section.

    With the `vllm` backend the engine keeps its own vLLM copies of both models and copies the live senior's
    weights into its engine before each call, so trl's own vLLM (`use_vllm`) stays off.
    """
    from tandem.rollout.engine import TandemEngine

    vllm_options = None
    if rollout.backend == "vllm":
        vllm_options = {"lookahead": rollout.vllm_lookahead, "gpu_memory_utilization": rollout.vllm_gpu_memory}
    return TandemEngine(senior, junior, tokenizer, backend=rollout.backend,
                        device=next(senior.parameters()).device, cpu_threads=rollout.cpu_threads or None,
                        vllm_options=vllm_options)


def sampling_params(train: TrainConfig):
    """Training sampling settings: the trainer's temperature, no truncation, the response budget."""
    from tandem.rollout.engine import SamplingParams

    # top-p 1 and top-k off: trl recomputes log-probs from logits / temperature alone, so any truncation
    # would make the trained distribution differ from the sampled one.
    return SamplingParams(temperature=train.temperature, top_p=1.0, top_k=0, max_new_tokens=train.max_new_tokens)


# --------------------------------------------------------------------------------------------------
# Summaries and the per-step table
# --------------------------------------------------------------------------------------------------

TABLE_COLUMNS = {
    "step": "step", "reward_mean": "reward", "reward_std": "reward_std", "senior_fraction": "tandem/senior_fraction",
    "handoffs": "tandem/handoffs", "handoffs_per_100": "tandem/handoffs_per_100",
    "joint_length": "tandem/joint_length", "zero_variance_groups": "tandem/zero_variance_groups",
    "kl_to_base": "tandem/kl_to_base", "trl_kl": "kl", "loss": "loss", "entropy": "entropy",
    "grad_norm": "grad_norm", "learning_rate": "learning_rate", "clip_ratio": "clip_ratio/region_mean",
    "time_rollout": "time/rollout", "time_reward": "time/reward", "time_kl": "time/kl",
    "time_update": "time/update", "time_step": "time/step", "val_accuracy": "val/accuracy",
}


def step_rows(history: Sequence[dict]) -> list[dict]:
    """One row per optimizer step (the training logs of trl's log history), in the table's columns."""
    rows = {}
    for h in history:
        if "loss" in h and "step" in h:
            rows[int(h["step"])] = {col: h.get(key) for col, key in TABLE_COLUMNS.items()}
    return [rows[k] for k in sorted(rows)]


def _first(history: Sequence[dict], key: str):
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
        "phase_seconds": {p: _mean([r[f"time_{p}"] for r in timed]) for p in ("rollout", "reward", "kl", "update")},
    }
