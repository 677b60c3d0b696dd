"""Tandem decoding over streaming sessions, in plain Python: the row state machine and the engine-core stop rule.

No vLLM import: this runs (and is tested) in the pipeline's environment, in the rollout service and inside
vLLM's engine-core processes alike.

How a rollout runs (design D1). Every row is one asyncio task (`run_row`) that replays the schedule
(`schedule.RowSchedule`) and holds one resumable *session* per model (`Session`: a vLLM streaming-input
request). The author's session decodes until the engine core stops it exactly after the token at which the
schedule hands authorship to the other model (`stop_reason`: `TandemScheduler` applies `chunk_stop` to every
sampled token, an O(1) lookup), at EOS or at the budget. The row then sends the partner exactly the tokens
its session has not seen (everything after the last token it computed: its own last sampled token, whose KV
was never computed, plus the author's run), and the partner resumes from its kept KV cache: no round barrier,
no history resubmission, no vocabulary-sized stop list, both engines continuously batched.

Every chunk carries the schedule state at its start (`chunk_args`: position, gap counter, newline bit, turns),
so the gap counter, the step schedule's state and the budget cross chunk boundaries exactly. A switch is decided
once, by the engine core: a chunk that comes back on the chunk returns with its stop rule's state after the
switch (`Chunk.state`) continues the row from that state. A chunk without it (the row's last one, at EOS, the
budget or the rounds cap; or a session on vLLM's output path) is walked by the frontend with `ChunkReferee`
(`walk_turn`'s result for a whole chunk, without a `RowSchedule` call per token), which refuses a chunk that
decoded past a switch or stopped where the schedule does not (an engine/client disagreement on EOS, the budget
or the tables). `walk_turn` is the per-token reference the referee is tested against.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Callable, Protocol, Sequence

from tandem.rollout.core import FINISH_EOS, FINISH_LENGTH, FINISH_ROUNDS, RolloutBatch, count_handoffs
from tandem.rollout.sampling import MASK32, STREAM_REDRAW, mix32_int, uniform_at, uniform_prefix
from tandem.rollout.schedule import LookupTables, RowSchedule, ScheduleSpec

STREAM_VLLM_SEED = 3
STOP_SWITCH, STOP_ROUNDS = "tandem_switch", "tandem_rounds"  # stop reasons set by the engine core


class RolloutError(RuntimeError):
    """The engine and the schedule disagree (a chunk decoded past a switch, or stopped where none is)."""


def session_seed(seed: int, row_id: int, role: int) -> int:
    """vLLM sampling seed of one row's session with one model (31-bit). One seed per (row, model): a session
    keeps its generator across chunks, and the two models never share a noise stream."""
    return mix32_int(uniform_prefix(seed, STREAM_VLLM_SEED, row_id) ^ (role & MASK32)) & 0x7FFFFFFF


def tandem_args(params) -> dict | None:
    """The `chunk_args` a request's vLLM sampling parameters carry (`extra_args["tandem"]`), or None for a
    request that is not a tandem chunk."""
    extra = getattr(params, "extra_args", None) if params is not None else None
    return extra.get("tandem") if extra else None


def walk_turn(state: RowSchedule, tokens: Sequence[int], t0: int, budget: int, eos: set[int]
              ) -> tuple[int, str | None]:
    """How many of a turn's `tokens` (starting at completion position t0) to keep, and the finish reason if the
    row ends within them. Advances `state` over the kept tokens.

    Keeps tokens up to and including the first one that ends the row (EOS, budget, rounds cap) or hands
    authorship to the other model.
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


VECTOR_MIN = 256  # chunk length from which the numpy walk beats the loop (measured: see ChunkReferee)


