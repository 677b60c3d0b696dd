"""The SmolLM2 jargon control's registration (studies/jargon-smollm2) read by the control's driver on tiny
stand-ins: its fields load, the gate's per-dialect params are the registered ones (the dialect phase on for S with
the dialect's styles, J from the warm-up), an unknown field is refused, a model other than the gated one is refused,
the any-line annotation count reaches the results, and the rollout dialect series names the new styles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tandem.errors import BadInputError
from tandem.study import registration as R

ROOT = Path(__file__).resolve().parents[2]
JARGON = ROOT / "studies" / "jargon-smollm2"


def _copy(tmp_path: Path, **changes) -> Path:
    raw = yaml.safe_load((JARGON / "registration.yaml").read_text())
    raw["params"] = str(ROOT / raw["params"])
    raw.update(changes)
    (tmp_path / "registration.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return tmp_path


def test_the_jargon_registration_loads():
    reg = R.load(JARGON, ROOT)
    assert isinstance(reg, R.ControlRegistration) and reg.setting == "smollm2-jargon"
    assert reg.senior.build == "dialect_phase" and reg.senior.seed == 0
    assert reg.junior.sections["junior"]["source"] == "warmup"
    assert reg.setting_indicators == {"H_grpo_keeps": 0.5}
    assert [d.name for d in reg.dialects] == ["annotated", "reversed"]
    assert "S7" in [s.id for s in reg.secondary] and "annotated_anywhere" in reg.gate.reported
    assert reg.seeds == (0, 1, 2) and reg.steps == 100 and reg.evaluation["checkpoints"] == [0, 50, 100]
    # the toy keeps its build (the styles are the warm-up's) and its tiny junior
    toy = R.load(ROOT / "studies" / "junior-control", ROOT)
    assert toy.senior.build == "styles" and toy.junior.sections["junior"]["source"] == "tiny"
    assert toy.setting_indicators == {}


@pytest.mark.parametrize("dialect", ["annotated", "reversed"])
def test_the_gate_params_of_each_dialect_are_the_registered_ones(tmp_path, dialect):
    from tasks.study import control as ctl

    reg = ctl.registration(_copy(tmp_path))
    d = reg.dialect(dialect)
    raw = yaml.safe_load(ctl.dialect_params(reg, d).read_text())
    base = yaml.safe_load((JARGON / "params.yaml").read_text())
    assert raw["model"]["dialect_styles"] == {dialect: 0.60, "verbose": 0.28, "terse": 0.12}
    assert raw["model"]["dialect_steps"] == 16 and raw["model"]["sft_steps"] == 12
    assert raw["data"]["solution_styles"] == {"verbose": 0.70, "terse": 0.30} == base["data"]["solution_styles"]
    assert raw["junior"]["source"] == "warmup" and raw["seed"] == 0
    assert raw["out_root"] == str((tmp_path / "work" / dialect).resolve())
    # a run of seed 2 keeps the warm-up junior (tandem-self: the base), and the registered decoding and length
    from tandem.study.params import derive, run_changes

    for arm, source in (("grpo", "warmup"), ("tandem-naive", "warmup"), ("tandem-self", "base")):
        run = derive(raw, *run_changes(reg, 2, arm, "/r"))
        assert run["seed"] == 2 and run["junior"]["source"] == source
        assert run["train"]["steps"] == 100 and run["train"]["save_every"] == 50
        assert run["train"]["temperature"] == 0.5 and run["evaluate"]["temperature"] == 0.5


def test_an_unknown_field_or_build_is_refused_in_one_line(tmp_path):
    with pytest.raises(BadInputError) as e:
        R.load(_copy(tmp_path, junior_source="warmup"), ROOT)
    assert "\n" not in str(e.value) and "unknown fields ['junior_source']" in str(e.value)
    with pytest.raises(BadInputError, match="senior.build: 'phase'"):
        R.load(_copy(tmp_path, senior={"seed": 0, "build": "phase"}), ROOT)
    with pytest.raises(BadInputError, match="setting_indicators"):
        R.load(_copy(tmp_path, setting_indicators={"H_other": 1}), ROOT)


def _models(root, s=b"S", j=b"J"):
    for sub, data in (("base", s), ("junior", j)):
        (root / "models" / sub).mkdir(parents=True, exist_ok=True)
        (root / "models" / sub / "model.safetensors").write_bytes(data * 64)


def _gated(tmp_path, gated: dict, amendment: bool) -> "R.ControlRegistration":
    """A copy of setting 2 whose gate.json records `gated` as reversed-long's hashes, with or without its rebuild
    amendment."""
    import json
    import shutil

    src = ROOT / "studies" / "jargon-smollm2" / "setting-2"
    d = tmp_path / "studies" / "jargon-smollm2" / "setting-2"
    d.mkdir(parents=True)
    for name in ("registration.yaml", "params.yaml") + (("amendments.yaml",) if amendment else ()):
        shutil.copy(src / name, d / name)
    doc = json.loads((src / "gate.json").read_text())
    doc["dialects"][-1]["hashes"] = dict(gated)
    (d / "gate.json").write_text(json.dumps(doc))
    return R.load(d, ROOT)


def test_a_model_other_than_the_gated_one_trains_only_as_a_gated_rebuild(tmp_path):
    from tasks.study import control as ctl

    root = tmp_path / "work"
    _models(root)
    gated = ctl.build_of(root)
    reg = _gated(tmp_path, gated, amendment=False)
    assert ctl.accepted_build(reg, "reversed-long", gated)["gate"].endswith("setting-2/gate.json")
    _models(root, j=b"X")
    other = ctl.build_of(root)
    with pytest.raises(BadInputError) as e:
        ctl.accepted_build(reg, "reversed-long", other)
    assert "\n" not in str(e.value) and "not the gated build" in str(e.value) and "amendment" in str(e.value)
    reg = _gated(tmp_path / "b", gated, amendment=True)
    with pytest.raises(BadInputError, match="gate --rebuild"):
        ctl.accepted_build(reg, "reversed-long", other)
    f = ctl.rebuild_dir(reg, other) / "gate.json"
    f.parent.mkdir(parents=True)
    f.write_text('{"passed": false}')
    with pytest.raises(BadInputError, match="failed their own gate"):
        ctl.accepted_build(reg, "reversed-long", other)
    f.write_text('{"passed": true}')
    assert ctl.accepted_build(reg, "reversed-long", other) == {**other, "gate": ctl.rel(f)}


def test_a_run_refuses_to_resume_on_another_build(tmp_path):
    from tasks.study import control as ctl

    f = tmp_path / "run" / "build.json"
    ctl.keep_build(f, {"S": "a" * 64, "J": "b" * 64, "gate": "g"})
    ctl.keep_build(f, {"S": "a" * 64, "J": "b" * 64, "gate": "g"})
    with pytest.raises(BadInputError, match="start that run over"):
        ctl.keep_build(f, {"S": "c" * 64, "J": "b" * 64, "gate": "h"})


def test_amendments_are_read_and_checked(tmp_path):
    reg = R.load(ROOT / "studies" / "jargon-smollm2" / "setting-2", ROOT)
    assert reg.amended("rebuild").id == "A1" and "seed 2 grpo" in reg.amended("rebuild").governs
    assert R.load(ROOT / "studies" / "jargon-smollm2", ROOT).amendments == ()
    d = _gated(tmp_path, {"S": "s", "J": "j"}, amendment=True).dir
    (d / "amendments.yaml").write_text("amendments:\n  - {id: A1, kind: retrain, reason: r, governs: [], rule: r}\n")
    with pytest.raises(BadInputError, match="kind: 'retrain' is none of rebuild"):
        R.load(d, ROOT)


def test_large_models_stay_in_the_ignored_work_root(tmp_path, monkeypatch):
    from tasks.study import control as ctl

    reg = ctl.registration(_copy(tmp_path))
    src = ctl.work_root(reg, "annotated") / "models"
    for sub in ("base", "junior"):
        (src / sub).mkdir(parents=True)
        (src / sub / "model.safetensors").write_bytes(b"w" * 1000)
    monkeypatch.setattr(ctl, "KEEP_MAX_BYTES", 1500)
    assert ctl.keep_models(reg, "annotated") == src and not ctl.models_dir(reg, "annotated").exists()
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "/studies/jargon-smollm2/work/" in ignored


def test_the_any_line_annotation_count_reaches_the_results(tmp_path):
    from tandem.data.synthetic import solution_style
    from tandem.study.results import read_control_results
    from tasks.study.control import _problems

    recs = [{"id": 1, "score": 1.0, "text": "First, 4 + 2 = <<4+2=6>>6\n\\boxed{6}"},
            {"id": 1, "score": 0.0, "text": "First, 4 + 2 = 6\nThen, 6 + 1 = <<6+1=7>>7"},
            {"id": 1, "score": 0.0, "text": "First: 4 + 2 = 6"}]
    assert _problems(recs, "annotated", solution_style) == {"1": [3, 1, 1, 2]}
    assert _problems(recs, "reversed", solution_style) == {"1": [3, 1, 0]}
    counts = {"solo": {"arith": {"1": [3, 1, 1, 2]}}, "step": {"arith": {"1": [3, 0, 1, 1]}}}
    doc = {"seed": 0, "arm": "grpo", "evaluation": {"checkpoints": {"0": counts}}, "analysis": {}}
    (tmp_path / "seed-0").mkdir()
    (tmp_path / "seed-0" / "grpo.json").write_text(json.dumps(doc))
    res = read_control_results(tmp_path, [1])
    vals = res.values[("0", "grpo", 0)]
    assert vals["annotated_anywhere"]["arith"].tolist() == pytest.approx([2 / 3])
    assert vals["dialect_share"]["arith"].tolist() == pytest.approx([1 / 3])


def test_the_setting_indicator_h():
    from tandem.study.control import setting_indicators

    keeps = setting_indicators({"grpo": {"mean": [0.6, 0.5, 0.4]}}, {"H_grpo_keeps": 0.5})
    sheds = setting_indicators({"grpo": {"mean": [0.6, 0.4, 0.2]}}, {"H_grpo_keeps": 0.5})
    assert keeps["H"]["fired"] is False and sheds["H"]["fired"] is True
    assert setting_indicators({}, {"H_grpo_keeps": 0.5})["H"]["fired"] is None


def test_the_rollout_dialect_series_names_the_new_styles():
    """tandem/train/rollout.py logs `style/<name>` for every SOLUTION_STYLES name via solution_style."""
    from tandem.config import SOLUTION_STYLES
    from tandem.data.synthetic import solution_style

    assert {"annotated", "reversed"} <= set(SOLUTION_STYLES)
    assert solution_style("First, 4 + 2 = <<4+2=6>>6\n\\boxed{6}") == "annotated"
    assert solution_style("First; 40 + 20 = 60\n\\boxed{6}") == "reversed"
    assert solution_style("First, 4 + 2 = 6") == "verbose"


def test_the_gate_page_names_the_setting_and_the_jargon_extras():
    from tandem.study.control import gate_markdown

    doc = json.loads((ROOT / "studies" / "junior-control" / "gate.json").read_text())
    plain = gate_markdown(doc)
    assert plain.startswith("# The gate of the junior positive control\n") and "annotation on any line" not in plain
    d = doc["dialects"][-1]
    d["junior_metrics"] = {**d["junior_metrics"], "matches_base_warmup": True}
    for k in d["measures"]:
        d["measures"][k]["annotated_anywhere"] = 0.25
    page = gate_markdown({**doc, "setting": "smollm2-jargon"})
    assert page.startswith("# The gate of the junior positive control, setting smollm2-jargon\n")
    assert "matches_base_warmup): True" in page and "S_solo 0.250" in page


def test_b2_reads_a_warmup_junior_s_equality_to_the_senior_s_warm_up():
    from tandem.study.control import bug_indicators

    reg = R.load(JARGON, ROOT).bug_indicators
    base = {"junior_hashes_equal": True, "junior_unchanged": True}
    assert "matches_base_warmup" not in bug_indicators(base, reg)["B2"]["value"]
    assert bug_indicators({**base, "junior_matches_warmup": True}, reg)["B2"]["fired"] is False
    assert bug_indicators({**base, "junior_matches_warmup": False}, reg)["B2"]["fired"] is True


def test_the_committed_gate_pages_render_unchanged():
    """The first settings' gate pages are what gate_markdown makes of their gate.json (pooled estimator)."""
    from tandem.study.control import gate_markdown

    for rel in ("studies/junior-control", "studies/jargon-smollm2"):
        doc = json.loads((ROOT / rel / "gate.json").read_text())
        assert gate_markdown(doc) == (ROOT / rel / "gate.md").read_text(), rel


