"""tandem/study/registration.py: the committed registrations read as they are, one-line errors naming every problem,
and a new control whose params file, dialects, classifier and S/J build settings come from its registration alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tandem.errors import BadInputError
from tandem.study import registration as R

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_registrations_load_as_they_are():
    toy = R.load(ROOT / "studies" / "junior-control", ROOT)
    assert isinstance(toy, R.ControlRegistration) and toy.gate_from is None and toy.gated is toy
    assert [d.name for d in toy.dialects] == ["compact", "coded"] and toy.classifier == "solution_style"
    assert toy.junior.sections == {"junior": {"source": "tiny", "seed": 1,
                                              "solution_styles": {"verbose": 0.70, "terse": 0.30}}}
    assert toy.arms["tandem-self"] == R.Arm("tandem", "S") and [c.id for c in toy.claims] == ["J1", "J2", "H1", "L1"]
    later = R.load(ROOT / "studies" / "junior-control" / "coded-100" / "registration.yaml", ROOT)
    assert later.gated.dir == toy.dir and later.steps == 100 and later.params_overrides == {
        "train": {"steps": 100, "save_every": 25}}
    pilot = R.load(ROOT / "studies" / "registration.yaml", ROOT)
    assert isinstance(pilot, R.PilotRegistration) and pilot.lengths == (400, 600)
    assert [c.id for c in pilot.claims][:2] == ["C1", "C2"] and pilot.secondary[0].id == "C1 solo/pass@8"


def _toy(tmp_path: Path, **changes) -> Path:
    raw = yaml.safe_load((ROOT / "studies" / "junior-control" / "registration.yaml").read_text())
    raw["params"] = str(ROOT / raw["params"])
    raw.update(changes)
    (tmp_path / "registration.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return tmp_path


def test_every_problem_is_named_in_one_error(tmp_path):
    out = _toy(tmp_path, classifier="gsm8k", seeds=[1, 1], arms={"grpo": {"train": "grpo", "partner": "J"},
                                                      "x": {"train": "grpo", "partner": "X"}},
               statistics={"level": 0.95, "n_boot": 10, "boot_seed": 0, "alpha_one_sided": 0.025,
                           "bootstrap": "nested", "robustness": "seed_t", "multiplicity": "holm"})
    with pytest.raises(BadInputError) as e:
        R.load(out, ROOT)
    msg = str(e.value)
    assert "\n" not in msg and str(out / "registration.yaml") in msg
    for part in ("classifier: 'gsm8k'", "seeds: distinct", "arms.x", "statistics.bootstrap: 'nested'",
                 "n_boot >= 100", "claims J1: arm 'tandem-naive' is not registered"):
        assert part in msg, part


def test_a_missing_or_unknown_registration_is_refused(tmp_path):
    with pytest.raises(BadInputError, match="does not exist"):
        R.load(tmp_path, ROOT)
    (tmp_path / "registration.yaml").write_text("seeds: [0]\n")
    with pytest.raises(BadInputError, match="no registered kind"):
        R.load(tmp_path, ROOT)


def test_a_new_control_runs_from_its_registration_alone(tmp_path, monkeypatch):
    """S's build sections, the dialect's styles and J's section (a GGUF junior) reach the gate's params file."""
    from tasks.study import control as ctl

    preset = yaml.safe_load((ROOT / "studies" / "junior-control" / "params.yaml").read_text())
    preset["model"].update(source="gguf", gguf_file="package:somepkg/model.gguf", sft_steps=0)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(preset, sort_keys=False))
    out = _toy(tmp_path, params=str(tmp_path / "params.yaml"),
               senior={"seed": 3, "params": {"model": {"sft_steps": 40, "sft_lr": 1e-4}}},
               junior={"seed": 2, "source": "gguf", "gguf_file": "package:somepkg/model.gguf"},
               dialects=[{"name": "coded", "senior_styles": {"coded": 0.8, "verbose": 0.2}}])
    reg = ctl.registration(out)
    f = ctl.dialect_params(reg, reg.dialects[0])
    raw = yaml.safe_load(f.read_text())
    assert raw["seed"] == 3 and raw["model"]["sft_steps"] == 40 and raw["model"]["sft_lr"] == 1e-4
    assert raw["model"]["source"] == "gguf" and raw["data"]["solution_styles"] == {"coded": 0.8, "verbose": 0.2}
    assert raw["junior"]["source"] == "gguf" and raw["junior"]["gguf_file"] == "package:somepkg/model.gguf"
    assert raw["junior"]["seed"] == 2 and f.parent == (out / "work" / "coded").resolve()


def test_derive_merges_sections_in_order_and_leaves_its_input_alone():
    from tandem.study.params import derive, run_changes

    raw = {"seed": 0, "out_root": ".", "train": {"arms": ["tandem"], "steps": 300}, "junior": {"source": "tiny"}}
    got = derive(raw, {"out_root": "/r", "train": {"steps": 100}}, {"train": {"arms": ["grpo"]}, "new": 1})
    assert got == {"seed": 0, "out_root": "/r", "train": {"arms": ["grpo"], "steps": 100}, "junior": {"source": "tiny"},
                   "new": 1}
    assert list(got) == ["seed", "out_root", "train", "junior", "new"] and raw["train"]["steps"] == 300
    later = R.load(ROOT / "studies" / "junior-control" / "coded-100", ROOT)
    self_run = derive(raw, *run_changes(later, 5, "tandem-self", "/r"))
    assert self_run["junior"] == {"source": "base"} and self_run["train"] == {"arms": ["tandem"], "steps": 100,
                                                                             "save_every": 25}
    assert derive(raw, *run_changes(later, 5, "grpo", "/r"))["junior"] == {"source": "tiny"}
