"""The one place a rollout engine is built: training, evaluation, the base stage's accuracy and the benchmarks.

    engine = make_engine(senior, junior, tokenizer, "hf")                  # explicit settings
    engine = rollout_engine(senior, junior, tokenizer, params.rollout)     # from the `rollout` params section

A new backend adds its options here once, and every caller gets them. With the `vllm` backend the engine keeps
its own vLLM copies of both models and copies the live senior's weights into its engine before each call.
"""

from __future__ import annotations

from typing import Any

from tandem.rollout.engine import TandemEngine


def make_engine(senior: Any, junior: Any | None, tokenizer: Any, backend: str = "hf", *, device: Any = None,
                cpu_threads: int = 0, vllm_lookahead: int = 16, vllm_gpu_memory: float = 0.35,
                vllm_options: dict | None = None, fast: bool | None = None) -> TandemEngine:
    """A `TandemEngine` over `senior` (and `junior`, None for solo-only use) with `backend`.

    `device` defaults to the senior's; `cpu_threads` (0 = leave torch's setting) applies while generating;
    `vllm_*` configure the vllm backend (`vllm_options` adds or overrides `VLLMBackend` arguments).
    """
    opts = None
    if backend == "vllm":
        opts = {"lookahead": vllm_lookahead, "gpu_memory_utilization": vllm_gpu_memory, **(vllm_options or {})}
    if device is None and hasattr(senior, "parameters"):
        device = next(senior.parameters()).device
    return TandemEngine(senior, junior, tokenizer, backend=backend, device=device, cpu_threads=cpu_threads or None,
                        vllm_options=opts, fast=fast)


def rollout_engine(senior: Any, junior: Any | None, tokenizer: Any, rollout: Any, **overrides: Any) -> TandemEngine:
    """`make_engine` configured from a `RolloutConfig` (backend, vllm_*); `overrides` win.

    Threads are the calling stage's setting (`train.cpu_threads`, `evaluate.cpu_threads`, ...), applied by the
    stage around its whole work, so the engine leaves them as they are unless `cpu_threads` is passed.
    """
    kw = {"vllm_lookahead": rollout.vllm_lookahead,
          "vllm_gpu_memory": rollout.vllm_gpu_memory}
    kw.update(overrides)
    return make_engine(senior, junior, tokenizer, kw.pop("backend", rollout.backend), **kw)
