"""The junior positive control's decision rules (tandem/study/control.py) on hand-made numbers."""

import numpy as np
import pytest

from tandem.study.control import GateCriteria, bug_indicators, dose_slope, gate

CRIT = GateCriteria.from_dict({"G1_share": [0.5, 0.9], "G2_solo_pass1_min": 0.30, "G3_cost_max": -0.15,
                               "G4_solo_gap_abs_max": 0.10})
GOOD = {"share": 0.6, "solo_pass1_S": 0.4, "solo_pass1_J": 0.35, "cost_SJ": -0.2, "solo_gap_S": 0.05, "cost_SS": 0.0}


def test_a_dialect_that_meets_every_criterion_passes():
    g = gate(GOOD, CRIT)
    assert g["passed"] and all(g["criteria"][k]["passed"] for k in ("G1", "G2", "G3", "G4"))
    assert g["criteria"]["G5"]["passed"] is None  # reported only


@pytest.mark.parametrize("key,value,failed", [("share", 0.95, "G1"), ("share", 0.4, "G1"), ("solo_pass1_J", 0.2, "G2"),
                                              ("cost_SJ", -0.1, "G3"), ("cost_SJ", None, "G3"),
                                              ("solo_gap_S", -0.12, "G4"), ("solo_gap_S", float("nan"), "G4")])
def test_each_criterion_fails_on_its_own(key, value, failed):
    g = gate({**GOOD, key: value}, CRIT)
    assert not g["passed"]
    assert [k for k in ("G1", "G2", "G3", "G4") if not g["criteria"][k]["passed"]] == [failed]


def test_dose_slope_is_least_squares_per_100_steps():
    rng = np.random.default_rng(0)
    x = np.arange(0, 301, 50)
    y = 0.6 - 0.001 * x + rng.normal(0, 0.02, x.size)
    assert dose_slope(x.tolist(), y.tolist()) == pytest.approx(100 * np.polyfit(x, y, 1)[0])
    assert dose_slope([0, 0], [0.1, 0.2]) is None


REG = {"B1_senior_share": [0.45, 0.55], "B3_first_steps": 5, "B3_max_se": 3.0, "B4_min_move": 0.05,
       "B6_self_fraction": 0.5, "B7_ratio": [0.5, 2.0]}


def _v(**kw):
    base = {"senior_share": {"tandem-naive": 0.5, "tandem-self": 0.51}, "junior_hashes_equal": True,
            "junior_unchanged": True, "first_reward": 0.30, "first_reward_se": 0.02, "gate_word_SJ": 0.32,
            "gate_cost": -0.2, "move": {"grpo": 0.1, "tandem-naive": -0.4, "tandem-self": 0.05},
            "final_share": {"grpo": 0.7, "tandem-naive": 0.2, "tandem-self": 0.65}, "J1_holds": True,
            "H1_estimate": 0.1}
    return {**base, **kw}


def test_a_healthy_study_fires_no_indicator():
    out = bug_indicators(_v(), REG)
    assert {k: v["fired"] for k, v in out.items()} == {f"B{i}": False for i in range(1, 8)}


@pytest.mark.parametrize("change,fired", [
    ({"senior_share": {"tandem-naive": 0.6}}, "B1"),
    ({"junior_unchanged": False}, "B2"),
    ({"first_reward": 0.5}, "B3"),
    ({"move": {"grpo": 0.01, "tandem-naive": -0.02, "tandem-self": 0.0}}, "B4"),
    ({"final_share": {"grpo": 0.3, "tandem-naive": 0.4, "tandem-self": 0.3}}, "B5"),
    ({"move": {"grpo": 0.1, "tandem-naive": -0.4, "tandem-self": -0.3}}, "B6"),
    ({"H1_estimate": 0.5}, "B7"),
])
def test_each_indicator_fires_on_its_observation(change, fired):
    out = bug_indicators(_v(**change), REG)
    assert out[fired]["fired"] is True


def test_missing_inputs_leave_an_indicator_undecided():
    out = bug_indicators({}, REG)
    assert all(v["fired"] is None for v in out.values())
