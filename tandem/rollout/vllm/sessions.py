"""How a rollout's rows reach the engines: one resumable session per row and model (`DirectSession`), driven
through the engine-core client, and the `Router` that hands a direct session its engine-core outputs before
`AsyncLLM`'s output processor (used until the chunk returns are open, and for engine errors).

Part of the rollout service (`service.py`), in vLLM's environment; vLLM is imported inside the functions.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tandem.rollout.vllm.submit import Submitter
from tandem.rollout.vllm.turns import STOP_ROUNDS, STOP_SWITCH, Chunk

_STOPS = {STOP_SWITCH: "switch", STOP_ROUNDS: "rounds"}  # a chunk's stop: the engine core's stop reason, else
_FINISHES = {"length": "length", "stop": "eos"}  # vLLM's finish reason (EOS is vLLM's own stop)


class Router:
    """Engine-core outputs of the direct sessions of one engine, taken before `AsyncLLM`'s output processor.

    `AsyncLLM` turns every engine-core output into a `RequestOutput`, queues it in a collector and wakes the
    consumer's generator: Python per generated token per row (measured ~300 us of frontend CPU per token with
    two engines). A direct session only needs to know when its chunk ends: the router appends each output's
    token ids (and the senior's sampled log-probs) to the session and wakes the row once, at the chunk's end.
    Outputs of other requests (`/score`) go on to the output processor unchanged. With the chunk returns
    (`returns.py`, the default) a direct session's chunks bypass this path; the router still fails every
    session when vLLM's output handler reports an engine error."""

    def __init__(self, engine):
        self.engine = engine
        self.sessions: dict[str, "DirectSession"] = {}
        op = engine.output_processor
        orig_process, orig_error = op.process_outputs, op.propagate_error

        def process_outputs(outputs, *args, **kwargs):
            rest = []
            sessions = self.sessions
            for o in outputs:
                s = sessions.get(o.request_id)
                if s is None:
                    rest.append(o)
                else:
                    s.on_output(o)
            return orig_process(rest, *args, **kwargs)

        def propagate_error(e):
            for s in list(self.sessions.values()):
                s.fail(e)
            return orig_error(e)

        op.process_outputs, op.propagate_error = process_outputs, propagate_error
        engine._run_output_handler()  # the loop that pulls outputs from the engine core (started lazily)


class DirectSession:
    """One row's resumable request on one engine, driven through the engine-core client (`turns.Session`).

    The first chunk goes through vLLM's input processor once (validation, the generation config's EOS ids, the
    processed sampling parameters); every later chunk is an `EngineCoreRequest` built from that one with the
    chunk's tokens and a shallow copy of its sampling parameters (the chunk's `extra_args` and `max_tokens`),
    sent with the chunks other rows send the same engine in the same event-loop turn, as one message
    (`submit.Submitter`): the engine core resumes the parked session (`_update_request_as_session`).
    Its chunks carry `hold`: the engine core sends one output per chunk, with the engine-core times of the
    chunk's first and last tokens (`sched.TandemScheduler`), on the engine's chunk returns (`returns.Returns`,
    `on_chunk`; until the frontend has opened them, through vLLM's output path: `Router`, `on_output`).
    Closing aborts the request, which frees its KV blocks. This is the one way rows reach the engines; the
    alternatives it was measured against live with the benchmark (`benchmarks/vllm_ab_service.py`)."""

    def __init__(self, svc: Any, role: int, request_id: str, make_sp, extra: dict | None = None):
        self.svc, self.role, self.rid, self.make_sp = svc, role, request_id, make_sp
        self.extra = extra or {}
        self.router: Router = svc.routers[role]
        self.submitter: Submitter = svc.submitters[role]
        self.hold = "returns" if role in svc.returns else True
        self.first = None  # the processed first chunk: the template of the later ones
        self.fut: asyncio.Future | None = None
        self.toks: list[int] = []
        self.lps: list[float] | None = None
        self.t_first = 0.0
        self.state: dict | None = None  # the row's schedule state after the chunk, from the engine core

    def on_output(self, o) -> None:
        if o.new_token_ids:
            if not self.toks:
                # the engine core's time of the chunk's first token (`TandemScheduler` emits a chunk once)
                self.t_first = o.events[0].timestamp if o.events else time.perf_counter()
            self.toks += o.new_token_ids
            if self.lps is not None:
                lp = o.new_logprobs
                n = len(o.new_token_ids)
                if lp is None or len(lp.logprobs) != n:
                    self.lps += [float("nan")] * n  # refused by the row (non-finite log-prob)
                else:
                    self.lps += [float(x) for x in lp.logprobs[:, 0]]  # column 0: the sampled token
        if o.finish_reason is not None and self.fut is not None and not self.fut.done():
            t_last = o.events[-1].timestamp if o.events else time.perf_counter()
            self.fut.set_result((o.finish_reason, o.stop_reason, t_last))

    def on_chunk(self, toks: list[int], lps: list[float] | None, finish: str, stop, t_first: float,
                 t_last: float, state: dict | None = None) -> None:
        """A whole chunk from the chunk returns (`returns.Returns`): its tokens, the sampled log-probs (None
        unless the engine computed them), vLLM's finish reason as text, the stop reason, the engine-core times
        of its first and last tokens, and the row's schedule state after a switch (the engine core's rule's)."""
        if self.fut is None or self.fut.done():
            return
        self.toks, self.t_first, self.state = toks, t_first, state
        if self.lps is not None:
            self.lps = lps if lps is not None and len(lps) == len(toks) else [float("nan")] * len(toks)
        self.fut.set_result((finish, stop, t_last))

    def fail(self, e: Exception) -> None:
        if self.fut is not None and not self.fut.done():
            self.fut.set_exception(e)

    async def send(self, tokens, args):
        eng = self.svc.engines[self.role]
        a = {**args, **self.extra, "hold": self.hold} if self.extra else {**args, "hold": self.hold}
        t_sub = time.perf_counter()
        if self.first is None:
            from vllm.inputs import TokensPrompt

            req = eng.input_processor.process_inputs(
                request_id=self.rid, prompt=TokensPrompt(prompt_token_ids=list(tokens)),
                params=self.make_sp(self.role, a), supported_tasks=await eng.get_supported_tasks(),
                resumable=True)
            req.external_req_id = self.rid
            self.first = req
            self.router.sessions[self.rid] = self
            self.svc.open_sessions += 1
        else:
            sp = self.first.sampling_params.__copy__()  # msgspec structs: a shallow copy, as copy.copy makes
            sp.extra_args = {"tandem": a}
            sp.max_tokens = max(1, a["budget"] - a["t0"])
            req = self.first.__copy__()
            req.prompt_token_ids = tokens
            req.sampling_params = sp
            req.arrival_time = time.time()
        self.toks, self.lps, self.state = [], ([] if self.role == 1 else None), None
        self.fut = asyncio.get_running_loop().create_future()
        await self._submit(req)
        finish, reason, t_last = await self.fut
        self.fut = None
        stop = _STOPS.get(reason) or _FINISHES.get(str(finish), str(finish))
        return Chunk(self.toks, self.lps, stop, t_sub, self.t_first or t_last, t_last, self.state)

    async def close(self):
        if self.first is None:
            return
        self.router.sessions.pop(self.rid, None)
        self.first = None
        try:
            await self._abort()
        finally:
            self.svc.open_sessions -= 1

    async def _submit(self, req) -> None:
        self.submitter.add(req)

    async def _abort(self) -> None:
        self.submitter.abort([self.rid])  # the same path as its chunks: the abort never overtakes them
