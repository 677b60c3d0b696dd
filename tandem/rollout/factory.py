"""The one place a rollout engine is built: training, evaluation, the base stage's accuracy and the benchmarks.

    engine = make_engine(senior, junior, tokenizer, "hf")                  # explicit settings
    engine = rollout_engine(senior, junior, tokenizer, params.rollout)     # from the `rollout` params section

A new backend adds its options here once, and every caller gets them. With the `vllm` backend the engine is a
client of the rollout service, which runs vLLM in its own environment (docs/rollout.md).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from tandem.rollout.engine import TandemEngine
from tandem.rollout.request import HFOptions


def make_engine(senior: Any, junior: Any | None, tokenizer: Any, backend: str = "hf", *, device: Any = None,
                cpu_threads: int = 0, vllm_options: dict | None = None, fast: bool | None = None) -> TandemEngine:
    """A `TandemEngine` over `senior` (and `junior`, None for solo-only use) with `backend`.

    `device` defaults to the senior's; `cpu_threads` (0 = leave torch's setting) applies while generating;
    `fast` picks the hf backend's kernel (`HFOptions`); `vllm_options` (`service`, `live`, `transport`)
    configure the vllm backend's client.
    """
    if device is None and hasattr(senior, "parameters"):
        device = next(senior.parameters()).device
    return TandemEngine(senior, junior, tokenizer, backend=backend, vllm_options=vllm_options,
                        hf=HFOptions(device=device, fast=fast, cpu_threads=cpu_threads or None))


def rollout_engine(senior: Any, junior: Any | None, tokenizer: Any, rollout: Any, *, live: bool = False,
                   roots: Sequence[str | os.PathLike] = (), trainer_processes: int = 1, **overrides: Any):
    """The engine the `rollout` params section asks for; `overrides` go to `make_engine` (hf backend).

    With `backend: vllm` this is a client of the run's shared rollout service (vLLM in its own environment,
    `tandem.rollout.vllm.client`; `roots`: the directories it may load weights from, besides the junior's):
    `trainer_processes` (`train.num_processes`): the trainer's GPUs, which a dedicated service stays off.
    `live=True` in training, where the trained senior module is pushed to the
    service after each optimizer step; False in evaluation, where the senior is a saved checkpoint directory.
    Threads are the calling stage's setting (`train.cpu_threads`, `evaluate.cpu_threads`, ...), applied by the
    stage around its whole work, so the engine leaves them as they are unless `cpu_threads` is passed.
    """
    if rollout.backend == "vllm":
        from tandem.rollout.vllm.client import engine_from_config

        return engine_from_config(senior, junior, tokenizer, rollout, live=live, roots=roots,
                                  trainer_processes=trainer_processes)
    return make_engine(senior, junior, tokenizer, rollout.backend, **overrides)