class ChunkReferee:
    """`walk_turn` over a whole chunk, for the frontend: the same kept count, finish reason and schedule state
    after the kept tokens. The (seed, stream, row) part of the redraw uniform's hash is computed once per row,
    so a redraw costs 3 of the uniform's 8 hash rounds. Long chunks (a solo row, a long step turn) go through
    numpy: table lookups (word starts, step ends, newlines, EOS) are array gathers, the word schedule's redraw
    positions are its word starts unless the gap cap binds in the chunk (then walked one redraw at a time),
    and the uniform is evaluated at the redraw positions only. Short chunks, most of them (an authorship run
    is ~3-4 tokens), take one plain loop: numpy's cost per call exceeds the loop's there. Measured on the tiny
    base's tables (2-core machine, loaded): 9 us per 8-token word chunk against `walk_turn`'s 33 us; 3,000-
    token chunks 0.2-0.4 ms in numpy against 3.4-3.9 ms."""

    def __init__(self, tables: LookupTables, eos: Sequence[int]):
        import numpy as np

        self.np = np
        self.word = np.frombuffer(tables.word, dtype=np.uint8).astype(bool)
        self.end = np.frombuffer(tables.end, dtype=np.uint8).astype(bool)
        self.snl = np.frombuffer(tables.snl, dtype=np.uint8).astype(bool)
        self.enl = np.frombuffer(tables.enl, dtype=np.uint8).astype(bool)
        self.empty = np.frombuffer(tables.empty, dtype=np.uint8).astype(bool)
        self.eos = np.zeros(len(self.word), dtype=bool)
        for e in eos:
            if 0 <= int(e) < len(self.eos):  # an EOS id the tables do not cover can never come back
                self.eos[int(e)] = True
        self.eos_bytes, self.word_bytes = bytes(self.eos.astype(np.uint8)), tables.word
        self.vector_min = VECTOR_MIN
        _mix32_np(np, np.zeros(1, dtype=np.uint64))  # its constants

    def _hash(self, seed: int, row: int) -> int:
        """The (seed, STREAM_REDRAW, row) part of the uniform's hash, once per row."""
        return uniform_prefix(seed, STREAM_REDRAW, row)

    def _uniform(self, seed: int, row: int, pos):
        """`uniform_int(seed, STREAM_REDRAW, row, t)` for every t in `pos` (int64 array)."""
        np = self.np
        h = self._hash(seed, row)
        x = _mix32_np(np, np.uint64(h) ^ (pos.astype(np.uint64) & _NP_CONST["m"]))
        hi = _mix32_np(np, x ^ np.uint64(0x5BD1E995)) >> np.uint64(5)
        lo = _mix32_np(np, x ^ np.uint64(0x1B873593)) >> np.uint64(6)
        return ((hi * np.uint64(1 << 26) + lo).astype(np.float64) + 0.5) * (2.0 ** -53)

    def _word_redraws(self, state: RowSchedule, toks) -> list[int] | object:
        """Indices in the chunk at which the word schedule redraws (word start or gap cap)."""
        np = self.np
        ws = np.flatnonzero(self.word[toks])
        cap, L = state.spec.max_gap_tokens, len(toks)
        # gap after token j = j - last, with last = the previous redraw's index (virtually -gap-1 at the start)
        bounds = np.concatenate(([-state.gap - 1], ws, [L]))
        if (np.diff(bounds) <= cap).all():
            return ws  # the cap never binds inside the chunk: the word starts are the redraws
        out, last, i = [], -state.gap - 1, 0
        while True:
            while i < ws.size and ws[i] <= last:
                i += 1
            nxt = last + cap
            if i < ws.size and ws[i] < nxt:
                nxt = int(ws[i])
            if nxt >= L:
                return np.asarray(out, dtype=np.int64)
            out.append(nxt)
            last = nxt

    def walk(self, state: RowSchedule, tokens: Sequence[int], t0: int, budget: int) -> tuple[int, str | None]:
        """Exactly `walk_turn(state, tokens, t0, budget, eos)` (see there), `state` advanced alike: chunks of
        at least `vector_min` tokens in numpy, shorter ones (most: an authorship run is ~3-4 tokens, where
        numpy's per-call cost exceeds the loop's) in one plain loop with the hash prefix cached."""
        L = len(tokens)
        if L == 0:
            return 0, None
        if L < self.vector_min:
            return self._walk_loop(state, tokens, t0, budget)
        return self._walk_numpy(state, tokens, t0, budget)

    def _walk_loop(self, state: RowSchedule, tokens: Sequence[int], t0: int, budget: int) -> tuple[int, str | None]:
        kind, eos, word, V = state.spec.kind, self.eos_bytes, self.word_bytes, len(self.word_bytes)
        start = author = state.author
        cap, gap, p = state.spec.max_gap_tokens, state.gap, state.spec.p_senior
        h = self._hash(state.seed, state.row_id) if kind in ("word", "token") else 0
        rounds_done = False
        for i, tok in enumerate(tokens):
            tok = int(tok)
            if not 0 <= tok < V:
                raise RolloutError(f"row {state.row_id}: a token id outside the vocabulary came back")
            t = t0 + i
            if kind == "word":
                gap += 1
                if word[tok] or gap >= cap:
                    author, gap = int(uniform_at(h, t) < p), 0
            elif kind == "token":
                author = int(uniform_at(h, t) < p)
            elif kind == "step":
                rounds_done = state.advance(tok, t)
                author = state.author
            if eos[tok] or t + 1 >= budget or rounds_done or author != start:
                break
        state.author = author
        if kind == "word":
            state.gap = gap
        n = i + 1
        if eos[tok]:
            return n, FINISH_EOS
        if t + 1 >= budget:
            return n, FINISH_LENGTH
        if rounds_done:
            return n, FINISH_ROUNDS
        return n, None

    def _walk_numpy(self, state: RowSchedule, tokens: Sequence[int], t0: int, budget: int
                    ) -> tuple[int, str | None]:
        np = self.np
        toks = np.asarray(tokens, dtype=np.int64)
        if toks.min() < 0 or toks.max() >= len(self.word):
            raise RolloutError(f"row {state.row_id}: a token id outside the vocabulary came back")
        stop = len(toks) - 1  # the last index walked: the first token that ends the row or hands over, else the last one
        e = np.flatnonzero(self.eos[toks])
        if e.size:
            stop = int(e[0])
        stop = min(stop, max(0, budget - t0 - 1))
        kind, switch, rounds_done = state.spec.kind, None, False
        if kind == "word":
            red = self._word_redraws(state, toks[:stop + 1])
            if len(red):
                drawn = self._uniform(state.seed, state.row_id, red + t0) < state.spec.p_senior
                other = np.flatnonzero(drawn != bool(state.author))
                if other.size:
                    switch = int(red[other[0]])
                    stop = switch
                state.author = 1 - state.author if other.size else state.author
                last = switch if switch is not None else int(red[-1])
                state.gap = stop - last
            else:
                state.gap += stop + 1
        elif kind == "token":
            drawn = self._uniform(state.seed, state.row_id, np.arange(t0, t0 + stop + 1, dtype=np.int64)) \
                < state.spec.p_senior
            other = np.flatnonzero(drawn != bool(state.author))
            if other.size:
                stop = switch = int(other[0])
                state.author = 1 - state.author
        elif kind == "step":
            t = toks[:stop + 1]
            nonempty = ~self.empty[t]
            idx = np.where(nonempty, np.arange(len(t)), -1)
            last_ne = np.maximum.accumulate(idx)  # the last non-empty token at or before each index
            before = np.concatenate(([-1], last_ne[:-1]))
            nl = np.where(before >= 0, self.enl[t[np.maximum(before, 0)]], state.newline)
            ends = np.flatnonzero(self.end[t] | (nl & self.snl[t]))
            if ends.size:
                stop = switch = int(ends[0])
                state.author, state.newline = 1 - state.author, False
                state.turns += 1
                rounds_done = state.turns >= state.spec.max_rounds
            elif last_ne[stop] >= 0:
                state.newline = bool(self.enl[t[last_ne[stop]]])
        n = stop + 1
        if self.eos[toks[stop]]:
            return n, FINISH_EOS
        if t0 + stop + 1 >= budget:
            return n, FINISH_LENGTH
        if rounds_done:
            return n, FINISH_ROUNDS
        return n, None  # a handoff at `switch`, or the chunk's end


