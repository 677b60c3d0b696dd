"""tandem/study/claims.py and results.py (with tasks/study/recompute.py): the study's CSVs read and checked, the registered rows on synthetic results with known effects
(verdicts, Holm, what is excluded, the positive control, secondary rows), partial data, byte-identical output,
and `tandem study --recompute` from nothing but the CSVs and the registration."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem.errors import BadInputError
from tandem.metrics.passk import pass_at_k
from tandem.study import claims as engine
from tandem.study import results
from tasks.study import recompute as rc
from tests.tasks.fake_results import write_fake_results


class claims:  # noqa: N801 - the names the tests read, from the study package's parts
    ARMS, COLUMNS, FORMAT = results.ARMS, results.COLUMNS, engine.FORMAT
    read_results, summary = staticmethod(results.read_results), staticmethod(engine.summary)
    compute = staticmethod(engine.compute)

    @staticmethod
    def load_registration(path: Path):
        from tandem.study.registration import load

        return load(path)

    @staticmethod
    def write_arm_csv(path: Path, rows) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(results.arm_csv_text(rows))

    @staticmethod
    def recompute(out: Path, registration: Path | None = None) -> dict:
        if registration is not None and Path(registration) != Path(out) / "registration.yaml":
            shutil.copy(registration, Path(out) / "registration.yaml")
        return rc.registered(Path(out))

ROOT = Path(__file__).resolve().parents[2]
BENCHES = {"arith-long": 30, "arith-mid": 30, "arith-short": 30}
SEEDS = (0, 1, 2, 3, 4)
# tandem matches GRPO alone (keeps all of its gain), is worse with the junior, drifts less, overlaps more; its
# junior cross-entropy differs by little next to a large seed-to-seed spread; KL-Reg drifts less than GRPO
# and beats tandem with the junior
LEVELS = {"tandem": {"solo": 0.60, "step": 0.40, "junior_ce": 0.39}, "grpo": {"solo": 0.60, "step": 0.45},
          "kl_reg": {"step": 0.47}}
SDS = {"junior_ce": (0.02, 0.08, 0.01)}


def _registration(tmp: Path, seeds=SEEDS, n_boot: int = 400) -> Path:
    reg = yaml.safe_load((ROOT / "studies" / "registration.yaml").read_text())
    reg["study"]["seeds"] = list(seeds)
    reg["statistics"]["n_boot"] = n_boot
    p = tmp / "registration.yaml"
    p.write_text(yaml.safe_dump(reg, sort_keys=False))
    return p


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("study")
    write_fake_results(out / "results", seeds=SEEDS, levels=LEVELS, sds=SDS, benchmarks=BENCHES, best_shift=0.02)
    _registration(out)
    return out, claims.recompute(out)


def test_csv_round_trip_and_pass_at_k_from_the_counts(tmp_path):
    rows = [{"seed": 0, "arm": "grpo", "checkpoint": c, "step": 600 if c == "final" else 300, "benchmark": "b",
             "id": f"p{i}", "n_samples": 8, "solo_correct": i, "step_correct": None if i == 2 else 8 - i,
             "junior_ce": 0.1 + i / 3, "overlap": math.nan, "kl_mean": 1e-17, "common_kl": 0.2,
             "common_overlap": 0.9, "compact_share": 0.5} for c in ("best", "final") for i in (10 - 8, 3, 1)]
    claims.write_arm_csv(tmp_path / "seed-0" / "grpo.csv", rows)
    lines = (tmp_path / "seed-0" / "grpo.csv").read_text().splitlines()
    assert lines[0] == ",".join(claims.COLUMNS)
    assert lines[1].startswith("0,grpo,final,600,b,p1,8,1,7,")  # final first, ids in natural order
    res = claims.read_results(tmp_path, [1, 2, 4, 8, 16])
    assert res.ks == (1, 2, 4, 8) and res.n_samples == 8 and res.ids == {"b": ["p1", "p2", "p3"]}
    v = res.values[("final", "grpo", 0)]
    assert list(v["solo/pass@4"]["b"]) == [pass_at_k(8, c, 4) for c in (1, 2, 3)]
    assert math.isnan(v["step/pass@1"]["b"][1]) and math.isnan(v["overlap"]["b"][0])  # empty = not measured
    assert list(v["junior_ce"]["b"]) == [0.1 + i / 3 for i in (1, 2, 3)]  # repr: the exact float back
    assert v["kl_mean"]["b"][0] == 1e-17 and res.steps[("best", "grpo", 0)] == 300


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("seed,arm", "seed,arms", 1), "header must be"),
    (lambda t: t.replace("\n0,grpo,", "\n1,grpo,", 1), "in the file of seed 0 arm grpo"),
    (lambda t: t.replace(",8,3,", ",8,9,", 1), "outside 0..8"),
    (lambda t: t.replace(",final,", ",last,", 1), "neither final nor best"),
    (lambda t: t + t.splitlines()[1] + "\n", "appears twice"),
    (lambda t: t.replace(",8,3,", ",4,3,", 1), "same number of samples"),
])
def test_a_bad_file_is_refused_with_its_line(tmp_path, edit, message):
    rows = [{"seed": 0, "arm": "grpo", "checkpoint": "final", "step": 6, "benchmark": "b", "id": f"p{i}",
             "n_samples": 8, "solo_correct": 3, "step_correct": 3} for i in range(3)]
    f = tmp_path / "seed-0" / "grpo.csv"
    claims.write_arm_csv(f, rows)
    f.write_text(edit(f.read_text()))
    with pytest.raises(BadInputError, match=message):
        claims.read_results(tmp_path, [1])


def test_an_unknown_arm_file_and_an_empty_folder_are_refused(tmp_path):
    with pytest.raises(BadInputError, match="no seed-<S>"):
        claims.read_results(tmp_path, [1])
    (tmp_path / "seed-0").mkdir()
    (tmp_path / "seed-0" / "ppo.csv").write_text(",".join(claims.COLUMNS) + "\n")
    with pytest.raises(BadInputError, match="no arm of the study"):
        claims.read_results(tmp_path, [1])


def test_verdicts_follow_the_known_effects(study):
    _, doc = study
    rows = {r["id"]: r for r in doc["claims"]}
    assert list(rows) == ["C1", "C2", "C3", "C4a", "C4b", "A1", "A2"]
    got = {k: r["verdict"] for k, r in rows.items()}
    assert got == {"C1": "holds", "C2": "does not hold", "C3": "holds", "C4a": "inconclusive", "C4b": "holds",
                   "A1": "holds", "A2": "does not hold"}, {k: (r["estimate"], r["ci"], r["p_holm"]) for k, r in rows.items()}
    for r in rows.values():
        assert r["ci"][0] <= r["estimate"] <= r["ci"][1] and r["seeds"] == list(SEEDS) and r["complete"]
        assert r["p_holm"] >= r["p_one_sided"]
        assert (r["excludes"] is None) == (r["verdict"] == "holds")
    assert rows["C2"]["excludes"].startswith("any step pass@1 gain of tandem over grpo is excluded")
    assert rows["C3"]["sesoi"]["threshold"] == pytest.approx(-0.2 * rows["C3"]["arms"]["grpo"]["estimate"])
    k = rows["C1"]["kept_share"]
    assert k["estimate"] == pytest.approx(1.0, abs=0.15) and k["gain_b_excludes_0"]
    assert doc["summary"]["holds"] == ["C1", "C3", "C4b", "A1"]
    # junior CE: the seeds disagree far more than the problems, so the seed t-interval is the wider one
    c4a = rows["C4a"]
    assert (c4a["seed_t"][1] - c4a["seed_t"][0]) > (c4a["ci"][1] - c4a["ci"][0])
    assert doc["positive_control"]["detected"] is True and len(doc["positive_control"]["checks"]) == 4


def test_secondary_rows_and_the_arm_tables(study):
    _, doc = study
    sec = {r["id"]: r for r in doc["secondary"]}
    assert list(sec) == ["C1 solo/pass@8", "C2 step/pass@8", "C3 common/kl_mean", "C4b common/overlap",
                         "A1 common/kl_mean", "C1 at best_by_validation", "C2 at best_by_validation"]
    assert all(r["p_holm"] is None and r["family"] == "secondary" for r in sec.values())
    best, final = doc["arms"]["best_by_validation"], doc["arms"]["final"]
    # the best-by-validation checkpoint was made 0.02 better in the fixture; the base repeats its one checkpoint
    assert best["grpo"]["solo/pass@1"]["estimate"] > final["grpo"]["solo/pass@1"]["estimate"]
    assert best["base"]["solo/pass@1"] == final["base"]["solo/pass@1"]
    assert sec["C2 at best_by_validation"]["arms"]["tandem"]["estimate"] == \
        pytest.approx(best["tandem"]["step/pass@1"]["estimate"])
    assert doc["steps"]["best_by_validation"]["grpo"] == {str(s): 300 for s in SEEDS}
    assert set(final) == set(claims.ARMS) and "compact_share" in final["control"]
    assert {f"{m}/pass@{k}" for m in ("solo", "step") for k in (1, 2, 4, 8)} <= set(final["tandem"])
    keys = {frozenset(r) for r in doc["claims"] + doc["secondary"]}
    assert len(keys) == 1  # one schema for every row


def test_partial_results_are_marked_and_say_what_is_missing(tmp_path):
    write_fake_results(tmp_path / "results", seeds=(0, 1, 2), arms=("base", "tandem", "grpo"), levels=LEVELS,
                       benchmarks={"arith-short": 20, "arith-long": 20})
    (tmp_path / "results" / "seed-2" / "grpo.csv").unlink()
    doc = claims.compute(claims.read_results(tmp_path / "results", [1, 2, 4, 8]),
                         claims.load_registration(_registration(tmp_path, seeds=(0, 1, 2))))
    rows = {r["id"]: r for r in doc["claims"]}
    assert rows["A1"]["verdict"] == rows["A2"]["verdict"] == "not measured"
    assert any("kl_reg" in m for m in rows["A1"]["missing"]) and rows["A1"]["p_holm"] is None
    assert rows["C2"]["seeds"] == [0, 1] and not rows["C2"]["complete"] and rows["C2"]["missing"] == ["seed 2"]
    assert doc["data"]["complete"] is False and "seed-2/grpo.csv" in doc["data"]["missing"]
    assert "seed-0/kl_reg.csv" in doc["data"]["missing"] and doc["positive_control"]["detected"] is None
    # the unmeasured rows stay in Holm's family with p = 1: the smallest p is still multiplied by all seven
    smallest = min((r for r in rows.values() if r["p_one_sided"] is not None), key=lambda r: r["p_one_sided"])
    assert smallest["p_holm"] == pytest.approx(min(1.0, 7 * smallest["p_one_sided"]))
    assert "partial" in claims.summary(doc)


def test_the_same_csvs_give_the_same_bytes(study, tmp_path):
    out, _ = study
    shutil.copytree(out / "results", tmp_path / "results")
    shutil.copy(out / "registration.yaml", tmp_path / "registration.yaml")
    claims.recompute(tmp_path)
    for name in ("claims.json", "report.md", "report.html", "figures/study-claims.png"):
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes(), name
    text = (out / "claims.json").read_text()
    assert "NaN" not in text and json.loads(text)["format"] == claims.FORMAT


def test_recompute_from_the_csvs_and_the_registration_alone(tmp_path):
    # a folder holding nothing but results/ and the registration as committed: no params, models or seed roots
    write_fake_results(tmp_path / "results", seeds=(0, 1, 2, 3, 4),
                       benchmarks={"arith-short": 10, "arith-mid": 10, "arith-long": 10})
    shutil.copy(ROOT / "studies" / "registration.yaml", tmp_path / "registration.yaml")
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    outputs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-m", "cli", "study", "--recompute", "--out", str(tmp_path)],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "claims over seeds 0, 1, 2, 3, 4 (complete)" in r.stdout and "positive control" in r.stdout
        outputs.append({p: (tmp_path / p).read_bytes() for p in ("claims.json", "report.md", "report.html")})
    assert outputs[0] == outputs[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["claims.json", "figures", "registration.yaml",
                                                          "report.html", "report.md", "results"]
    doc = json.loads(outputs[0]["claims.json"])
    assert doc["statistics"]["n_boot"] == 4000 and doc["data"]["complete"]


def test_an_unregistered_seed_is_refused(tmp_path):
    write_fake_results(tmp_path / "results", seeds=(0, 7), arms=("base",), benchmarks={"arith-short": 4})
    with pytest.raises(BadInputError, match=r"seed\(s\) \[7\]"):
        claims.recompute(tmp_path, _registration(tmp_path, seeds=(0, 1)))


def test_recompute_names_a_missing_registration(tmp_path):
    with pytest.raises(BadInputError, match="registration"):
        claims.recompute(tmp_path)


def test_recompute_refuses_a_registered_study_without_results(tmp_path):
    _registration(tmp_path)
    with pytest.raises(BadInputError, match=r"no results to compute claims from: no seed x arm has finished yet"):
        claims.recompute(tmp_path)
    assert not (tmp_path / "claims.json").exists()
