"""The vLLM path without vLLM: the per-row state machine over two fake streaming sessions that stop with the
engine core's rule (`turns.ChunkRule`), turn walking, session seeds, the counters, admission, the weight-sync
callback, and the engine's service requirement."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from tandem.rollout.schedule import LookupTables, RowSchedule, Schedule, ScheduleSpec, naive_authors
from tandem.rollout.vllm.turns import (Chunk, ChunkReferee, ChunkRule, RolloutContext, RolloutError,
                                       rollout_counters, run_rows, session_seed, walk_turn)
from tandem.rollout.vocab import tables_from_texts

TEXTS = ["a", " b", "\n", "\n\n", "c", "<eos>"]
TABLES = tables_from_texts(TEXTS)
LOOKUP = LookupTables.of(TABLES)
EOS = {5}


class FakeSession:
    """A streaming session the way vLLM keeps one: it holds every token it computed, drops its last sampled
    token at a chunk end (its KV was never computed), samples from a fixed distribution, and stops with EOS
    or with the engine core's rule."""

    def __init__(self, role, weights, seed, log, break_rule=False, with_state=False):
        self.role, self.weights, self.rng = role, weights, random.Random(seed)
        self.hist: list[int] = []
        self.last: int | None = None
        self.log, self.break_rule, self.closed = log, break_rule, False
        self.with_state = with_state  # return the rule's schedule state after a switch, as the chunk returns do

    async def send(self, tokens, args):
        assert not self.closed
        if self.last is not None:
            assert tokens[:1] == [self.last], "the next chunk must start with the session's last sampled token"
        assert args["role"] == self.role
        self.hist += tokens
        rule = ChunkRule(args, LOOKUP)
        out, stop = [], None
        t0 = time.perf_counter()
        while stop is None:
            tok = self.rng.choices(range(len(self.weights)), self.weights)[0]
            out.append(tok)
            if tok in EOS:
                stop = "eos"
                break
            why = rule.step(tok, len(out) - 1)
            if why is not None and not (self.break_rule and why == "tandem_switch" and len(out) < 2):
                stop = {"tandem_switch": "switch", "tandem_rounds": "rounds"}.get(why, why)
        await asyncio.sleep(0)
        self.hist += out[:-1]
        self.last = out[-1]
        self.log.append((self.role, len(tokens), len(out)))
        lps = [-1.0] * len(out) if self.role == 1 else None
        state = rule.state.state() if self.with_state and stop == "switch" else None
        return Chunk(out, lps, stop, t0, time.perf_counter(), time.perf_counter(), state)

    async def close(self):
        self.closed = True


def _run(kind, p, budget=40, rows=12, gap=4, rounds=6, break_rule=False, with_state=False):
    weights = {1: [3.0, 2, 1.5, 1, 3, 0.3], 0: [1.0, 3, 2, 1, 2, 0.3]}
    sessions, log = [], []
    prompts = [[0, 4]] * rows
    row_ids = list(range(100, 100 + rows))

    def open_session(role, b):
        s = FakeSession(role, weights[role], session_seed(9, row_ids[b], role), log, break_rule, with_state)
        sessions.append((b, s))
        return s

    ctx = RolloutContext(ScheduleSpec(kind, p, gap, rounds), LOOKUP, "tables", 9, budget, frozenset(EOS))
    batch, records, extra = asyncio.run(run_rows(prompts, row_ids, ctx, open_session))
    return batch, records, extra, sessions, log, prompts, row_ids


@pytest.mark.parametrize("kind,p", [("word", 0.5), ("token", 0.5), ("step", 0.5), ("solo", 0.5), ("junior", 0.5),
                                    ("word", 1.0), ("token", 0.3)])
def test_rows_follow_the_schedule_and_each_model_gets_exactly_the_unseen_tokens(kind, p):
    batch, records, extra, sessions, log, prompts, rows = _run(kind, p)
    for b, (ids, own, why) in enumerate(zip(batch.completion_ids, batch.owner, batch.finish_reason)):
        want, by_rounds = naive_authors(kind, ids, TEXTS, 9, rows[b], p, 4, 6)
        assert own == want[:len(ids)]
        assert len(ids) <= 40 and (why != "length" or len(ids) == 40)
        assert (why == "eos") == (ids[-1] in EOS) and not any(t in EOS for t in ids[:-1])
        assert (why == "rounds") == (by_rounds and why != "length")
        assert all((lp == -1.0) == (o == 1) for lp, o in zip(batch.senior_logprobs[b], own))
    for b, s in sessions:  # every session holds a prefix of its row's history: nothing was sent twice
        full = prompts[b] + batch.completion_ids[b]
        assert s.closed and s.hist == full[:len(s.hist)] and len(s.hist) >= len(full) - len(batch.completion_ids[b])
    n_chunks = len(log)
    assert n_chunks == sum(len(r.chunks) for r in records)
    # one chunk per authorship run: a switch stop is a handoff, nothing decoded is thrown away
    assert sum(n for _, _, n in log) == sum(map(len, batch.completion_ids))
    assert n_chunks == sum(h + 1 for h in batch.handoffs)
    assert extra["max_live_rows"] == len(rows)
    if kind in ("word", "token") and 0 < p < 1:
        assert 0 < sum(map(sum, batch.owner)) < sum(map(len, batch.owner)) and sum(batch.handoffs) > 0