_NP_CONST: dict = {}


def _mix32_np(np, x):
    """`sampling.mix32` on uint64 numpy arrays holding 32-bit values (products wrap modulo 2^64)."""
    c = _NP_CONST
    if not c:
        c.update(m=np.uint64(MASK32), s15=np.uint64(15), s16=np.uint64(16), a=np.uint64(0x7FEB352D),
                 b=np.uint64(0x846CA68B))
    m, s16 = c["m"], c["s16"]
    x = x & m
    x ^= x >> s16
    x *= c["a"]
    x &= m
    x ^= x >> c["s15"]
    x *= c["b"]
    x &= m
    return x ^ (x >> s16)


# ---------------------------------------------------------------------------------------------------------
# The engine-core side: one chunk's stop rule
# ---------------------------------------------------------------------------------------------------------

def chunk_args(state: RowSchedule, role: int, t0: int, budget: int, tables: str) -> dict:
    """What the engine core needs to stop a chunk of `role` starting at completion position t0: the schedule's
    settings and state there, the budget and the token tables' file. JSON/msgpack-friendly."""
    spec = state.spec
    return {"kind": spec.kind, "p_senior": float(spec.p_senior), "max_gap_tokens": int(spec.max_gap_tokens),
            "max_rounds": int(spec.max_rounds),  # the ScheduleSpec's fields, under its names
            "role": int(role), "row": int(state.row_id), "seed": int(state.seed),
            "budget": int(budget), "t0": int(t0), "gap": int(state.gap), "newline": bool(state.newline),
            "turns": int(state.turns), "tables": tables}


