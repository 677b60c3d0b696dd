"""Params: typed frozen sections, unknown keys, wrong types and impossible values all reported at once."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem.config import SECTIONS, ParamsError, Params, params_from_dict

REPO = Path(__file__).resolve().parents[1]


def test_repo_params_file_is_valid():
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    p = params_from_dict(raw)
    assert isinstance(p, Params)
    assert set(raw) - {"seed", "out_root", "preset", "presets"} == set(SECTIONS)


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
    ("rollout", "top_p", 0.0, "(0, 1]"),
    ("train", "arms", ["tandem", "nope"], "drawn from"),
])
def test_impossible_values(section, key, value, rule):
    with pytest.raises(ParamsError) as e:
        params_from_dict({section: {key: value}})
    assert f"{section}.{key}" in str(e.value) and rule in str(e.value)


def test_bool_is_not_an_int_and_int_is_a_float():
    with pytest.raises(ParamsError, match="train.steps"):
        params_from_dict({"train": {"steps": True}})
    assert params_from_dict({"train": {"learning_rate": 1}}).train.learning_rate == 1.0


def test_preset_overrides_and_restrictions():
    raw = {"preset": "study", "presets": {"study": {"train": {"steps": 300}}}}
    assert params_from_dict(raw).train.steps == 300
    with pytest.raises(ParamsError, match="unknown preset"):
        params_from_dict({"preset": "nope"})
    with pytest.raises(ParamsError, match="may only override"):
        params_from_dict({"presets": {"x": {"data": {"n_train": 3}}}})


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


def test_stage_rejects_bad_params_before_any_work(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"out_root: {tmp_path}\ntrain:\n  group_size: 1\n")
    out = subprocess.run([sys.executable, "-m", "cli", "stage", "prepare", "--params", str(bad)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and "train.group_size" in out.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "metrics").exists()
