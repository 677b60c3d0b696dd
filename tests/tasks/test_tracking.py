"""W&B around the stages (tasks/tracking.py): the arm's environment for trl's W&B callback (group, job
type, tags, a stable run id with resume), and the evaluation tables, checked against a fake `wandb`."""

from __future__ import annotations

import os
import sys
import types

import pytest

from tandem.config import params_from_dict
from tasks import tracking

from tests.report.fake_metrics import write_fake_run


def _params(root, report_to="wandb"):
    return params_from_dict({"out_root": str(root), "train": {"report_to": report_to}})


def _base(root, content=b"weights"):
    d = root / "models" / "base"
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.safetensors").write_bytes(content)


def test_arm_run_sets_and_restores_the_wandb_environment(tmp_path, monkeypatch):
    _base(tmp_path)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    params = _params(tmp_path)
    with tracking.arm_run(params, "tandem", "brave-otter") as run_id:
        assert os.environ["WANDB_RUN_GROUP"] == "brave-otter" and os.environ["WANDB_JOB_TYPE"] == "train"
        assert os.environ["WANDB_RESUME"] == "allow" and os.environ["WANDB_RUN_ID"] == run_id
        assert "tandem" in os.environ["WANDB_TAGS"].split(",")
    assert "WANDB_RUN_ID" not in os.environ
    # the same arm on the same base resumes the same run; another arm or base is another run
    assert tracking.arm_run_id(params, "tandem") == run_id
    assert tracking.arm_run_id(params, "grpo") != run_id
    _base(tmp_path, b"other weights")
    assert tracking.arm_run_id(params, "tandem") != run_id


def test_nothing_happens_when_wandb_is_off(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)
    params = _params(tmp_path, report_to="none")
    with tracking.arm_run(params, "tandem", "g") as run_id:
        assert run_id is None and "WANDB_RUN_GROUP" not in os.environ
    assert tracking.log_evaluation(params, "g") is None


def test_evaluation_tables_go_to_one_run_of_the_group(tmp_path, monkeypatch):
    write_fake_run(tmp_path)
    calls: dict = {"log": []}

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    class Run:
        id = "eval-run"

        def log(self, d):
            calls["log"].append(d)

        def finish(self):
            calls["finished"] = True

    def init(**kw):
        calls["init"] = kw
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Table=Table))
    params = _params(tmp_path)
    assert tracking.log_evaluation(params, "brave-otter") == "eval-run"
    assert calls["init"]["group"] == "brave-otter" and calls["init"]["job_type"] == "evaluate"
    assert calls["finished"]
    tables = {k: v for d in calls["log"] for k, v in d.items()}
    results, samples = tables["evaluation/pass_at_k"], tables["evaluation/samples"]
    assert results.columns[:4] == ["arm", "step", "mode", "benchmark"] and "pass@1" in results.columns
    assert {r[0] for r in results.data} >= {"tandem", "grpo"} and all(r[4] is not None for r in results.data)
    assert samples.data and samples.columns[5] == "completion" and all(isinstance(r[5], str) for r in samples.data)


@pytest.mark.integration
def test_offline_wandb_writes_the_evaluation_run(tmp_path, monkeypatch):
    """The real wandb in offline mode: the run's files appear under runs/wandb."""
    write_fake_run(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_id = tracking.log_evaluation(_params(tmp_path), "brave-otter")
    assert run_id and any((tmp_path / "runs" / "wandb").rglob(f"*{run_id}*"))
