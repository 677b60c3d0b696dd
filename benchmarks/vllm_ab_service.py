"""The rollout service as the benchmark runs it: the production service (`tandem/rollout/vllm/service.py`) plus
the alternatives it was measured against, the replayed real text and a profiler.

`benchmarks/vllm_rollout.py` starts it (`LaunchOptions(service="benchmarks.vllm_ab_service")`, vLLM's
environment, the repository root on PYTHONPATH) and names, per `/generate`, how the rows reach the engines
(`"sessions"`):
- `direct` (the default; the production service's only way): `DirectSession`, batched submissions (`submit.py`)
  and the chunk returns (`returns.py`);
- `direct-vllm-out`: the same sessions and submissions, the chunks back through vLLM's output path (`Router`);
- `direct-single`: one engine-core message per chunk each way (`add_request_async`, vLLM's output path);
- `stream`: `AsyncLLM.generate`'s streaming-input sessions (vLLM's public path, Python per token).
The measurements that chose `direct` are in docs/vllm-measurements.md ("The chunks back on a socket of their
own", "Where the time goes through vLLM's output path").

`--replay`: both engines load `vllm_replay.ReplayLogitsProcessor`, and a `/generate` may carry `"replay"` (one
token list per row): the engines then emit that text (`vllm_replay.py`), so a random body counts a rollout of
real text.

`--async-scheduling`: both engines run with vLLM's asynchronous scheduling requested (`async_scheduling=True`
instead of the production service's `compat.ENGINE_FIXED` value, False), to measure what it does to the tandem
scheduler (`benchmarks/vllm_gpu.py`); vLLM's CPU build turns it off whatever is asked. The authenticated
`/health` says what each engine runs (`async_scheduling`: {"senior", "junior"}, read from its `vllm_config`).

`$TANDEM_VLLM_PROFILE_DIR=<dir>`: a cProfile of the event-loop thread per rollout (`rollout-<call>.prof`, by
the thread's CPU clock; the rows, the submissions and the output handler all run there). It slows the thread,
so its rollouts are not timed ones.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from tandem.rollout.vllm import service as production
from tandem.rollout.vllm.service import DirectSession, Refused, Service
from tandem.rollout.vllm.turns import Chunk

SESSION_KINDS = ("direct", "direct-vllm-out", "direct-single", "stream")
PROFILE_ENV = "TANDEM_VLLM_PROFILE_DIR"
REPLAY_PROCESSOR = "benchmarks.vllm_replay:ReplayLogitsProcessor"


class StreamSession:
    """One row's streaming-input session on one engine through `AsyncLLM.generate` (`turns.Session`): vLLM's
    public path, Python per generated token in the frontend (`"sessions": "stream"`)."""

    def __init__(self, svc: Service, role: int, request_id: str, make_sp, extra: dict | None = None):
        self.svc, self.role, self.rid, self.make_sp = svc, role, request_id, make_sp
        self.extra = extra or {}
        self.q: asyncio.Queue = asyncio.Queue()
        self.gen = None

    async def _inputs(self):
        while True:
            item = await self.q.get()
            if item is None:
                return
            yield item

    async def send(self, tokens, args):
        from vllm.engine.protocol import StreamingInput
        from vllm.inputs import TokensPrompt

        sp = self.make_sp(self.role, {**args, **self.extra} if self.extra else args)
        t_sub = time.perf_counter()
        await self.q.put(StreamingInput(prompt=TokensPrompt(prompt_token_ids=list(tokens)), sampling_params=sp))
        if self.gen is None:
            self.gen = self.svc.engines[self.role].generate(prompt=self._inputs(), sampling_params=sp,
                                                            request_id=self.rid)
            self.svc.open_sessions += 1
        toks: list[int] = []
        lps: list[float] | None = [] if self.role == 1 else None
        t_first = t_last = 0.0
        while True:
            out = await self.gen.__anext__()
            o = out.outputs[0]
            if o.token_ids:
                t_last = time.perf_counter()
                if not toks:
                    t_first = t_last
                toks += list(o.token_ids)
                if lps is not None:
                    got = o.logprobs or []
                    for d, t in zip(got, o.token_ids):
                        lps.append(d[t].logprob if d is not None and t in d else float("nan"))
            if o.finish_reason is not None:  # the stop as the production sessions name it
                stop = production._STOPS.get(o.stop_reason) or production._FINISHES.get(str(o.finish_reason),
                                                                                           str(o.finish_reason))
                return Chunk(toks, lps, stop, t_sub, t_first, t_last)

    async def close(self):
        if self.gen is None:
            return
        await self.q.put(None)
        try:
            async def drain():
                async for _ in self.gen:
                    pass
            await asyncio.wait_for(drain(), 60)
        finally:
            self.gen = None
            self.svc.open_sessions -= 1


class VLLMOutSession(DirectSession):
    """`direct-vllm-out`: the direct session with batched submissions, its chunks back through vLLM's output
    path (`Router`, `on_output`) instead of the chunk returns."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hold = True