@lru_cache(maxsize=256)
def chunk_spec(kind: str, p_senior: float, max_gap_tokens: int, max_rounds: int) -> ScheduleSpec:
    """The `ScheduleSpec` a chunk's arguments name, made (and validated) once per distinct spec in the process."""
    return ScheduleSpec(kind, p_senior, max_gap_tokens, max_rounds)


class ChunkRule:
    """The stop rule of one chunk, resumed from its `chunk_args`: `step(token, i)` for the chunk's i-th sampled
    token returns None (go on), `STOP_SWITCH`, `STOP_ROUNDS` or "length". EOS is vLLM's own stop."""

    __slots__ = ("state", "role", "t0", "budget")

    def __init__(self, args: dict, tables: LookupTables):
        spec = chunk_spec(args["kind"], args["p_senior"], args["max_gap_tokens"], args["max_rounds"])
        self.state = RowSchedule.resume(spec, tables, args["seed"], args["row"], {**args, "author": args["role"]})
        self.role, self.t0, self.budget = int(args["role"]), int(args["t0"]), int(args["budget"])

    def step(self, token: int, i: int) -> str | None:
        t = self.t0 + i
        rounds_done = self.state.advance(token, t)
        if t + 1 >= self.budget:
            return "length"
        if rounds_done:
            return STOP_ROUNDS
        if self.state.author != self.role:
            return STOP_SWITCH
        return None


# ---------------------------------------------------------------------------------------------------------
# The frontend side: one row's state machine over two sessions
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Chunk:
    """What a session returns for one chunk: the sampled tokens (and the senior's log-probs), why it stopped
    (`stop`: "switch" | "eos" | "length" | "rounds"), when its first and last tokens arrived, and, after a
    switch, the row's schedule state as the engine core's stop rule left it (`RowSchedule.state()`; None
    where the session cannot carry it: the frontend then walks the chunk itself)."""

    tokens: list[int]
    logprobs: list[float] | None
    stop: str
    t_submit: float
    t_first: float
    t_last: float
    state: dict | None = None


class Session(Protocol):
    """One row's resumable request on one model's engine."""

    async def send(self, tokens: list[int], args: dict) -> Chunk: ...

    async def close(self) -> None: ...


OpenSession = Callable[[int, int], Session]  # (role, row index) -> a new session


@dataclass
class RowRecord:
    """Per-row accounting for the counters: chunks as (role, tokens, t_submit, t_first, t_last)."""

    chunks: list[tuple[int, int, float, float, float]] = field(default_factory=list)
    sessions: int = 0
    walked: int = 0  # chunks the frontend walked with the referee (those that came without the engine's state)
    t_start: float = 0.0
    t_end: float = 0.0


@dataclass
class RowResult:
    completion: list[int]
    owner: list[int]
    logprobs: list[float]
    finish: str
    record: RowRecord


