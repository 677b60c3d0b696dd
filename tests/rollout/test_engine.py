"""The catch-up engine: token identity with the lockstep oracle, replay, EOS/budget/rounds, log-probs, modes."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tandem.rollout.toy import add_logit_bias, rollout, tiny_pair as make_pair
from tandem.rollout import toy
from tandem.rollout import kernel
from tandem.rollout.core import RolloutBatch, count_handoffs
from tandem.rollout.engine import SamplingParams, TandemEngine
from tandem.rollout.lockstep import lockstep_generate
from tandem.rollout.request import HFOptions, RolloutSettings
from tandem.rollout.schedule import ScheduleSpec, naive_authors
from tandem.rollout.vocab import token_texts


@pytest.fixture(scope="module")
def steered(tok):
    """float64 senior/junior that write newlines and word starts often (so steps and words actually end)."""
    s, j = make_pair(tok)
    nl = tok.convert_tokens_to_ids("Ċ")
    words = {i: 2.5 for t, i in tok.get_vocab().items() if t.startswith("Ġ")}
    for m in (s, j):
        add_logit_bias(m, {**words, nl: 5.0})
    return s, j


def _lockstep(eng, prompts, schedule, sp, seed, forward="hf", **settings):
    request = RolloutSettings(ScheduleSpec(schedule, **settings), sp).request(prompts, seed)
    with torch.no_grad():
        return lockstep_generate(eng.pair, request, forward=forward)


@pytest.mark.parametrize("schedule", ["word", "step", "token", "solo", "junior"])
@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0, max_new_tokens=48),
                                SamplingParams(temperature=0.7, top_k=12, top_p=0.9, max_new_tokens=40)],
                         ids=["plain", "topk-topp"])
def test_catch_up_is_token_identical_to_lockstep(tok, steered, schedule, sp):
    s, j = steered
    eng = TandemEngine(s, j, tok)
    assert eng.fast
    prompts = toy.prompts(tok, 7, seed=3)
    fast = rollout(eng, prompts, schedule, sp, seed=11, max_gap_tokens=6, max_rounds=5)
    ref = _lockstep(eng, prompts, schedule, sp, 11, max_gap_tokens=6, max_rounds=5)
    assert fast.completion_ids == ref.completion_ids
    assert fast.owner == ref.owner
    assert fast.finish_reason == ref.finish_reason
    for a, b in zip(fast.senior_logprobs, ref.senior_logprobs):
        assert a == pytest.approx(b, abs=1e-9)
    if schedule in ("word", "token", "step"):
        assert sum(fast.handoffs) > 5  # the test exercises catch-up, not a single author
    # the owner mask follows the schedule's rules applied to the text (naive reference)
    texts = token_texts(tok, eng.vocab_size)
    for b, ids in enumerate(fast.completion_ids):
        want, _ = naive_authors(schedule, ids, texts, 11, b, max_gap_tokens=6, max_rounds=5)
        assert fast.owner[b] == want[:len(ids)]


def test_long_catch_ups_are_token_identical(tok, pair64):
    """Random models rarely start words: runs are long, so catch-up chunks exceed MERGE_C (the split path)."""
    s, j = pair64
    eng = TandemEngine(s, j, tok)
    prompts = toy.prompts(tok, 8, seed=9)
    sp = SamplingParams(max_new_tokens=80)
    fast = rollout(eng, prompts, "word", sp, seed=4, max_gap_tokens=12)
    ref = _lockstep(eng, prompts, "word", sp, 4, max_gap_tokens=12)
    assert fast.completion_ids == ref.completion_ids and fast.owner == ref.owner

    def runs(o):
        out, n = [], 1
        for a, b in zip(o, o[1:]):
            n = n + 1 if a == b else (out.append(n) or 1)
        return out  # completed runs only (each followed by a handoff)

    assert max(r for o in fast.owner for r in runs(o)) > kernel.MERGE_C


def test_fast_lockstep_kernel_and_fallback_agree(tok, steered):
    s, j = steered
    prompts = toy.prompts(tok, 5, seed=4)
    sp = SamplingParams(max_new_tokens=30)
    fast = rollout(TandemEngine(s, j, tok), prompts, "word", sp, seed=2)
    slow = rollout(TandemEngine(s, j, tok, hf=HFOptions(fast=False)), prompts, "word", sp, seed=2)
    eng = TandemEngine(s, j, tok)
    kern = _lockstep(eng, prompts, "word", sp, 2, forward="fast")
    assert fast.completion_ids == slow.completion_ids == kern.completion_ids


def test_replay_from_seed_and_independence_from_batching(tok, pair64):
    s, j = pair64
    eng = TandemEngine(s, j, tok)
    prompts = toy.prompts(tok, 6, seed=5)
    sp = SamplingParams(max_new_tokens=24)
    a = rollout(eng, prompts, "word", sp, seed=7)
    assert rollout(eng, prompts, "word", sp, seed=7).completion_ids == a.completion_ids
    assert rollout(eng, prompts, "word", sp, seed=8).completion_ids != a.completion_ids
    split = rollout(eng, prompts, "word", sp, seed=7, batch_size=2)
    assert split.completion_ids == a.completion_ids and split.owner == a.owner
    # a row's noise follows its row id, not its position in the batch
    order = [3, 0, 5, 1, 4, 2]
    perm = rollout(eng, [prompts[i] for i in order], "word", sp, seed=7, row_ids=order)
    assert perm.completion_ids == [a.completion_ids[i] for i in order]


def test_eos_from_either_model_ends_the_row(tok):
    s, j = make_pair(tok, seeds=(5, 6))
    add_logit_bias(j, {tok.eos_token_id: 30.0})  # the junior ends the row at its first token
    eng = TandemEngine(s, j, tok)
    prompts = toy.prompts(tok, 16, seed=6)
    b = rollout(eng, prompts, "word", SamplingParams(max_new_tokens=200), seed=3, max_gap_tokens=4)
    assert b.finish_reason.count("eos") == 16
    for ids, own in zip(b.completion_ids, b.owner):
        assert ids[-1] == tok.eos_token_id and own[-1] == 0
        assert tok.eos_token_id not in ids[:-1]
    # an EOS written by the senior ends a row too
    s2, j2 = make_pair(tok, seeds=(5, 6))
    add_logit_bias(s2, {tok.eos_token_id: 30.0})
    b2 = rollout(TandemEngine(s2, j2, tok), prompts, "word", SamplingParams(max_new_tokens=40), seed=3)
    assert all(r == "eos" and o[-1] == 1 for r, o in zip(b2.finish_reason, b2.owner))


def test_budget_and_rounds_cap(tok, steered, pair64):
    s, j = pair64
    eng = TandemEngine(s, j, tok, eos_token_ids=[])  # no EOS at all: every row must stop at the budget
    b = rollout(eng, toy.prompts(tok, 4), "token", SamplingParams(max_new_tokens=13), seed=1)
    assert [len(c) for c in b.completion_ids] == [13] * 4 and set(b.finish_reason) == {"length"}
    assert all(len(o) == len(lp) == 13 for o, lp in zip(b.owner, b.senior_logprobs))
    st = steered
    eng = TandemEngine(st[0], st[1], tok, eos_token_ids=[])
    r = rollout(eng, toy.prompts(tok, 8), "step", SamplingParams(max_new_tokens=120), seed=4, max_rounds=2)
    texts = token_texts(tok, eng.vocab_size)
    assert "rounds" in r.finish_reason
    for ids, own, why in zip(r.completion_ids, r.owner, r.finish_reason):
        if why == "rounds":
            assert "".join(texts[i] for i in ids).count("\n\n") == 2 and texts[ids[-1]] == "\n"
            assert own[0] == 1 and count_handoffs(own) == 1
        else:
            assert why == "length" and len(ids) == 120


def test_stop_token_ids_end_rows(tok, pair64):
    s, j = pair64
    eng = TandemEngine(s, j, tok, eos_token_ids=[])
    prompts = toy.prompts(tok, 8)
    free = rollout(eng, prompts, "word", SamplingParams(max_new_tokens=30), seed=9)
    row = free.completion_ids[0]
    stop = row[4]
    cut = row.index(stop) + 1
    b = rollout(eng, prompts, "word", SamplingParams(max_new_tokens=30, stop_token_ids=(stop,)), seed=9)
    assert b.completion_ids[0] == row[:cut] and b.finish_reason[0] == "eos"
    for ids, full in zip(b.completion_ids[1:], free.completion_ids[1:]):
        assert ids == (full[:full.index(stop) + 1] if stop in full else full)


def test_senior_fraction_and_stats(tok):
    s, j = make_pair(tok, dtype=torch.float32, seeds=(7, 8))
    words = {i: 2.0 for t, i in tok.get_vocab().items() if t.startswith("Ġ")}
    for m in (s, j):
        add_logit_bias(m, words)
    eng = TandemEngine(s, j, tok, eos_token_ids=[])
    prompts = [p for p in toy.prompts(tok, 8) for _ in range(8)]
    b = rollout(eng, prompts, "word", SamplingParams(max_new_tokens=48), seed=0, p_senior=0.5)
    st = b.stats()
    assert 0.3 <= st["senior_fraction"] <= 0.7
    n_tok = sum(map(len, b.completion_ids))
    assert st["tokens"] == n_tok and st["mean_length"] == n_tok / 64
    assert b.handoffs == [count_handoffs(o) for o in b.owner]
    assert st["handoffs_per_100"] == pytest.approx(100 * sum(b.handoffs) / n_tok)
    assert st["mean_run_length"] == pytest.approx(n_tok / (sum(b.handoffs) + 64))
    assert st["handoffs_per_100"] > 5
    # p_senior at the extremes
    assert rollout(eng, prompts[:4], "word", SamplingParams(max_new_tokens=10), seed=0, p_senior=1.0).stats()[
        "senior_fraction"] == 1.0
    assert rollout(eng, prompts[:4], "word", SamplingParams(max_new_tokens=10), seed=0, p_senior=0.0).stats()[
        "senior_fraction"] == 0.0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_senior_logprobs_match_teacher_forced_recomputation(tok, pair64, prompts, temperature):
    s, j = pair64
    eng = TandemEngine(s, j, tok)
    b = rollout(eng, prompts, "word", SamplingParams(temperature=temperature, max_new_tokens=30), seed=5)
    assert any(0 < sum(o) < len(o) for o in b.owner)
    for p, ids, own, lps in zip(prompts, b.completion_ids, b.owner, b.senior_logprobs):
        with torch.no_grad():
            logits = s(input_ids=torch.tensor([p + ids])).logits[0, len(p) - 1:-1]
        ref = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        for t, (o, lp) in enumerate(zip(own, lps)):
            if o:
                assert lp == pytest.approx(float(ref[t]), abs=1e-9)
            else:
                assert lp == 0.0


def test_modes_restored_and_solo_without_junior(tok, pair64, prompts):
    s, j = pair64
    s.train()
    try:
        eng = TandemEngine(s, j, tok)
        rollout(eng, prompts[:2], "word", SamplingParams(max_new_tokens=5), seed=0)
        assert s.training and not j.training
    finally:
        s.eval()
    solo = TandemEngine(s, None, tok)
    a = rollout(solo, prompts, "solo", SamplingParams(max_new_tokens=12), seed=1)
    assert all(set(o) == {1} for o in a.owner) and set(a.handoffs) == {0}
    with pytest.raises(ValueError, match="needs a junior"):
        rollout(solo, prompts, "word", SamplingParams(max_new_tokens=5), seed=0)
    # same weights as senior and junior: the tandem rollout is the solo rollout, token for token
    same = TandemEngine(s, copy.deepcopy(s), tok)
    t = rollout(same, prompts, "word", SamplingParams(max_new_tokens=12), seed=1)
    assert t.completion_ids == a.completion_ids


def test_cpu_threads_apply_during_generation_only(tok, pair64, prompts, monkeypatch):
    from tandem.rollout import core

    s, j = pair64
    seen = []
    real = core.sample_rows
    monkeypatch.setattr(core, "sample_rows", lambda *a, **k: (seen.append(torch.get_num_threads()), real(*a, **k))[1])
    eng = TandemEngine(s, j, tok, hf=HFOptions(cpu_threads=1))
    torch.set_num_threads(2)  # the autouse fixture restores its own setting afterwards
    rollout(eng, prompts[:2], "word", SamplingParams(max_new_tokens=3), seed=0)
    assert seen and set(seen) == {1} and torch.get_num_threads() == 2


def test_input_validation(tok, pair64):
    s, j = pair64
    eng = TandemEngine(s, j, tok)
    sp = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        rollout(eng, [[]], "word", sp, seed=0)
    with pytest.raises(ValueError, match="outside"):
        rollout(eng, [[len(tok) + 100]], "word", sp, seed=0)
    with pytest.raises(ValueError, match="row_ids"):
        rollout(eng, [[1, 2]], "word", sp, seed=0, row_ids=[0, 1])
    with pytest.raises(ValueError, match="unknown schedule"):
        rollout(eng, [[1, 2]], "words", sp, seed=0)
    with pytest.raises(ValueError, match="backend"):
        TandemEngine(s, j, tok, backend="tgi")
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    assert rollout(eng, [], "word", sp, seed=0).completion_ids == []


def test_self_check_rejects_a_wrong_kernel(tok, pair64, monkeypatch):
    s, j = pair64
    real = kernel._rms
    monkeypatch.setattr(kernel, "_rms", lambda x, w, eps: real(x, w, eps * 1e3 + 1e-2))
    with pytest.raises(RuntimeError, match="disagrees"):
        TandemEngine(s, j, tok)
    with pytest.raises(ValueError):  # fast=True refuses to fall back
        from transformers import GPT2Config, GPT2LMHeadModel
        g = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2))
        TandemEngine(g, None, tok, hf=HFOptions(fast=True))


def test_unsupported_architecture_falls_back_to_lockstep(tok, prompts):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    g = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=256)).eval()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        eng = TandemEngine(g, copy.deepcopy(g), tok)
    assert not eng.fast and any("falling back" in str(x.message) for x in w)
    b = rollout(eng, prompts[:3], "word", SamplingParams(max_new_tokens=8), seed=0)
    assert isinstance(b, RolloutBatch) and all(0 < len(c) <= 8 for c in b.completion_ids)
