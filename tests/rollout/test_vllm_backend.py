"""The vLLM backend's pure parts (turn walking, per-request seeds) and its import guard; vLLM itself needs a GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tandem.rollout.backends.vllm import request_seed, walk_turn
from tandem.rollout.schedule import RowSchedule, Schedule
from tandem.rollout.vocab import tables_from_texts

TEXTS = ["a", " b", "\n", "\n\n", "c", "<eos>"]
TABLES = tables_from_texts(TEXTS)
EOS = {5}


def _walk_all(kind, tokens, budget, **kw):
    """Feed `tokens` in turns the way the vLLM backend does; return kept tokens, owners and the finish reason."""
    st = RowSchedule(kind, TABLES, 3, 7, **kw)
    kept, owner, pos = [], [], 0
    while pos < len(tokens):
        author = st.author
        n, why = walk_turn(st, tokens[pos:pos + 5], len(kept), budget, EOS)
        kept += tokens[pos:pos + n]
        owner += [author] * n
        pos += n
        if why:
            return kept, owner, why
    return kept, owner, None


@pytest.mark.parametrize("kind", ["word", "token", "step"])
def test_turn_walk_reproduces_the_vectorised_schedule(kind):
    g = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(torch.tensor([3.0, 2, 1, 1, 3, 0]), 60, replacement=True, generator=g).tolist()
    kept, owner, why = _walk_all(kind, tokens, budget=1000, max_gap_tokens=4, max_rounds=50)
    s = Schedule(kind, TABLES, 3, torch.tensor([7]), max_gap_tokens=4, max_rounds=50)
    want = []
    for t, tok in enumerate(tokens):
        want.append(int(s.author_B[0]))
        s.advance(torch.tensor([tok]), t)
    assert kept == tokens and owner == want and why is None
    if kind != "step":
        assert 0 < sum(owner) < len(owner)


def test_turn_walk_stops_at_eos_budget_and_rounds():
    st = RowSchedule("word", TABLES, 0, 0)
    assert walk_turn(st, [0, 4, 5, 0], 0, 100, EOS) == (3, "eos")
    st = RowSchedule("word", TABLES, 0, 0, max_gap_tokens=100)
    assert walk_turn(st, [0, 4, 0, 4], 10, 12, EOS) == (2, "length")
    st = RowSchedule("step", TABLES, 0, 0, max_rounds=1)
    assert walk_turn(st, [0, 2, 2, 0], 0, 100, EOS) == (3, "rounds")
    st = RowSchedule("step", TABLES, 0, 0, max_rounds=5)
    n, why = walk_turn(st, [0, 3, 0, 0], 0, 100, EOS)
    assert (n, why) == (2, None) and st.author == 0  # the blank line hands the turn to the junior


def test_request_seed_is_deterministic_and_spread():
    seeds = {request_seed(1, r, t) for r in range(50) for t in range(20)}
    assert len(seeds) == 1000 and all(0 <= s < 2**31 for s in seeds)
    assert request_seed(1, 2, 3) == request_seed(1, 2, 3) != request_seed(2, 2, 3)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_backend_without_vllm_is_a_clear_error():
    from tandem.rollout import toy
    from tandem.rollout.engine import TandemEngine

    tok = toy.byte_bpe_tokenizer()
    m = toy.tiny_qwen3(len(tok), layers=1, hidden=32, intermediate=64)
    with pytest.raises(ImportError, match="needs vLLM"):
        TandemEngine(m, None, tok, backend="vllm")
