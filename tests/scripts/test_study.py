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


def _scores(n_right: int, n: int = 200) -> list[float]:
    return [1.0] * n_right + [0.0] * (n - n_right)


def _run(greedy_right: int, sampled_right: int) -> dict:
    return {"greedy": _scores(greedy_right), "sampled": _scores(sampled_right)}


TRAIN = {"reward_first": 0.1, "reward_last": 0.2, "steps": 3, "step_seconds": 1.0}


def test_gain_must_exceed_seed_spread_and_paired_error():
    study = _study()
    base = _run(100, 60)
    clear = {("grpo", 0): _run(100, 90), ("grpo", 1): _run(102, 88)}
    summary, table = study.tabulate(base, clear, {k: TRAIN for k in clear})
    arm = summary["arms"]["grpo"]
    assert arm["sampled"]["gain_mean"] == pytest.approx(0.145)
    assert arm["sampled"]["gain_exceeds_noise"] is True
    assert arm["greedy"]["gain_exceeds_noise"] is False  # +0.005 is within noise
    # paired SE of "30 more problems right, none lost" against a naive formula
    d = [1.0] * 30 + [0.0] * 170
    mean = sum(d) / 200
    sd = (sum((x - mean) ** 2 for x in d) / 199) ** 0.5
    run0 = next(r for r in summary["runs"] if r["seed"] == 0)
    assert run0["sampled"]["paired_se"] == pytest.approx(sd / 200 ** 0.5)
    assert "| grpo | 0 | 0.500 -> 0.500 (+0.000) | 0.300 -> 0.450 (+0.150) |" in table

    # same mean gain, but one seed lost accuracy: not a result
    mixed = {("grpo", 0): _run(100, 120), ("grpo", 1): _run(100, 58)}
    assert study.tabulate(base, mixed, {})[0]["arms"]["grpo"]["sampled"]["gain_exceeds_noise"] is False
    # a gain below twice the paired standard error is noise
    tiny = {("grpo", 0): _run(100, 62), ("grpo", 1): _run(100, 62)}
    assert study.tabulate(base, tiny, {})[0]["arms"]["grpo"]["sampled"]["gain_exceeds_noise"] is False


def test_prepare_root_links_base_and_data_and_sets_seed_and_root(tmp_path):
    study = _study()
    main = tmp_path / "main"
    (main / "data" / "prepared").mkdir(parents=True)
    (main / "models" / "base").mkdir(parents=True)
    raw = yaml.safe_load((ROOT / "params.study.yaml").read_text())
    params = main / "params.study.yaml"
    params.write_text(yaml.safe_dump(raw))
    root = study.prepare_root(params, tmp_path / "studies", 3)
    got = yaml.safe_load((root / "params.yaml").read_text())
    assert got["seed"] == 3 and got["out_root"] == str(root)
    # everything else is the study file as written: the per-seed file is a complete record of its run
    assert {k: v for k, v in got.items() if k not in ("seed", "out_root")} == \
        {k: v for k, v in raw.items() if k not in ("seed", "out_root")}
    assert (root / "models" / "base").resolve() == (main / "models" / "base").resolve()
    assert (root / "data" / "prepared").resolve() == (main / "data" / "prepared").resolve()
    from tasks.common import load_params

    p = load_params(root / "params.yaml")
    assert p.train.steps == raw["train"]["steps"] and p.seed == 3


def test_prepare_root_explains_a_missing_base(tmp_path):
    study = _study()
    params = tmp_path / "params.yaml"
    params.write_text((ROOT / "params.yaml").read_text())
    with pytest.raises(SystemExit, match="dvc repro base"):
        study.prepare_root(params, tmp_path / "studies", 0)
