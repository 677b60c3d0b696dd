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

import asyncio
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from tandem.rollout.vllm.engines import (ROLE_NAMES, ROLES, EngineHost, EngineSpec, check_vllm,  # noqa: F401
                                         engine_envs, engine_kwargs, parallel_kwargs, resolve_dtype)
from tandem.rollout.vllm.httpd import Conflict, Refused, Server, _inbox_root, make_handler, serve  # noqa: F401
from tandem.rollout.vllm.returns import Returns
from tandem.rollout.vllm.sessions import _FINISHES, _STOPS, DirectSession, Router  # noqa: F401

MAX_VOCAB = 1 << 22


class Service(EngineHost):
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

    # -- work --------------------------------------------------------------------------------------
    def _table_key(self, key: str) -> str:
        if key not in self.tables:
            raise Conflict(f"unknown token tables {key!r}: send them first (POST /tables)")
        return key

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


def main(argv: list[str] | None = None, service_cls: type[Service] = Service) -> int:
    """Serve until stopped (`httpd.serve`; `service_cls`: the benchmark's service passes its subclass)."""
    return serve(argv, service_cls)


if __name__ == "__main__":
    sys.exit(main())
