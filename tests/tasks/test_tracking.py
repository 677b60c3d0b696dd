"""W&B around the stages (tasks/tracking.py): explicit runs per arm and per evaluation, with the real `wandb`.

The training runs are driven through transformers' own W&B callback (what trl's `report_to: wandb` installs),
so the test sees what a training arm does: the callback finds the arm's run and logs its steps into it.
Offline runs are read back with wandb's own transaction-log reader (`wandb leet inspect --json`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tandem.config import params_from_dict
from tasks import tracking

from tests.report.fake_metrics import write_fake_run

WANDB = Path(sys.executable).with_name("wandb")


def _params(root, report_to="wandb"):
    return params_from_dict({"out_root": str(root), "train": {"report_to": report_to}})


def offline_runs(root: Path) -> dict[str, dict]:
    """run id -> {run record fields, 'history': [history items]} for every offline run under root/runs/wandb."""
    out = {}
    for run_dir in sorted((root / "runs" / "wandb").glob("offline-run-*")):
        res = subprocess.run([str(WANDB), "leet", "inspect", "--json", str(run_dir)], capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        records = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
        run = next(r["run"] for r in records if r["type"] == "run")
        run["history"] = [r["history"]["item"] for r in records if r["type"] == "history"]
        out.setdefault(run["run_id"], {**run, "history": []})["history"] += run["history"]
    return out


class _Junior:
    """What `weights_hash` reads of a model: its state dict."""

    def __init__(self, value: float):
        import torch

        self.weights = {"w": torch.full((2,), value)}

    def state_dict(self):
        return self.weights


def test_an_arms_run_id_is_its_training_fingerprint():
    from tandem.train import arm_spec, run_fingerprint
    from tandem.train.numerics import weights_hash
    from tasks.train import run_fingerprint_of

    params = _params("/tmp")
    fp = run_fingerprint_of(params, "tandem", _Junior(1.0))
    assert fp == run_fingerprint(arm_spec("tandem", params.train, params.rollout), params.train, params.rollout,
                                 params.seed, weights_hash(_Junior(1.0)))  # the trainer's, which resume matches
    assert fp == run_fingerprint_of(params, "tandem", _Junior(1.0))
    assert fp != run_fingerprint_of(params, "grpo", _Junior(1.0))
    assert fp != run_fingerprint_of(params, "tandem", _Junior(2.0))  # another base
    assert tracking.arm_run_id("tandem", fp) == f"tandem-tandem-{fp}"


def test_group_is_the_pipeline_run_or_the_params(tmp_path, monkeypatch):
    monkeypatch.delenv(tracking.GROUP_ENV, raising=False)
    params = _params(tmp_path)
    default = tracking.group(params)
    assert default.startswith("tandem-") and default == tracking.group(_params(tmp_path))
    with tracking.pipeline_group("brave-otter"):
        assert tracking.group(params) == "brave-otter" and os.environ[tracking.GROUP_ENV] == "brave-otter"
    assert tracking.group(params) == default and tracking.GROUP_ENV not in os.environ


def test_nothing_happens_when_wandb_is_off(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it would fail
    params = _params(tmp_path, report_to="none")
    with tracking.arm_run(params, "tandem", "fp") as run:
        assert run is None
    assert tracking.log_evaluation(params) is None
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert tracking.log_evaluation(_params(tmp_path)) is None


def _train_with_transformers_callback(arm: str, rewards: list[float]) -> None:
    """What trl's trainer does with `report_to: wandb`: transformers' WandbCallback logs each step."""
    from transformers.integrations import WandbCallback

    args = types.SimpleNamespace(to_dict=lambda: {"learning_rate": 1e-4}, run_name=f"arm-{arm}",
                                 output_dir=f"scratch/{arm}")
    state = types.SimpleNamespace(is_world_process_zero=True, trial_name=None, logging_steps=1, global_step=0,
                                  is_hyper_param_search=False)
    cb = WandbCallback()
    cb.on_train_begin(args, state, None, model=None)
    for step, reward in enumerate(rewards, start=1):
        state.global_step = step
        cb.on_log(args, state, None, logs={"reward": reward})


@pytest.mark.integration
def test_offline_runs_per_arm_and_evaluation_with_their_own_histories(tmp_path, monkeypatch):
    """The real wandb, offline: two arms trained one after the other in one process, then the evaluation,
    are three runs with their own ids, names, group, job types, tags and step histories."""
    write_fake_run(tmp_path)
    for var in ("WANDB_RUN_ID", "WANDB_NAME", "WANDB_TAGS", "WANDB_RUN_GROUP", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    params = _params(tmp_path)
    rewards = {"tandem": [0.1, 0.2, 0.3], "grpo": [0.5, 0.4]}
    with tracking.pipeline_group("brave-otter"):
        for arm, values in rewards.items():
            with tracking.arm_run(params, arm, f"fp-{arm}") as run:
                assert run.id == tracking.arm_run_id(arm, f"fp-{arm}")
                _train_with_transformers_callback(arm, values)
        eval_id = tracking.log_evaluation(params)
    assert not any(k in os.environ for k in ("WANDB_RUN_ID", "WANDB_NAME", "WANDB_TAGS"))

    runs = offline_runs(tmp_path)
    ids = {arm: tracking.arm_run_id(arm, f"fp-{arm}") for arm in rewards}
    assert set(runs) == {*ids.values(), eval_id} and len(runs) == 3
    for arm, run_id in ids.items():
        r = runs[run_id]
        assert (r["display_name"], r["run_group"], r["job_type"]) == (f"brave-otter-train-{arm}", "brave-otter", "train")
        assert f"arm:{arm}" in r["tags"] and not {"arm:tandem", "arm:grpo"} - {f"arm:{arm}"} & set(r["tags"])
        steps = [(h["train/global_step"], h["train/reward"]) for h in r["history"] if "train/reward" in h]
        assert steps == list(enumerate(rewards[arm], start=1)), (arm, steps)
    ev = runs[eval_id]
    assert ev["job_type"] == "evaluate" and ev["run_group"] == "brave-otter" and "evaluation" in ev["tags"]
    # pass@k per checkpoint step, then the two tables
    by_step = {h["_step"]: h for h in ev["history"]}
    assert any("tandem/solo/pass@1" in h for h in by_step.values())
    assert any(h.get("evaluation/pass_at_k._type") == h.get("evaluation/samples._type") == "table-file"
               for h in ev["history"])
    (table,) = (tmp_path / "runs" / "wandb").glob(f"offline-run-*-{eval_id}/files/media/table/evaluation/pass_at_k*.json")
    assert json.loads(table.read_text())["columns"][:4] == ["arm", "step", "mode", "benchmark"]

    # a rerun (after a crash) continues the arm's run: same id, no new run id
    with tracking.arm_run(params, "tandem", "fp-tandem") as run:
        assert run.id == ids["tandem"]
    assert set(offline_runs(tmp_path)) == set(runs)


def test_evaluation_tables(tmp_path):
    write_fake_run(tmp_path)
    params = _params(tmp_path)
    cols, rows = tracking.evaluation_rows(params)
    assert cols[:4] == ["arm", "step", "mode", "benchmark"] and "pass@1" in cols
    assert {r[0] for r in rows} >= {"tandem", "grpo"} and all(r[4] is not None for r in rows)
    scols, srows = tracking.sample_rows(params)
    assert srows and scols[5] == "completion" and all(isinstance(r[5], str) for r in srows)
    history = tracking.checkpoint_history(params)
    assert [s for s, _ in history] == sorted(s for s, _ in history) and history[0][1]
