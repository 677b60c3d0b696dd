"""W&B around the stages (tasks/tracking.py): explicit runs per arm, per evaluation and per report, with the real
`wandb`.

The training runs are driven through transformers' own W&B callback (what trl's `report_to: wandb` installs),
so the test sees what a training arm does: the callback finds the arm's run and logs its steps into it.
Offline runs are read back folder by folder (`runs/wandb/offline-run-<time>-<id>/`) with wandb's own
transaction-log reader (`wandb leet inspect --json`): the run ids, groups, configs, histories and artifacts are
what a `wandb sync` would upload.
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


def _params(root, report_to="wandb", **train):
    return params_from_dict({"out_root": str(root), "train": {"report_to": report_to, **train}})


def run_folders(root: Path) -> list[dict]:
    """Every offline run folder under root/runs/wandb, in time order, as {'folder_id': the id in the folder's
    name, run record fields, 'config': the config it logged, 'history': [items], 'artifacts': [records]}."""
    out = []
    for run_dir in sorted((root / "runs" / "wandb").glob("offline-run-*")):
        res = subprocess.run([str(WANDB), "leet", "inspect", "--json", str(run_dir)], capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        records = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
        run = next(r["run"] for r in records if r["type"] == "run")
        config = dict((run.get("config") or {}).get("update") or {})
        for r in records:
            if r["type"] == "config":
                config.update(r["config"].get("update") or {})
        out.append({**run, "folder_id": run_dir.name.split("-", 3)[3], "config": config,
                    "history": [r["history"]["item"] for r in records if r["type"] == "history"],
                    "artifacts": [r["artifact"] for r in records if r["type"] == "artifact"]})
    return out


def offline_runs(root: Path) -> dict[str, dict]:
    """run id -> the run, its folders' histories and artifacts together (what sync makes of them)."""
    out: dict[str, dict] = {}
    for f in run_folders(root):
        run = out.setdefault(f["run_id"], {**f, "history": [], "artifacts": [], "folders": 0})
        run["history"] += f["history"]
        run["artifacts"] += f["artifacts"]
        run["folders"] += 1
    return out


def _clean_wandb_env(monkeypatch) -> None:
    for var in ("WANDB_RUN_ID", "WANDB_NAME", "WANDB_TAGS", "WANDB_RUN_GROUP", "WANDB_DIR", tracking.GROUP_ENV,
                tracking.EXP_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")


class _Junior:
    """What `weights_hash` reads of a model: its state dict."""

    def __init__(self, value: float):
        import torch

        self.weights = {"w": torch.full((2,), value)}

    def state_dict(self):
        return self.weights


def _checkpoint(arm_dir: Path, step: int, fingerprint: str) -> Path:
    """A complete checkpoint as training leaves it (`tandem.checkpoints.is_complete`), of run `fingerprint`."""
    from tandem.checkpoints import step_name, write_state

    ckpt = arm_dir / step_name(step)
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"weights" * 8)
    (ckpt / "optimizer.pt").write_bytes(b"moments")
    write_state(ckpt, {"arm": arm_dir.name, "fingerprint": fingerprint, "step": step})
    return ckpt


def test_an_arms_fingerprint_is_the_trainers():
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
    assert tracking.arm_run_id("tandem", fp) == f"tandem-tandem-{fp}"  # what checkpoints without a record resume


def test_a_training_run_keeps_its_id_only_when_it_resumes(tmp_path):
    params = _params(tmp_path)
    work = tracking.arm_dir(params, "tandem")
    assert work == tmp_path / "scratch" / "train" / "tandem"
    first = tracking.training_run_id(params, "tandem", "fp1")
    again = tracking.training_run_id(params, "tandem", "fp1")  # crashed before its first checkpoint: starts over
    assert first != again and first.startswith("tandem-tandem-") and again.startswith("tandem-tandem-")
    _checkpoint(work, 2, "fp1")
    assert tracking.resumes(params, work, "fp1") and not tracking.resumes(params, work, "fp2")
    assert tracking.training_run_id(params, "tandem", "fp1") == again  # resumes: the id the run started with
    assert tracking.training_run_id(params, "tandem", "fp1", work_dir=work) == again
    other = tracking.training_run_id(params, "tandem", "fp2")  # another run (its checkpoints are removed)
    assert other not in (first, again) and tracking.recorded_run_id(work, "fp2") == other
    # train.resume: never starts the arm over, so a new run (the record lives beside the dir the trainer empties)
    never = _params(tmp_path, resume="never")
    assert not tracking.resumes(never, work, "fp1") and tracking.training_run_id(never, "tandem", "fp1") != again
    assert not any(p.name.endswith(tracking.RECORD_SUFFIX) for p in work.iterdir())


