"""The vLLM rollout service: a small HTTP server, run in vLLM's own environment, that makes tandem rollouts.

    TANDEM_VLLM_TOKEN=<secret> .venv-vllm/bin/python -m tandem.rollout.vllm.service \\
        --senior models/base --junior models/base --port 8471 --allow-root .

vLLM cannot live in the pipeline's environment (prefect needs fastapi >= 0.139, vLLM < 0.137; vLLM 0.31-0.33
need transformers < 5.20), so it runs here, in its own virtual environment (`make vllm-env`), and the
pipeline talks to it through `tandem.rollout.vllm.client`. This module imports only the standard library,
torch, safetensors, vLLM and the pure rollout code of `tandem.rollout`.

Engines. Two `AsyncLLM` engines, each in its own engine-core process on the devices the client placed it
(`--senior-devices`, `--junior-devices`: `tandem/rollout/placement.py`; the log and `/health` name them): the senior (processed log-probs: after
temperature, what trl recomputes) and the frozen junior, both with `TandemScheduler`
(`tandem/rollout/vllm/sched.py`: the O(1) stop at authorship switches and the counters) and `TandemWorker`
(`worker.py`: weights reloaded in place). A rollout runs one asyncio task per row over one streaming-input
session per model (`turns.run_rows`, design D1 in docs/rollout.md), each driven through the engine-core client
(`DirectSession`: no per-token Python in `AsyncLLM`'s output processor); the chunks the rows send one engine in
one event-loop turn travel as one message (`submit.py`, over an `ipc://` socket in the private inbox), and the
chunks that stop in one engine step come back as one message (`returns.py`, likewise; `Router` when a
rollout asks for vLLM's output path instead).
Weights are pushed only while no session
is open (requests are served one at a time); after every load the engine's prefix cache is reset and the
reset must succeed (it is refused while any block is in use).

Security: it serves the pipeline that started it, nobody else on the machine.
- Every request but `GET /health` must carry `Authorization: Bearer <token>`, the per-run secret the
  starting stage generated (environment `TANDEM_VLLM_TOKEN`, or `--token-file`); `/health` without it says
  only that the service is up, and answers an `X-Tandem-Challenge` header with the HMAC of it under the secret
  (`lifecycle.health_proof`), so that a client sends its secret only to a process that proves it holds it.
- The service binds its own port (`--port 0`: one the system picks) and reports it on the client's private pipe
  (`--ready-fd`); a port it cannot bind is one line on stderr and exit code 2.
- At most 64 connections at a time, each closed after 60 s of silence; a failed connection is one log line
  (the first 20 of them).
- `Host` must name the bound address (or `--allow-host`); requests with an `Origin` header (a browser) are
  refused; bodies are JSON (`Content-Type: application/json`, at most `--max-json-mb`) except `/upload`
  (`application/octet-stream`, streamed to disk, at most `--max-upload-gb`).
- Weights come only from directories under `--allow-root`, from files the client placed in the service's own
  inbox (`inbox` in the authenticated `/health`; each file is deleted once loaded) or by upload (one file per
  role, replaced by the next upload).
- Errors answer with one short line; details and tracebacks go to the service log (stderr).
- A watchdog stops the service when the process that started it dies (`--parent-pid`); a service stopped while
  its engines start ends its process group but the resource trackers that release the engines' shared
  memory (`lifecycle.end_group`, which the client also runs after every stop and restart); and every exit
  removes its inbox (`/dev/shm/tandem-vllm-*`, which holds pushed weights, the engines' counters and the
  submission and return sockets) and its
  run directory (`--run-dir`, the client's `/tmp/tandem-vllm-*` with the log) unless it exits on an error.

Endpoints (JSON in and out; served one at a time, except /health):
- GET  /health: {"ok"} (+ {"pid", "vllm", "senior", "junior", "tables", "reloads", "inbox", "kv_blocks",
  "block_size", "uptime_s", "layout", "calls" (rollouts served), "devices": {"senior", "junior"}} with the token)
- POST /tables {"key", "vocab_size", "word_start", "step_end", "starts_newline", "ends_newline", "empty"}
- POST /weights {"role", "tag", "dir" | "file" | (an uploaded tag)}
- POST /upload?role=R&tag=T (octet-stream body): weights for role R, loaded by a later /weights or /generate
- POST /generate {"tables", "senior", "junior", "prompts", "rows", "schedule": {"kind", "p_senior",
  "max_gap_tokens", "max_rounds"} (`schedule.ScheduleSpec`), "sampling", "seed", "eos"}: a `RolloutBatch`
  as JSON plus {"stats": counters}
- POST /score {"role", "weights", "sequences", "starts"}: teacher-forced log-probs (temperature 1)
- POST /shutdown
Unknown tables or weights answer 409 so that the client re-sends them (a restarted service starts empty).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from tandem.rollout.vllm.compat import (ENGINE_ENV, ENGINE_FIXED, UnsupportedVLLMError, check_version,
                                        supported_text)
from tandem.rollout.vllm.knobs import EngineKnobs
from tandem.rollout.vllm.lifecycle import (CHALLENGE_HEADER, end_group, health_proof, make_inbox, port_report,
                                          sweep_stale_inboxes)
from tandem.rollout.vllm.returns import Returns
from tandem.rollout.vllm.submit import Submitter
from tandem.rollout.placement import Placement, PlacementError
from tandem.rollout.vllm.turns import STOP_ROUNDS, STOP_SWITCH, Chunk

ROLES = {"senior": 1, "junior": 0}
_STOPS = {STOP_SWITCH: "switch", STOP_ROUNDS: "rounds"}  # a chunk's stop: the engine core's stop reason, else
_FINISHES = {"length": "length", "stop": "eos"}  # vLLM's finish reason (EOS is vLLM's own stop)
ROLE_NAMES = {1: "senior", 0: "junior"}
MAX_VOCAB = 1 << 22
LOG = logging.getLogger("tandem.vllm.service")


class Conflict(Exception):
    """The request names state the service does not hold (a restarted service): the client re-sends it."""


class Refused(Exception):
    """A request the service will not serve (HTTP status, one-line reason)."""

    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


def resolve_dtype(dtype: str, model_dir: str) -> str:
    """`auto` keeps a float32 checkpoint in float32: vLLM's own `auto` serves float32 models in half precision,
    whose log-probs then differ from the trainer's float32 recomputation (measured: up to 0.46 nats on the
    tiny base)."""
    if dtype != "auto":
        return dtype
    cfg_path = Path(model_dir) / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    return "float32" if (cfg.get("dtype") or cfg.get("torch_dtype")) == "float32" else "auto"


def _inbox_root() -> Path:
    """This service's inbox (`lifecycle.make_inbox`), after removing those of services killed before they could."""
    stale = sweep_stale_inboxes()
    if stale:
        LOG.info("removed %d inbox(es) of services that are gone: %s", len(stale), ", ".join(map(str, stale)))
    return make_inbox()


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

    def __init__(self, svc: "Service", role: int, request_id: str, make_sp, extra: dict | None = None):
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


