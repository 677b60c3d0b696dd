"""The shared generation-and-scoring path (tandem/generation.py): records, seeds, accuracy, batch independence."""

from __future__ import annotations

import pytest

from tandem.generation import (Draws, SoloDecode, accuracy, accuracy_of, cut_at_eos, generate_and_score,
                               stable_seed)
from tandem.rollout.core import RolloutBatch, SamplingParams
from tandem.rollout.request import RolloutSettings
from tandem.rollout.schedule import ScheduleSpec
from train_fixtures import SMALL



@pytest.fixture(scope="module")
def tok_model():
    from tandem.config import ModelConfig
    from tandem.data.synthetic import generate
    from tandem.models import build_tiny_model, train_tokenizer

    probs = generate(200, 2, 4, seed=123)
    tok = train_tokenizer([p.problem + "\n\n" + p.solution for p in probs], vocab_size=300)
    return tok, build_tiny_model(tok, ModelConfig(**SMALL), seed=3), probs


class Scripted:
    """Returns `script[row_id]` for each row and records each call's seed and row ids."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, request):
        self.calls.append((request.seed, list(request.row_ids), request.schedule))
        rows = [self.script[r] for r in request.row_ids]
        return RolloutBatch([list(r) for r in rows], [[1] * len(r) for r in rows], [[0.0] * len(r) for r in rows],
                            [0] * len(rows), ["eos" if 0 in r else "length" for r in rows])


def test_records_cut_at_eos_score_and_share_one_seed(tok_model):
    tok = tok_model[0]
    digits = [tok.convert_tokens_to_ids(d) for d in "0123456789"]
    eos = tok.eos_token_id
    script = [[digits[5], eos, digits[1]], [digits[7]], [digits[4], eos], [digits[4]], [digits[2], eos], [eos]]
    engine = Scripted([[0 if t == eos else t for t in r] for r in script])
    rows = [{"id": "a", "prompt": "p a", "answer": "5"}, {"id": "b", "prompt": "p b", "answer": "4"},
            {"id": "c", "prompt": "p c", "answer": "2"}]
    seen = []
    settings = RolloutSettings(ScheduleSpec("solo"), SamplingParams(), batch_size=4)
    recs = generate_and_score(engine, tok, rows, settings, Draws(2, seed=9),
                              score_fn=lambda t, g: [float(x.strip() == y) for x, y in zip(t, g)],
                              eos_ids=[0], progress=seen.append)
    assert [(r["id"], r["sample"]) for r in recs] == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0), ("c", 1)]
    assert recs[0]["completion_ids"] == [digits[5], 0] and recs[0]["owner"] == [1, 1]  # cut after the first EOS
    assert [r["score"] for r in recs] == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert seen == [4, 2] and [c[1] for c in engine.calls] == [[0, 1, 2, 3], [4, 5]]
    assert {c[0] for c in engine.calls} == {stable_seed(9)}  # row ids carry the noise, not per-batch seeds
    acc = accuracy_of(recs)
    assert acc["per_problem"] == [0.5, 1.0, 0.5] and acc["accuracy"] == pytest.approx(2 / 3)
    assert acc["max_tokens"] == 2 and acc["finished"] == pytest.approx(4 / 6)


def test_cut_at_eos_keeps_the_eos():
    assert cut_at_eos([1, 2, 0, 3], [1, 0, 1, 1], [0]) == ([1, 2, 0], [1, 0, 1])
    assert cut_at_eos([1, 2], [1, 0], [0]) == ([1, 2], [1, 0])


def test_accuracy_counts_samples_per_problem(tok_model):
    tok = tok_model[0]
    texts = iter(["\\boxed{5}", "\\boxed{7}", "no box", "\\boxed{4}", "\\boxed{4}", "\\boxed{3}"])

    class Fake:
        def generate(self, request):
            assert request.schedule.kind == "solo"
            ids = [tok(next(texts), add_special_tokens=False)["input_ids"] for _ in request.row_ids]
            return RolloutBatch(ids, [[1] * len(i) for i in ids], [[0.0] * len(i) for i in ids], [0] * len(ids),
                                ["eos"] * len(ids))

    r = accuracy(None, tok, ["a", "b", "c"], ["5", "8", "1"], engine=Fake())
    assert r["accuracy"] == pytest.approx(1 / 3) and r["per_problem"] == [1.0, 0.0, 0.0]
    r = accuracy(None, tok, ["a"], ["4"], SoloDecode(temperature=1.0, n_samples=3), engine=Fake())
    assert r["per_problem"] == [pytest.approx(2 / 3)]
    with pytest.raises(ValueError, match="gold"):
        accuracy(None, tok, ["a"], [])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_results_do_not_depend_on_the_batch_split(tok_model, temperature):
    from tandem.data.prompts import user_message

    tok, model, probs = tok_model
    msgs, golds = [user_message(p.problem) for p in probs[:3]], [p.answer for p in probs[:3]]
    runs = [accuracy(model, tok, msgs, golds, SoloDecode(max_new_tokens=10, temperature=temperature, batch_size=bs,
                                                         seed=4, n_samples=2)) for bs in (1, 6)]
    assert runs[0] == runs[1]
    other = accuracy(model, tok, msgs, golds, SoloDecode(max_new_tokens=10, temperature=temperature, seed=5,
                                                         n_samples=2))
    assert other["mean_tokens"] > 0
