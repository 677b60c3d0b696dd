"""What shapes a run (tandem/run_keys.py): every train and rollout setting is placed in one group, and the
resume fingerprint, dvc.yaml's `train@<arm>` params, the evaluation result key, eval.json and the promotion
fingerprint all derive from the one statement."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from dvc_project import arm_files, committed_project, stale, write_placeholders  # shared helper in tests/
from tandem import run_keys
from tandem.config import ARMS, SECTIONS, params_from_dict


def test_every_train_and_rollout_setting_is_in_exactly_one_group():
    placed: dict[str, list[str]] = {}
    for group, keys in run_keys.TRAIN_KEY_GROUPS.items():
        for key in run_keys.dotted(keys):
            placed.setdefault(key, []).append(group)
    settings = {f"{s}.{f.name}" for s in ("train", "rollout") for f in dataclasses.fields(SECTIONS[s])}
    assert settings - set(placed) == set(), "place each new setting in one group of tandem/run_keys.py"
    assert set(placed) - settings == set(), "a group names a setting the config does not have"
    assert {k: g for k, g in placed.items() if len(g) > 1} == {}


def test_the_train_stage_declares_neither_the_arm_list_nor_the_service_address():
    declared = run_keys.train_stage_params()
    assert len(declared) == len(set(declared))
    for key in run_keys.dotted(run_keys.RUNTIME_KEYS):
        assert key not in declared
    assert {"train.arms", "rollout.vllm_port"} <= set(run_keys.dotted(run_keys.RUNTIME_KEYS))
    for key in run_keys.dotted(run_keys.TRAJECTORY_KEYS) + ["train.save_every", "rollout.schedule", "seed"]:
        assert key in declared


def test_the_fingerprint_follows_the_trajectory_keys_only():
    from tandem.train import arm_spec, run_fingerprint

    def fp(**train):
        p = params_from_dict({"train": train} if train else {})
        return run_fingerprint(arm_spec("grpo", p.train, p.rollout), p.train, p.rollout, 0, "h")

    ref = fp()
    assert fp(save_every=3, arms=["grpo"], report_to="none") == ref  # resumable and runtime keys
    assert fp(learning_rate=1e-3) != ref and fp(steps=3) != ref       # trajectory keys


def test_evaluation_keys_derive_from_one_list():
    from tandem.evaluation import EvalSettings
    from tandem.report.promotion import settings_fingerprint

    s = EvalSettings()
    assert set(s.key_fields("solo")) == set(run_keys.EVAL_RESULT_KEYS) - set(run_keys.EVAL_MODE_ONLY)
    assert set(s.key_fields("step")) - set(s.key_fields("solo")) == {"max_rounds"}
    assert set(s.key_fields("word")) - set(s.key_fields("solo")) == {"p_senior", "max_gap_tokens"}
    # every result key is a field of the settings and a real params key
    p = params_from_dict({})
    for field, key in run_keys.EVAL_RESULT_KEYS.items():
        assert s.value(field) is not None and run_keys.setting(p, key) is not None
    # promotion compares the estimate keys: all result keys but the seed
    ev = {"settings": {k: s.value(k) for k in run_keys.EVAL_RESULT_KEYS}}
    assert settings_fingerprint(ev) == settings_fingerprint({"settings": {**ev["settings"], "seed": 7}})
    for k in run_keys.eval_estimate_fields():
        assert settings_fingerprint(ev) != settings_fingerprint({"settings": {**ev["settings"], k: -1}}), k


@pytest.mark.integration
def test_adding_an_arm_or_moving_the_service_retrains_no_arm_but_a_trajectory_key_retrains_all(tmp_path):
    """In a copy of the project with every stage committed (tests/dvc_project.py), `dvc status` lists which
    stages a params edit makes stale."""
    dvc = committed_project(tmp_path / "proj")
    params_file = tmp_path / "proj" / "params.yaml"
    original = yaml.safe_load(params_file.read_text())
    trained = {f"train@{a}" for a in original["train"]["arms"]}
    new_arm = next(a for a in ARMS if a not in original["train"]["arms"])

    def edit(section: str, **values) -> set[str]:
        raw = yaml.safe_load(params_file.read_text())
        raw[section].update(values)
        params_file.write_text(yaml.safe_dump(raw, sort_keys=False))
        return stale(dvc)

    assert stale(dvc) == set()
    after_arm = edit("train", arms=original["train"]["arms"] + [new_arm])
    assert f"train@{new_arm}" in after_arm and not after_arm & trained
    write_placeholders(tmp_path / "proj", arm_files(new_arm))
    dvc("commit", "-f", "-q")
    assert stale(dvc) == set()
    after_port = edit("rollout", vllm_port=original["rollout"]["vllm_port"] + 8471)
    assert not {s for s in after_port if s.startswith("train@")}
    after_lr = edit("train", learning_rate=original["train"]["learning_rate"] * 2)  # a trajectory key
    assert trained | {f"train@{new_arm}"} <= after_lr
