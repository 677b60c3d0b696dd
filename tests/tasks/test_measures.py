"""Per-problem measures of a run (tasks/measures.py) on tiny hand-written generation files: pass@1 per problem
against a hand count, the analysis table's values, the base under the first arm's step 0, and two seeds
stacked into (2, P) arrays aligned by problem id."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from tandem.errors import BadInputError
from tasks.measures import BASE, run_measures, stack_seeds

# problem id -> sample scores, per (arm, step); the base's live under the first arm's step 0
SCORES = {
    ("tandem", 0): {"p1": [1, 0, 0, 0], "p2": [0, 0, 0, 0], "p3": [1, 1, 0, 0]},
    ("tandem", 5): {"p1": [1, 1, 1, 0], "p2": [1, 0, 0, 0], "p3": [1, 1, 1, 1]},
    ("grpo", 5): {"p1": [0, 1, 0, 0], "p2": [1, 1, 0, 0], "p3": [0, 0, 0, 0]},
}


def _write_run(root: Path, scores=SCORES, order=None) -> None:
    ev = {"settings": {"ks": [1, 2], "modes": ["solo"], "benchmarks": {"b": {"n_problems": 3}}},
          "arms": {"tandem": {"checkpoints": [{"step": 0}, {"step": 5}]},
                   "grpo": {"checkpoints": [{"step": 0}, {"step": 5}]}}}
    (root / "metrics").mkdir(parents=True, exist_ok=True)
    (root / "metrics" / "eval.json").write_text(json.dumps(ev))
    for (arm, step), per in scores.items():
        d = root / "results" / "generations" / arm / f"step-{step}" / "solo"
        d.mkdir(parents=True, exist_ok=True)
        ids = order or list(per)
        rows = [{"id": i, "sample": j, "score": float(s)} for i in ids for j, s in enumerate(per[i])]
        (d / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_pass_at_1_per_problem_is_the_fraction_correct(tmp_path):
    _write_run(tmp_path)
    m = run_measures(tmp_path, ["tandem", "grpo"])
    assert set(m) == {BASE, "tandem", "grpo"}
    for who, key in ((BASE, ("tandem", 0)), ("tandem", ("tandem", 5)), ("grpo", ("grpo", 5))):
        hand = {i: sum(s) / len(s) for i, s in SCORES[key].items()}
        assert m[who]["solo/pass@1"]["b"] == pytest.approx(hand), who
    # pass@2 of p1 at tandem step 5: 3 of 4 correct -> 1 - C(1,2)/C(4,2) = 1
    assert m["tandem"]["solo/pass@2"]["b"]["p1"] == pytest.approx(1.0)
    assert m["grpo"]["solo/pass@2"]["b"]["p2"] == pytest.approx(1 - 1 / 6)  # 2 of 4: 1 - C(2,2)/C(4,2)
    assert "kl_mean" not in m["tandem"]  # no per_problem.csv: pass@k only


def test_analysis_values_come_from_the_per_problem_table(tmp_path):
    _write_run(tmp_path)
    d = tmp_path / "metrics" / "plots" / "analysis"
    d.mkdir(parents=True)
    with open(d / "per_problem.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "step", "benchmark", "id", "n_completions", "junior_ce", "overlap", "kl_mean"])
        for arm, step, kl in (("tandem", 0, 0.0), ("tandem", 5, 0.1), ("grpo", 5, 0.3)):
            for i, pid in enumerate(("p1", "p2", "p3")):
                w.writerow([arm, step, "b", pid, 4, 1.0 + kl, 0.9 - kl, kl + 0.01 * i])
        w.writerow(["grpo", 5, "b", "p4", 4, "", 0.5, 0.2])  # an empty cell stays undefined
    m = run_measures(tmp_path, ["tandem", "grpo"])
    assert m["grpo"]["kl_mean"]["b"] == pytest.approx({"p1": 0.3, "p2": 0.31, "p3": 0.32, "p4": 0.2})
    assert math.isnan(m["grpo"]["junior_ce"]["b"]["p4"])
    assert m[BASE]["overlap"]["b"] == pytest.approx({"p1": 0.9, "p2": 0.9, "p3": 0.9})
    assert m["tandem"]["junior_ce"]["b"]["p2"] == pytest.approx(1.1)


def test_two_seeds_stack_to_seeds_by_problems_aligned_by_id(tmp_path):
    _write_run(tmp_path / "s0")
    second = {k: {i: [1 - s for s in v] for i, v in per.items()} for k, per in SCORES.items()}
    _write_run(tmp_path / "s1", second, order=["p3", "p1", "p2"])  # written in another order
    stacked = stack_seeds([run_measures(tmp_path / s, ["tandem", "grpo"]) for s in ("s0", "s1")])
    arr = stacked["tandem"]["solo/pass@1"]["b"]
    assert arr.shape == (2, 3)
    np.testing.assert_allclose(arr[0], [0.75, 0.25, 1.0])  # p1, p2, p3
    np.testing.assert_allclose(arr[1], [0.25, 0.75, 0.0])
    assert set(stacked) == {BASE, "tandem", "grpo"}


def test_stack_seeds_marks_a_problem_one_seed_lacks_as_nan():
    a = {"x": {"m": {"b": {"p1": 1.0, "p2": 0.0}}}}
    b = {"x": {"m": {"b": {"p2": 0.5}}}, "y": {"m": {"b": {"p1": 1.0}}}}
    out = stack_seeds([a, b])
    assert set(out) == {"x"}  # only arms every seed has
    np.testing.assert_array_equal(out["x"]["m"]["b"], [[1.0, 0.0], [np.nan, 0.5]])
    assert stack_seeds([]) == {}


def test_missing_inputs_name_the_stage_to_rerun(tmp_path):
    with pytest.raises(BadInputError, match="evaluate stage"):
        run_measures(tmp_path, ["tandem"])
    _write_run(tmp_path, {k: v for k, v in SCORES.items() if k != ("grpo", 5)})
    with pytest.raises(BadInputError, match="missing generations"):
        run_measures(tmp_path, ["tandem", "grpo"])
