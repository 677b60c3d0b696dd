"""The rollout request: one frozen settings object, built once from params and validated once, and the rows of
one engine call.

    settings = RolloutSettings.from_config(params.rollout, sampling, kind="word")   # validated here, once
    batch = engine.generate(settings.request(prompt_ids, seed=step_seed, row_ids=rows))  # -> RolloutBatch

`RolloutSettings` holds everything that shapes the sampled distribution of a rollout (the authorship schedule as
one `ScheduleSpec`: kind, `p_senior`, `max_gap_tokens`, `max_rounds`; the sampling settings and with them the
token budget) plus the batching (`batch_size`, which never changes a result). `RolloutRequest` adds the
prompts, the seed and the row ids of one call. Every backend (`tandem.rollout.backends`) implements
`generate(request) -> RolloutBatch`; the engine checks only what depends on its models (token ids inside the
vocabulary, a junior when the schedule needs one).

`ModelPair` is what every backend and the lockstep reference receive about the models: senior, junior and
what they share (tokenizer, vocabulary size, token tables, EOS ids), checked once by `ModelPair.build`.
`HFOptions` are the settings of the in-process `hf` backend (device, catch-up kernel, torch threads).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from tandem.rollout.core import SamplingParams, collect_eos_ids
from tandem.rollout.schedule import ScheduleSpec


@dataclass(frozen=True)
class RolloutSettings:
    """Schedule, sampling and batching of rollouts; invalid values raise `ValueError` at construction."""

    # the schedule and its settings: the one value that crosses into the rollout service and its engine cores
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    batch_size: int = 0  # rows generated together in one group (0 = all rows of a call)

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, ScheduleSpec):
            raise TypeError(f"schedule must be a ScheduleSpec, got {type(self.schedule).__name__}")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if self.batch_size < 0:
            raise ValueError(f"batch_size must be >= 0 (0 = all rows together), got {self.batch_size}")

    @classmethod
    def from_config(cls, rollout: Any, sampling: SamplingParams, kind: str | None = None,
                    batch_size: int | None = None) -> "RolloutSettings":
        """From the `rollout` params section (`schedule` unless `kind` is given, `p_senior`, `max_gap_tokens`,
        `max_rounds`, `batch_size`) and the stage's sampling settings."""
        spec = ScheduleSpec(kind or rollout.schedule, rollout.p_senior, rollout.max_gap_tokens, rollout.max_rounds)
        return cls(spec, sampling, rollout.batch_size if batch_size is None else batch_size)

    @property
    def budget(self) -> int:
        """Completion tokens per row at most (`sampling.max_new_tokens`)."""
        return self.sampling.max_new_tokens

    @property
    def needs_junior(self) -> bool:
        return self.schedule.needs_junior

    @property
    def needs_senior(self) -> bool:
        return self.schedule.needs_senior

    def replace(self, **changes: Any) -> "RolloutSettings":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def request(self, prompts: Sequence[Sequence[int]], seed: int, row_ids: Sequence[int] | None = None,
                progress: bool = False) -> "RolloutRequest":
        return RolloutRequest.make(prompts, self, seed, row_ids, progress)


@dataclass(frozen=True)
class RolloutRequest:
    """One engine call: prompts (token ids), their row ids (each row's noise), the seed and the settings."""

    prompts: tuple[tuple[int, ...], ...]
    settings: RolloutSettings
    seed: int
    row_ids: tuple[int, ...]
    progress: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.settings, RolloutSettings):
            raise TypeError(f"settings must be a RolloutSettings, got {type(self.settings).__name__}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if len(self.row_ids) != len(self.prompts):
            raise ValueError(f"row_ids has {len(self.row_ids)} entries for {len(self.prompts)} prompts")
        if self.row_ids and min(self.row_ids) < 0:
            raise ValueError("row_ids must be >= 0")
        for b, p in enumerate(self.prompts):
            if not p:
                raise ValueError(f"prompt {b} is empty: every prompt needs at least one token")

    @classmethod
    def make(cls, prompts: Sequence[Sequence[int]], settings: RolloutSettings, seed: int,
             row_ids: Sequence[int] | None = None, progress: bool = False) -> "RolloutRequest":
        ps = tuple(tuple(int(t) for t in p) for p in prompts)
        rows = tuple(range(len(ps))) if row_ids is None else tuple(int(r) for r in row_ids)
        return cls(ps, settings, int(seed), rows, progress)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def schedule(self) -> ScheduleSpec:
        return self.settings.schedule

    @property
    def sampling(self) -> SamplingParams:
        return self.settings.sampling

    def check_vocab(self, vocab_size: int) -> None:
        """Every prompt token must be an id of the models' vocabulary."""
        for b, p in enumerate(self.prompts):
            if min(p) < 0 or max(p) >= vocab_size:
                raise ValueError(f"prompt {b} holds token ids outside [0, {vocab_size})")

    def eos(self, eos_ids: Sequence[int]) -> list[int]:
        """The ids that end a row: the engine's EOS ids plus the sampling settings' stop ids."""
        return sorted({int(e) for e in eos_ids} | {int(s) for s in self.sampling.stop_token_ids})

    def groups(self) -> list[list[int]]:
        """Row indices generated together: all rows, or `batch_size` at a time grouped by prompt length
        (results do not depend on the grouping)."""
        B, bs = len(self.prompts), self.settings.batch_size
        if not bs or bs >= B:
            return [list(range(B))] if B else []
        order = sorted(range(B), key=lambda i: len(self.prompts[i]))
        return [order[i:i + bs] for i in range(0, B, bs)]

    def subset(self, idx: Sequence[int]) -> "RolloutRequest":
        return RolloutRequest(tuple(self.prompts[i] for i in idx), self.settings, self.seed,
                              tuple(self.row_ids[i] for i in idx), self.progress)


@dataclass(frozen=True, eq=False)
class ModelPair:
    """The senior, the junior (None: solo only) and what they share: the tokenizer, the models' vocabulary
    size, the token tables of the schedules and the EOS ids. Models are compared by identity (eq=False)."""

    senior: Any
    junior: Any | None
    tokenizer: Any
    vocab_size: int
    tables: Any
    eos_ids: tuple[int, ...]

    @classmethod
    def build(cls, senior: Any, junior: Any | None, tokenizer: Any,
              eos_token_ids: Sequence[int] | None = None) -> "ModelPair":
        """Check that the models share one vocabulary and build the tables and EOS ids.

        `tokenizer` is the shared tokenizer, or a (senior_tokenizer, junior_tokenizer) pair that must be equal;
        `eos_token_ids` None collects the tokenizer's and both models' EOS ids."""
        from tandem.rollout.vocab import build_tables, check_vocab_compatible

        junior_tokenizer = None
        if isinstance(tokenizer, (tuple, list)):
            tokenizer, junior_tokenizer = tokenizer
        vocab_size = check_vocab_compatible(senior, junior, tokenizer, junior_tokenizer)
        eos = eos_token_ids if eos_token_ids is not None else collect_eos_ids(tokenizer, senior, junior)
        return cls(senior, junior, tokenizer, vocab_size, build_tables(tokenizer, vocab_size),
                   tuple(int(e) for e in eos))


@dataclass(frozen=True)
class HFOptions:
    """Settings of the `hf` backend (`backends.hf.HFBackend`): `device` None = the senior's; `fast` None picks
    the catch-up kernel when the architecture supports it (True requires it, False forces the lockstep
    fallback); `cpu_threads` torch's intra-op threads while generating (None/0 = leave torch's setting)."""

    device: Any = None
    fast: bool | None = None
    cpu_threads: int | None = None