@dataclass(frozen=True)
class RolloutContext:
    """What every row of one rollout shares: the schedule and its settings (`ScheduleSpec`, validated), the call's
    seed, the token budget, the EOS ids, and the token tables (in memory for the frontend's referee, by file for
    the engine cores)."""

    schedule: ScheduleSpec
    tables: LookupTables
    tables_ref: str
    seed: int
    budget: int
    eos: frozenset[int]

    @cached_property
    def referee(self) -> "ChunkReferee":
        """The frontend's check of every chunk (built once per rollout)."""
        return ChunkReferee(self.tables, sorted(self.eos))

    def row_schedule(self, row_id: int) -> RowSchedule:
        return RowSchedule(self.schedule, self.tables, self.seed, row_id)


async def run_row(prompt: Sequence[int], row_id: int, ctx: RolloutContext,
                  open_session: Callable[[int], Session]) -> RowResult:
    """Roll out one row: replay the schedule, feed each model exactly the tokens its session has not seen."""
    budget, tables_ref, referee = ctx.budget, ctx.tables_ref, ctx.referee
    state = ctx.row_schedule(row_id)
    hist = [int(t) for t in prompt]
    comp: list[int] = []
    owner: list[int] = []
    logp: list[float] = []
    seen = {0: 0, 1: 0}  # history tokens each model's session holds (computed or queued)
    sessions: dict[int, Session] = {}
    rec = RowRecord(t_start=time.perf_counter())
    finish: str | None = None
    try:
        while finish is None:
            m = state.author
            t0 = len(comp)
            if m not in sessions:
                sessions[m] = open_session(m)
                rec.sessions += 1
            chunk = hist[seen[m]:]
            res = await sessions[m].send(chunk, chunk_args(state, m, t0, budget, tables_ref))
            toks = [int(x) for x in res.tokens]
            if res.state is not None and res.stop == "switch" and toks and t0 + len(toks) < budget:
                # the engine core's stop rule decided the switch: the row goes on from its schedule state
                n, why = len(toks), None
                state.set_state(res.state)
                if state.author == m:
                    raise RolloutError(f"row {row_id}: the engine switched authors at position {t0 + n - 1} "
                                       f"but its schedule state names the same author")
            else:
                n, why = referee.walk(state, toks, t0, budget)
                rec.walked += 1
                if not toks or n != len(toks):
                    raise RolloutError(f"row {row_id}: the {'senior' if m else 'junior'} engine decoded "
                                       f"{len(toks)} tokens from position {t0}, the schedule keeps {n}")
                expected = why or "switch"
                if res.stop != expected:
                    raise RolloutError(f"row {row_id}: the engine stopped a chunk at position {t0 + n - 1} for "
                                       f"{res.stop!r}, the schedule says {expected!r} (EOS ids, budget or token "
                                       f"tables differ between the engine and the client)")
            if m == 1:
                lps = res.logprobs
                if lps is None or len(lps) != n:
                    raise RolloutError(f"row {row_id}: the senior's chunk came back without a log-prob per token")
                bad = [x for x in lps if not math.isfinite(x)]
                if bad:
                    raise RolloutError(f"row {row_id}: the senior engine returned a non-finite log-prob ({bad[0]})")
                logp += [float(x) for x in lps]
            else:
                logp += [0.0] * n
            hist += toks
            comp += toks
            owner += [m] * n
            seen[m] = len(hist) - 1  # its last sampled token was never computed: the next chunk starts there
            rec.chunks.append((m, n, res.t_submit, res.t_first, res.t_last))
            finish = why
    finally:
        for s in sessions.values():
            await s.close()
    rec.t_end = time.perf_counter()
    return RowResult(comp, owner, logp, finish or FINISH_LENGTH, rec)


class Admission:
    """Rows admitted while their worst-case KV (prompt + budget, in blocks, per engine) fits: a parked session
    keeps its blocks, so an engine whose cache is full of parked rows waiting for their partner would stall;
    admitting no more rows than both caches hold at their full length keeps every rollout able to finish."""

    def __init__(self, capacity_blocks: int | None, block_size: int):
        self.free = capacity_blocks
        self.block_size = max(1, block_size)
        self.cond = asyncio.Condition()
        self.live = 0
        self.max_live = 0

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size) + 1

    async def acquire(self, need: int) -> None:
        async with self.cond:
            if self.free is not None:
                await self.cond.wait_for(lambda: self.free >= need or self.live == 0)
                self.free -= need
            self.live += 1
            self.max_live = max(self.max_live, self.live)

    async def release(self, need: int) -> None:
        async with self.cond:
            if self.free is not None:
                self.free += need
            self.live -= 1
            self.cond.notify_all()