def test_checkpoints_from_before_the_record_resume_the_fingerprint_id(tmp_path):
    params = _params(tmp_path)
    _checkpoint(tracking.arm_dir(params, "grpo"), 4, "fp")
    assert tracking.training_run_id(params, "grpo", "fp") == tracking.arm_run_id("grpo", "fp")
    # a damaged record is no record
    tracking._record(tracking.arm_dir(params, "grpo")).write_text("{not json")
    assert tracking.training_run_id(params, "grpo", "fp") == tracking.arm_run_id("grpo", "fp")


def test_evaluation_and_report_ids_are_new_every_time():
    ids = {tracking.new_run_id("evaluate") for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith("tandem-evaluate-") and len(i) == len("tandem-evaluate-") + 12
                                  for i in ids)


def test_group_is_the_experiment_the_pipeline_run_or_the_params(tmp_path, monkeypatch):
    monkeypatch.delenv(tracking.GROUP_ENV, raising=False)
    monkeypatch.delenv(tracking.EXP_ENV, raising=False)
    params = _params(tmp_path)
    default = tracking.group(params)
    assert default.startswith("tandem-") and default == tracking.group(_params(tmp_path))
    with tracking.pipeline_group("brave-otter"):
        assert tracking.group(params) == "brave-otter" and os.environ[tracking.GROUP_ENV] == "brave-otter"
        monkeypatch.setenv(tracking.EXP_ENV, "exp1")  # `dvc exp run` names the experiment
        assert tracking.group(params) == "exp1"
        monkeypatch.delenv(tracking.EXP_ENV)
    assert tracking.group(params) == default and tracking.GROUP_ENV not in os.environ
    monkeypatch.setenv(tracking.EXP_ENV, "exp1")
    assert tracking.group(params) == "exp1"


def test_the_config_is_the_full_params_with_secrets_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "planted0secret0value0123456789")
    params = params_from_dict({"out_root": str(tmp_path), "train": {"report_to": "wandb"},
                               "report": {"title": "run planted0secret0value0123456789"}})
    config = tracking.run_config(params, arm="tandem")
    assert set(config) == {*params.to_dict(), "arm"} and config["train"] == params.to_dict()["train"]
    assert "planted0secret0value0123456789" not in json.dumps(config)


