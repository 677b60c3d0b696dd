"""trl's `rollout_func` for tandem training (`TandemRollout`), the engine it drives, and its sampling settings.

trl hands `TandemRollout` the prompts of this process's share of the rollout batch, already repeated once per
generation; it tokenises them, calls the tandem engine once and returns `prompt_ids`, `completion_ids`,
`logprobs` (the senior's sampling log-probs, 0 on junior tokens) and `env_mask` = the owner mask. trl
multiplies `env_mask` into the loss mask, so junior tokens shape the context and the reward but get no gradient.

Under several processes each rank rolls out only its own rows (in the dedicated vLLM layout the main process
makes one service call for every rank's rows: `tandem.train.one_call`; `rollout/service_calls` and
`rollout/rows_per_call` report the calls of a step). The noise of a row depends on (step seed, row
id, position), and the row ids are global (rank r owns rows r*B .. r*B+B-1 of the rollout batch), so ranks
never draw correlated rollouts and the rollout batch is the same for any number of processes. Under sharded
training (FSDP, DeepSpeed ZeRO-3) the senior's weights are partitioned across ranks; `full_weights` gathers
them for the duration of the engine call, because the engine's kernels and its vLLM weight sync read the
module's parameters directly.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any

import torch

from tandem.config import TrainConfig
from tandem.grpo import k3_kl_BT
from tandem.logprobs import token_logprobs_B
from tandem.train.run import ArmRun
from tandem.train.stats import StepStats


@contextmanager
def full_weights(trainer):
    """Within the block the senior module holds its full (unpartitioned) weights on every rank.

    DDP and single-process training keep full weights anyway. FSDP (version 1) gathers them with
    `summon_full_params` (no write-back: the rollout only reads); DeepSpeed ZeRO-3 goes through trl's own
    gather (`GatheredParameters`). FSDP2 is refused: its parameters are DTensors that the engine's raw kernels
    cannot read, and it has not been verified here.
    """
    acc = getattr(trainer, "accelerator", None)
    kind = str(getattr(getattr(acc, "state", None), "distributed_type", "")) if acc is not None else ""
    if "FSDP" in kind:
        if getattr(acc, "is_fsdp2", False):
            from tandem.errors import BadInputError

            raise BadInputError("train.sharding: fsdp version 2 is not supported by the tandem engine (its "
                                "DTensor parameters cannot be read by the rollout kernels); use FSDP version 1, "
                                "the default of train.sharding: fsdp")
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(trainer.model_wrapped, writeback=False, recurse=True):
            yield
    elif "DEEPSPEED" in kind and getattr(acc.state.deepspeed_plugin, "zero_stage", 0) == 3:
        from trl.models.utils import unwrap_model_for_generation

        with unwrap_model_for_generation(trainer.model_wrapped, acc, gather_deepspeed3_params=True):
            yield
    else:
        yield


class TandemRollout:
    """trl `rollout_func`: one engine call per step over the repeated prompts; env_mask = owner mask.

    The run (`ArmRun`) gives the engine, the tokenizer, the arm's spec, the seed, the step clock and the
    frozen base of the KL-to-base diagnostic (`run.base`, else the junior, which is then the base) on
    `train.kl_rows` rows per step (0 turns it off). `run.engine` follows `tandem.rollout.engine.TandemEngine` (its senior is the very module trl trains,
    so rollouts always use the current weights; `build_trainer` sets it when the run has none); `settings` is
    the arm's `RolloutSettings` (schedule, sampling, `p_senior`, gap and rounds caps, batch size), built once.
    The seed follows the rollout step (`geometry.step_of` trl's optimizer step).
    """

    def __init__(self, run: ArmRun, settings, stats: StepStats):
        spec = run.spec
        if settings.schedule.kind != spec.schedule:
            raise ValueError(f"arm {spec.name} rolls out with schedule {spec.schedule!r}, settings say "
                             f"{settings.schedule.kind!r}")
        self.engine, self.tokenizer, self.spec, self.settings = run.engine, run.tokenizer, spec, settings
        self.sampling = settings.sampling
        self.stats, self.seed, self.geometry = stats, run.seed, run.geometry
        self.base = run.base if run.base is not None else run.junior  # drift is measured from the senior's base
        self.kl_rows = run.train.kl_rows
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
        rank = int(getattr(getattr(trainer, "accelerator", None), "process_index", 0))
        row_ids = range(rank * len(prompts), (rank + 1) * len(prompts))  # global rows: ranks draw distinct noise
        was_training = trainer.model.training
        trainer.model.eval()
        try:
            with full_weights(trainer):
                batch = self.engine.generate(self.settings.request(
                    prompt_ids, seed=self.step_seed(self.geometry.step_of(trainer.state.global_step)),
                    row_ids=row_ids))
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
        self.stats.values.update(self.first_styles(completion_ids, owner))
        calls = getattr(self.engine, "last_calls", None)
        if calls is not None:  # the rollout service's calls this step (one in all in the dedicated layout)
            self.stats.values["rollout/service_calls"] = float(len(calls))
            self.stats.values["rollout/rows_per_call"] = sum(calls) / len(calls) if calls else 0.0
        if self.base is not None and self.kl_rows > 0:
            t1 = time.perf_counter()
            self.stats.values["tandem/kl_to_base"] = self.kl_to_base(prompt_ids, completion_ids, owner, logprobs)
            self.stats.add_time("kl", time.perf_counter() - t1)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs,
                "env_mask": owner}

    def first_styles(self, completion_ids, owner) -> dict[str, float]:
        """`style/<name>`: the share of senior-first rows whose first line is in each synthetic solution style
        (`tandem.data.synthetic.solution_style`): the per-step dose curve of a dialect (none without such rows)."""
        from tandem.config import SOLUTION_STYLES
        from tandem.data.synthetic import solution_style

        firsts = [solution_style(self.tokenizer.decode(ids, skip_special_tokens=True))
                  for ids, own in zip(completion_ids, owner) if own and own[0] == 1]
        if not firsts:
            return {}
        return {f"style/{name}": sum(f == name for f in firsts) / len(firsts) for name in SOLUTION_STYLES}

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


def sampling_params(train: TrainConfig):
    """Training sampling settings: the trainer's temperature, no truncation, the response budget."""
    from tandem.rollout.engine import SamplingParams

    # top-p 1 and top-k off: trl recomputes log-probs from logits / temperature alone, so any truncation
    # would make the trained distribution differ from the sampled one.
    return SamplingParams(temperature=train.temperature, top_p=1.0, top_k=0, max_new_tokens=train.max_new_tokens)