async def run_rows(prompts: Sequence[Sequence[int]], rows: Sequence[int], ctx: RolloutContext,
                   open_session: OpenSession, capacity_blocks: int | None = None, block_size: int = 16
                   ) -> tuple[RolloutBatch, list[RowRecord], dict]:
    """Every row as its own task (admitted while the KV caches hold it); the batch, per-row records, and
    {"max_live_rows"}."""
    adm = Admission(capacity_blocks, block_size)

    async def one(b: int) -> RowResult:
        need = adm.blocks(len(prompts[b]) + ctx.budget)
        await adm.acquire(need)
        try:
            return await run_row(prompts[b], int(rows[b]), ctx, lambda role: open_session(role, b))
        finally:
            await adm.release(need)

    tasks = [asyncio.ensure_future(one(b)) for b in range(len(prompts))]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:  # one row failed: stop the others, each closing its sessions
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    batch = RolloutBatch([r.completion for r in results], [r.owner for r in results],
                         [r.logprobs for r in results], [count_handoffs(r.owner) for r in results],
                         [r.finish for r in results])
    return batch, [r.record for r in results], {"max_live_rows": adm.max_live}


# ---------------------------------------------------------------------------------------------------------
# Counters from the per-row records and the engines' own counters
# ---------------------------------------------------------------------------------------------------------

def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(math.ceil(q * len(xs))) - 1))
    return float(xs[k])


def rollout_counters(records: Sequence[RowRecord], step_seconds: dict[int, float],
                     row_seconds: float | None = None) -> dict:
    """Row-level counters, in steps of the engine a row waits for (`step_seconds[role]`: that engine's mean
    step time over the rollout):
    - `chunks`, `session_starts`: requests sent to the engines (a session's first chunk opens it);
    - `walked_chunks`: chunks the frontend walked itself (no schedule state from the engine core: the rows'
      last chunks, or sessions on vLLM's output path);
    - `handoff_latency_steps_p50/p90`: per authorship switch, the partner's steps between the author's last
      token and the partner's first one, not counting the step that computes it ((t_first - t_prev) / step
      time - 1, floored at 0): 0 when the partner takes the row in its very next step;
    - `idle_row_step_fraction`: the share of the rows' live time in which a row was in no engine's batch:
      1 - `row_seconds` / (the rows' lifetimes), `row_seconds` being what the engine cores measured (each
      step's rows x its duration, both engines; `TandemScheduler`). Without it (None) the estimate below;
    - `idle_row_step_fraction_mean_step`: 1 - (one author step per token, at the author's mean step time) /
      (the rows' lifetimes). It counts as idle whatever a row's steps took beyond the engine's mean step: rows
      sit in the larger, slower batches, so it overstates the idle time (a row is in every step of its
      author's engine from a chunk's first token to its last).
    """
    lat: list[float] = []
    ideal, life = 0.0, 0.0
    chunks = sessions = 0
    for rec in records:
        sessions += rec.sessions
        prev_role, prev_t = None, rec.t_start
        for role, n, _t_sub, t_first, t_last in rec.chunks:
            chunks += 1
            st = step_seconds.get(role) or 0.0
            ideal += n * st
            if prev_role is not None and prev_role != role and st > 0:
                lat.append(max(0.0, (t_first - prev_t) / st - 1.0))
            prev_role, prev_t = role, t_last
        if rec.chunks:
            life += max(rec.chunks[-1][4] - rec.t_start, 0.0)
    at_mean = max(0.0, 1.0 - ideal / life) if life > 0 else 0.0
    measured = at_mean if row_seconds is None else (max(0.0, 1.0 - row_seconds / life) if life > 0 else 0.0)
    return {"chunks": chunks, "session_starts": sessions, "walked_chunks": sum(r.walked for r in records),
            "handoffs_timed": len(lat),
            "handoff_latency_steps_p50": _pct(lat, 0.5), "handoff_latency_steps_p90": _pct(lat, 0.9),
            "idle_row_step_fraction": measured, "idle_row_step_fraction_mean_step": at_mean}