def test_a_chunk_that_stops_where_the_schedule_does_not_is_refused():
    with pytest.raises(RolloutError, match="the schedule keeps"):  # it decoded past a switch
        _run("word", 0.5, break_rule=True)


def test_turn_walk_reproduces_the_vectorised_schedule():
    g = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(torch.tensor([3.0, 2, 1, 1, 3, 0]), 60, replacement=True, generator=g).tolist()
    for kind in ("word", "token", "step"):
        st = RowSchedule(ScheduleSpec(kind, max_gap_tokens=4, max_rounds=50), TABLES, 3, 7)
        kept, owner, pos = [], [], 0
        while pos < len(tokens):
            author = st.author
            n, why = walk_turn(st, tokens[pos:pos + 5], len(kept), 1000, EOS)
            kept += tokens[pos:pos + n]
            owner += [author] * n
            pos += n
        s = Schedule(st.spec, TABLES, 3, torch.tensor([7]))
        want = []
        for t, tok in enumerate(tokens):
            want.append(int(s.author_B[0]))
            s.advance(torch.tensor([tok]), t)
        assert kept == tokens and owner == want


def test_turn_walk_stops_at_eos_budget_and_rounds():
    st = RowSchedule(ScheduleSpec("word"), TABLES, 0, 0)
    assert walk_turn(st, [0, 4, 5, 0], 0, 100, EOS) == (3, "eos")
    st = RowSchedule(ScheduleSpec("word", max_gap_tokens=100), TABLES, 0, 0)
    assert walk_turn(st, [0, 4, 0, 4], 10, 12, EOS) == (2, "length")
    st = RowSchedule(ScheduleSpec("step", max_rounds=1), TABLES, 0, 0)
    assert walk_turn(st, [0, 2, 2, 0], 0, 100, EOS) == (3, "rounds")


@pytest.mark.parametrize("path", ["numpy", "loop"])
@pytest.mark.parametrize("kind", ["word", "token", "step", "solo", "junior"])
def test_chunk_referee_equals_the_per_token_walk(kind, path):
    """The referee (both its numpy walk and its loop) keeps the same tokens, gives the same finish reason and
    leaves the same schedule state as `walk_turn` on random chunks from random states (gap caps that bind, EOS,
    budget, rounds cap)."""
    rng = random.Random(kind)
    referee = ChunkReferee(LOOKUP, sorted(EOS))
    referee.vector_min = 0 if path == "numpy" else 10**9
    for trial in range(400):
        gap_cap, rounds = rng.choice([1, 2, 3, 5, 32]), rng.choice([1, 2, 150])
        seed, row, p = rng.randrange(2**40), rng.randrange(2**33), rng.random()
        state = {"author": rng.randrange(2), "gap": rng.randrange(gap_cap), "newline": rng.random() < 0.5,
                 "turns": rng.randrange(rounds)}
        st = RowSchedule.resume(ScheduleSpec(kind, p, gap_cap, rounds), LOOKUP, seed, row, state)
        weights = [rng.random() for _ in TEXTS]
        toks = rng.choices(range(len(TEXTS)), weights, k=rng.randrange(1, 40))
        t0 = rng.randrange(50)
        budget = t0 + rng.randrange(1, 60)
        ref = RowSchedule.resume(st.spec, LOOKUP, st.seed, st.row_id, st.state())
        want = walk_turn(ref, toks, t0, budget, EOS)
        got = referee.walk(st, toks, t0, budget)
        assert got == want and st.state() == ref.state(), (trial, toks, t0, budget)