def test_nothing_happens_when_wandb_is_off(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it would fail
    params = _params(tmp_path, report_to="none")
    with tracking.arm_run(params, "tandem", "fp") as run:
        assert run is None
    assert tracking.log_evaluation(params) is None
    assert tracking.log_checkpoints(params, "tandem") is None
    assert tracking.log_report(params, []) is None
    assert not (tmp_path / "scratch").exists()  # no run id recorded either
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert tracking.log_evaluation(_params(tmp_path)) is None
    assert tracking.log_checkpoints(_params(tmp_path), "tandem") is None


def test_wandb_failing_never_fails_the_stage(tmp_path, monkeypatch):
    """The evaluation and the checkpoints are logged after the stage's outputs are written: a W&B failure is
    one warning, never an error of the stage."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it fails
    monkeypatch.setenv("WANDB_MODE", "offline")
    write_fake_run(tmp_path)
    params = _params(tmp_path)
    _checkpoint(tmp_path / "models" / "checkpoints" / "tandem", 2, "fp")
    assert tracking.log_evaluation(params) is None
    assert tracking.log_checkpoints(params, "tandem") is None


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


def _as_json(obj):
    return json.loads(json.dumps(obj))


@pytest.mark.integration
def test_offline_runs_per_arm_and_evaluation_with_their_own_histories(tmp_path, monkeypatch):
    """The real wandb, offline: two arms trained one after the other in one process, then the evaluation,
    are three runs with their own ids, names, group, job types, tags, configs and step histories."""
    write_fake_run(tmp_path)
    _clean_wandb_env(monkeypatch)
    params = _params(tmp_path)
    rewards = {"tandem": [0.1, 0.2, 0.3], "grpo": [0.5, 0.4]}
    ids = {}
    with tracking.pipeline_group("brave-otter"):
        for arm, values in rewards.items():
            with tracking.arm_run(params, arm, f"fp-{arm}") as run:
                ids[arm] = run.id
                _train_with_transformers_callback(arm, values)
        eval_id = tracking.log_evaluation(params)
    assert not any(k in os.environ for k in ("WANDB_RUN_ID", "WANDB_NAME", "WANDB_TAGS"))

    runs = offline_runs(tmp_path)
    assert set(runs) == {*ids.values(), eval_id} and len(runs) == 3
    for arm, run_id in ids.items():
        r = runs[run_id]
        assert (r["display_name"], r["run_group"], r["job_type"]) == (f"brave-otter-train-{arm}", "brave-otter", "train")
        assert f"arm:{arm}" in r["tags"] and not {"arm:tandem", "arm:grpo"} - {f"arm:{arm}"} & set(r["tags"])
        assert r["config"]["arm"] == arm and r["config"]["fingerprint"] == f"fp-{arm}"
        assert {k: r["config"][k] for k in params.to_dict()} == _as_json(params.to_dict())  # the full params
        steps = [(h["train/global_step"], h["train/reward"]) for h in r["history"] if "train/reward" in h]
        assert steps == list(enumerate(rewards[arm], start=1)), (arm, steps)
    ev = runs[eval_id]
    assert ev["job_type"] == "evaluate" and ev["run_group"] == "brave-otter" and "evaluation" in ev["tags"]
    assert {k: ev["config"][k] for k in params.to_dict()} == _as_json(params.to_dict())
    assert len(ev["config"]["content_digest"]) == 16
    # pass@k per checkpoint step, then the two tables
    assert any("tandem/solo/pass@1" in h for h in ev["history"])
    assert any(h.get("evaluation/pass_at_k._type") == h.get("evaluation/samples._type") == "table-file"
               for h in ev["history"])
    (table,) = (tmp_path / "runs" / "wandb").glob(f"offline-run-*-{eval_id}/files/media/table/evaluation/pass_at_k*.json")
    assert json.loads(table.read_text())["columns"][:4] == ["arm", "step", "mode", "benchmark"]


@pytest.mark.integration
def test_reruns_of_the_evaluation_are_runs_of_their_own(tmp_path, monkeypatch):
    """Two reruns of the same evaluation logging (the same content, other groups): two ids, two runs, each with
    its whole history (with one id they would merge on sync and the second's repeated steps be dropped)."""
    write_fake_run(tmp_path)
    _clean_wandb_env(monkeypatch)
    params = _params(tmp_path)
    with tracking.pipeline_group("first-run"):
        first = tracking.log_evaluation(params)
    with tracking.pipeline_group("second-run"):
        second = tracking.log_evaluation(params)
    assert first and second and first != second
    folders = run_folders(tmp_path)
    assert sorted(f["folder_id"] for f in folders) == sorted([first, second])
    assert all(f["folder_id"] == f["run_id"] for f in folders)
    by_id = {f["run_id"]: f for f in folders}
    assert (by_id[first]["run_group"], by_id[second]["run_group"]) == ("first-run", "second-run")
    assert by_id[first]["config"]["content_digest"] == by_id[second]["config"]["content_digest"]  # same content
    steps = [sorted(h["_step"] for h in by_id[i]["history"] if "checkpoint_step" in h) for i in (first, second)]
    assert steps[0] == steps[1] and steps[0] == [0, 10, 20]


@pytest.mark.integration
def test_a_resumed_training_keeps_its_run_and_a_new_one_does_not(tmp_path, monkeypatch):
    _clean_wandb_env(monkeypatch)
    params = _params(tmp_path)
    work = tracking.arm_dir(params, "tandem")
    with tracking.arm_run(params, "tandem", "fp", work_dir=work) as run:  # crashes after its checkpoint at step 2
        started = run.id
        _train_with_transformers_callback("tandem", [0.1, 0.2, 0.3])
    _checkpoint(work, 2, "fp")
    with tracking.arm_run(params, "tandem", "fp", work_dir=work) as run:  # the rerun resumes from step 2
        assert run.id == started
    with tracking.arm_run(params, "tandem", "fp-other", work_dir=work) as run:  # other settings: a new run
        assert run.id != started
        other = run.id
    (tmp_path / "scratch").rename(tmp_path / "scratch-gone")  # no checkpoint left: the same settings train anew
    with tracking.arm_run(params, "tandem", "fp", work_dir=work) as run:
        assert run.id not in (started, other)
        anew = run.id
    runs = offline_runs(tmp_path)
    assert set(runs) == {started, other, anew}
    assert runs[started]["folders"] == 2 and runs[other]["folders"] == runs[anew]["folders"] == 1
    assert {runs[i]["config"]["fingerprint"] for i in (started, anew)} == {"fp"}


@pytest.mark.integration
def test_a_run_under_a_dvc_experiment_is_grouped_by_its_name(tmp_path, monkeypatch):
    write_fake_run(tmp_path)
    _clean_wandb_env(monkeypatch)
    monkeypatch.setenv(tracking.EXP_ENV, "exp1")
    params = _params(tmp_path)
    with tracking.arm_run(params, "grpo", "fp") as run:
        arm_id = run.id
    eval_id = tracking.log_evaluation(params)
    runs = offline_runs(tmp_path)
    assert {runs[i]["run_group"] for i in (arm_id, eval_id)} == {"exp1"}
    assert (runs[arm_id]["display_name"], runs[eval_id]["display_name"]) == ("exp1-train-grpo", "exp1-evaluate")


@pytest.mark.integration
def test_final_checkpoints_and_report_are_reference_artifacts(tmp_path, monkeypatch):
    """The arm's last published checkpoint is a `model` artifact of the arm's training run, the report a `report`
    artifact of the report's run; both by `file://` reference (nothing uploaded)."""
    from PIL import Image

    _clean_wandb_env(monkeypatch)
    params = _params(tmp_path)
    with tracking.arm_run(params, "tandem", "fp") as run:
        train_id = run.id
    published = tmp_path / "models" / "checkpoints" / "tandem"
    _checkpoint(published, 2, "fp")
    final = _checkpoint(published, 4, "fp")
    # the call the train stage makes once it has published the arm (tasks/train.py `run_arm`)
    assert tracking.log_checkpoints(params, "tandem", published,
                                    work_dir=tracking.arm_dir(params, "tandem")) == "tandem-checkpoint-tandem"

    reports = tmp_path / "reports"
    (reports / "figures").mkdir(parents=True)
    (reports / "report.html").write_text("<html>report</html>")
    (reports / "report.md").write_text("# report\n")
    Image.new("RGB", (8, 8), "white").save(reports / "figures" / "fig2.png")
    figures = [("fig2", reports / "figures" / "fig2.png", "pass@k")]
    report_id = tracking.log_report(params, figures)
    html_only = tracking.log_report(params, figures, files=[reports / "report.html"])  # the stage's outputs

    runs = offline_runs(tmp_path)
    assert set(runs) == {train_id, report_id, html_only} and runs[train_id]["folders"] == 2  # the run, continued
    (model,) = runs[train_id]["artifacts"]
    assert (model["name"], model["type"]) == ("tandem-checkpoint-tandem", "model")
    contents = {c["path"]: c for c in model["manifest"]["contents"]}
    assert set(contents) == {"config.json", "model.safetensors", "optimizer.pt", "tandem_state.json"}
    assert all(c["ref"] == f"file://{final.resolve() / p}" for p, c in contents.items())
    meta = json.loads(model["metadata"]) if isinstance(model["metadata"], str) else model["metadata"]
    assert meta["step"] == 4 and meta["path"] == "models/checkpoints/tandem/step-4" and meta["fingerprint"] == "fp"
    (report,) = runs[report_id]["artifacts"]
    assert (report["name"], report["type"]) == ("tandem-report", "report")
    assert {c["path"] for c in report["manifest"]["contents"]} == {"report.html", "report.md", "figures/fig2.png"}
    assert all(c["ref"].startswith(f"file://{reports.resolve()}/") for c in report["manifest"]["contents"])
    assert {c["path"] for c in runs[html_only]["artifacts"][0]["manifest"]["contents"]} == {"report.html",
                                                                                          "figures/fig2.png"}
    assert not list((tmp_path / "runs" / "wandb").glob("offline-run-*/files/**/report.html"))  # nothing uploaded


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
