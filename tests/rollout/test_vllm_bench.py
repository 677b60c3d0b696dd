"""The vLLM benchmark's vocabulary A/B: `relabel` rewrites one vocabulary's text into another's so that the word
schedule redraws at the same positions, hence the same owners, chunks and handoffs in both; and its counters'
arithmetic on a service's stats (no vLLM needed)."""

from __future__ import annotations

import random

import pytest

from tandem.rollout.schedule import LookupTables, RowSchedule, ScheduleSpec
from cli.main import load_benchmark

_bench = load_benchmark("vllm_rollout")
_counters, relabel = _bench._counters, _bench.relabel


def _tables(word: list[int]) -> LookupTables:
    V = len(word)
    return LookupTables(bytes(word), bytes(V), bytes(V), bytes(V), bytes(V))


def _owners(tokens: list[int], tables: LookupTables, seed: int, row: int) -> list[int]:
    st = RowSchedule(ScheduleSpec("word"), tables, seed, row)
    out = []
    for t, tok in enumerate(tokens):
        out.append(st.author)
        st.advance(tok, t)
    return out


def test_relabel_keeps_word_starts_and_avoids_ids():
    rng = random.Random(0)
    src = [int(rng.random() < 0.35) for _ in range(5000)]   # a "large" vocabulary
    dst = [int(rng.random() < 0.4) for _ in range(60)]      # a small one
    avoid = {0, 1, 7}
    rows = [[rng.randrange(5000) for _ in range(300)] for _ in range(4)]
    out = relabel(rows, src, dst, avoid)
    assert [len(r) for r in out] == [len(r) for r in rows]
    for r, m in zip(rows, out):
        assert all(0 <= j < len(dst) and j not in avoid for j in m)
        assert [src[i] for i in r] == [dst[j] for j in m]
    # the same redraws, hence the same owner at every position, whatever the vocabulary
    for i, (r, m) in enumerate(zip(rows, out)):
        assert _owners(r, _tables(src), 3, i) == _owners(m, _tables(dst), 3, i)
    # deterministic
    assert relabel(rows, src, dst, avoid) == out


def test_relabel_needs_both_kinds_of_id():
    with pytest.raises(ValueError, match="word-start and other ids"):
        relabel([[0, 1]], [0, 1], [1, 1, 0], {2})


def test_counters_give_engine_steps_per_generated_token_per_engine():
    from collections import defaultdict

    engines = {"senior": defaultdict(float, steps=30, computed_tokens=70, busy_seconds=1.0, scheduled_rows_sum=60),
               "junior": defaultdict(float, steps=20, computed_tokens=60, busy_seconds=1.0, scheduled_rows_sum=40)}
    st = defaultdict(float, engines=engines, kept=50, seconds=2.0, chunks=13, decoded=50)
    out = _counters(st)
    assert out["engine_steps_per_token_senior"] == pytest.approx(30 / 50)
    assert out["engine_steps_per_token_junior"] == pytest.approx(20 / 50)
    assert out["chunks_per_token"] == pytest.approx(13 / 50) and out["computed_per_token"] == pytest.approx(130 / 50)
