"""The paired gate of a positive control (tandem/metrics/dialect.py `class_counts`, `paired_difference`;
tandem/study/control.py `paired_gate_values`, `gate` with `estimator: paired_problems`) on tiny hand-made counts,
each against a naive version: a class that falls on easier problems does not look better within problems, G3 is
the junior's extra cost only, and the optional criteria (keyed share, problems each difference rests on) decide."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tandem.metrics.dialect import class_counts, paired_difference
from tandem.study.control import GateCriteria, gate, gate_markdown, paired_gate_values


def _naive_mh(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> tuple[float | None, int]:
    """Mantel-Haenszel risk difference written out problem by problem."""
    num = den = 0.0
    used = 0
    for (na, ca), (nb, cb) in zip(a, b):
        if na == 0 or nb == 0:
            continue
        w = na * nb / (na + nb)
        num += w * (ca / na - cb / nb)
        den += w
        used += 1
    return (num / den if den else None), used


def test_paired_difference_matches_the_naive_sum_on_random_counts():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n_a, n_b = rng.integers(0, 6, 7), rng.integers(0, 6, 7)
        c_a, c_b = rng.binomial(n_a, 0.6), rng.binomial(n_b, 0.3)
        got = paired_difference(n_a, c_a, n_b, c_b)
        want, used = _naive_mh(list(zip(n_a, c_a)), list(zip(n_b, c_b)))
        assert got["problems"] == used
        assert (got["value"] is None) == (want is None)
        if want is not None:
            assert got["value"] == pytest.approx(want, abs=1e-12) and got["se"] >= 0


def test_one_problem_gives_the_plain_difference_and_none_without_both_classes():
    got = paired_difference([4], [3], [2], [0])
    assert got["value"] == pytest.approx(0.75) and got["n_a"] == 4 and got["n_b"] == 2
    assert got["se"] == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    none = paired_difference([4, 0], [1, 0], [0, 3], [0, 1])
    assert none["value"] is None and none["problems"] == 0
    with pytest.raises(ValueError):
        paired_difference([1], [2], [1], [0])  # more correct than samples


def test_a_class_on_easier_problems_looks_better_pooled_but_not_within_problems():
    # problem e (easy): both classes solve 0.9; problem h (hard): both 0.1. The dialect falls mostly on h.
    ids = ["e"] * 10 + ["h"] * 10
    styles = ["jargon"] * 2 + ["verbose"] * 8 + ["jargon"] * 8 + ["terse"] * 2
    scores = [1, 1] + [1] * 7 + [0] + [1] + [0] * 7 + [0, 0]
    counts = class_counts(ids, styles, scores, "jargon")
    assert counts == {"e": [2, 2, 8, 7], "h": [8, 1, 2, 0]}
    pooled = (2 + 1) / 10 - (7 + 0) / 10
    paired = paired_difference(*zip(*[(c[0], c[1], c[2], c[3]) for c in counts.values()]))
    assert pooled == pytest.approx(-0.4)
    # within problems: e 1.0 - 0.875, h 0.125 - 0.0, weights 1.6 each
    assert paired["value"] == pytest.approx(0.125) and paired["problems"] == 2


def _counts(d: dict[str, tuple[int, int, int, int]]) -> dict[str, list[int]]:
    return {k: list(v) for k, v in d.items()}


def test_g3_is_the_junior_s_extra_cost_and_not_s_s_own_gap():
    # S pays 0.25 for the dialect itself (G4); J's steps cost 0.5 on dialect-first and nothing on keyed-first
    S = _counts({"p1": (4, 2, 4, 3), "p2": (4, 2, 4, 3)})
    SJ = _counts({"p1": (4, 0, 4, 3), "p2": (4, 0, 4, 3)})
    SS = _counts({"p1": (4, 2, 4, 3), "p2": (4, 2, 4, 3)})
    v = paired_gate_values({"S_solo": S, "SJ_step": SJ, "SS_step": SS})
    assert v["solo_gap_S"] == pytest.approx(-0.25)
    assert v["cost_SJ"] == pytest.approx(-0.5)          # (0 - 0.5) - (0.75 - 0.75)
    assert v["gap_SJ"] == pytest.approx(-0.75)          # S's own gap plus J's cost: what the pooled G3 measured
    assert v["cost_SS"] == pytest.approx(0.0)
    assert v["problems"] == {"G3": 2, "G4": 2, "G5": 2}
    # each part is the naive MH difference of its two classes
    naive, _ = _naive_mh([(4, 0), (4, 0)], [(4, 2), (4, 2)])
    assert v["parts"]["SJ_step - S_solo, dialect-first"]["value"] == pytest.approx(naive)


def test_a_problem_missing_from_one_measurement_counts_as_no_samples():
    S = _counts({"p1": (2, 1, 2, 2)})
    SJ = _counts({"p2": (2, 0, 2, 2)})
    v = paired_gate_values({"S_solo": S, "SJ_step": SJ, "SS_step": S})
    assert v["cost_SJ"] is None and v["problems"]["G3"] == 0 and v["solo_gap_S"] == pytest.approx(-0.5)


PAIRED = GateCriteria.from_dict({"G1_share": [0.5, 0.9], "G1_keyed_share_min": 0.10, "G2_solo_pass1_min": 0.25,
                                 "G3_cost_max": -0.15, "G4_solo_gap_abs_max": 0.10,
                                 "estimator": "paired_problems", "min_problems": 20})
GOOD = {"share": 0.7, "keyed_share": 0.25, "solo_pass1_S": 0.5, "solo_pass1_J": 0.6, "cost_SJ": -0.3,
        "solo_gap_S": 0.02, "cost_SS": 0.0, "problems": {"G3": 30, "G4": 25, "G5": 30}}


def test_the_paired_gate_passes_and_each_new_rule_fails_on_its_own():
    assert gate(GOOD, PAIRED)["passed"]
    for change, failed in (({"keyed_share": 0.05}, "G1"), ({"problems": {"G3": 19, "G4": 25}}, "G3"),
                           ({"problems": {"G3": 30, "G4": 19}}, "G4"), ({"problems": {}}, "G3")):
        g = gate({**GOOD, **change}, PAIRED)
        assert not g["passed"] and not g["criteria"][failed]["passed"]
    assert "within problems" in gate(GOOD, PAIRED)["criteria"]["G4"]["rule"]
    # the first settings' criteria read as before: no keyed floor, no problem count, the same rule text
    plain = GateCriteria.from_dict({"G1_share": [0.5, 0.9], "G2_solo_pass1_min": 0.25, "G3_cost_max": -0.15,
                                    "G4_solo_gap_abs_max": 0.10})
    g = gate({k: v for k, v in GOOD.items() if k not in ("keyed_share", "problems")}, plain)
    assert g["passed"] and g["criteria"]["G3"]["rule"] == "<= -0.15" and g["criteria"]["G1"]["value"] == 0.7


def test_the_gate_page_of_a_paired_gate_shows_every_difference_and_the_problems():
    parts = {"S_solo dialect - keyed": {"value": 0.02, "se": 0.05, "problems": 25, "n_a": 300, "n_b": 120}}
    measure = {"n": 800, "pass@1": 0.5, "styles": {"jargon": {"share": 0.7}},
               "dialect_vs_keyed": {"gap": -0.1, "dialect": 0.4, "keyed": 0.5, "n_dialect": 560, "n_keyed": 200}}
    d = {"dialect": "jargon", "passed": True, **gate(GOOD, PAIRED), "values": GOOD, "paired": {"parts": parts},
         "measures": {k: measure for k in ("S_solo", "SJ_step", "SS_step")},
         "hashes": {"S": "a" * 64, "J": "b" * 64}, "junior_metrics": {}}
    page = gate_markdown({"passed": True, "dialect": "jargon", "dialects": [d], "setting": "2"})
    assert "| G3 | -0.300 (30 problems) |" in page and "| S_solo dialect - keyed | 0.020 | 0.050 | 25 | 300, 120 |" in page
    assert "Pooled over all samples" in page and "G4 -0.100" in page


def test_the_driver_summarises_records_into_the_paired_values():
    """tasks/study/control.py `_summary` keeps per-problem class counts and `gate_values` decides on the paired
    differences (the pooled ones stay in the summaries), on records a stand-in classifier names."""
    from tasks.study.control import _summary, gate_values

    def recs(rows):  # (problem, style, score)
        return [{"id": p, "benchmark": "arith", "text": s, "score": x, "owner": []} for p, s, x in rows]

    solo = recs([("1", "jargon", 1), ("1", "verbose", 1), ("2", "jargon", 0), ("2", "jargon", 0), ("2", "terse", 1)])
    step = recs([("1", "jargon", 0), ("1", "verbose", 1), ("2", "jargon", 0), ("2", "terse", 1)])
    summ = {k: _summary(v, "jargon", lambda t: t, ("verbose", "terse"))
            for k, v in {"S_solo": solo, "J_solo": solo, "SJ_step": step, "SS_step": solo}.items()}
    assert summ["S_solo"]["per_problem"] == {"arith/1": [1, 1, 1, 1], "arith/2": [2, 0, 1, 1]}
    pooled = gate_values(summ, "jargon", ("verbose", "terse"))
    assert "paired" not in pooled and pooled["values"]["keyed_share"] == pytest.approx(0.4)
    assert pooled["values"]["solo_gap_S"] == pytest.approx(1 / 3 - 1)
    got = gate_values(summ, "jargon", ("verbose", "terse"), "paired_problems")
    # within problems: p1 1 - 1 = 0 (w 1/2), p2 0 - 1 = -1 (w 2/3) -> -(2/3) / (7/6) = -4/7
    assert got["values"]["solo_gap_S"] == pytest.approx(-4 / 7) and got["values"]["problems"]["G4"] == 2
    # J's cost: dialect-first p1 0 - 1 (w 1/2), p2 0 - 0 (w 2/3); keyed-first 0 on both -> -(1/2) / (7/6) = -3/7
    assert got["values"]["cost_SJ"] == pytest.approx(-3 / 7) and got["values"]["cost_SS"] == pytest.approx(0.0)
    assert set(got["paired"]["parts"]) >= {"SJ_step - S_solo, dialect-first", "SJ_step - S_solo, keyed-first"}
