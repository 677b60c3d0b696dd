"""Params: typed frozen sections, unknown keys, wrong types and impossible values all reported at once; every
shipped params file is complete (a file that leaves out a setting is refused, naming it)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem.config import SECTIONS, ParamsError, Params, params_from_dict, setting_keys

REPO = Path(__file__).resolve().parents[1]
# every params file shipped: the run files at the top level and the tiny pipeline of the tests and benchmarks
PARAMS_FILES = sorted(p.name for p in REPO.glob("params*.yaml")) + ["tests/flows/tiny_params.yaml"]


def _stated(raw: dict) -> set[str]:
    """Dotted keys a parsed params file states (a dict-valued setting such as data.benchmarks is one key)."""
    return {f"{k}.{f}" for k, v in raw.items() if isinstance(v, dict) for f in v} | \
        {k for k, v in raw.items() if not isinstance(v, dict)}


def test_shipped_params_files_are_complete_and_load_strictly():
    from tasks.common import load_params

    assert {"params.yaml", "params.study.yaml", "params.paper.yaml"} <= set(PARAMS_FILES)
    for name in PARAMS_FILES:
        p = load_params(REPO / name)  # strict: raises on any missing setting
        assert isinstance(p, Params)
        raw = yaml.safe_load((REPO / name).read_text())
        # check-params resolves no setting that the file does not state, and the file states nothing else
        assert _stated(raw) == set(setting_keys()), name


def test_study_file_is_the_default_run_with_other_train_and_evaluate_values():
    """The study reuses the default run's prepared data and base model (tandem study links them), so its
    data and model sections (and everything outside train/evaluate) must equal params.yaml's."""
    main = yaml.safe_load((REPO / "params.yaml").read_text())
    study = yaml.safe_load((REPO / "params.study.yaml").read_text())
    assert {k: v for k, v in study.items() if k not in ("train", "evaluate")} == \
        {k: v for k, v in main.items() if k not in ("train", "evaluate")}
    assert study["train"]["arms"] == main["train"]["arms"]
    assert study["train"]["steps"] > 10 * main["train"]["steps"]


def test_a_file_that_leaves_out_a_setting_is_refused_naming_each_key():
    full = yaml.safe_load((REPO / "params.yaml").read_text())
    raw = {**full, "train": {k: v for k, v in full["train"].items() if k not in ("max_grad_norm", "lr_schedule")}}
    del raw["analyze"]
    with pytest.raises(ParamsError) as e:
        params_from_dict(raw, strict=True)
    missing = [p for p in e.value.problems if "(missing)" in p]
    named = {p.split(":")[0] for p in missing}
    assert named == {"train.max_grad_norm", "train.lr_schedule"} | {f"analyze.{k}" for k in full["analyze"]}
    assert all("must state every setting" in p for p in missing)
    # lenient (configs built in code): the defaults fill the gap
    assert params_from_dict(raw).train.max_grad_norm == 1.0


def test_removed_keys_say_where_the_setting_went():
    with pytest.raises(ParamsError) as e:
        params_from_dict({"preset": "study", "rollout": {"temperature": 1.0, "cpu_threads": 1},
                          "evaluate": {"torch_threads": 1}})
    text = str(e.value)
    assert "--params" in text and "train.temperature" in text and "train.cpu_threads" in text
    assert "evaluate.cpu_threads" in text


def test_one_thread_setting_per_stage_section():
    """cpu_threads in each section whose stage does torch work, and no other thread setting anywhere."""
    have = {k for k in setting_keys() if "thread" in k.split(".")[-1]}
    assert have == {"model.cpu_threads", "train.cpu_threads", "evaluate.cpu_threads", "analyze.cpu_threads"}


def test_sections_are_frozen_and_documented():
    p = params_from_dict({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.train.steps = 3  # type: ignore[misc]
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"


def test_unknown_key_wrong_type_and_range_all_named():
    raw = {"data": {"n_trian": 5}, "train": {"steps": "ten"}, "rollout": {"p_senior": 1.5}}
    with pytest.raises(ParamsError) as e:
        params_from_dict(raw)
    text = str(e.value)
    assert "data.n_trian" in text and "unknown key" in text
    assert "train.steps" in text and "'ten'" in text and "wrong type" in text
    assert "rollout.p_senior" in text and "1.5" in text and "[0, 1]" in text
    assert len(e.value.problems) == 3


@pytest.mark.parametrize("section,key,value,rule", [
    ("train", "group_size", 1, "relative within a group"),
    ("data", "n_train", -3, ">= 0"),
    ("evaluate", "ks", [1, 16], "n_samples"),
    ("evaluate", "top_p", 0.0, "(0, 1]"),
    ("evaluate", "checkpoints", "last", "one of all, final"),
    ("train", "arms", ["tandem", "nope"], "drawn from"),
    ("data", "solution_styles", {"verbose": 0.7, "terse": 0.2}, "sum to 1"),
    ("data", "solution_styles", {"verbose": 0.5, "poetic": 0.5}, "unknown style"),
    ("data", "solution_styles", {"verbose": 1.5, "terse": -0.5}, ">= 0"),
])
def test_impossible_values(section, key, value, rule):
    with pytest.raises(ParamsError) as e:
        params_from_dict({section: {key: value}})
    assert f"{section}.{key}" in str(e.value) and rule in str(e.value)


def test_bool_is_not_an_int_and_int_is_a_float():
    with pytest.raises(ParamsError, match="train.steps"):
        params_from_dict({"train": {"steps": True}})
    assert params_from_dict({"train": {"learning_rate": 1}}).train.learning_rate == 1.0


def test_cli_check_params_exit_code_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  n_trian: 5\ntrain:\n  steps: ten\nrollout:\n  p_senior: 1.5\n")
    out = subprocess.run([sys.executable, "-m", "cli", "check-params", str(bad)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2
    for needle in ("data.n_trian", "train.steps", "rollout.p_senior"):
        assert needle in out.stderr
    ok = subprocess.run([sys.executable, "-m", "cli", "check-params", "params.yaml"],
                        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert ok.returncode == 0, ok.stderr
    full = yaml.safe_load((REPO / "params.yaml").read_text())
    del full["model"]["vocab_size"]
    bad.write_text(yaml.safe_dump(full))
    out = subprocess.run([sys.executable, "-m", "cli", "check-params", str(bad)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and "model.vocab_size: (missing)" in out.stderr


def test_stage_rejects_bad_params_before_any_work(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"out_root: {tmp_path}\ntrain:\n  group_size: 1\n")
    out = subprocess.run([sys.executable, "-m", "cli", "stage", "prepare", "--params", str(bad)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and "train.group_size" in out.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "metrics").exists()


def test_a_key_given_twice_is_refused(tmp_path):
    from tasks.common import load_params

    text = Path("params.yaml").read_text().replace("\ntrain:\n", "\ntrain:\n  steps: 3\n", 1)
    bad = tmp_path / "dup.yaml"
    bad.write_text(text)
    with pytest.raises(ParamsError, match="appears twice"):
        load_params(bad)