@dataclass(frozen=True)
class EngineSpec:
    """How the service starts its two engines: the models, the engines' seed, their knobs
    (`knobs.EngineKnobs`, the flags the client passed) and each engine's devices (`placement.Placement`)."""

    senior: str
    junior: str
    knobs: EngineKnobs = EngineKnobs()
    seed: int = 0
    placement: Placement = Placement("shared")


def engine_envs(placement: Placement) -> list[dict[int, dict[str, str]]]:
    """The engines' starts, in order: each a {role: environment} of engines started together. Engines on the
    same devices (or placed nowhere) start at once under one environment; engines on devices of their own start
    one after the other, each under its own `CUDA_VISIBLE_DEVICES` (the environment is the process's, and vLLM
    spawns the engine-core process from it: `placement` module docstring)."""
    envs = {ROLES[name]: placement.env(name) for name in ("senior", "junior")}
    if envs[1] == envs[0]:
        return [envs]
    return [{1: envs[1]}, {0: envs[0]}]


class Service:
    """Two AsyncLLM engines on an event loop of their own, their weight tags, the token tables, the rollouts."""

    def __init__(self, spec: EngineSpec, *, roots: list[str] | None = None, inbox: Path | None = None):
        senior, junior = spec.senior, spec.junior
        self.inbox = inbox or _inbox_root()
        os.chmod(self.inbox, 0o700)
        self.roots = [Path(r).resolve() for r in (roots or [])] + [Path(senior).resolve(), Path(junior).resolve()]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tandem-vllm-loop", daemon=True)
        self.thread.start()
        self.open_sessions = 0
        self.tables: dict[str, Any] = {}
        self.lookup: dict[str, Any] = {}
        self.uploads: dict[str, Path] = {}
        self.lock = threading.Lock()
        self.t0 = time.time()
        self.reloads = 0
        self.calls = 0
        self.stats_files = {r: self.inbox / f"counters-{ROLE_NAMES[r]}.f64" for r in (0, 1)}
        from tandem.rollout.vllm.sched import FIELDS

        for f in self.stats_files.values():
            f.write_bytes(b"\0" * (8 * len(FIELDS)))
        self.placement = spec.placement
        self.engines = self._run(self._start(spec))
        self.loaded = {1: f"dir:{Path(senior).resolve()}", 0: f"dir:{Path(junior).resolve()}"}
        cc = self.engines[1].vllm_config.cache_config
        self.block_size = int(cc.block_size)
        self.kv_blocks = min(int(e.vllm_config.cache_config.num_gpu_blocks or 0) for e in self.engines.values())
        self.max_model_len = min(int(e.vllm_config.model_config.max_model_len) for e in self.engines.values())
        self.vocab_size = int(self.engines[1].vllm_config.model_config.get_vocab_size())
        self.returns: dict[int, Returns] = {}
        self.routers = self._run(self._routers())
        self.submitters = self._run(self._submitters())
        self.returns = self._run(self._returns())

    async def _routers(self) -> dict:
        return {r: Router(e) for r, e in self.engines.items()}

    async def _returns(self) -> dict:
        out = {}
        for r, e in self.engines.items():
            ret = Returns(e, f"ipc://{self.inbox}/returns-{ROLE_NAMES[r]}", self.routers[r].sessions)
            await ret.start()
            out[r] = ret
        return out

    async def _submitters(self) -> dict:
        out = {}
        for r, e in self.engines.items():
            s = Submitter(e, f"ipc://{self.inbox}/submit-{ROLE_NAMES[r]}")
            await s.start()
            out[r] = s
        return out

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, spec: EngineSpec) -> dict:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        def args(role: int) -> AsyncEngineArgs:
            model = spec.senior if role == 1 else spec.junior
            return AsyncEngineArgs(**self._engine_kwargs(spec, model, role, current_platform.is_cpu()))

        loop = asyncio.get_running_loop()
        engines: dict = {}
        # engines on the same devices start at once (each engine core in its own processes: about half the start
        # time); engines on devices of their own one after the other, the process's environment naming the
        # engine's devices while vLLM spawns its engine core. The engines' queues and sockets bind to this loop
        # when first used.
        for group in engine_envs(spec.placement):
            env = next(iter(group.values()))
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                started = await asyncio.gather(*(loop.run_in_executor(None, AsyncLLM.from_engine_args, args(r))
                                                 for r in group))
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            engines.update(zip(group, started))
            for r in group:
                LOG.info("engine %s started on %s", ROLE_NAMES[r], self.device_text(spec.placement, r))
        return engines

    @staticmethod
    def device_text(placement: Placement, role: int) -> str:
        """Where engine `role` runs, as /health and the log say it."""
        env = placement.env(ROLE_NAMES[role])
        return ",".join(f"{k}={v}" for k, v in env.items()) or "the service's devices (nothing placed)"

    def _engine_kwargs(self, spec: EngineSpec, model: str, role: int, is_cpu: bool) -> dict[str, Any]:
        """One engine's `AsyncEngineArgs` (`engine_kwargs`; a hook for the benchmark's service)."""
        kw = engine_kwargs(spec.knobs, model, role, spec.seed, str(self.stats_files[role]),
                           resolve_dtype(spec.knobs.dtype, model), is_cpu)
        return {**kw, **parallel_kwargs(len(spec.placement.devices(ROLE_NAMES[role])))}

    def shutdown(self) -> None:
        for s in [*getattr(self, "submitters", {}).values(), *getattr(self, "returns", {}).values()]:
            s.close()
        for e in getattr(self, "engines", {}).values():
            try:
                e.shutdown()
            except Exception:  # noqa: BLE001 - shutting down anyway
                LOG.exception("engine shutdown")
        self.loop.call_soon_threadsafe(self.loop.stop)

    # -- state -------------------------------------------------------------------------------------
    def health(self, full: bool) -> dict:
        if not full:
            return {"ok": True}
        import vllm

        return {"ok": True, "pid": os.getpid(), "vllm": vllm.__version__, "senior": self.loaded[1],
                "junior": self.loaded[0], "tables": sorted(self.tables), "reloads": self.reloads,
                "inbox": str(self.inbox), "kv_blocks": self.kv_blocks, "block_size": self.block_size,
                "max_model_len": self.max_model_len, "uptime_s": round(time.time() - self.t0, 1),
                "layout": self.placement.layout, "calls": self.calls,
                "devices": {ROLE_NAMES[r]: self.device_text(self.placement, r) for r in (1, 0)}}

    def set_tables(self, req: dict) -> dict:
        import torch

        from tandem.rollout.schedule import LookupTables
        from tandem.rollout.vocab import TokenTables

        V = req.get("vocab_size")
        if not isinstance(V, int) or not 0 < V <= MAX_VOCAB:
            raise Refused(400, f"vocab_size must be an integer in [1, {MAX_VOCAB}]")
        if V != self.vocab_size:
            raise Refused(400, f"vocab_size {V} differs from the engines' vocabulary ({self.vocab_size})")
        key = str(req.get("key", ""))
        if not key.isalnum() or len(key) > 64:
            raise Refused(400, "key must be a short alphanumeric string")

        def col(name: str) -> torch.Tensor:
            ids = req.get(name)
            if not isinstance(ids, list) or any(not isinstance(i, int) or not 0 <= i < V for i in ids):
                raise Refused(400, f"{name} must be a list of token ids in [0, {V})")
            t = torch.zeros(V, dtype=torch.bool)
            t[torch.as_tensor(ids, dtype=torch.int64)] = True
            return t

        tables = TokenTables(col("word_start"), col("step_end"), col("starts_newline"), col("ends_newline"),
                             col("empty"))
        lookup = LookupTables.of(tables)
        path = self.inbox / f"tables-{key}.bin"
        path.write_bytes(lookup.word + lookup.end + lookup.snl + lookup.enl + lookup.empty)
        self.tables[key] = str(path)
        self.lookup[key] = lookup
        return {"ok": True, "key": key}

    def _inside(self, path: Path, roots: list[Path]) -> bool:
        p = path.resolve()
        return any(p == r or p.is_relative_to(r) for r in roots)

    def upload(self, role: int, tag: str, rfile, length: int) -> dict:
        path = self.inbox / f"upload-{ROLE_NAMES[role]}.safetensors"
        tmp = path.with_suffix(".part")
        left = length
        with open(tmp, "wb") as f:
            while left > 0:
                buf = rfile.read(min(left, 1 << 22))
                if not buf:
                    raise Refused(400, "upload body shorter than its Content-Length")
                f.write(buf)
                left -= len(buf)
        os.replace(tmp, path)  # one upload per role: the previous one is replaced, never accumulated
        self.uploads = {t: p for t, p in self.uploads.items() if p != path}
        self.uploads[tag] = path
        return {"ok": True, "tag": tag, "bytes": length}

    def ensure(self, role: int, spec: dict | None) -> bool:
        """Load the weights `spec` names into engine `role` unless already loaded; reset its prefix cache."""
        if not spec or spec.get("tag") == self.loaded[role]:
            return False
        tag = str(spec.get("tag", ""))
        delete = False
        if spec.get("dir"):
            path = Path(str(spec["dir"]))
            if not self._inside(path, self.roots):
                raise Refused(403, "weights directory outside the run's directories")
        elif spec.get("file"):
            path = Path(str(spec["file"]))
            if not self._inside(path, [self.inbox]) or path.suffix != ".safetensors":
                raise Refused(403, "weights file outside the service's inbox")
            delete = True
        elif tag in self.uploads:
            path = self.uploads[tag]
        else:
            raise Conflict(f"unknown weights {tag!r}: upload them first")
        if not path.exists():
            raise Conflict(f"weights {tag!r} are not on the service's machine: send them again")
        if self.open_sessions:
            raise RuntimeError(f"weights pushed while {self.open_sessions} sessions are open")
        self._run(self._load(role, str(path)))
        if delete:
            path.unlink(missing_ok=True)
        self.loaded[role] = tag
        self.reloads += 1
        return True

    async def _load(self, role: int, path: str) -> None:
        eng = self.engines[role]
        await eng.collective_rpc("tandem_load_weights", args=(path,))
        ok = await eng.reset_prefix_cache()
        if not ok:  # blocks still in use: cached KV from the old weights could be reused
            raise RuntimeError(f"the {ROLE_NAMES[role]} engine refused to reset its prefix cache after a load")

    # -- work --------------------------------------------------------------------------------------
    def _table_key(self, key: str) -> str:
        if key not in self.tables:
            raise Conflict(f"unknown token tables {key!r}: send them first (POST /tables)")
        return key

    def counters(self) -> dict[int, dict]:
        import numpy as np

        from tandem.rollout.vllm.sched import FIELDS

        out = {}
        for r, f in self.stats_files.items():
            a = np.fromfile(f, dtype=np.float64, count=len(FIELDS))
            out[r] = dict(zip(FIELDS, (float(x) for x in a)))
        return out

    def socket_counters(self) -> dict[str, float]:
        """The frontend's own sockets, summed over both engines: the batched submissions (messages sent, the chunk
        requests they carried, the CPU of sending them; no messages with one message per chunk) and the chunk
        returns (messages and chunks taken, the CPU of taking them; none through vLLM's output path)."""
        subs, rets = list(self.submitters.values()), list(self.returns.values())
        return {"submit_messages": sum(s.messages for s in subs), "submit_requests": sum(s.requests for s in subs),
                "submit_cpu_seconds": sum(s.send_cpu_seconds for s in subs),
                "return_messages": sum(x.messages for x in rets), "return_chunks": sum(x.chunks for x in rets),
                "return_cpu_seconds": sum(x.cpu_seconds for x in rets)}

    def _sessions(self, req: dict, call: str, rows: list[int], make_sp, budget: int, eos: list[int]):
        """How this rollout's rows reach the engines: (open_session(role, b), cleanup after the rollout). One
        `DirectSession` per row and model; the benchmark's service (`benchmarks/vllm_ab_service.py`) overrides
        this with the alternatives it measures against."""
        def open_session(role: int, b: int) -> DirectSession:
            return DirectSession(self, role, f"{call}-{rows[b]}-{role}", make_sp)

        return open_session, lambda: None

    async def _run_rows(self, prompts, rows, ctx, open_session, call: str):
        """`turns.run_rows` under the engines' KV capacity (a hook for the benchmark's profiler)."""
        from tandem.rollout.vllm.turns import run_rows

        return await run_rows(prompts, rows, ctx, open_session, self.kv_blocks, self.block_size)

    def generate(self, req: dict) -> dict:
        key = self._table_key(str(req["tables"]))
        self.ensure(1, req.get("senior"))
        self.ensure(0, req.get("junior"))
        return self._run(self._generate(req, key))

    async def _generate(self, req: dict, key: str) -> dict:
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        from tandem.rollout.schedule import ScheduleSpec
        from tandem.rollout.vllm.turns import RolloutContext, rollout_counters, session_seed

        s = req["sampling"]
        try:
            schedule = ScheduleSpec.from_dict(req["schedule"])  # validated here, once per rollout
        except ValueError as e:
            raise Refused(400, str(e)) from None
        budget, seed = int(s["max_new_tokens"]), int(req["seed"])
        prompts = [[int(t) for t in q] for q in req["prompts"]]
        rows = [int(r) for r in req["rows"]]
        eos = sorted({int(e) for e in req["eos"]})
        if len(prompts) != len(rows) or not all(prompts):
            raise Refused(400, "prompts and rows must have one non-empty entry each")
        longest = max((len(q) for q in prompts), default=0) + budget
        if longest > self.max_model_len:
            raise Refused(400, f"prompt + max_new_tokens ({longest}) exceeds the engines' max_model_len "
                               f"({self.max_model_len}): raise rollout.vllm_max_model_len")
        temp, top_p, top_k = float(s["temperature"]), float(s["top_p"]), int(s["top_k"])
        self.calls += 1
        call = f"c{self.calls}-{uuid.uuid4().hex[:6]}"

        def make_sp(role: int, args: dict):
            kw: dict[str, Any] = dict(n=1, temperature=temp, top_p=top_p, top_k=top_k if top_k > 0 else -1,
                                      max_tokens=max(1, args["budget"] - args["t0"]),
                                      seed=session_seed(seed, args["row"], role), stop_token_ids=eos,
                                      ignore_eos=False, detokenize=False, skip_special_tokens=False,
                                      output_kind=RequestOutputKind.DELTA, extra_args={"tandem": args})
            if role == 1:
                kw["logprobs"] = 0  # the sampled token's log-prob only
            return VSP(**kw)

        open_session, cleanup = self._sessions(req, call, rows, make_sp, budget, eos)
        before, sockets0 = self.counters(), self.socket_counters()
        t0, c0 = time.perf_counter(), time.thread_time()
        ctx = RolloutContext(schedule, self.lookup[key], self.tables[key], seed, budget, frozenset(eos))
        try:
            batch, records, extra = await self._run_rows(prompts, rows, ctx, open_session, call)
        finally:
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            cleanup()
        after = self.counters()
        eng = {ROLE_NAMES[r]: {k: after[r][k] - before[r][k] for k in after[r]} for r in after}
        for r in ("senior", "junior"):
            eng[r]["max_scheduled_rows"] = after[ROLES[r]]["max_scheduled_rows"]
        step_s = {r: (eng[ROLE_NAMES[r]]["busy_seconds"] / eng[ROLE_NAMES[r]]["steps"]
                      if eng[ROLE_NAMES[r]]["steps"] else 0.0) for r in (0, 1)}
        tokens = sum(len(c) for c in batch.completion_ids)
        stats = {"seconds": wall, "frontend_cpu_seconds": cpu, "kept": tokens, "decoded": tokens,
                 "rows": len(prompts), "engines": eng, **extra,
                 **rollout_counters(records, step_s, eng["senior"]["row_seconds"] + eng["junior"]["row_seconds"])}
        stats["decoded"] = int(sum(e["generated_tokens"] for e in eng.values()))
        stats.update({k: v - sockets0[k] for k, v in self.socket_counters().items()})
        return {"completion_ids": batch.completion_ids, "owner": batch.owner,
                "senior_logprobs": batch.senior_logprobs, "handoffs": batch.handoffs,
                "finish_reason": batch.finish_reason, "stats": stats}

    def score(self, req: dict) -> dict:
        role = ROLES.get(req.get("role", "senior"))
        if role is None:
            raise Refused(400, "role must be senior or junior")
        self.ensure(role, req.get("weights"))
        return self._run(self._score(role, req["sequences"], req["starts"]))

    async def _score(self, role: int, seqs, starts) -> dict:
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        async def one(i: int, q: list[int]):
            sp = VSP(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
            last = None
            async for out in self.engines[role].generate(TokensPrompt(prompt_token_ids=q), sp,
                                                         request_id=f"score-{uuid.uuid4().hex[:8]}-{i}"):
                last = out
            return last

        outs = await asyncio.gather(*(one(i, [int(t) for t in q]) for i, q in enumerate(seqs)))
        res = []
        for q, st, out in zip(seqs, starts, outs):
            plp = out.prompt_logprobs
            res.append([plp[t][int(q[t])].logprob for t in range(int(st), len(q))])
        return {"logprobs": res}


# ---------------------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------------------

class Server(ThreadingHTTPServer):
    """The HTTP server, bounded: at most `MAX_CONNECTIONS` connections at a time (more are closed at once, one
    warning), and a failed connection (reset, timed out) is one log line, at most `ERROR_LINES` of them; each
    connection's socket times out after `SOCKET_TIMEOUT_S` of silence (`Handler.timeout`)."""

    daemon_threads = True
    MAX_CONNECTIONS = 64
    ERROR_LINES = 20

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(self.MAX_CONNECTIONS)
        self._refused = self._errors = 0
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self._refused += 1
            if self._refused in (1, 10, 100, 1000):
                LOG.warning("over %d open connections: closed %d so far", self.MAX_CONNECTIONS, self._refused)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address):
        self._errors += 1
        if self._errors <= self.ERROR_LINES:
            e = sys.exc_info()[1]
            LOG.warning("connection from %s failed: %s: %s%s", client_address[0], type(e).__name__, e,
                        " (further failures are not logged)" if self._errors == self.ERROR_LINES else "")


