"""Authorship schedules: vectorised state machine vs a naive text-decoding reference, and their statistics."""

from __future__ import annotations

import pytest
import torch

from tandem.rollout.schedule import RowSchedule, Schedule, ScheduleSpec, naive_authors, uses_junior, uses_senior
from tandem.rollout.vocab import tables_from_texts

TEXTS = ["a", "b", " c", " d", "\n", "\n\n", "x\n", "\ny", "", "e"]
A, B_, C, D, NL, NN, XNL, NLY, EMPTY, E = range(len(TEXTS))
TABLES = tables_from_texts(TEXTS)


def run_vectorised(kind, tokens_BT, seed=0, rows=None, **kw):
    """Authors [B, T] from `Schedule`, and the position at which each row hit the rounds cap (-1 if never)."""
    B, T = tokens_BT.shape
    rows = torch.arange(B) if rows is None else rows
    s = Schedule(ScheduleSpec(kind, **kw), TABLES, seed, rows)
    authors = torch.zeros(B, T, dtype=torch.int64)
    cap = torch.full((B,), -1)
    for t in range(T):
        authors[:, t] = s.author_B.to(torch.int64)
        hit = s.advance(tokens_BT[:, t], t)
        cap = torch.where(hit & (cap < 0), t, cap)
    return authors, cap


@pytest.mark.parametrize("kind", ["word", "token", "step", "solo", "junior"])
@pytest.mark.parametrize("max_gap,max_rounds", [(32, 150), (3, 4)])
def test_vectorised_and_row_schedules_match_naive(kind, max_gap, max_rounds):
    g = torch.Generator().manual_seed(3)
    weights = torch.tensor([4, 4, 1, 1, 1, 0.3, 1, 0.5, 0.3, 4])
    tokens = torch.multinomial(weights, 60 * 80, replacement=True, generator=g).view(60, 80)
    rows = torch.arange(60) * 7 + 11
    kw = dict(p_senior=0.5, max_gap_tokens=max_gap, max_rounds=max_rounds)
    authors, cap = run_vectorised(kind, tokens, seed=5, rows=rows, **kw)
    for b in range(60):
        want, stopped = naive_authors(kind, tokens[b].tolist(), TEXTS, 5, int(rows[b]), **kw)
        n = len(want)
        assert authors[b, :n].tolist() == want, b
        assert (int(cap[b]) == n - 1) if stopped else (int(cap[b]) == -1)
        rs = RowSchedule(ScheduleSpec(kind, **kw), TABLES, 5, int(rows[b]))
        got = []
        for t, tok in enumerate(tokens[b, :n].tolist()):
            got.append(rs.author)
            rs.advance(tok, t)
        assert got == want


def test_word_redraws_only_after_word_starts_and_about_half_switch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(torch.tensor([3.0, 3, 1, 1, 0, 0, 0, 0, 0, 3]), 400 * 50, replacement=True,
                               generator=g).view(400, 50)
    authors, _ = run_vectorised("word", tokens, seed=1, max_gap_tokens=1000)  # isolate word starts
    changed = authors[:, 1:] != authors[:, :-1]
    after_start = TABLES.word_start_V[tokens[:, :-1]]
    assert not changed[~after_start].any()             # no handoff except right after a word-initial token
    rate = changed[after_start].double().mean().item()  # a redraw picks the other model half the time
    assert 0.45 < rate < 0.55
    frac = authors.double().mean().item()
    assert 0.45 < frac < 0.55


def test_word_gap_cap_forces_redraws_every_max_gap_tokens():
    tokens = torch.full((600, 100), A)  # never a word start
    authors, _ = run_vectorised("word", tokens, seed=2, max_gap_tokens=32)
    changed = (authors[:, 1:] != authors[:, :-1]).double()
    at = [31, 63, 95]  # index t-1 of positions t = 32, 64, 96
    others = [i for i in range(99) if i not in at]
    assert changed[:, others].sum() == 0
    for i in at:
        assert 0.4 < changed[:, i].mean().item() < 0.6
    # a word start resets the counter: the next forced redraw is max_gap tokens after it
    tok = torch.full((600, 60), A)
    tok[:, 9] = C
    authors, _ = run_vectorised("word", tok, seed=4, max_gap_tokens=32)
    changed = (authors[:, 1:] != authors[:, :-1])
    assert changed[:, 9].any() and changed[:, 41].any()
    assert not changed[:, 31].any()


