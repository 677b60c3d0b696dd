"""tasks/study/pilot.py and tandem/study/pilot.py: the room rules and the beta choice on hand-made measures, the study file derived from a
variant's file, and (slow) the registered pilot end to end on the tiny test settings: one variant, one KL-Reg
candidate, a decision, result files and the generated study file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tandem.errors import BadInputError
from tandem.study import pilot as rules
from tasks.study import pilot
from tests.params_files import complete_params

ROOT = Path(__file__).resolve().parents[2]


def test_beta_closest_to_half_of_grpo_on_a_log_scale():
    # GRPO's KL 0.2: the target is 0.1; 0.06 is 0.6x, 0.14 is 1.4x -> 0.14 is closer on a log scale
    beta, ratio = rules.choose_beta(0.2, {0.05: 0.14, 0.2: 0.06})
    assert beta == 0.05 and ratio == pytest.approx(1.4)
    beta, _ = rules.choose_beta(0.2, {0.05: 0.19, 0.2: 0.09})
    assert beta == 0.2
    with pytest.raises(BadInputError, match="no drift"):
        rules.choose_beta(0.0, {0.05: 0.0})


def test_set_value_replaces_one_setting_and_keeps_the_rest():
    text = "seed: 0\ntrain:\n  steps: 600  # old\n  arms: [grpo]\nevaluate:\n  steps: 3\n"
    out = rules.set_value(text, "train.steps", "400", "chosen")
    assert out == "seed: 0\ntrain:\n  steps: 400  # chosen\n  arms: [grpo]\nevaluate:\n  steps: 3\n"
    with pytest.raises(BadInputError, match="not found"):
        rules.set_value(text, "train.nope", "1", "x")


def test_the_registered_study_file_is_the_variant_with_the_registered_changes_only():
    reg = pilot.load_registration()
    v1 = ROOT / reg.variants[0].params
    text = rules.study_file_text(v1, 400, 0.05, reg)
    got, raw = yaml.safe_load(text), yaml.safe_load(v1.read_text())
    assert got["train"]["arms"] == ["tandem", "grpo", "kl_reg"] and got["train"]["steps"] == 400
    assert got["train"]["kl_beta"] == 0.05 and got["train"]["save_every"] == 50
    assert got["evaluate"]["checkpoints"] == "final_and_best"
    for section in raw:
        if isinstance(raw[section], dict):
            changed = {k for k in raw[section] if raw[section][k] != got[section][k]}
            allowed = {"train": {"arms", "steps", "kl_beta", "save_every"}, "evaluate": {"checkpoints"}}
            assert changed <= allowed.get(section, set()), section
        else:
            assert raw[section] == got[section]


def _variant(tmp_path: Path, name: str, arms: list[str], beta: float) -> Path:
    raw = complete_params({"out_root": str(tmp_path / "tasks" / "a"),
                           "train": {"arms": arms, "steps": 4, "save_every": 2, "kl_beta": beta},
                           "evaluate": {"modes": ["solo", "step"], "checkpoints": "all"},
                           "analyze": {"reference_arm": arms[0]}})
    p = tmp_path / "pilot-files" / f"{name}.yaml"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(raw, sort_keys=False))
    return p


def _registration(tmp_path: Path, variants: list[dict], **pilot_keys) -> Path:
    reg = yaml.safe_load((ROOT / "studies" / "registration.yaml").read_text())
    reg["pilot"].update(variants=variants, **pilot_keys)
    path = tmp_path / "registration.yaml"
    path.write_text(yaml.safe_dump(reg, sort_keys=False))
    return path


def test_decision_order_kl_reg_choice_and_the_study_file(tmp_path, monkeypatch):
    """The rules on stand-in measures: V1 fails at both lengths, V2 passes at 600 (not 400), its KL-Reg candidates
    are trained then and the one nearest half of GRPO's KL is chosen; V3 is never trained."""
    files = {n: _variant(tmp_path, n, ["kl_reg" if "kl" in n else "grpo"], 0.05 if "0.05" in n else 0.2)
             for n in ("v1", "v2", "v3", "v1-kl0.05", "v1-kl0.2", "v2-kl0.05", "v2-kl0.2")}
    variants = [{"name": v.upper(), "params": str(files[v]),
                 "kl_reg": [str(files[f"{v}-kl0.05"]), str(files[f"{v}-kl0.2"])] if v != "v3" else []}
                for v in ("v1", "v2", "v3")]
    path = _registration(tmp_path, variants, lengths=[600, 400], first_batch=["V1", "V2", "V1/kl_reg"])
    trained: list[list[str]] = []
    monkeypatch.setattr(pilot, "run_units",
                        lambda units, jobs, log, skip=None: trained.append([u.name for u in units
                                                                             if skip is None or not skip(u)]))
    monkeypatch.setattr(pilot, "_complete", lambda u: True)

    def fake_room(root, arm, step, criteria):
        ok = "/v2/" in str(root) and step == 600
        return {"step": step, "values": {"kl_to_base": 0.3}, "passed": dict.fromkeys(rules.CRITERIA, ok), "room": ok}

    monkeypatch.setattr(pilot, "room", fake_room)
    monkeypatch.setattr(pilot, "kl_at", lambda root, arm, step: 0.2 if "kl0.05" in str(root) else 0.12)
    monkeypatch.setattr(pilot, "result_markdown", lambda doc: "stand-in")
    doc = pilot.run(path, jobs=2, log=lambda *_: None)
    assert trained[0] == ["v1", "v2"]  # the registered first batch, minus V1's KL-Reg once V1 has failed
    assert trained[-1] == ["v2-kl0.05", "v2-kl0.2"] and not any("v3" in n for b in trained for n in b)
    assert [r["step"] for r in doc["variants"]["V1"]["lengths"]] == [400, 600]  # shortest first
    assert doc["chosen"]["variant"] == "V2" and doc["chosen"]["steps"] == 600 and "V3" not in doc["variants"]
    k = doc["chosen"]["kl_reg"]
    assert k["target"] == pytest.approx(0.15) and k["beta"] == 0.2  # 0.12 is nearer 0.15 than 0.2 on a log scale
    study = yaml.safe_load((tmp_path / "study.yaml").read_text())
    assert study["train"]["steps"] == 600 and study["train"]["kl_beta"] == 0.2
    assert study["train"]["arms"] == ["tandem", "grpo", "kl_reg"]
    # once written the study file is frozen: another decision does not rewrite it
    (tmp_path / "study.yaml").write_text("frozen")
    pilot.run(path, jobs=2, log=lambda *_: None)
    assert (tmp_path / "study.yaml").read_text() == "frozen"
    assert json.loads((tmp_path / "pilot" / "result.json").read_text())["chosen"]["variant"] == "V2"