def test_chunk_rule_resumes_the_schedule_state_across_chunks():
    """The engine core's rule, resumed at every chunk from the state the frontend sends, stops exactly where
    one uninterrupted schedule switches, and carries the gap counter and the budget across chunks."""
    from tandem.rollout.vllm.turns import chunk_args

    rng = random.Random(4)
    tokens = [rng.choice([0, 0, 0, 4, 1]) for _ in range(200)]
    ref = RowSchedule(ScheduleSpec("word", 0.5, max_gap_tokens=3), TABLES, 5, 2)
    switches = []
    for t, tok in enumerate(tokens):
        a = ref.author
        ref.advance(tok, t)
        if ref.author != a:
            switches.append(t)
    st = RowSchedule(ScheduleSpec("word", 0.5, max_gap_tokens=3), TABLES, 5, 2)
    t, got = 0, []
    while t < 150:
        rule = ChunkRule(chunk_args(st, st.author, t, 150, "x"), LOOKUP)
        i = 0
        while True:
            why = rule.step(tokens[t + i], i)
            if why is not None:
                break
            i += 1
        walk_turn(st, tokens[t:t + i + 1], t, 150, set())
        t += i + 1
        if why == "tandem_switch":
            got.append(t - 1)
        else:
            assert why == "length" and t == 150
    assert got == [s for s in switches if s < 149]


@pytest.mark.parametrize("kind", ["word", "token", "step", "solo", "junior"])
def test_chunk_rule_stops_where_the_row_schedule_switches(kind):
    """The rule's flat path (word and token schedules) and its `RowSchedule` path stop every chunk where a naive
    walk of one `RowSchedule` first changes author (or completes the last round), over random tokens, gap caps,
    probabilities and budgets, and report the budget's end as "length"."""
    from tandem.rollout.vllm.turns import STOP_ROUNDS, STOP_SWITCH, chunk_args

    rng = random.Random(hash(kind) & 0xFFFF)
    for trial in range(60):
        cap, p, budget = rng.choice([1, 2, 3, 32]), rng.choice([0.0, 0.3, 0.5, 1.0]), rng.randrange(1, 120)
        seed, row = rng.randrange(1 << 40), rng.randrange(1 << 33)
        tokens = [rng.randrange(len(TEXTS)) for _ in range(budget)]
        st = RowSchedule(ScheduleSpec(kind, p, cap, rng.choice([2, 150])), TABLES, seed, row)
        t = 0
        while t < budget:
            role = st.author
            rule = ChunkRule(chunk_args(st, role, t, budget, "x"), LOOKUP)
            i = 0
            while True:
                rounds = st.advance(tokens[t + i], t + i)
                want = ("length" if t + i + 1 >= budget else STOP_ROUNDS if rounds
                        else STOP_SWITCH if st.author != role else None)
                got = rule.step(tokens[t + i], i)
                assert got == want, (kind, trial, t, i)
                if got is not None:
                    break
                i += 1
            t += i + 1
            if got == STOP_ROUNDS:
                break


def test_session_seeds_are_deterministic_and_spread():
    seeds = {session_seed(1, r, m) for r in range(50) for m in (0, 1)}
    assert len(seeds) == 100 and all(0 <= s < 2**31 for s in seeds)
    assert session_seed(1, 2, 1) == session_seed(1, 2, 1) != session_seed(2, 2, 1)


