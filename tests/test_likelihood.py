"""tandem.likelihood: the probability that one draw of a decoding writes a reference solution, against a naive
token-by-token computation, and synthetic.restyle, which writes a reference in each style."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from tandem import models as M
from tandem.config import ModelConfig
from tandem.data.prompts import user_message
from tandem.data.synthetic import STYLES, generate, make_problem, restyle
from tandem.likelihood import Decoding, reference_logprobs, reference_pass_rate, sequence_logprob_B
from tandem.rollout.sampling import decoding_logprobs_BT
from train_fixtures import SMALL



@pytest.fixture(scope="module")
def problems():
    return generate(40, 2, 4, seed=3, prefix="test-likelihood")


@pytest.fixture(scope="module")
def tok(problems):
    return M.train_tokenizer([user_message(p.problem) + "\n\n" + p.solution for p in problems], 400)


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    m = M.build_tiny_model(tok, ModelConfig(**SMALL))
    with torch.no_grad():  # a peaked model, so that top-k and the nucleus cut
        m.lm_head.weight.mul_(8.0) if not m.config.tie_word_embeddings else m.model.embed_tokens.weight.mul_(8.0)
    return m.eval()


def test_restyle_writes_the_same_solution_in_every_style():
    for seed, (a, b) in itertools.product(range(40), itertools.permutations(STYLES, 2)):
        made = {s: make_problem(random.Random(seed), 2 + seed % 7, 20, 99, style=s).solution for s in (a, b)}
        assert restyle(made[a], b) == made[b]
    with pytest.raises(ValueError, match="not an equation"):
        restyle("First, it rains.\n\n\\boxed{3}", "terse")
    with pytest.raises(ValueError, match="unknown solution style"):
        restyle("First: 1 + 2 = 3\n\n\\boxed{3}", "poetic")


def test_sequence_logprob_sums_the_scored_positions_one_step_back():
    g = torch.Generator().manual_seed(4)
    logits_BTV = torch.randn(2, 6, 7, generator=g)
    labels_BT = torch.tensor([[-100, -100, 3, 1, 5, -100], [-100, 2, 2, 0, 6, 4]])
    d = Decoding(0.8, 3, 0.9)
    got = sequence_logprob_B(logits_BTV, labels_BT, d)
    for b in range(2):
        want = sum(decoding_logprobs_BT(logits_BTV[b, t - 1][None, None], labels_BT[b, t][None, None], 0.8, 3, 0.9)
                   .item() for t in range(1, 6) if labels_BT[b, t] != -100)
        assert got[b].item() == pytest.approx(want, abs=1e-5) if math.isfinite(want) else got[b].item() == want


@pytest.mark.parametrize("decoding", [Decoding(1.0), Decoding(0.7, 20, 0.8), Decoding(0.0)])
def test_reference_logprobs_match_token_by_token_prefixes(model, tok, problems, decoding):
    """Padded batches of several lengths give what feeding each reference's prefixes one by one gives."""
    picked = problems[:3]
    messages = [user_message(p.problem) for p in picked]
    refs = [[restyle(p.solution, "verbose"), restyle(p.solution, "terse")] for p in picked]
    got = reference_logprobs(model, tok, messages, refs, decoding, batch_size=4)
    want = []
    for msg, rs in zip(messages, refs):
        want.append([])
        for e in M.encode_examples(tok, [(msg, r) for r in rs]):
            with torch.no_grad():
                logits_TV = torch.cat([model(input_ids=torch.tensor([e.ids[:t]])).logits[0, -1:]
                                       for t in range(e.n_prompt, len(e.ids))]).float()
            want[-1].append(decoding_logprobs_BT(logits_TV[None], torch.tensor([e.ids[e.n_prompt:]]),
                                                 decoding.temperature, decoding.top_k, decoding.top_p).sum().item())
    assert [len(r) for r in got] == [2, 2, 2]
    for g, w in zip(sum(got, []), sum(want, [])):
        assert g == pytest.approx(w, rel=1e-4) if math.isfinite(w) else g == w
    if decoding.temperature == 1.0:
        assert all(math.isfinite(g) for g in sum(got, []))  # full distribution: every reference has a probability
    rate = reference_pass_rate(model, tok, messages, refs, decoding, batch_size=4)
    assert rate["per_problem"] == pytest.approx([sum(math.exp(x) for x in w) for w in want], rel=1e-4)
    assert rate["pass_rate"] == pytest.approx(sum(rate["per_problem"]) / 3)


def test_a_trained_model_writes_its_reference_far_more_likely_than_an_untrained_one(tok, problems):
    """The measure tracks learning: a few steps on the references raise their log-probability."""
    cfg = ModelConfig(**SMALL, pretrain_steps=30, pretrain_batch_size=8, pretrain_lr=3e-3, curve_points=0)
    model = M.build_tiny_model(tok, cfg)
    msgs = [user_message(p.problem) for p in problems[:4]]
    refs = [[p.solution] for p in problems[:4]]
    before = sum(lp[0] for lp in reference_logprobs(model, tok, msgs, refs, Decoding(1.0)))
    M.pretrain(model, tok, [(user_message(p.problem), p.solution) for p in problems], cfg, progress=False)
    after = sum(lp[0] for lp in reference_logprobs(model, tok, msgs, refs, Decoding(1.0)))
    assert after > before + 50


def test_reference_pass_rate_refuses_mismatched_or_empty_inputs(model, tok):
    with pytest.raises(ValueError, match="2 messages but 1"):
        reference_pass_rate(model, tok, ["a", "b"], [["x"]], Decoding(1.0))
    with pytest.raises(ValueError, match="at least one"):
        reference_logprobs(model, tok, ["a"], [[]], Decoding(1.0))