def test_a_dialect_may_name_its_style_and_its_own_build(tmp_path):
    from tasks.study import control as ctl

    raw = yaml.safe_load((JARGON / "registration.yaml").read_text())
    crit = {**raw["gate"]["criteria"], "G1_keyed_share_min": 0.1, "estimator": "paired_problems", "min_problems": 20}
    dialects = [{"name": "reversed", "senior_styles": {"reversed": 0.6, "verbose": 0.28, "terse": 0.12}},
                {"name": "reversed-long", "style": "reversed", "params": {"model": {"dialect_steps": 48}},
                 "senior_styles": {"reversed": 0.5, "verbose": 0.35, "terse": 0.15}}]
    reg = ctl.registration(_copy(tmp_path, dialects=dialects, gate={**raw["gate"], "criteria": crit}))
    long = reg.dialect("reversed-long")
    assert long.style == "reversed" and reg.dialect("reversed").style == "reversed"
    f = yaml.safe_load(ctl.dialect_params(reg, long).read_text())
    assert f["model"]["dialect_steps"] == 48 and f["model"]["dialect_styles"] == dialects[1]["senior_styles"]
    assert f["out_root"] == str((tmp_path / "work" / "reversed-long").resolve())
    short = yaml.safe_load(ctl.dialect_params(reg, reg.dialect("reversed")).read_text())
    assert short["model"]["dialect_steps"] == 16
    from tandem.study.control import GateCriteria

    c = GateCriteria.from_dict(reg.gate.criteria)
    assert c.estimator == "paired_problems" and c.min_problems == 20 and c.keyed_share_min == 0.1


