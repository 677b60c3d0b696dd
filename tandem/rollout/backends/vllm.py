"""The `vllm` backend (GPU machines, `[gpu]` extra): one vLLM engine per model, prefix caching does the catch-up.

UNVERIFIED: written against vLLM's public offline API (`LLM`, `SamplingParams`, token-id prompts, per-request
seeds, `logprobs_mode="processed_logprobs"`, vLLM >= 0.10.2) but never run here (no GPU, no vLLM on the
development machine). `scripts/gpu_check.sh` is the check to run on a GPU; until it has passed, treat this
backend as unverified. vLLM is imported lazily, so the rest of the package works without it.

How a rollout runs. Every row is a turn-based loop. In each round, every active row gets one *turn* from its
current author; each model runs ONE batched `generate` over the rows it authors, each request's prompt being
the row's full token history as ids (prompt + every token so far, whoever wrote it). Automatic prefix caching
finds the history's cached prefix, so only the partner's tokens since this model's last turn are prefilled:
that is the catch-up. A turn's output is then walked token by token through the same schedule state machine
as the `hf` engine (`schedule.RowSchedule`, same tables, same (seed, row, position) redraw noise) and cut right
after the first token at which authorship changes, the row ends (EOS, budget, rounds cap), and nothing after
that is kept. Cutting at a point decided by the tokens before it does not bias the kept tokens.
- `word`/`token`: a turn asks for up to `lookahead` tokens without stop tokens; the author changes at a redraw
  that picks the other model (the redraw noise is known in advance, but where words start is not).
- `step`: a turn asks for the rest of the budget with stop string `\\n\\n` (and stop ids for tokens holding a
  blank line); the walk cuts at the step end exactly as the `hf` engine would.
- `solo`/`junior`: one turn per row.
`min_tokens` is never set: combined with stop token ids, vLLM would forbid those tokens.

Log-probabilities: the senior's engine is built with `logprobs_mode="processed_logprobs"` so that the sampled
token's log-prob is taken after temperature scaling, i.e. log_softmax(logits / T) when top-p = 1 and top-k is
off (training), which is what trl recomputes.

Weights: an engine loads its model from a local directory (the model's `name_or_path` or an explicit path).
When `senior` is a live torch module that is trained in place, `sync_senior()` pushes its weights into the
senior engine before every `generate` (the colocated-engine path trl uses; needs
`VLLM_ENABLE_V1_MULTIPROCESSING=0`).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from tandem.rollout.core import (FINISH_EOS, FINISH_LENGTH, FINISH_ROUNDS, RolloutBatch, SamplingParams,
                                 count_handoffs)
from tandem.rollout.sampling import mix32_int
from tandem.rollout.schedule import RowSchedule, uses_junior, uses_senior
from tandem.rollout.vocab import TokenTables

STREAM_VLLM_SEED = 3


def request_seed(seed: int, row_id: int, t: int) -> int:
    """Per-request vLLM seed for the turn of row `row_id` starting at completion position t (31-bit)."""
    h = 0x243F6A88
    for v in (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, STREAM_VLLM_SEED, row_id & 0xFFFFFFFF, t & 0xFFFFFFFF):
        h = mix32_int(h ^ v)
    return h & 0x7FFFFFFF


def walk_turn(state: RowSchedule, tokens: Sequence[int], t0: int, budget: int, eos: set[int]
              ) -> tuple[int, str | None]:
    """How many of a turn's `tokens` (starting at completion position t0) to keep, and the finish reason if the
    row ends within them. Advances `state` over the kept tokens.

    Keeps tokens up to and including the first one that ends the row (EOS, budget, rounds cap) or hands
    authorship to the other model; a turn may also end without either (vLLM stopped at max_tokens).
    """
    author = state.author
    for i, tok in enumerate(tokens):
        t = t0 + i
        rounds_done = state.advance(int(tok), t)
        if int(tok) in eos:
            return i + 1, FINISH_EOS
        if t + 1 >= budget:
            return i + 1, FINISH_LENGTH
        if rounds_done:
            return i + 1, FINISH_ROUNDS
        if state.author != author:
            return i + 1, None
    return len(tokens), None


def _model_path(model: Any) -> str:
    if isinstance(model, (str, os.PathLike)):
        return str(model)
    path = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not path or not os.path.isdir(path):
        raise ValueError("vllm backend: cannot find a local model directory for this model; save it first or "
                         "pass the directory (vllm_options={'senior_path': ..., 'junior_path': ...})")
    return str(path)


class VLLMBackend:
    """Tandem rollouts on two vLLM engines (see the module docstring)."""

    def __init__(self, senior: Any, junior: Any | None, tokenizer: Any, tables: TokenTables, eos_ids: Sequence[int],
                 senior_path: str | None = None, junior_path: str | None = None, lookahead: int = 16,
                 gpu_memory_utilization: float = 0.35, max_model_len: int | None = None, dtype: str = "auto",
                 enforce_eager: bool = False, sync_weights: bool | None = None, **llm_kwargs: Any):
        try:
            import vllm  # noqa: F401
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("backend 'vllm' needs vLLM (a CUDA GPU and the [gpu] extra: pip install -e '.[gpu]'); "
                              "use backend 'hf' on CPU") from e
        from vllm import LLM

        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        self.senior, self.junior, self.tokenizer, self.tables = senior, junior, tokenizer, tables
        self.eos_ids = [int(e) for e in eos_ids]
        self.lookahead = lookahead
        self.step_stop_ids = tables.step_end_V.nonzero().flatten().tolist()
        common = dict(gpu_memory_utilization=gpu_memory_utilization, dtype=dtype, enforce_eager=enforce_eager,
                      enable_prefix_caching=True, skip_tokenizer_init=False, **llm_kwargs)
        if max_model_len:
            common["max_model_len"] = max_model_len
        self.engines: dict[int, Any] = {1: LLM(model=senior_path or _model_path(senior),
                                               logprobs_mode="processed_logprobs", **common)}
        if junior is not None:
            self.engines[0] = LLM(model=junior_path or _model_path(junior), **common)
        self.sync = (not isinstance(senior, (str, os.PathLike))) if sync_weights is None else sync_weights

    def sync_senior(self) -> None:
        """Copy the live senior module's weights into the senior engine (colocated, single-process engines)."""
        llm = self.engines[1]
        try:
            runner_model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        except AttributeError:
            try:
                runner_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
            except AttributeError as e:
                raise RuntimeError("vllm backend: cannot reach the engine's model to sync the senior's weights; "
                                   "set VLLM_ENABLE_V1_MULTIPROCESSING=0, or pass sync_weights=False when the "
                                   "senior is not trained") from e
        runner_model.load_weights(((n, p.detach()) for n, p in self.senior.state_dict().items()))

    def _sampling(self, sampling: SamplingParams, max_tokens: int, seed: int, logprobs: bool, step: bool):
        from vllm import SamplingParams as VSP

        kw: dict[str, Any] = dict(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                  top_k=sampling.top_k if sampling.top_k > 0 else -1, max_tokens=max_tokens,
                                  seed=seed, stop_token_ids=list(self.eos_ids), skip_special_tokens=False)
        if logprobs:
            kw["logprobs"] = 0  # the sampled token's log-prob only
        if step:
            kw["stop"] = ["\n\n"]
            kw["include_stop_str_in_output"] = True
            kw["stop_token_ids"] = sorted(set(self.eos_ids) | set(self.step_stop_ids))
        else:
            kw["detokenize"] = False
        return VSP(**kw)

    def generate(self, prompts: list[list[int]], rows: list[int], schedule: str, sampling: SamplingParams, seed: int,
                 eos: list[int], p_senior: float, max_gap_tokens: int, max_rounds: int,
                 progress: bool = False) -> RolloutBatch:
        if self.sync and uses_senior(schedule, p_senior):
            self.sync_senior()
        if uses_junior(schedule, p_senior) and 0 not in self.engines:
            raise ValueError(f"schedule {schedule!r} needs a junior engine")
        B, budget, eos_set = len(prompts), sampling.max_new_tokens, set(eos)
        states = [RowSchedule(schedule, self.tables, seed, r, p_senior, max_gap_tokens, max_rounds) for r in rows]
        comp: list[list[int]] = [[] for _ in range(B)]
        owner: list[list[int]] = [[] for _ in range(B)]
        logp: list[list[float]] = [[] for _ in range(B)]
        finish: list[str | None] = [None] * B
        short = schedule in ("word", "token")
        while any(f is None for f in finish):
            for m in (1, 0):
                todo = [b for b in range(B) if finish[b] is None and states[b].author == m]
                if not todo:
                    continue
                reqs, sps = [], []
                for b in todo:
                    left = budget - len(comp[b])
                    reqs.append({"prompt_token_ids": list(prompts[b]) + comp[b]})
                    sps.append(self._sampling(sampling, min(left, self.lookahead) if short else left,
                                              request_seed(seed, rows[b], len(comp[b])), m == 1,
                                              schedule == "step"))
                outs = self.engines[m].generate(reqs, sps, use_tqdm=progress)
                for b, out in zip(todo, outs):
                    o = out.outputs[0]
                    toks = list(o.token_ids)
                    lps = ([d[tok].logprob if d is not None and tok in d else float("nan")
                            for d, tok in zip(o.logprobs, toks)] if m == 1 and o.logprobs is not None
                           else [0.0] * len(toks))
                    t0 = len(comp[b])
                    n, why = walk_turn(states[b], toks, t0, budget, eos_set)
                    if n == 0 and why is None:
                        # an empty turn can only come from an engine that stopped on a token it did not emit
                        raise RuntimeError(f"vllm backend: empty turn for row {rows[b]} (finish_reason "
                                           f"{o.finish_reason!r})")
                    comp[b] += toks[:n]
                    owner[b] += [m] * n
                    logp[b] += lps[:n] if m == 1 else [0.0] * n
                    finish[b] = why
        return RolloutBatch(comp, owner, logp, [count_handoffs(o) for o in owner],
                            [f or FINISH_LENGTH for f in finish])