class SingleSession(VLLMOutSession):
    """`direct-single`: one engine-core message per chunk each way (`add_request_async` and vLLM's output path)."""

    async def _submit(self, req) -> None:
        await self.svc.engines[self.role].engine_core.add_request_async(req)

    async def _abort(self) -> None:
        await self.svc.engines[self.role].engine_core.abort_requests_async([self.rid])


KINDS = {"direct": DirectSession, "direct-vllm-out": VLLMOutSession, "direct-single": SingleSession,
         "stream": StreamSession}


def _profiler():
    """A running cProfile of the event-loop thread by its own CPU clock when $TANDEM_VLLM_PROFILE_DIR names a
    folder, else None (on shared cores a wall clock charges the thread's preemptions to whatever call it was in)."""
    if not os.environ.get(PROFILE_ENV):
        return None
    import cProfile

    Path(os.environ[PROFILE_ENV]).mkdir(parents=True, exist_ok=True)
    prof = cProfile.Profile(time.thread_time_ns, 1e-9)
    prof.enable()  # this thread only
    return prof


class ABService(Service):
    """The production service with the benchmark's session kinds, replayed text and profiler."""

    replay = False  # set by main from --replay: both engines load the replay logits processor
    async_scheduling = False  # set by main from --async-scheduling: ask vLLM for asynchronous scheduling

    def _engine_kwargs(self, spec, model: str, role: int, is_cpu: bool) -> dict:
        kw = super()._engine_kwargs(spec, model, role, is_cpu)
        if self.replay:
            kw["logits_processors"] = [REPLAY_PROCESSOR]
        if self.async_scheduling:
            kw["async_scheduling"] = True  # the production service keeps compat.ENGINE_FIXED (False)
        return kw

    def health(self, full: bool) -> dict:
        out = super().health(full)
        if full:  # what each engine runs, as vLLM resolved it (the CPU build forces it off)
            out["async_scheduling"] = {production.ROLE_NAMES[r]: bool(e.vllm_config.scheduler_config.async_scheduling)
                                       for r, e in self.engines.items()}
        return out

    def _sessions(self, req: dict, call: str, rows: list[int], make_sp, budget: int, eos: list[int]):
        kind = str(req.get("sessions", "direct"))
        if kind not in KINDS:
            raise Refused(400, f"sessions must be one of {', '.join(SESSION_KINDS)}")
        cls = KINDS[kind]
        replay_path = self._replay_file(req, call, len(rows), budget, eos)

        def open_session(role: int, b: int):
            extra = {"replay": str(replay_path), "replay_row": b} if replay_path else None
            return cls(self, role, f"{call}-{rows[b]}-{role}", make_sp, extra)

        def cleanup() -> None:
            if replay_path is not None:
                replay_path.unlink(missing_ok=True)

        return open_session, cleanup

    def _replay_file(self, req: dict, call: str, n_rows: int, budget: int, eos: list[int]) -> Path | None:
        """The rollout's replayed text as the processor reads it (int32: rows, budget, then rows x budget)."""
        if req.get("replay") is None:
            return None
        if not self.replay:
            raise Refused(400, "replayed text needs a service started with --replay")
        import numpy as np

        text = req["replay"]
        if len(text) != n_rows:
            raise Refused(400, "replay needs one token list per row")
        arr = np.full((n_rows, budget), eos[0] if eos else 0, dtype=np.int32)
        for b, t in enumerate(text):
            n = min(len(t), budget)
            arr[b, :n] = np.asarray(t[:n], dtype=np.int32)
        path = self.inbox / f"replay-{call}.i32"
        np.concatenate([np.asarray([n_rows, budget], dtype=np.int32), arr.ravel()]).tofile(path)
        return path

    async def _run_rows(self, prompts, rows, ctx, open_session, call: str):
        prof = _profiler()
        try:
            return await super()._run_rows(prompts, rows, ctx, open_session, call)
        finally:
            if prof is not None:
                prof.disable()
                prof.dump_stats(str(Path(os.environ[PROFILE_ENV]) / f"rollout-{call}.prof"))


def main(argv: list[str] | None = None) -> int:
    """The production service's command line, plus `--replay` and `--async-scheduling`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ABService.replay = "--replay" in argv
    ABService.async_scheduling = "--async-scheduling" in argv
    return production.main([a for a in argv if a not in ("--replay", "--async-scheduling")], service_cls=ABService)


if __name__ == "__main__":
    sys.exit(main())
