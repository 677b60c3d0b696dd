"""`TandemEngine`: co-generation by a senior and a junior over one shared token history.

    engine = TandemEngine(senior, junior, tokenizer)            # checks the shared vocabulary
    settings = RolloutSettings(ScheduleSpec("word"), SamplingParams(temperature=1.0, max_new_tokens=160))
    batch = engine.generate(settings.request(prompt_ids, seed=3))
    batch.completion_ids, batch.owner, batch.senior_logprobs, batch.handoffs, batch.finish_reason, batch.stats()

Schedules (`tandem.rollout.schedule`): `word` (training), `step` (handoff-robustness evaluation), `token`,
`solo`, `junior`. Backends (`tandem.rollout.backends`, one interface `generate(request) -> RolloutBatch`):
`hf` (default; transformers models on CPU or GPU, catch-up prefill with a hand-written KV-cache forward,
`backends/hf.py`) and `vllm` (the rollout service in vLLM's own environment, `tandem/rollout/vllm/`).

Token ids move between the models as ids (never decoded and re-encoded). Every random draw is a function of
(seed, row id, position), so a call replays exactly from its seed and a row's result does not depend on the
batch it was generated in (up to floating-point effects of batch shape on the logits).
"""

from __future__ import annotations

from typing import Any, Sequence

from tandem.rollout.backends import backend_names, make_backend
from tandem.rollout.core import RolloutBatch, SamplingParams, collect_eos_ids
from tandem.rollout.request import HFOptions, ModelPair, RolloutRequest, RolloutSettings
from tandem.rollout.schedule import ScheduleSpec, uses_junior, uses_senior
from tandem.rollout.vocab import TokenTables

BACKENDS = backend_names()


class TandemEngine:
    """Generate tandem (and solo) rollouts. `senior` may be trained in place between calls; nothing is cached.

    `tokenizer` is the shared tokenizer, or a (senior_tokenizer, junior_tokenizer) pair that must be equal
    (`ModelPair.build` checks the vocabulary and builds the token tables and EOS ids). `hf` (an `HFOptions`:
    device, catch-up kernel, threads) configures the hf backend (`backends.hf.HFBackend`); `vllm_options` the
    vllm client (`service`, a `tandem.rollout.vllm.client.VLLMService`, plus `VLLMEngine` options such as
    `live` and `transport`).
    """

    def __init__(self, senior: Any, junior: Any | None, tokenizer: Any, backend: str = "hf", *,
                 eos_token_ids: Sequence[int] | None = None, hf: HFOptions | None = None,
                 vllm_options: dict | None = None):
        if backend not in backend_names():
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(backend_names())}")
        self.pair = pair = ModelPair.build(senior, junior, tokenizer, eos_token_ids)
        self.senior, self.junior, self.tokenizer, self.backend = senior, junior, pair.tokenizer, backend
        self.vocab_size = pair.vocab_size
        self.tables: TokenTables = pair.tables
        self.eos_ids = list(pair.eos_ids)
        if backend == "hf":
            self._backend = make_backend("hf", pair=pair, options=hf or HFOptions())
        else:
            opts = dict(vllm_options or {})
            if opts.get("service") is None:
                raise ValueError("backend 'vllm' generates through the rollout service: pass vllm_options="
                                 "{'service': VLLMService, 'live': ...} (see tandem.rollout.vllm.client; "
                                 "`engine_from_config` builds both from the rollout section)")
            self._backend = make_backend(backend, pair=pair, **opts)

    @property
    def fast(self) -> bool:
        return bool(getattr(self._backend, "fast", False))

    @property
    def device(self) -> Any:
        return getattr(self._backend, "device", None)

    # ---------------------------------------------------------------------------------------------
    def generate(self, request: RolloutRequest) -> RolloutBatch:
        """Roll out every prompt of `request` once; rows keep input order (see `RolloutRequest`)."""
        if not isinstance(request, RolloutRequest):
            raise TypeError(f"generate takes a RolloutRequest (RolloutSettings.request(prompts, seed, row_ids)), "
                            f"got {type(request).__name__}")
        if request.settings.needs_junior and self.junior is None:
            raise ValueError(f"schedule {request.schedule.kind!r} (p_senior={request.schedule.p_senior}) needs a "
                             f"junior model, but junior is None")
        request.check_vocab(self.vocab_size)
        return self._backend.generate(request)

    @property
    def last_calls(self) -> list[int] | None:
        """vllm backend: the rows of each rollout-service call of the last `generate` (None for the hf backend)."""
        calls = getattr(self._backend, "last_calls", None)
        return None if calls is None else list(calls)

    @property
    def live(self) -> bool:
        return bool(getattr(self._backend, "live", False))

    def push_weights(self, module: Any | None = None) -> dict:
        """vllm backend: push the live senior's weights to the service (the hf backend reads the module)."""
        push = getattr(self._backend, "push_weights", None)
        return push(module) if push is not None else {}


__all__ = ["TandemEngine", "SamplingParams", "RolloutBatch", "RolloutRequest", "RolloutSettings", "ScheduleSpec",
           "collect_eos_ids", "uses_senior", "uses_junior"]
