"""scripts/study.py: per-seed roots share the base and data; the summary judges gains against seed noise."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _study():
    spec = importlib.util.spec_from_file_location("study_script", ROOT / "scripts" / "study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _summary(base, last, best=None):
    return {"val_accuracy_initial": base, "val_accuracy_last": last, "val_accuracy_best": best or last,
            "reward_first": 0.1, "reward_last": 0.2, "steps": 3, "step_seconds": 1.0}


def test_gain_must_exceed_seed_spread_and_binomial_error():
    study = _study()
    clear = {("grpo", 0): _summary(0.50, 0.62), ("grpo", 1): _summary(0.50, 0.60)}
    summary, table = study.tabulate(clear, n_val=200)
    arm = summary["arms"]["grpo"]
    assert arm["gain_mean"] == pytest.approx(0.11)
    assert arm["binomial_se"] == pytest.approx((0.25 / 200) ** 0.5)
    assert arm["gain_exceeds_noise"] is True
    assert "| grpo | 0 | 0.500 | 0.620 |" in table

    # same mean gain, but one seed lost accuracy: not a result
    mixed = {("grpo", 0): _summary(0.50, 0.73), ("grpo", 1): _summary(0.50, 0.49)}
    assert study.tabulate(mixed, n_val=200)[0]["arms"]["grpo"]["gain_exceeds_noise"] is False
    # a gain smaller than one binomial standard error of a 200-problem measurement is noise
    tiny = {("grpo", 0): _summary(0.50, 0.52), ("grpo", 1): _summary(0.50, 0.52)}
    assert study.tabulate(tiny, n_val=200)[0]["arms"]["grpo"]["gain_exceeds_noise"] is False


def test_prepare_root_links_base_and_data_and_sets_preset_seed(tmp_path):
    study = _study()
    main = tmp_path / "main"
    (main / "data" / "prepared").mkdir(parents=True)
    (main / "models" / "base").mkdir(parents=True)
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    params = main / "params.yaml"
    params.write_text(yaml.safe_dump(raw))
    root = study.prepare_root(params, tmp_path / "studies", 3, ["train.steps=7", "rollout.batch_size=16"])
    got = yaml.safe_load((root / "params.yaml").read_text())
    assert got["preset"] == "study" and got["seed"] == 3 and got["out_root"] == str(root)
    assert got["presets"]["study"]["train"]["steps"] == 7
    assert got["presets"]["study"]["rollout"]["batch_size"] == 16
    assert (root / "models" / "base").resolve() == (main / "models" / "base").resolve()
    assert (root / "data" / "prepared").resolve() == (main / "data" / "prepared").resolve()
    from tandem.config import params_from_dict

    p = params_from_dict(got)
    assert p.train.steps == 7 and p.seed == 3


def test_prepare_root_explains_a_missing_base(tmp_path):
    study = _study()
    params = tmp_path / "params.yaml"
    params.write_text((ROOT / "params.yaml").read_text())
    with pytest.raises(SystemExit, match="dvc repro base"):
        study.prepare_root(params, tmp_path / "studies", 0, [])
