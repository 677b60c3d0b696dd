"""The registered verdict rules (tandem.metrics.verdicts): Holm against a naive step-down, the smallest effects of
interest per kind, the three verdicts per direction, what an interval excludes, the not-robust flag, and one row's
numbers (the keep-80%-of-the-gain contrast and its kept share) on data with a known effect."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.metrics.verdicts import RegisteredClaim, decide, evaluate, excludes, holm_adjust, not_robust

C1 = RegisteredClaim("C1", "1. solo skill", "s", "solo/pass@1", "keeps_gain", "tandem", "grpo", keep=0.8)
C2 = RegisteredClaim("C2", "2. handoff", "s", "step/pass@1", "greater", "tandem", "grpo", sesoi=0.02)
C3 = RegisteredClaim("C3", "3. drift", "s", "kl_mean", "less", "tandem", "grpo", sesoi_relative=0.2)
C4B = RegisteredClaim("C4b", "4. legibility", "s", "overlap", "greater", "tandem", "grpo", sesoi_tv_relative=0.2)


def _naive_holm_rejections(p, alpha):
    """Holm's step-down as written: sort, reject while p_(i) < alpha / (m - i), stop at the first failure."""
    order = sorted(range(len(p)), key=lambda i: (p[i], i))
    rejected = set()
    for rank, i in enumerate(order):
        if p[i] < alpha / (len(p) - rank):
            rejected.add(i)
        else:
            break
    return rejected


def test_holm_adjusted_p_values_reject_exactly_what_the_naive_step_down_rejects():
    rng = np.random.default_rng(0)
    for trial in range(300):
        m = int(rng.integers(1, 9))
        p = list(rng.choice([rng.uniform(0, 0.02), rng.uniform(0, 1)], size=m))
        if trial % 7 == 0 and m > 1:
            p[1] = p[0]  # ties
        adj = holm_adjust(p)
        assert all(a >= x for a, x in zip(adj, p)) and all(a <= 1 for a in adj)
        for alpha in (0.005, 0.025, 0.05, 0.2):
            assert {i for i, a in enumerate(adj) if a < alpha} == _naive_holm_rejections(p, alpha), (p, alpha)


def test_holm_by_hand():
    assert holm_adjust([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm_adjust([0.5, 0.001]) == pytest.approx([0.5, 0.002])


def test_thresholds_per_kind_of_smallest_effect():
    assert C2.threshold(0.4) == pytest.approx(0.02)
    assert C3.threshold(0.15) == pytest.approx(-0.03)  # a reduction of 20% of GRPO's KL
    assert C4B.threshold(0.95) == pytest.approx(0.01)  # 20% of GRPO's 1 - overlap
    assert C1.threshold(0.6) == 0.0 and C1.coefficients == {"tandem": 1.0, "grpo": -0.8, "base": pytest.approx(-0.2)}
    assert C1.comparison == "(tandem - base) - 0.8 (grpo - base)"


@pytest.mark.parametrize("p, est, lo, hi, direction, thr, expected", [
    (0.001, 0.03, 0.01, 0.05, "greater", 0.02, "holds"),
    (0.001, 0.015, 0.01, 0.02, "greater", 0.02, "inconclusive"),   # significant, but short of the SESOI...
    (0.001, 0.012, 0.008, 0.016, "greater", 0.02, "does not hold"),  # ... and here the SESOI is excluded
    (0.03, 0.03, -0.001, 0.06, "greater", 0.02, "inconclusive"),    # adjusted p above alpha
    (0.9, -0.01, -0.03, 0.003, "greater", 0.02, "does not hold"),
    (0.001, -0.05, -0.07, -0.035, "less", -0.03, "holds"),
    (0.001, -0.02, -0.04, -0.01, "less", -0.03, "inconclusive"),
    (0.001, -0.02, -0.025, -0.01, "less", -0.03, "does not hold"),
    (0.01, 0.02, 0.001, 0.04, "greater", 0.0, "holds"),             # keeps_gain: bound 0
    (0.6, -0.02, -0.04, -0.001, "greater", 0.0, "does not hold"),   # the contrast's interval lies below 0
])
def test_registered_verdicts(p, est, lo, hi, direction, thr, expected):
    assert decide(p, 0.025, est, lo, hi, direction, thr) == expected


def test_what_an_interval_excludes():
    assert excludes(C2, -0.027, 0.0025, 0.45) == \
        "a step pass@1 gain of tandem over grpo above +0.00250 is excluded"
    assert excludes(C2, -0.03, -0.01, 0.45).startswith("any step pass@1 gain of tandem over grpo is excluded")
    text = excludes(C3, -0.0027, 0.0048, 0.0147)
    assert text == "a KL to the base (own text) reduction of tandem against grpo larger than 0.00270 (18% of " \
                   "grpo's 0.0147) is excluded"
    assert "any" in excludes(C3, 0.001, 0.004, 0.0147)
    kept = {"estimate": 0.75, "ci": [0.47, 1.05]}
    assert excludes(C1, -0.02, 0.004, 0.5, kept) == \
        "tandem keeps 75% [47%, 105%] of grpo's gain over the base; keeping more than 105% of it is excluded"


def test_not_robust_when_the_seed_interval_disagrees_about_zero():
    assert not_robust((0.01, 0.05), (-0.01, 0.07)) is True
    assert not_robust((-0.01, 0.05), (0.002, 0.04)) is True
    assert not_robust((0.01, 0.05), (0.002, 0.07)) is False
    assert not_robust((0.01, 0.05), None) is None


def test_claims_refuse_inconsistent_rules():
    with pytest.raises(ValueError, match="keep"):
        RegisteredClaim("X", "c", "s", "m", "keeps_gain", "a", "b")
    with pytest.raises(ValueError, match="at most one"):
        RegisteredClaim("X", "c", "s", "m", "greater", "a", "b", sesoi=0.1, sesoi_relative=0.2)
    with pytest.raises(ValueError, match="test"):
        RegisteredClaim("X", "c", "s", "m", "bigger", "a", "b")
    with pytest.raises(ValueError, match="unknown keys"):
        RegisteredClaim.from_dict({"id": "X", "claim": "c", "statement": "s", "metric": "m", "test": "greater",
                                   "a": "a", "b": "b", "margin": 0.05})


def test_a_row_on_data_with_a_known_gain():
    rng = np.random.default_rng(1)
    S, P = 4, 60
    problem = rng.normal(0, 0.1, P)

    def arm(level):
        return {"b": level + problem[None, :] + rng.normal(0, 0.02, (S, P))}

    arms = {"base": arm(0.4), "grpo": arm(0.6), "tandem": arm(0.58)}  # tandem keeps 90% of GRPO's 0.2 gain
    row = evaluate(C1, arms, n_boot=500, level=0.95, seed=0)
    assert row["estimate"] == pytest.approx(0.58 - 0.4 - 0.8 * 0.2, abs=0.01)
    assert row["ci"][0] > 0 and row["p_one_sided"] == pytest.approx(1 / 501)
    assert row["kept_share"]["estimate"] == pytest.approx(0.9, abs=0.05)
    lo, hi = row["kept_share"]["ci"]
    assert lo < row["kept_share"]["estimate"] < hi and row["kept_share"]["gain_b_excludes_0"]
    assert row["seed_t"][0] <= row["estimate"] <= row["seed_t"][1]
    assert set(row["arms"]) == {"tandem", "grpo", "base"}