@pytest.mark.parametrize("change,message", [
    ({"dialects": [{"name": "x", "style": "annotated", "senior_styles": {"reversed": 0.6, "verbose": 0.4}}]},
     "style \\(one of its senior styles\\)"),
    ({"dialects": [{"name": "r", "senior_styles": {"reversed": 1.0}}, {"name": "r", "senior_styles": {"reversed": 1.0}}]},
     "names must differ"),
    ({"gate": {"n_samples": 8, "criteria": {"G1_share": [0.5, 0.9], "G2_solo_pass1_min": 0.25, "G3_cost_max": -0.15,
                                           "G4_solo_gap_abs_max": 0.1, "estimator": "median"}}}, "estimator"),
    ({"gate": {"n_samples": 8, "criteria": {"G1_share": [0.5, 0.9], "G2_solo_pass1_min": 0.25, "G3_cost_max": -0.15,
                                           "G4_solo_gap_abs_max": 0.1, "G9": 1}}}, "unknown \\['G9'\\]"),
])
def test_a_bad_dialect_or_criterion_is_refused(tmp_path, change, message):
    with pytest.raises(BadInputError, match=message):
        R.load(_copy(tmp_path, **change), ROOT)


SETTING_2 = JARGON / "setting-2"


def test_setting_2_loads_with_its_own_gate_and_builds_each_jargon_as_registered(tmp_path):
    """studies/jargon-smollm2/setting-2: a gate of its own (no gate_from), the paired estimator, reversed on values
    0-9 first and reversed-long (48-step phase) second; setting 1's rules untouched."""
    from tandem.study.control import GateCriteria
    from tasks.study import control as ctl

    reg = R.load(SETTING_2, ROOT)
    assert reg.gate_from is None and reg.gated is reg and reg.setting == "smollm2-jargon-2"
    assert [(d.name, d.style) for d in reg.dialects] == [("reversed", "reversed"), ("reversed-long", "reversed")]
    c = GateCriteria.from_dict(reg.gate.criteria)
    assert (c.estimator, c.min_problems, c.keyed_share_min, c.cost_max, c.solo_gap_abs_max) == (
        "paired_problems", 20, 0.10, -0.15, 0.10)
    assert [x.id for x in reg.claims] == ["J1", "J2", "H1", "L1"] and len(reg.seeds) >= 3 and reg.steps == 100
    first = R.load(JARGON, ROOT)
    assert GateCriteria.from_dict(first.gate.criteria).estimator == "pooled"
    assert [d.name for d in first.dialects] == ["annotated", "reversed"]
    # each jargon's gate params, in a copy (the driver writes them under the registration's work root)
    raw = yaml.safe_load((SETTING_2 / "registration.yaml").read_text())
    raw["params"] = str(ROOT / raw["params"])
    (tmp_path / "registration.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    copy = ctl.registration(tmp_path)
    base = yaml.safe_load((JARGON / "params.yaml").read_text())
    for name, steps, styles in (("reversed", 16, {"reversed": 0.60, "verbose": 0.28, "terse": 0.12}),
                                ("reversed-long", 48, {"reversed": 0.50, "verbose": 0.35, "terse": 0.15})):
        f = yaml.safe_load(ctl.dialect_params(copy, copy.dialect(name)).read_text())
        assert f["data"]["max_value"] == 9 and f["model"]["dialect_steps"] == steps
        assert f["model"]["dialect_styles"] == styles and f["junior"]["source"] == "warmup"
        # everything else is setting 1's params file
        for section in ("train", "evaluate", "rollout"):
            assert f[section] == base[section], section
        assert {k: v for k, v in f["data"].items() if k != "max_value"} == {
            k: v for k, v in base["data"].items() if k != "max_value"}
    assert "/studies/jargon-smollm2/*/work/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_rebuild_gate_needs_the_amendment_and_a_build_other_than_the_gated_one(tmp_path, monkeypatch):
    from tasks.study import control as ctl

    gated = {"S": "a" * 64, "J": "b" * 64}
    with pytest.raises(BadInputError, match="registers no rebuild amendment"):
        ctl.gate_rebuild(_gated(tmp_path / "none", gated, amendment=False).dir)
    reg = _gated(tmp_path, gated, amendment=True)
    monkeypatch.setattr(ctl, "built", lambda r, d: (tmp_path / "work", gated))
    with pytest.raises(BadInputError, match="holds the gated build itself"):
        ctl.gate_rebuild(reg.dir)
    other = {"S": "c" * 64, "J": "b" * 64}
    monkeypatch.setattr(ctl, "built", lambda r, d: (tmp_path / "work", other))
    kept = ctl.rebuild_dir(reg, other) / "gate.json"
    kept.parent.mkdir(parents=True)
    kept.write_text('{"passed": true, "build": {}}')
    monkeypatch.setattr(ctl, "_measured", lambda *a: pytest.fail("a rebuild already gated is read back"))
    assert ctl.gate_rebuild(reg.dir)["passed"] is True
