"""The claims table's logic (tandem.metrics.claims): a verdict per direction on measures with an obvious
difference, "not measured" for an absent arm, the row fields, and the per-arm intervals."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.metrics.claims import Claim, arm_intervals, claims_for, evaluate_claims, seeds_of

FIELDS = ("claim", "metric", "tandem", "grpo", "kl_reg", "difference", "ci_low", "ci_high", "verdict")


def _measures(level: dict[str, float], metric: str = "m", seeds: int = 2, problems: int = 30, spread: float = 0.01):
    """arm -> {metric: {benchmark: values_MP}} with each arm centred on `level[arm]`."""
    rng = np.random.default_rng(0)
    return {arm: {metric: {b: v + spread * rng.standard_normal((seeds, problems)) for b in ("b1", "b2")}}
            for arm, v in level.items()}


@pytest.mark.parametrize("direction, a_level, expected", [
    ("greater", 1.0, "holds"), ("greater", 0.0, "does not hold"),
    ("less", 0.0, "holds"), ("less", 1.0, "does not hold"),
    ("equivalent", 0.5, "holds"), ("equivalent", 1.0, "does not hold"),
])
def test_verdict_per_direction_on_an_obvious_difference(direction, a_level, expected):
    m = _measures({"tandem": a_level, "grpo": 0.5, "kl_reg": 0.5})
    claim = Claim("c", "s", "m", "tandem", "grpo", direction, 0.05 if direction == "equivalent" else 0.0)
    (row,) = evaluate_claims(m, (claim,), n_boot=300)
    assert row["verdict"] == expected, row
    assert row["difference"] == pytest.approx(a_level - 0.5, abs=0.02)
    assert row["ci_low"] <= row["difference"] <= row["ci_high"]
    assert row["within_noise"] is (a_level == 0.5)  # only the equal arms cannot be told apart


def test_inconclusive_when_the_arms_are_the_same_up_to_noise():
    m = _measures({"tandem": 0.5, "grpo": 0.5}, spread=0.3)
    (row,) = evaluate_claims(m, (Claim("c", "s", "m", "tandem", "grpo", "greater"),), n_boot=300)
    assert row["verdict"] == "inconclusive" and row["within_noise"] is True


def test_an_absent_arm_is_not_measured_and_the_row_keeps_its_fields():
    m = _measures({"tandem": 0.6, "grpo": 0.4})  # no kl_reg
    rows = evaluate_claims(m, claims_for(1), n_boot=100)
    assert len(rows) == len(claims_for(1))
    for row in rows:
        assert all(f in row for f in FIELDS), row
        # only metric "m" exists: every claim of the real table is on another metric
        assert row["verdict"] == "not measured" and row["difference"] is None and row["ci_low"] is None
        assert row["tandem"] is None and row["kl_reg"] is None
    klreg = [r for r in rows if r["comparison"] == "kl_reg - grpo"]
    assert klreg and all(r["missing"] == ["kl_reg", "grpo"] for r in klreg)


def test_a_claim_with_only_one_arm_measured_names_the_missing_arm():
    m = _measures({"tandem": 0.6, "grpo": 0.4}, metric="kl_mean")
    rows = [r for r in evaluate_claims(m, claims_for(4), n_boot=100) if r["comparison"] == "kl_reg - grpo"]
    assert rows and rows[0]["verdict"] == "not measured" and rows[0]["missing"] == ["kl_reg"]
    assert rows[0]["grpo"] == pytest.approx(0.4, abs=0.01) and rows[0]["grpo_ci"] is not None


def test_claims_for_adds_the_largest_k_only_when_above_one():
    assert [c.metric for c in claims_for(1)].count("solo/pass@1") == 1
    assert "solo/pass@8" in [c.metric for c in claims_for(8)] and len(claims_for(8)) == len(claims_for(1)) + 1
    assert all(c.margin > 0 for c in claims_for(8) if c.direction == "equivalent")


def test_arm_intervals_bracket_each_estimate_and_seeds_of_counts_the_first_axis():
    m = _measures({"tandem": 0.8, "base": 0.2}, seeds=3)
    iv = arm_intervals(m, n_boot=200)
    assert set(iv) == {"tandem", "base"}
    for arm, centre in (("tandem", 0.8), ("base", 0.2)):
        lo, hi = iv[arm]["m"]
        assert lo < hi and lo <= centre + 0.01 and hi >= centre - 0.01
    assert seeds_of(m) == 3 and seeds_of({}) == 0
    with pytest.raises(ValueError, match="number of seeds"):
        seeds_of({"a": {"m": {"b": np.zeros((1, 3))}}, "c": {"m": {"b": np.zeros((2, 3))}}})