@pytest.mark.slow
def test_pilot_end_to_end_measures_room_and_reports_no_room(tmp_path):
    """The real runs on the tiny test settings (GRPO of one variant, two lengths): training, evaluation,
    analysis and the room measures from their files; a criterion no run can meet gives "no room"."""
    v = _variant(tmp_path, "v1", ["grpo"], 0.001)
    path = _registration(tmp_path, [{"name": "V1", "params": str(v), "kl_reg": []}], lengths=[2, 4],
                         first_batch=["V1"], jobs=1,
                         criteria={"R1_solo_gain": 2.0, "R2_kl": 0.0, "R2_junior_ce_ratio": 0.0,
                                   "R3_handoff_cost": -1.0, "R4_zero_variance": 1.0})
    doc = pilot.run(path, log=lambda *_: None)
    rows = doc["variants"]["V1"]["lengths"]
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        assert set(r["values"]) >= {"solo_gain", "kl_to_base", "junior_ce_ratio", "handoff_cost",
                                    "zero_variance_groups"}
        assert 0.0 <= r["values"]["zero_variance_groups"] <= 1.0 and r["values"]["kl_to_base"] >= 0.0
        assert r["passed"]["R1"] is False and r["passed"]["R4"] is True and not r["room"]
    assert doc["chosen"] is None and doc["verdict"].startswith("no room") and not (tmp_path / "study.yaml").exists()
    assert json.loads((tmp_path / "pilot" / "result.json").read_text()) == json.loads(json.dumps(doc))
    assert "Verdict: no room" in (tmp_path / "pilot" / "result.md").read_text()
    assert [u["state"] for u in pilot.status(path)] == ["analyzed"]


def test_every_registered_params_file_loads_strictly():
    """The committed pilot and study files are records of runs: they must stay complete and valid."""
    from tasks.common import load_params

    reg = pilot.load_registration()
    files = [v.params for v in reg.variants] + [k for v in reg.variants for k in v.kl_reg]
    for f in files + ([str(ROOT / "studies" / "study.yaml")] if (ROOT / "studies" / "study.yaml").exists() else []):
        p = load_params(ROOT / f)
        assert p.train.max_new_tokens == 88 and p.evaluate.n_samples == 8, f