def test_admission_keeps_rows_within_the_kv_capacity():
    """With room for three rows' worst case, at most three rows are live at once, and the result is the same
    as with room for all."""
    weights = {1: [3.0, 2, 1.5, 1, 3, 0.3], 0: [1.0, 3, 2, 1, 2, 0.3]}
    prompts, rows = [[0, 4]] * 10, list(range(10))

    def run(capacity):
        def open_session(role, b):
            return FakeSession(role, weights[role], session_seed(3, rows[b], role), [])
        ctx = RolloutContext(ScheduleSpec("word", 0.5, 4, 6), LOOKUP, "t", 3, 30, frozenset(EOS))
        return asyncio.run(run_rows(prompts, rows, ctx, open_session, capacity, 8))

    full, _, e_full = run(None)
    small, _, e_small = run(3 * (-(-32 // 8) + 1))
    assert e_small["max_live_rows"] == 3 and e_full["max_live_rows"] == 10
    assert small.completion_ids == full.completion_ids and small.owner == full.owner


def test_counters_from_row_records():
    from tandem.rollout.vllm.turns import RowRecord

    # one row: senior writes 3 tokens (steps of 1 s), the junior starts 2 s after the senior's last token
    rec = RowRecord(chunks=[(1, 3, 0.0, 1.0, 3.0), (0, 2, 3.0, 5.0, 6.0)], sessions=2, t_start=0.0, t_end=6.0)
    c = rollout_counters([rec], {1: 1.0, 0: 1.0})
    assert c["chunks"] == 2 and c["session_starts"] == 2 and c["handoffs_timed"] == 1
    assert c["handoff_latency_steps_p50"] == pytest.approx(1.0)  # one partner step lost beyond the computing one
    assert c["idle_row_step_fraction"] == pytest.approx(1 - 5 / 6)  # no engine row time: the mean-step estimate
    assert c["idle_row_step_fraction_mean_step"] == pytest.approx(1 - 5 / 6)
    # the engines measured the row in batches for 4.5 s of its 6 (its steps were longer than the mean step)
    m = rollout_counters([rec], {1: 1.0, 0: 1.0}, row_seconds=4.5)
    assert m["idle_row_step_fraction"] == pytest.approx(1 - 4.5 / 6)
    assert m["idle_row_step_fraction_mean_step"] == pytest.approx(1 - 5 / 6)
    assert rollout_counters([rec], {1: 1.0, 0: 1.0}, row_seconds=7.0)["idle_row_step_fraction"] == 0.0


def test_weight_sync_callback_pushes_after_each_step():
    from tandem.rollout.vllm.sync import VLLMWeightSync

    class Engine:
        live = True

        def __init__(self):
            self.pushed = []

        def generate(self):
            pass

        def push_weights(self, module=None):
            self.pushed.append(module)

    eng = Engine()
    cb = VLLMWeightSync(lambda: eng)
    cb.on_train_begin(None, None, None, model="m0")
    cb.on_step_end(None, None, None, model="m1")
    cb.on_step_end(None, None, None, model="m2")
    assert eng.pushed == ["m0", "m1", "m2"] and cb.pushes == 3
    eng.live = False  # an engine that reads the module itself is left alone
    cb.on_step_end(None, None, None, model="m3")
    assert cb.pushes == 3


def test_vllm_backend_needs_a_service():
    from tandem.rollout import toy
    from tandem.rollout.engine import TandemEngine

    tok = toy.byte_bpe_tokenizer()
    m = toy.tiny_qwen3(len(tok), 0, toy.TinyShape(layers=1, hidden=32, intermediate=64))
    with pytest.raises(ValueError, match="rollout service"):
        TandemEngine(m, None, tok, backend="vllm")


def test_engine_and_client_do_not_import_each_other():
    import ast
    from pathlib import Path

    import tandem.rollout.engine as engine_mod
    import tandem.rollout.vllm.client as client_mod

    def imports(mod):
        tree = ast.parse(Path(mod.__file__).read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    assert "tandem.rollout.vllm.client" not in imports(engine_mod)
    # the client reaches the engine only inside engine_from_config (a lazy import), never at module level
    top = ast.parse(Path(client_mod.__file__).read_text()).body
    assert not any(isinstance(n, ast.ImportFrom) and n.module == "tandem.rollout.engine" for n in top)


@pytest.mark.parametrize("kind,p", [("word", 0.5), ("token", 0.3), ("step", 0.5)])
def test_a_switch_is_decided_once_by_the_engine_core_and_the_row_goes_on_from_its_state(kind, p, monkeypatch):
    """With the engine core's schedule state on each switch chunk (the chunk returns), the frontend does not walk
    those chunks again: the same rollout, and the referee sees only the chunks that end the row."""
    import tandem.rollout.vllm.turns as turns

    walked = []
    orig = turns.ChunkReferee.walk

    def counting(self, state, tokens, t0, budget):
        walked.append(len(tokens))
        return orig(self, state, tokens, t0, budget)

    ref = _run(kind, p)[0]
    monkeypatch.setattr(turns.ChunkReferee, "walk", counting)
    got, records = _run(kind, p, with_state=True)[:2]
    assert (got.completion_ids, got.owner, got.finish_reason) == (ref.completion_ids, ref.owner, ref.finish_reason)
    assert len(walked) == len(records) == sum(r.walked for r in records)  # one per row: its last chunk
    assert sum(len(r.chunks) for r in records) > 2 * len(records)


def test_a_switch_state_that_names_the_same_author_is_refused():
    class Liar(FakeSession):
        async def send(self, tokens, args):
            c = await super().send(tokens, args)
            if c.state is not None:
                c.state = {**c.state, "author": args["role"]}
            return c

    ctx = RolloutContext(ScheduleSpec("word", 0.5, 4, 6), LOOKUP, "t", 9, 40, frozenset(EOS))
    weights = {1: [3.0, 2, 1.5, 1, 3, 0.3], 0: [1.0, 3, 2, 1, 2, 0.3]}
    with pytest.raises(RolloutError, match="same author"):
        asyncio.run(run_rows([[0, 4]] * 4, [1, 2, 3, 4], ctx,
                             lambda role, b: Liar(role, weights[role], 7 + b, [], with_state=True)))
