"""The promotion gate: best-checkpoint selection and the no-regression rule, against a naive restatement."""

from __future__ import annotations

import copy
import itertools
import random

import pytest

from tandem.report.promotion import (Candidate, best_checkpoint, candidates, comparison_rows, decide,
                                     selection_score, settings_fingerprint)

from tests.report.fake_metrics import fake_eval


def _cand(solo, tandem, step=10, h="h1", fp="fp", k=1, mode="step", arm="tandem") -> Candidate:
    return Candidate(arm=arm, step=step, path=f"p/{step}", hash=h, k=k, solo=solo, tandem=tandem,
                     tandem_mode=mode, fingerprint=fp)


def _set(ev, arm, step, mode, value, k=1):
    c = next(c for c in ev["arms"][arm]["checkpoints"] if c["step"] == step)
    c["modes"][mode]["macro"][f"pass@{k}"] = value


def test_candidates_exclude_the_base_and_filter_by_arm():
    ev = fake_eval(arms=("tandem", "grpo"), steps=(0, 10, 20))
    cs = candidates(ev, "tandem")
    assert [(c.arm, c.step) for c in cs] == [("tandem", 10), ("tandem", 20)]
    assert {c.arm for c in candidates(ev, "")} == {"tandem", "grpo"}
    assert all(c.tandem_mode == "step" for c in cs)
    assert candidates(ev, "kl_reg") == []


def test_best_checkpoint_maximises_the_mean_of_solo_and_tandem():
    ev = fake_eval(arms=("tandem",), steps=(0, 10, 20, 30))
    for step, (solo, tandem) in {10: (0.5, 0.1), 20: (0.4, 0.4), 30: (0.1, 0.5)}.items():
        _set(ev, "tandem", step, "solo", solo)
        _set(ev, "tandem", step, "step", tandem)
    best = best_checkpoint(ev, "tandem")
    assert best.step == 20 and best.solo == 0.4 and best.tandem == 0.4


def test_ties_go_to_the_later_step():
    ev = fake_eval(arms=("tandem",), steps=(0, 10, 20))
    for step in (10, 20):
        _set(ev, "tandem", step, "solo", 0.3)
        _set(ev, "tandem", step, "step", 0.3)
    assert best_checkpoint(ev, "tandem").step == 20


def test_solo_only_evaluation_scores_on_solo():
    ev = fake_eval(arms=("tandem",), steps=(0, 10), modes=("solo",))
    c = best_checkpoint(ev, "tandem")
    assert c.tandem_mode is None and c.tandem is None and selection_score(c) == c.solo


def test_unscored_checkpoints_are_not_candidates():
    ev = fake_eval(arms=("tandem",), steps=(0, 10))
    _set(ev, "tandem", 10, "solo", None)
    assert best_checkpoint(ev, "tandem") is None


def test_k_must_have_been_evaluated():
    with pytest.raises(ValueError, match="pass@3"):
        candidates(fake_eval(), "tandem", k=3)


def test_fingerprint_tracks_what_changes_the_estimate():
    ev = fake_eval()
    ev2 = copy.deepcopy(ev)
    ev2["settings"]["seed"] = 7  # another random stream, same quantity
    assert settings_fingerprint(ev) == settings_fingerprint(ev2)
    ev2["settings"]["temperature"] = 1.0
    assert settings_fingerprint(ev) != settings_fingerprint(ev2)
    ev3 = copy.deepcopy(ev)
    ev3["settings"]["benchmarks"]["arith-short"]["rows_hash"] = "other"
    assert settings_fingerprint(ev) != settings_fingerprint(ev3)


def test_first_promotion_and_same_weights():
    c = _cand(0.5, 0.4)
    assert decide(c, None, 0.02).promote
    again = decide(c, _cand(0.5, 0.4), 0.02)
    assert not again.promote and "already promoted" in again.reason
    assert not decide(None, c, 0.02).promote


def test_changed_settings_fail_closed():
    d = decide(_cand(0.9, 0.9, h="new", fp="a"), _cand(0.1, 0.1, h="old", fp="b"), 0.02)
    assert not d.promote and "not comparable" in d.reason


@pytest.mark.parametrize("metric", ["solo", "tandem"])
def test_a_regression_beyond_tolerance_blocks(metric):
    prev = _cand(0.50, 0.40, h="old")
    new = _cand(0.50 - (0.03 if metric == "solo" else 0), 0.40 - (0.03 if metric == "tandem" else 0), h="new")
    d = decide(new, prev, 0.02)
    assert not d.promote and metric in d.reason
    assert d.deltas[metric] == pytest.approx(-0.03)


def test_the_tolerance_boundary_passes():
    d = decide(_cand(0.48, 0.38, h="new"), _cand(0.50, 0.40, h="old"), 0.02)
    assert d.promote and d.deltas["solo"] == pytest.approx(-0.02)


def test_gate_matches_its_naive_statement():
    """promote <=> new >= old - tol on both scores (for comparable, different checkpoints)."""
    rnd = random.Random(0)
    for _ in range(500):
        olds, oldt, news, newt = (round(rnd.uniform(0, 1), 2) for _ in range(4))
        tol = rnd.choice([0.0, 0.01, 0.05, 0.2])
        naive = news >= olds - tol - 1e-12 and newt >= oldt - tol - 1e-12
        assert decide(_cand(news, newt, h="n"), _cand(olds, oldt, h="o"), tol).promote == naive


def test_missing_tandem_score_blocks_when_the_previous_had_one():
    d = decide(_cand(0.6, None, h="n"), _cand(0.5, 0.4, h="o"), 0.02)
    assert not d.promote and "missing" in d.reason


def test_negative_tolerance_is_rejected():
    with pytest.raises(ValueError):
        decide(_cand(0.5, 0.5), None, -0.1)


def test_comparison_rows_and_serialisation_round_trip():
    d = decide(_cand(0.55, 0.45, h="n", step=20), _cand(0.5, 0.4, h="o", step=10), 0.02)
    rows = comparison_rows(d)
    assert rows[0] == ["checkpoint", "tandem/step-10", "tandem/step-20", None]
    assert rows[1][0] == "solo pass@1" and rows[1][3] == pytest.approx(0.05)
    assert rows[2][0] == "tandem (step) pass@1" and rows[2][3] == pytest.approx(0.05)
    back = Candidate.from_dict(d.to_dict()["candidate"])
    assert back == d.candidate
    for a, b in itertools.combinations([d.to_dict()["candidate"], d.to_dict()["previous"]], 2):
        assert a != b
