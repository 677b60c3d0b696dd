"""tasks/study.py: settings rules, per-seed roots sharing the data and base, status, and the claims over
several fake seeds (claims.json fields, verdicts that follow the data, the report with the claims first)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tandem.errors import BadInputError
from tasks import study
from tests.report.fake_metrics import fake_eval, write_full_generations, write_per_problem_csv

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("claim", "metric", "tandem", "grpo", "kl_reg", "difference", "ci_low", "ci_high", "verdict")


def _study_file(tmp_path: Path) -> Path:
    main = tmp_path / "main"
    (main / "data" / "prepared").mkdir(parents=True)
    (main / "models" / "base").mkdir(parents=True)
    raw = yaml.safe_load((ROOT / "params.study.yaml").read_text())
    raw["out_root"] = str(main)  # a relative out_root is the project root's, as for the stages
    p = main / "params.study.yaml"
    p.write_text(yaml.safe_dump(raw, sort_keys=False))
    return p


@pytest.mark.parametrize("kw, message", [({"seeds": 0}, "at least one seed"), ({"jobs": 0}, "jobs"),
                                         ({"margin": 0.0}, "margin"), ({"n_boot": 10}, "n_boot")])
def test_impossible_settings_are_refused_with_the_rule(tmp_path, kw, message):
    with pytest.raises(BadInputError, match=message):
        study.settings(_study_file(tmp_path), out=tmp_path / "studies", **kw)


def test_a_missing_params_file_is_named(tmp_path):
    with pytest.raises(BadInputError, match="does not exist"):
        study.settings(tmp_path / "nope.yaml")


def test_prepare_root_links_base_and_data_and_changes_only_seed_and_root(tmp_path):
    params = _study_file(tmp_path)
    s = study.settings(params, seeds=2, first_seed=3, out=tmp_path / "studies")
    assert s.seeds == (3, 4) and s.arms == ("tandem", "grpo", "kl_reg")
    root = study.prepare_root(s, 3)
    got = yaml.safe_load((root / "params.yaml").read_text())
    raw = yaml.safe_load(params.read_text())
    assert got["seed"] == 3 and got["out_root"] == str(root)
    # everything else is the study file as written: the per-seed file is a complete record of its run
    assert {k: v for k, v in got.items() if k not in ("seed", "out_root")} == \
        {k: v for k, v in raw.items() if k not in ("seed", "out_root")}
    for rel in study.SHARED:
        assert (root / rel).resolve() == (params.parent / rel).resolve()
    assert study.prepare_root(s, 3) == root  # again: idempotent (a rerun reuses the root)
    from tasks.common import load_params

    assert load_params(root / "params.yaml").seed == 3


def test_prepare_root_explains_a_missing_base(tmp_path):
    params = _study_file(tmp_path)
    (params.parent / "models" / "base").rmdir()
    s = study.settings(params, seeds=1, out=tmp_path / "studies")
    with pytest.raises(BadInputError, match="prepare and base stages"):
        study.prepare_root(s, 0)


def test_status_reports_trained_partial_and_pending_runs(tmp_path):
    s = study.settings(_study_file(tmp_path), seeds=1, out=tmp_path / "studies")
    root = study.prepare_root(s, 0)
    (root / "metrics").mkdir(parents=True)
    (root / "metrics" / "train_tandem.json").write_text(json.dumps({"steps": 200}))
    (root / "models" / "checkpoints" / "grpo" / "step-50").mkdir(parents=True)
    rows = {r["arm"]: r for r in study.status(s)}
    assert rows["tandem"]["state"] == "trained"
    assert rows["grpo"]["state"] == "partial" and rows["grpo"]["step"] == 50
    assert rows["kl_reg"]["state"] == "pending"
    assert rows["-"]["state"] == "pending"  # the seed's evaluation


def _fake_seed(root: Path, seed: int, p_correct: dict, kl: dict) -> None:
    ev = fake_eval(steps=(0, 20), modes=("solo", "step"), ks=(1, 2, 4), seed=seed)
    for b in ev["settings"]["benchmarks"].values():
        b["n_problems"] = 30
    ev["settings"]["n_samples"] = 4
    (root / "metrics").mkdir(parents=True, exist_ok=True)
    (root / "metrics" / "eval.json").write_text(json.dumps(ev))
    (root / "metrics" / "analysis.json").write_text(json.dumps({"summary": {}}))
    for arm in ev["arms"]:
        (root / "metrics" / f"train_{arm}.json").write_text(json.dumps({"steps": 20, "reward_first": 0.2,
                                                                        "reward_last": 0.4}))
    write_full_generations(root, ev, p_correct, seed=seed)
    write_per_problem_csv(root, ev, kl, seed=seed)


def test_aggregate_writes_every_claim_with_intervals_and_verdicts_that_follow_the_data(tmp_path):
    s = study.settings(_study_file(tmp_path), seeds=3, out=tmp_path / "studies", n_boot=400)
    # tandem far better with the junior and alone; tandem drifts far less than GRPO
    p = {"base": 0.5, "tandem": 0.9, "grpo": 0.1, "kl_reg": 0.5}
    for seed in s.seeds:
        _fake_seed(study.prepare_root(s, seed), seed, p, {"tandem": 0.05, "grpo": 0.5, "kl_reg": 0.2})
    doc = study.aggregate(s)
    saved = json.loads((s.out / "claims.json").read_text())
    assert saved["seeds"] == [0, 1, 2] and saved["n_seeds"] == 3
    assert {r["claim"] for r in saved["claims"]} == {"1. solo skill", "2. handoff robustness", "3. drift",
                                                     "4. legibility"}
    for r in saved["claims"]:
        assert all(k in r for k in FIELDS), r
        assert r["ci_low"] <= r["difference"] <= r["ci_high"]
    by = {(r["metric"], r["comparison"]): r for r in doc["claims"]}
    assert by[("step/pass@1", "tandem - grpo")]["verdict"] == "holds"
    assert by[("kl_mean", "tandem - grpo")]["verdict"] == "holds"
    assert by[("kl_mean", "kl_reg - grpo")]["verdict"] == "holds"
    assert by[("solo/pass@1", "tandem - grpo")]["verdict"] == "does not hold"  # 0.9 vs 0.1 is no match
    report = (s.out / "report.md").read_text()
    assert report.index("## Claims") < report.index("## Every measure")
    assert (s.out / "figures" / "claims-intervals.png").exists() and (s.out / "report.html").exists()


def test_aggregate_names_a_seed_that_is_not_finished(tmp_path):
    s = study.settings(_study_file(tmp_path), seeds=1, out=tmp_path / "studies")
    study.prepare_root(s, 0)
    with pytest.raises(BadInputError, match="seed 0 has no analysis"):
        study.aggregate(s)
