"""`tandem run` drives the flow: its options reach it, another params file runs in its own output root (the
default run's outputs and `dvc status` stay untouched), a no-op rerun keeps the last real run's metadata and
says that it ran nothing, `--force` recomputes every stage and every evaluation unit (past the evaluation's
result cache), and a run is compared with the committed record.

The flow runs on the fake stages (tests/flows/fake_stages.py) inside a scratch git + DVC project, on Prefect's
temporary local server, through the real command line (typer's test runner).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import flows.pipeline as fp
from cli.main import app

from tests.flows import fake_stages

REPO = Path(__file__).resolve().parents[2]


def _run(cwd: Path, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, timeout=300)


def _dvc_status(root: Path) -> dict:
    res = _run(root, sys.executable, "-m", "dvc", "status", "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout or "{}")


def _hashes(root: Path, *dirs: str) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.md5(f.read_bytes()).hexdigest()
            for d in dirs for f in sorted((root / d).rglob("*")) if f.is_file()}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A scratch git + DVC project with the fake dvc.yaml, its params.yaml and the real params.study.yaml."""
    root = tmp_path / "proj"
    root.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    assert _run(root, "git", "init", "-q").returncode == 0
    assert _run(root, sys.executable, "-m", "dvc", "init", "-q").returncode == 0
    (root / "dvc.yaml").write_text(fake_stages.DVC_YAML)
    (root / "params.yaml").write_text(fake_stages.PARAMS_YAML)
    (root / "params.study.yaml").write_text((REPO / "params.study.yaml").read_text())
    (root / "src.txt").write_text("source")
    (root / ".gitignore").write_text("/data/\n/models/\n/results/\n/reports/\n/runs/\n/.tandem.lock\n*.timing.*\n")
    monkeypatch.chdir(root)
    rec = fake_stages.Recorder()
    monkeypatch.setattr(fake_stages, "ACTIVE", fake_stages.modules(rec))
    monkeypatch.setattr(fp, "_stage", fake_stages.stage)
    _run(root, *git, "add", "-A")
    assert _run(root, *git, "commit", "-q", "-m", "project").returncode == 0
    return root, rec, git


def _tandem(*args: str):
    res = CliRunner().invoke(app, ["run", "--no-live", *args])
    assert res.exit_code == 0, (res.output, res.exception)
    return res.output


def test_run_help_lists_the_flow_options():
    res = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    for opt in ("--stages", "--force", "--promote", "--pull", "--push", "--remote", "--publish", "--eval-runner",
                "--dvc", "--live", "--direct", "--params", "--wait"):
        assert opt in res.output, opt
    assert "training" in res.output and "evaluation" in res.output


def test_stage_selection(tmp_path):
    from flows.dvc_sync import pipeline_stages
    from tandem.config import params_from_dict

    (tmp_path / "dvc.yaml").write_text(fake_stages.DVC_YAML)
    specs = pipeline_stages(tmp_path / "dvc.yaml", params_from_dict(yaml.safe_load(fake_stages.PARAMS_YAML)).to_dict())
    names = lambda w: [s.name for s in fp.select_stages(specs, w)]  # noqa: E731
    assert names(None) == names(["all"]) == [s.name for s in specs]
    assert names(["training"]) == ["prepare", "base", "train@tandem", "train@grpo"]
    assert names(["evaluation"]) == ["evaluate", "analyze", "report"]
    assert names(["report", "train"]) == ["train@tandem", "train@grpo", "report"]  # dvc.yaml's order
    assert names(["train@grpo"]) == ["train@grpo"]
    with pytest.raises(ValueError, match="neither a stage"):
        fp.select_stages(specs, ["trian"])


@pytest.mark.slow
def test_another_params_file_leaves_the_default_run_untouched(project, prefect_api):
    root, rec, git = project
    out = _tandem()  # the default run: the project's params.yaml into the project root, committed to dvc.lock
    assert _dvc_status(root) == {}
    assert "committed record" not in out  # HEAD has no dvc.lock yet: nothing to compare with
    _run(root, *git, "add", "-A")
    _run(root, *git, "commit", "-q", "-m", "record")
    tracked = ("data", "models", "metrics", "results", "reports")
    before, lock = _hashes(root, *tracked), (root / "dvc.lock").read_text()
    run_json = (root / "results" / "run.json").read_text()

    # a no-op rerun skips every stage, keeps results/run.json and says it reproduced nothing
    out = _tandem()
    assert "This run ran nothing" in out and "bit for bit" not in out
    assert (root / "results" / "run.json").read_text() == run_json

    calls = len(rec.calls)
    out = _tandem("--params", "params.study.yaml", "--stages", "prepare,base")
    assert "runs/study" in out
    assert rec.calls[calls:] == ["prepare", "base"]  # only the selected stages, in their own root
    assert (root / "runs" / "study" / "data" / "prepared" / "train.jsonl").exists()
    assert (root / "runs" / "study" / "models" / "base" / "w.txt").exists()
    assert not (root / "runs" / "study" / "models" / "checkpoints").exists()
    # the default run's outputs, dvc.lock and DVC's view are as they were
    assert _hashes(root, *tracked) == before and (root / "dvc.lock").read_text() == lock
    assert _dvc_status(root) == {}
    assert _run(root, "git", "status", "--porcelain").stdout == ""


@pytest.mark.slow
def test_a_changed_output_is_reported_against_the_record(project, prefect_api, monkeypatch):
    root, rec, git = project
    _tandem()
    _run(root, *git, "add", "-A")
    _run(root, *git, "commit", "-q", "-m", "record")
    real = fake_stages.modules(rec)

    def other_base(params, inputs, outputs):  # a base that comes out differently (another machine, say)
        out = real["base"].run(params, inputs, outputs)
        (root / "models" / "base" / "w.txt").write_text("another base")
        return out

    monkeypatch.setitem(fake_stages.ACTIVE, "base", type(real["base"])(default_io=real["base"].default_io,
                                                                        run=other_base))
    out = _tandem("--stages", "base", "--force")
    assert "differs from the committed record" in out
    assert "base (models/base)" in out and "same outputs:" in out and "prepare" in out
    assert "git checkout -- dvc.lock metrics && dvc checkout" in out


@pytest.mark.slow
def test_force_recomputes_every_stage_and_unit_and_reproduces_the_record(project, prefect_api, monkeypatch):
    root, rec, git = project
    _tandem()
    _run(root, *git, "add", "-A")
    _run(root, *git, "commit", "-q", "-m", "record")
    real = fake_stages.modules(rec)
    refreshed: list[bool] = []

    def run_unit(params, unit, inputs=None, outputs=None, progress=None, refresh=False):
        refreshed.append(refresh)  # the evaluation's result cache is bypassed only when this is True
        return real["evaluate"].run_unit(params, unit, inputs, outputs, progress)

    monkeypatch.setitem(fake_stages.ACTIVE, "evaluate", type(real["evaluate"])(
        **{**vars(real["evaluate"]), "run_unit": run_unit}))
    calls = len(rec.calls)
    out = _tandem("--force")
    stages = ["prepare", "base", "train-tandem", "train-grpo", "evaluate-collect", "analyze", "report"]
    assert [c for c in rec.calls[calls:] if not c.startswith("unit-")] == stages  # nothing skipped
    assert len(refreshed) == 6 and all(refreshed), refreshed  # every unit recomputed
    assert "reproduced the committed record" in out and "bit for bit" in out and "not rerun" not in out