SOCKET_TIMEOUT_S = 60.0  # a connection silent this long (an idle or stalled client) is closed


def make_handler(service: Service | None, server_ref: list, token: str, hosts: set[str], max_json: int,
                 max_upload: int):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = SOCKET_TIMEOUT_S

        def log_message(self, fmt, *args):  # one line per request on stderr is noise at a step a second
            pass

        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self) -> bool:
            got = self.headers.get("Authorization", "")
            return bool(token) and hmac.compare_digest(got.encode(), f"Bearer {token}".encode())

        def _check(self, write: bool) -> None:
            if (self.headers.get("Host") or "").lower() not in hosts:
                raise Refused(421, "unexpected Host header")
            if self.headers.get("Origin") is not None:
                raise Refused(403, "requests from web pages are refused")
            if write and not self._authorised():
                raise Refused(401, "missing or wrong token")

        def _length(self, limit: int) -> int:
            raw = self.headers.get("Content-Length")
            if raw is None or not raw.isdigit():
                raise Refused(411, "a numeric Content-Length is required")
            n = int(raw)
            if n > limit:
                raise Refused(413, f"body too large ({n} bytes; limit {limit})")
            return n

        def _fail(self, e: Exception) -> None:
            if isinstance(e, Refused):
                code, msg = e.status, str(e)
            elif isinstance(e, Conflict):
                code, msg = 409, str(e)
            else:
                code, msg = 500, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                LOG.error("request %s failed:\n%s", self.path, traceback.format_exc())
            self.close_connection = True
            try:
                self._send(code, {"error": msg})
            except OSError:
                pass

        def do_GET(self):
            try:
                self._check(write=False)
                if urlparse(self.path).path != "/health":
                    raise Refused(404, "no such route")
                # a client proves this is its service before it sends the secret: answer its challenge
                challenge = self.headers.get(CHALLENGE_HEADER)
                proof = {"proof": health_proof(token, challenge[:128])} if challenge and token else {}
                if service is None:
                    return self._send(503, {"error": "starting", **proof})
                return self._send(200, {**service.health(full=self._authorised()), **proof})
            except Exception as e:  # noqa: BLE001 - one short line to the client, details to the log
                return self._fail(e)

        def do_POST(self):
            url = urlparse(self.path)
            try:
                self._check(write=True)
                if service is None:
                    raise Refused(503, "starting")
                if url.path == "/upload":
                    if self.headers.get("Content-Type") != "application/octet-stream":
                        raise Refused(415, "uploads are application/octet-stream")
                    n = self._length(max_upload)
                    q = parse_qs(url.query)
                    role, tag = ROLES.get(q.get("role", [""])[0]), q.get("tag", [""])[0]
                    if role is None or not tag:
                        raise Refused(400, "upload needs ?role=senior|junior&tag=")
                    with service.lock:
                        return self._send(200, service.upload(role, tag, self.rfile, n))
                if (self.headers.get("Content-Type") or "").split(";")[0].strip() != "application/json":
                    raise Refused(415, "bodies are application/json")
                n = self._length(max_json)
                body = self.rfile.read(n) if n else b""
                if url.path == "/shutdown":
                    self._send(200, {"ok": True})
                    threading.Thread(target=server_ref[0].shutdown, daemon=True).start()
                    return
                try:
                    req = json.loads(body or b"{}")
                except ValueError:
                    raise Refused(400, "the body is not JSON") from None
                if not isinstance(req, dict):
                    raise Refused(400, "the body must be a JSON object")
                routes = {"/tables": service.set_tables, "/generate": service.generate, "/score": service.score,
                          "/weights": lambda r: {"ok": True, "reloaded": service.ensure(_role(r), r)}}
                if url.path not in routes:
                    raise Refused(404, "no such route")
                with service.lock:
                    out = routes[url.path](req)
                return self._send(200, out)
            except Exception as e:  # noqa: BLE001 - one short line to the client, details to the log
                return self._fail(e)

    return Handler


