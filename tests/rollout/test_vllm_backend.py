"""Turn planning of the vLLM rollout service, without vLLM: turn walking, stop-based turns that waste no
decoded token, per-request seeds, the weight-sync callback, and the engine's service requirement."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.rollout.backends.vllm import plan_turn, request_seed, run_turns, stop_sets, walk_turn
from tandem.rollout.schedule import RowSchedule, Schedule, naive_authors
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


def fake_vllm(weights: dict[int, list[float]], stops: dict[str, list[int]], log: list):
    """A stand-in for one batched `LLM.generate` per model: draws tokens from a fixed per-model distribution
    (seeded per request) and honours `max_tokens` and stop ids the way vLLM does (the stop token is kept)."""
    def generate_turns(author, reqs):
        out = []
        for hist, turn, vseed, want_lp in reqs:
            rng = random.Random(vseed * 7 + len(hist))
            toks = []
            while len(toks) < turn.max_tokens:
                t = rng.choices(range(len(weights[author])), weights[author])[0]
                toks.append(t)
                if t in stops[turn.stops]:
                    break
            log.append((author, len(toks)))
            out.append((toks, [-1.0] * len(toks) if want_lp else None))
        return out
    return generate_turns


@pytest.mark.parametrize("kind,p", [("word", 0.5), ("token", 0.5), ("step", 0.5), ("solo", 0.5), ("junior", 0.5),
                                    ("word", 1.0), ("token", 0.3)])
def test_turns_keep_every_decoded_token_and_follow_the_schedule(kind, p):
    weights = {1: [3.0, 2, 1.5, 1, 3, 0.3], 0: [1.0, 3, 2, 1, 2, 0.3]}
    stops = stop_sets(TABLES, sorted(EOS))
    log: list = []
    prompts = [[0, 4]] * 12
    rows = list(range(100, 112))
    batch, stats = run_turns(prompts, rows, kind, TABLES, 40, 9, sorted(EOS), p, 4, 6,
                             fake_vllm(weights, stops, log))
    assert stats["decoded"] == stats["kept"] == sum(len(c) for c in batch.completion_ids)
    assert stats["turns"] == len(log)
    for b, (ids, own, why) in enumerate(zip(batch.completion_ids, batch.owner, batch.finish_reason)):
        want, by_rounds = naive_authors(kind, ids, TEXTS, 9, rows[b], p, 4, 6)
        assert own == want[:len(ids)]
        assert len(ids) <= 40 and (why != "length" or len(ids) == 40)
        assert (why == "eos") == (ids[-1] in EOS) and not any(t in EOS for t in ids[:-1])
        # the rounds cap on the budget's last token reads as "length", as in the hf engine
        assert (why == "rounds") == (by_rounds and why != "length")
        lps = batch.senior_logprobs[b]
        assert all((lp == -1.0) == (o == 1) for lp, o in zip(lps, own))
    if kind in ("word", "token") and 0 < p < 1:
        assert 0 < sum(map(sum, batch.owner)) < stats["kept"]


def test_plan_turn_stops_where_authorship_may_change():
    st = RowSchedule("word", TABLES, 1, 2, 0.5, max_gap_tokens=5)
    assert plan_turn(st, 0, 100).stops == "word" and plan_turn(st, 0, 100).max_tokens == 5
    assert plan_turn(st, 0, 3).max_tokens == 3  # the budget caps the turn
    st = RowSchedule("token", TABLES, 1, 2, 0.5)
    turn = plan_turn(st, 0, 100)
    n, why = walk_turn(st, [0] * turn.max_tokens, 0, 1000, EOS)  # the pre-drawn run ends at its last token
    assert n == turn.max_tokens and why is None and st.author != RowSchedule("token", TABLES, 1, 2, 0.5).author
    stops = stop_sets(TABLES, [5])
    assert stops["word"] == [1, 2, 3, 5] and stops["step"] == [2, 3, 5] and stops["eos"] == [5]


def test_weight_sync_callback_pushes_after_each_step():
    from tandem.rollout.vllm_sync import VLLMWeightSync

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
    m = toy.tiny_qwen3(len(tok), layers=1, hidden=32, intermediate=64)
    with pytest.raises(ValueError, match="rollout service"):
        TandemEngine(m, None, tok, backend="vllm")