def test_step_alternates_strictly_at_blank_lines():
    seqs = {
        "one token": [A, NN, B_, E, NN, A],
        "two tokens": [A, XNL, NLY, B_, NL, NL, A],
        "empty between": [A, NL, EMPTY, NL, A],
        "not across turns": [A, NN, NLY, E, A],
        "a word-start newline": [A, NL, B_, NL, A],
    }
    want = {
        "one token": [1, 1, 0, 0, 0, 1],
        "two tokens": [1, 1, 1, 0, 0, 0, 1],
        "empty between": [1, 1, 1, 1, 0],
        "not across turns": [1, 1, 0, 0, 0],
        "a word-start newline": [1, 1, 1, 1, 1],
    }
    for name, seq in seqs.items():
        authors, _ = run_vectorised("step", torch.tensor([seq]))
        assert authors[0].tolist() == want[name], name


def test_step_rounds_cap():
    seq = torch.tensor([[A, NN, A, NN, A, NN, A]])
    authors, cap = run_vectorised("step", seq, max_rounds=2)
    assert int(cap[0]) == 3  # the second blank line completes the second turn
    assert authors[0, :4].tolist() == [1, 1, 0, 0]


def test_p_senior_extremes_and_usage():
    tokens = torch.randint(0, len(TEXTS), (50, 40), generator=torch.Generator().manual_seed(1))
    assert run_vectorised("word", tokens, p_senior=1.0)[0].eq(1).all()
    assert run_vectorised("token", tokens, p_senior=0.0)[0].eq(0).all()
    assert run_vectorised("junior", tokens)[0].eq(0).all()
    assert run_vectorised("solo", tokens)[0].eq(1).all()
    assert not uses_junior("solo") and not uses_junior("word", 1.0) and uses_junior("step")
    assert not uses_senior("junior") and not uses_senior("token", 0.0) and uses_senior("word")
    with pytest.raises(ValueError, match="unknown schedule"):
        Schedule(ScheduleSpec("random"), TABLES, 0, torch.arange(2))
    with pytest.raises(ValueError, match="p_senior"):
        Schedule(ScheduleSpec("word", p_senior=1.5), TABLES, 0, torch.arange(2))


def test_schedule_spec_is_validated_once_and_crosses_boundaries_under_its_own_names():
    from dataclasses import fields

    from tandem.rollout.request import RolloutSettings
    from tandem.rollout.vllm.turns import chunk_args

    spec = ScheduleSpec("step", 0.25, 7, 3)
    assert ScheduleSpec.from_dict(spec.as_dict()) == spec
    with pytest.raises(ValueError, match="p_senior must lie in"):
        ScheduleSpec("word", 1.5)
    with pytest.raises(ValueError, match="exactly the fields kind, p_senior, max_gap_tokens, max_rounds"):
        ScheduleSpec.from_dict({"kind": "word", "p": 0.5, "max_gap_tokens": 32, "max_rounds": 150})
    with pytest.raises(ValueError, match="integers"):
        ScheduleSpec.from_dict({**spec.as_dict(), "max_rounds": "3"})
    settings = RolloutSettings(ScheduleSpec("token", 0.75, 9, 4))
    assert settings.needs_junior and settings.replace(schedule=ScheduleSpec("solo")).needs_junior is False
    # the schedule is one value wherever it is held: a bare kind or loose scalars are refused
    for make in (lambda: RolloutSettings("token"), lambda: Schedule("word", TABLES, 0, torch.arange(2)),
                 lambda: RowSchedule("word", TABLES, 5, 2)):
        with pytest.raises(TypeError, match="must be a ScheduleSpec"):
            make()
    # the engine core's chunk arguments carry the spec's fields under the same names
    row = RowSchedule(spec, TABLES, 5, 2)
    args = chunk_args(row, row.author, 0, 10, "t")
    assert {f.name: args[f.name] for f in fields(ScheduleSpec)} == spec.as_dict()


@pytest.mark.parametrize("kind", ["word", "token", "step", "solo", "junior"])
def test_row_schedule_resumed_at_its_start_equals_a_fresh_one(kind):
    spec = ScheduleSpec(kind, 0.3, 5, 2)
    for row in range(20):
        a = RowSchedule(spec, TABLES, 11, row)
        b = RowSchedule.resume(spec, TABLES, 11, row, a.state())
        assert a.state() == b.state() and a.spec is b.spec is spec