def _role(r: dict) -> int:
    role = ROLES.get(r.get("role", ""))
    if role is None:
        raise Refused(400, "role must be senior or junior")
    return role


def _watch_parent(pid: int, stop) -> None:
    """Stop the service when the process that started it is gone (killed with -9 included): `stop` sends this
    process SIGTERM, whose handler interrupts even an engine start in progress."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(pid, 0)
            alive = os.getppid() == pid or pid == 1
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        if not alive:
            LOG.warning("the process that started the service (pid %d) is gone: stopping", pid)
            stop()
            return


def engine_kwargs(knobs: EngineKnobs, model: str, role: int, seed: int, stats_file: str, dtype: str,
                  is_cpu: bool) -> dict[str, Any]:
    """The `AsyncEngineArgs` of one engine (role 1: the senior, 0: the junior): the knobs, the tandem scheduler
    and worker, and the settings the service relies on whatever the platform's defaults (`compat.ENGINE_FIXED`:
    synchronous scheduling)."""
    kw: dict[str, Any] = dict(model=model, dtype=dtype, enforce_eager=knobs.enforce_eager,
                              enable_prefix_caching=True, seed=seed, gpu_memory_utilization=knobs.gpu_memory,
                              scheduler_cls="tandem.rollout.vllm.sched.TandemScheduler",
                              worker_extension_cls="tandem.rollout.vllm.worker.TandemWorker",
                              additional_config={"tandem_stats": stats_file},
                              max_num_seqs=knobs.max_num_seqs, disable_log_stats=True,
                              # one device per engine: the worker runs inside the engine-core process (no extra
                              # process to start), and collective_rpc reaches it there
                              distributed_executor_backend="uni", **ENGINE_FIXED)
    if role == 1:
        # processed_logprobs: the sampled token's log-prob after temperature, log_softmax(logits / T), which is
        # what trl recomputes (training uses top-p 1 and no top-k).
        kw["logprobs_mode"] = "processed_logprobs"
    if knobs.max_model_len:
        kw["max_model_len"] = knobs.max_model_len
    if knobs.kv_blocks:
        kw["num_gpu_blocks_override"] = knobs.kv_blocks
    if knobs.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = knobs.max_num_batched_tokens
    if knobs.block_size:
        kw["block_size"] = knobs.block_size
    elif is_cpu:
        # The CPU build defaults to 128-token KV blocks (its attention wants multiples of 32); the first chunk of
        # a session shares the group's prompt blocks through the prefix cache
        kw["block_size"] = 32
    return kw


def parallel_kwargs(devices: int) -> dict[str, Any]:
    """The engine arguments of an engine placed on `devices` GPUs: tensor-parallel over a group of several (vLLM's
    multiprocess executor, one worker per GPU); nothing for one GPU or none (the `uni` executor of
    `engine_kwargs`). Unverified on CUDA until a GPU check runs it."""
    if devices <= 1:
        return {}
    return {"tensor_parallel_size": devices, "distributed_executor_backend": "mp"}


def check_vllm() -> str:
    """Set the engine environment (`compat.ENGINE_ENV`, before vLLM is imported: the engine-core processes
    inherit it), then import vLLM and refuse a version outside the fence; returns the installed version."""
    os.environ.update(ENGINE_ENV)
    import vllm

    check_version(vllm.__version__)
    return vllm.__version__


def main(argv: list[str] | None = None, service_cls: type[Service] = Service) -> int:
    """Serve until stopped (`service_cls`: the benchmark's service passes its subclass)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--senior", required=True, help="model directory the senior engine starts from")
    ap.add_argument("--junior", required=True, help="model directory of the frozen junior")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    ap.add_argument("--port", type=int, default=8471)
    EngineKnobs.add_arguments(ap)
    ap.add_argument("--allow-root", action="append", default=[], help="weights directories may lie under this")
    ap.add_argument("--allow-host", action="append", default=[], help="extra accepted Host header values")
    ap.add_argument("--token-file", default=None, help="file holding the secret (else $TANDEM_VLLM_TOKEN)")
    ap.add_argument("--parent-pid", type=int, default=0, help="stop when this process is gone")
    ap.add_argument("--ready-fd", type=int, default=-1,
                    help="a pipe to report {port, pid} on once listening (the client that started the service)")
    ap.add_argument("--run-dir", default=None, help="the starter's temporary directory, removed on a clean exit")
    ap.add_argument("--max-json-mb", type=float, default=256.0)
    ap.add_argument("--max-upload-gb", type=float, default=64.0)
    ap.add_argument("--layout", default="shared", choices=("shared", "dedicated"), help="rollout.vllm_layout")
    ap.add_argument("--senior-devices", default="", help="the senior engine's CUDA_VISIBLE_DEVICES (empty: inherit)")
    ap.add_argument("--junior-devices", default="", help="the junior engine's CUDA_VISIBLE_DEVICES (empty: inherit)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    token = (Path(a.token_file).read_text().strip() if a.token_file else os.environ.pop("TANDEM_VLLM_TOKEN", ""))
    if len(token) < 16:
        print("tandem vllm service: a secret of at least 16 characters is required ($TANDEM_VLLM_TOKEN or "
              "--token-file)", file=sys.stderr)
        return 2
    try:
        placement = Placement.from_argv(a.layout, a.senior_devices, a.junior_devices)
    except PlacementError as e:
        print(f"tandem vllm service: {e}", file=sys.stderr)
        return 2
    try:
        version = check_vllm()
    except UnsupportedVLLMError as e:
        print(f"tandem vllm service: {e}", file=sys.stderr)
        return 2
    LOG.info("vLLM %s (supported: %s); engine environment %s; fixed engine arguments %s", version,
             supported_text(), ENGINE_ENV, ENGINE_FIXED)
    ref: list = []
    try:
        server = Server((a.host, a.port), make_handler(None, ref, token, set(), 0, 0))
    except OSError as e:
        print(f"tandem vllm service: cannot listen on {a.host}:{a.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    port = server.server_address[1]
    if a.ready_fd >= 0:  # the port is ours now: tell the client that started us, over its private pipe
        try:
            os.write(a.ready_fd, port_report(port))
        finally:
            os.close(a.ready_fd)
    hosts = {f"{a.host}:{port}".lower(), a.host.lower()} | {h.lower() for h in a.allow_host}
    if a.host in ("127.0.0.1", "localhost", "::1"):
        hosts |= {f"127.0.0.1:{port}", f"localhost:{port}"}
    ref.append(server)
    stopping = threading.Event()
    clean = {"ok": True}

    def stop(*_):
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

    def on_signal(*_):
        stop()
        if service is None:  # still starting the engines: abort the start (the finally below cleans up)
            raise SystemExit(1)

    service = None
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if a.parent_pid:
        threading.Thread(target=_watch_parent, args=(a.parent_pid, lambda: os.kill(os.getpid(), signal.SIGTERM)),
                         daemon=True).start()
    inbox = _inbox_root()
    server_thread = threading.Thread(target=server.serve_forever, daemon=True)
    try:
        server.RequestHandlerClass = make_handler(None, ref, token, hosts, 0, 0)
        server_thread.start()  # /health answers "starting" (503) while the engines load
        LOG.info("layout %s: %s", placement.layout, placement.describe())
        spec = EngineSpec(a.senior, a.junior, EngineKnobs.from_args(a), placement=placement)
        service = service_cls(spec, roots=a.allow_root, inbox=inbox)
        server.RequestHandlerClass = make_handler(service, ref, token, hosts, int(a.max_json_mb * 2**20),
                                                  int(a.max_upload_gb * 2**30))
        print(json.dumps({"listening": f"http://{a.host}:{port}", "pid": os.getpid()}), flush=True)
        while server_thread.is_alive() and not stopping.is_set():
            server_thread.join(0.5)
    except BaseException:
        if not stopping.is_set():  # a failure, not a stop asked for: keep the log for diagnosis
            clean["ok"] = False
            LOG.error("the rollout service failed:\n%s", traceback.format_exc())
        raise
    finally:
        stop()
        server_thread.join(10)
        server.server_close()
        if service is not None:
            service.shutdown()
        shutil.rmtree(inbox, ignore_errors=True)  # pushed weights and counters never outlive the service
        if a.run_dir and clean["ok"]:
            shutil.rmtree(a.run_dir, ignore_errors=True)
        if service is None and stopping.is_set() and os.getpgid(0) == os.getpid():
            # stopped while the engines were starting: their processes (this process group, which the client
            # made ours) would otherwise finish starting and linger; the resource trackers are spared, so the
            # engines' shared memory is released (lifecycle.end_group)
            end_group(os.getpid(), grace=5.0, tracker_wait=0.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
