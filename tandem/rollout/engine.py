"""`TandemEngine`: co-generation by a senior and a junior over one shared token history.

    engine = TandemEngine(senior, junior, tokenizer)            # checks the shared vocabulary
    batch = engine.generate(prompt_ids, "word", SamplingParams(temperature=1.0, max_new_tokens=160), seed=3)
    batch.completion_ids, batch.owner, batch.senior_logprobs, batch.handoffs, batch.finish_reason, batch.stats()

Schedules (`tandem.rollout.schedule`): `word` (training), `step` (handoff-robustness evaluation), `token`,
`solo`, `junior`. Backends: `hf` (default; transformers models on CPU or GPU, catch-up prefill with a
hand-written KV-cache forward, `backends/hf.py`) and `vllm` (the rollout service in vLLM's own environment,
`vllm_client.py`; `TandemEngine(backend="vllm")` delegates every call to a `VLLMEngine`).

Token ids move between the models as ids (never decoded and re-encoded). Every random draw is a function of
(seed, row id, position), so a call replays exactly from its seed and a row's result does not depend on the
batch it was generated in (up to floating-point effects of batch shape on the logits).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Sequence

import torch

from tandem.rollout.core import RolloutBatch, SamplingParams, check_request  # noqa: F401  (public API lives here)
from tandem.rollout.schedule import uses_junior, uses_senior
from tandem.rollout.vocab import TokenTables, build_tables, check_vocab_compatible

BACKENDS = ("hf", "vllm")


def _eos_list(x: Any) -> list[int]:
    if x is None:
        return []
    if isinstance(x, int):
        return [x]
    return [int(i) for i in x]


def collect_eos_ids(tokenizer: Any, *models: Any) -> list[int]:
    """EOS ids: the tokenizer's plus every model's generation/config EOS (either model may end a rollout)."""
    ids = set(_eos_list(getattr(tokenizer, "eos_token_id", None)))
    for m in models:
        if m is None:
            continue
        gc = getattr(m, "generation_config", None)
        ids |= set(_eos_list(getattr(gc, "eos_token_id", None)))
        ids |= set(_eos_list(getattr(getattr(m, "config", None), "eos_token_id", None)))
    return sorted(ids)


class TandemEngine:
    """Generate tandem (and solo) rollouts. `senior` may be trained in place between calls; nothing is cached.

    `tokenizer` is the shared tokenizer, or a (senior_tokenizer, junior_tokenizer) pair that must be equal.
    `fast` (hf backend): None picks the catch-up kernel when the architecture supports it and otherwise falls
    back, with a warning, to the lockstep algorithm through the models' own forward (same distribution,
    about twice the cost); True requires the kernel; False forces the fallback.
    `cpu_threads` sets torch's intra-op threads during `generate` (restored after); tiny models on a shared
    CPU run several times faster with 1 (the train stage sets `train.cpu_threads` for its whole run instead).
    `vllm_options` go to the vllm client (`service`, a `vllm_client.VLLMService`, plus `VLLMEngine` options such
    as `live` and `transport`).
    """

    def __init__(self, senior: Any, junior: Any | None, tokenizer: Any, backend: str = "hf", device: Any = None,
                 *, junior_tokenizer: Any | None = None, eos_token_ids: Sequence[int] | None = None,
                 fast: bool | None = None, vllm_options: dict | None = None, cpu_threads: int | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if isinstance(tokenizer, (tuple, list)):
            tokenizer, junior_tokenizer = tokenizer
        self.senior, self.junior, self.tokenizer, self.backend = senior, junior, tokenizer, backend
        self.vocab_size = check_vocab_compatible(senior, junior, tokenizer, junior_tokenizer)
        self.tables: TokenTables = build_tables(tokenizer, self.vocab_size)
        self.eos_ids = list(eos_token_ids) if eos_token_ids is not None else collect_eos_ids(tokenizer, senior,
                                                                                              junior)
        self.device = torch.device(device) if device is not None else None
        self.cpu_threads = cpu_threads or None
        self.fast = False
        self._vllm = None
        if backend == "hf":
            from tandem.rollout.backends.hf import self_check, unsupported_reason

            reasons = [r for r in (unsupported_reason(senior), junior is not None and unsupported_reason(junior))
                       if r]
            if fast is None or fast:
                if reasons:
                    if fast:
                        raise ValueError(f"catch-up kernel unavailable: {'; '.join(reasons)}")
                    warnings.warn(f"hf backend: catch-up kernel unavailable ({'; '.join(reasons)}); falling back "
                                  f"to lockstep decoding through the models' own forward (same distribution, "
                                  f"about 2x slower)", stacklevel=2)
                else:
                    for m in {id(senior): senior, id(junior): junior}.values():
                        if m is not None:
                            self_check(m)
                    self.fast = True
        else:
            from tandem.rollout.vllm_client import VLLMEngine

            opts = dict(vllm_options or {})
            service = opts.pop("service", None)
            if service is None:
                raise ValueError("backend 'vllm' generates through the rollout service: pass vllm_options="
                                 "{'service': VLLMService, 'live': ...} (see tandem.rollout.vllm_client; "
                                 "`engine_from_config` builds both from the rollout section)")
            self._vllm = VLLMEngine(senior, junior, (tokenizer, junior_tokenizer), service,
                                    eos_token_ids=self.eos_ids, **opts)

    # ---------------------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], schedule: str, sampling: SamplingParams, seed: int,
                 p_senior: float = 0.5, max_gap_tokens: int = 32, max_rounds: int = 150,
                 row_ids: Sequence[int] | None = None, batch_size: int | None = None,
                 progress: bool = False) -> RolloutBatch:
        """Roll out every prompt once; rows keep input order. `row_ids` name each row's noise (default 0..B-1).

        `batch_size` caps rows generated together (rows are grouped by prompt length first; results do not
        depend on the grouping). `progress` shows a bar per group.
        """
        if self._vllm is not None:
            return self._vllm.generate(prompt_ids, schedule, sampling, seed, p_senior, max_gap_tokens, max_rounds,
                                       row_ids, batch_size, progress)
        check_request(schedule, sampling, seed, p_senior, max_gap_tokens, max_rounds, self.junior is not None)
        prompts = [list(map(int, p)) for p in prompt_ids]
        B = len(prompts)
        if B == 0:
            return RolloutBatch([], [], [], [], [])
        rows = list(range(B)) if row_ids is None else [int(r) for r in row_ids]
        if len(rows) != B:
            raise ValueError(f"row_ids has {len(rows)} entries for {B} prompts")
        if min(rows) < 0:
            raise ValueError("row_ids must be >= 0")
        for b, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {b} is empty: every prompt needs at least one token")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ValueError(f"prompt {b} holds token ids outside [0, {self.vocab_size})")
        eos = sorted(set(self.eos_ids) | set(sampling.stop_token_ids))
        bs = B if not batch_size or batch_size >= B else int(batch_size)
        order = sorted(range(B), key=lambda i: len(prompts[i])) if bs < B else list(range(B))
        groups = [order[i:i + bs] for i in range(0, B, bs)]

        models = [m for m in (self.senior, self.junior) if isinstance(m, torch.nn.Module)]
        modes = [m.training for m in models]
        t0 = time.perf_counter()
        parts: list[tuple[list[int], RolloutBatch]] = []
        threads = torch.get_num_threads()
        try:
            if self.cpu_threads:
                torch.set_num_threads(self.cpu_threads)
            for m in models:
                m.eval()
            with torch.no_grad():
                for g in groups:
                    gp, gr = [prompts[i] for i in g], [rows[i] for i in g]
                    parts.append((g, self._run(gp, gr, schedule, sampling, seed, eos, p_senior, max_gap_tokens,
                                               max_rounds, progress)))
        finally:
            torch.set_num_threads(threads)
            for m, mode in zip(models, modes):
                m.train(mode)
        out = RolloutBatch([None] * B, [None] * B, [None] * B, [0] * B, [""] * B)  # type: ignore[list-item]
        for g, part in parts:
            for j, i in enumerate(g):
                out.completion_ids[i] = part.completion_ids[j]
                out.owner[i] = part.owner[j]
                out.senior_logprobs[i] = part.senior_logprobs[j]
                out.handoffs[i] = part.handoffs[j]
                out.finish_reason[i] = part.finish_reason[j]
        out.timings = {"seconds": time.perf_counter() - t0}
        return out

    @property
    def live(self) -> bool:
        return bool(self._vllm is not None and self._vllm.live)

    def push_weights(self, module: Any | None = None) -> dict:
        """vllm backend: push the live senior's weights to the service (the hf backend reads the module)."""
        if self._vllm is None:
            return {}
        return self._vllm.push_weights(module)

    def _run(self, prompts, rows, schedule, sampling, seed, eos, p_senior, max_gap_tokens, max_rounds,
             progress) -> RolloutBatch:
        if self.fast:
            from tandem.rollout.backends.hf import catch_up_generate

            return catch_up_generate(self.senior, self.junior, self.tables, prompts, schedule, sampling, seed, eos,
                                     p_senior, max_gap_tokens, max_rounds, rows, self.device, progress)
        from tandem.rollout.lockstep import lockstep_generate

        return lockstep_generate(self.senior, self.junior, self.tables, prompts, schedule, sampling, seed, eos,
                                 p_senior, max_gap_tokens, max_rounds, rows, forward="hf", device=self.device)


__all__ = ["TandemEngine", "SamplingParams", "RolloutBatch", "collect_eos_ids", "uses_senior", "uses_junior"]
