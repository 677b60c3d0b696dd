"""tasks/study/runs.py: settings rules, per-seed roots sharing the data and base, status, and the claims over
several fake seeds (claims.json fields, verdicts that follow the data, the report with the claims first)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tandem.errors import BadInputError
from tasks.study import runs as study
from tasks.study import stages
from tests.report.fake_metrics import fake_eval, write_full_generations, write_per_problem_csv

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("claim", "metric", "tandem", "grpo", "kl_reg", "difference", "ci_low", "ci_high", "verdict")


def _study_file(tmp_path: Path) -> Path:
    main = tmp_path / "main"
    (main / "data" / "prepared").mkdir(parents=True)
    (main / "models" / "base").mkdir(parents=True)
    (main / "models" / "junior").mkdir(parents=True)
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
    assert {r["unit"] for r in rows.values()} == {"seed 0"}
    # then evaluated and analyzed, each only once its stage wrote after the one before it
    m = root / "metrics"
    for name, t in (("train_tandem.json", 100), ("eval.json", 200), ("analysis.json", 150)):
        (m / name).write_text("{}")
        os.utime(m / name, (t, t))
    assert {r["arm"]: r["state"] for r in study.status(s)}["tandem"] == "evaluated"  # a former run's analysis
    os.utime(m / "analysis.json", (300, 300))
    assert {r["arm"]: r["state"] for r in study.status(s)}["tandem"] == "analyzed"
    os.utime(m / "train_tandem.json", (400, 400))  # retrained: a former run's evaluation and analysis
    assert {r["arm"]: r["state"] for r in study.status(s)}["tandem"] == "trained"


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


def _fake_seed_root(root: Path) -> None:
    """A seed root as evaluate (final_and_best) and analyze leave it: base, grpo at steps 50 (best) and 100."""
    from tandem.checkpoints import generations_file, write_state

    ev = {"settings": {"benchmarks": {"b1": {"n_problems": 2}, "b2": {"n_problems": 1}}},
          "arms": {"grpo": {"checkpoints": [{"step": 0}, {"step": 50}, {"step": 100}]}}}
    (root / "metrics" / "plots" / "analysis").mkdir(parents=True)
    (root / "metrics" / "eval.json").write_text(json.dumps(ev))
    for s in (50, 100):
        d = root / "models" / "checkpoints" / "grpo" / f"step-{s}"
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"w")
        write_state(d, {"step": s})
    hist = [{"loss": 1.0, "tandem/step": 50, "val/accuracy": 0.6}, {"loss": 1.0, "tandem/step": 100, "val/accuracy": 0.5}]
    (root / "models" / "checkpoints" / "grpo" / "step-100" / "trainer_state.json").write_text(
        json.dumps({"log_history": hist}))
    texts = {"solo": ["First, two more are found: 3 + 2 = 5\n\n\\boxed{5}", "3+2=5\n\n\\boxed{5}"],
             "step": ["First: 3 + 2 = 5\n\n\\boxed{6}", "3+2=5\n\n\\boxed{5}"]}
    own, common = [], []
    for step in (0, 50, 100):
        for b, ids in (("b1", ["p1", "p2"]), ("b2", ["q1"])):
            for mode in ("solo", "step"):
                f = generations_file(root / "results" / "generations", "grpo", step, mode, b)
                f.parent.mkdir(parents=True, exist_ok=True)
                rows = [{"id": i, "sample": k, "text": texts[mode][k], "score": float(k == 1 or step == 100)}
                        for i in ids for k in range(2)]
                f.write_text("".join(json.dumps(r) + "\n" for r in rows))
            for i in ids:
                own.append(f"grpo,{step},{b},{i},2,{0.5 + step / 1000},{1 - step / 1000},{step / 1000}")
                common.append(f"grpo,{step},{b},{i},{step / 2000},{1 - step / 2000}")
    (root / "metrics" / "plots" / "analysis" / "per_problem.csv").write_text(
        "arm,step,benchmark,id,n_completions,junior_ce,overlap,kl_mean\n" + "\n".join(own) + "\n")
    (root / "metrics" / "plots" / "analysis" / "common_text.csv").write_text(
        "arm,step,benchmark,id,kl_mean,overlap\n" + "\n".join(common) + "\n")


def test_export_writes_one_row_per_checkpoint_benchmark_and_problem(tmp_path):
    import csv

    root = tmp_path / "seed-3"
    _fake_seed_root(root)
    out = study.export_results(root, 3, "grpo", tmp_path / "results")
    assert out == tmp_path / "results" / "seed-3" / "grpo.csv"
    with open(out, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == study.RESULT_COLUMNS
    assert [(r["checkpoint"], r["step"], r["benchmark"], r["id"]) for r in rows] == [
        ("final", "100", "b1", "p1"), ("final", "100", "b1", "p2"), ("final", "100", "b2", "q1"),
        ("best", "50", "b1", "p1"), ("best", "50", "b1", "p2"), ("best", "50", "b2", "q1")]
    final, best = rows[0], rows[3]
    assert final["n_samples"] == "2" and final["solo_correct"] == "2" and best["solo_correct"] == "1"
    assert best["step_correct"] == "1" and final["compact_share"] == "0.5"
    assert float(final["kl_mean"]) == 0.1 and float(final["common_kl"]) == 0.05 and float(best["junior_ce"]) == 0.55
    base = list(csv.DictReader(open(study.export_results(root, 3, "base", tmp_path / "results"), newline="")))
    assert {r["step"] for r in base} == {"0"} and {r["checkpoint"] for r in base} == {"final", "best"}
    assert all(float(r["kl_mean"]) == 0.0 for r in base)
    before = out.read_bytes()
    study.export_results(root, 3, "grpo", tmp_path / "results")
    assert out.read_bytes() == before  # deterministic


def test_a_failed_stage_names_its_log_and_the_childs_message(tmp_path):
    """The study runs each stage through `python -m tasks.study.stages ...` (a child interpreter calling the
    stage's own function); a failure there comes back as one error with the log's tail."""
    from tandem.errors import UserError

    log = tmp_path / "logs" / "prepare.log"
    with pytest.raises(UserError, match="stage prepare") as err:
        stages.stage(tmp_path / "missing.yaml", "prepare", log)
    assert str(log) in str(err.value) and "missing.yaml" in log.read_text()
    assert stages.main(["nope"]) == 2
