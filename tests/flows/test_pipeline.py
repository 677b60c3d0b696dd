"""The `tandem-pipeline` flow: its stage list is dvc.yaml's, its wiring (order, one task run per arm and per
evaluation unit, artifacts, no retry on training) holds, and after a run `dvc status` is clean.

The artifacts are keyless in their task runs, keyed only for what runs are compared by; each evaluation unit
logs a line per finished benchmark; flow runs and their task runs carry the run's tags.

The wiring tests run the real flow on fake stage modules (tests/flows/fake_stages.py) inside a scratch DVC
project, on Prefect's temporary local server; the real stages run in tests/flows/test_server.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import flows.pipeline as fp
from flows.dvc_sync import DvcSync

from tests.flows import fake_stages

REPO = Path(__file__).resolve().parents[2]


def test_stage_list_matches_dvc_yaml():
    stages = list(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])
    assert list(fp.STAGES) == stages


@pytest.mark.integration
def test_flow_stages_are_dvcs_own_stage_graph(tmp_path):
    """The flow's stages, foreach expansion and order come from dvc.yaml exactly as DVC reads it."""
    from dvc.repo import Repo

    from flows.dvc_sync import pipeline_stages
    from tandem.config import params_from_dict

    for name in ("dvc.yaml", "params.yaml"):
        (tmp_path / name).write_text((REPO / name).read_text())
    assert _dvc(tmp_path, "init", "--no-scm", "-q").returncode == 0
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    specs = pipeline_stages(tmp_path / "dvc.yaml", params_from_dict({**raw, "out_root": "."}).to_dict())
    with Repo(str(tmp_path)) as repo:
        graph = repo.index.graph
        dvc_names = {s.name for s in repo.index.stages}
        edges = {(a.name, b.name) for a, b in graph.edges}  # a depends on b
    assert {s.name for s in specs} == dvc_names
    pos = {s.name: i for i, s in enumerate(specs)}
    assert all(pos[b] < pos[a] for a, b in edges), "a stage runs before one it depends on"
    direct = {(s.name, a) for s in specs for a in s.after}
    assert edges <= direct
    assert [s.name for s in fp._closure(specs, {"evaluate"}, downstream=True)] == ["evaluate", "analyze", "report"]
    assert [s.name for s in fp._closure(specs, {"train"}, downstream=False)] == \
        ["prepare", "base", "junior"] + [f"train@{a}" for a in raw["train"]["arms"]]


def _expand(stage: dict, raw_params: dict) -> list[dict]:
    """A `foreach` stage as its instances (`${item}` substituted); a plain stage as itself."""
    if "foreach" not in stage:
        return [stage]
    ref = stage["foreach"].strip("${} ")
    items = raw_params
    for part in ref.split("."):
        items = items[part]
    text = yaml.safe_dump(stage["do"])
    return [yaml.safe_load(text.replace("${item}", str(item))) for item in items]


def test_train_stage_is_one_dvc_stage_per_arm():
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    train = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["train"]
    assert train["foreach"] == "${train.arms}"
    cmds = [s["cmd"] for s in _expand(train, raw)]
    assert cmds == [f"tandem stage train --arm {a}" for a in raw["train"]["arms"]]


def _declared_outputs(stage: dict) -> list[str]:
    return [e if isinstance(e, str) else next(iter(e)) for k in ("outs", "metrics", "plots") for e in stage.get(k, [])]


def _related(a: str, b: str) -> bool:
    """Equal paths, or one inside the other."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


# Stage outputs DVC deliberately does not track: crash-resume state (scratch/) and tracker run files.
UNTRACKED = ("scratch/", "runs/")


def test_dvc_yaml_declares_what_each_stage_reads_and_writes():
    """What `dvc commit` needs for the flow/DVC agreement: every declared output is produced by the stage's
    `default_io`, every produced output is declared, and every input is a dependency."""
    import importlib

    from tandem.config import params_from_dict
    from tasks.common import load_params

    params = load_params(REPO / "params.yaml")
    params = params_from_dict({**params.to_dict(), "out_root": "."})
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    problems = []
    for name, st in stages.items():
        inputs, outputs = importlib.import_module(f"tasks.{name}").default_io(params)
        produced = [str(Path(v)) for v in outputs.values()]
        instances = _expand(st, raw)
        declared = [d for inst in instances for d in _declared_outputs(inst)]
        deps = [str(Path(d)) for inst in instances for d in inst.get("deps", [])]
        problems += [f"{name}: dvc.yaml declares {d} but default_io writes no such path" for d in declared
                     if not any(_related(d, q) for q in produced)]
        problems += [f"{name}: writes {q}, which dvc.yaml does not declare" for q in produced
                     if not q.startswith(UNTRACKED) and not any(_related(q, d) for d in declared)]
        problems += [f"{name}: reads {str(Path(i))}, which is not among its dvc.yaml deps" for i in inputs.values()
                     if not any(_related(str(Path(i)), d) for d in deps)]
    assert not problems, "\n".join(problems)


def test_every_stage_has_its_module_contract():
    import importlib

    for name in fp.STAGES:
        mod = importlib.import_module(f"tasks.{name}")
        assert callable(mod.default_io) and callable(mod.run), name
    train, evaluate = importlib.import_module("tasks.train"), importlib.import_module("tasks.evaluate")
    assert callable(train.run_arm)  # one task run per arm
    assert callable(evaluate.plan) and callable(evaluate.run_unit) and callable(evaluate.collect)


def test_retries_only_where_transient_and_timeouts_only_where_enforceable():
    assert fp.stage_task.retries == 0  # base gets retries only for a hub download, set per run
    assert not fp.evaluate_unit_task.retries and not fp.evaluate_collect_task.retries
    assert fp.push_task.retries == 3 and fp.pull_task.retries == 3
    for t in (fp.evaluate_plan_task, fp.evaluate_collect_task, fp.promote_task,
              fp.report_artifact_task, fp.pull_task, fp.push_task, fp.git_commit_task, fp.git_push_task):
        assert t.timeout_seconds, t.name
    # units run on the task runner's worker threads, where Prefect cannot enforce a timeout (and warns that it
    # cannot): their limit is the evaluation subflow's, set per run from the number of units
    assert fp.evaluate_unit_task.timeout_seconds is None and fp.TIMEOUTS["evaluate-unit"]
    assert all(fp.TIMEOUTS.get(g) for g in fp.STAGES)  # stage_task gets its stage's timeout per call
    for f in (fp.tandem_pipeline, fp.tandem_training, fp.tandem_evaluation, fp.evaluate_units):
        assert f.timeout_seconds and f.log_prints, f.name


def test_task_runner_choice():
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    assert isinstance(fp.task_runner("threads"), ThreadPoolTaskRunner)
    assert isinstance(fp.task_runner("dask"), DaskTaskRunner)
    assert fp.task_runner("tcp://10.0.0.5:8786").address == "tcp://10.0.0.5:8786"
    with pytest.raises(ValueError, match="eval_runner"):
        fp.task_runner("ray")


# The only artifact keys a run uses: what runs are compared by. Per-arm and per-unit artifacts are keyless.
KEYED = {"tandem-report", "tandem-promotion", "evaluation-summary"}


def test_the_keyed_artifacts_are_few_and_valid():
    assert {fp.REPORT_KEY, fp.PROMOTION_KEY, fp.SUMMARY_KEY} == KEYED
    assert all(re.fullmatch(r"[a-z0-9-]+", k) for k in KEYED)  # Prefect's rule for keys


def test_the_flows_units_draw_no_bars_of_their_own():
    from tandem.config import params_from_dict

    params = params_from_dict({"evaluate": {"progress": True}})
    quiet = fp.unit_params(params)
    assert quiet.evaluate.progress is False and params.evaluate.progress is True
    # nothing else moves
    assert {**quiet.to_dict(), "evaluate": None} == {**params.to_dict(), "evaluate": None}
    assert {**quiet.to_dict()["evaluate"], "progress": True} == params.to_dict()["evaluate"]
    off = params_from_dict({"evaluate": {"progress": False}})
    assert fp.unit_params(off) is off


def _milestones(sizes: dict[str, int]):
    heard: list = []
    return fp.progress.Milestones(sizes, heard.append), heard


def test_a_units_benchmarks_are_announced_as_they_finish():
    ms, heard = _milestones({"short": 4, "long": 8, "mid": 4})
    for done in (0, 2, 4, 10, 12, 16):
        ms.update(done, 16)
    assert [(p.name, p.index, p.count, p.size, p.done_before) for p in heard] == \
        [("short", 1, 3, 4, 0), ("long", 2, 3, 8, 0), ("mid", 3, 3, 4, 0)]
    assert all(p.seconds >= 0 for p in heard)
    # one benchmark cached: the first update says how much, and the sizes say which ones are left to compute
    ms, heard = _milestones({"short": 4, "long": 8, "mid": 2})
    for done in (8, 12, 14):
        ms.update(done, 14)
    assert [(p.name, p.index, p.count, p.done_before) for p in heard] == [("short", 1, 2, 1), ("mid", 2, 2, 1)]
    # ... unless two sets of benchmarks that end at different counts fit (long, or short + mid): then nothing
    ms, heard = _milestones({"short": 4, "long": 8, "mid": 4})
    for done in (8, 12, 16):
        ms.update(done, 16)
    assert heard == []
    # equal sizes, one cached: which is left is open, so the benchmarks are counted, not named
    ms, heard = _milestones({"a": 4, "b": 4, "c": 4})
    for done in (4, 8, 12):
        ms.update(done, 12)
    assert [(p.name, p.index, p.count) for p in heard] == [(None, 1, 2), (None, 2, 2)]
    # sizes that do not describe the work, or a unit found whole in the cache: nothing is announced
    for sizes, updates in (({"a": 4}, [(0, 6), (6, 6)]), ({"a": 4, "b": 4}, [(8, 8)]), ({}, [(0, 4), (4, 4)])):
        ms, heard = _milestones(sizes)
        for done, total in updates:
            ms.update(done, total)
        assert heard == [], sizes


def test_benchmark_lines():
    Passed = fp.progress.Passed
    assert fp.benchmark_line("evaluate-tandem-step-8-solo", Passed("arith-long", 1, 3, 16, 2.04, 0)) == \
        "evaluate-tandem-step-8-solo: arith-long done (1 of 3), 16 generations in 2.0 s"
    assert fp.benchmark_line("u", Passed("b", 2, 2, 8, 0.5, 1)) == "u: b done (2 of 2, 1 cached), 8 generations in 0.5 s"
    assert fp.benchmark_line("u", Passed(None, 1, 2, 8, 0.5, 1)) == \
        "u: benchmark 1 of 2 done (1 cached), 8 generations in 0.5 s"


def test_run_tags(tmp_path, monkeypatch):
    """The params file, the params' fingerprint (the digits of a `dvc repro` run's W&B group), the code's commit
    and, under `dvc exp run`, the experiment."""
    from tandem.config import params_from_dict
    from tasks import tracking

    params = params_from_dict({"seed": 3})
    for var in (tracking.EXP_ENV, tracking.GROUP_ENV, "TANDEM_GIT_COMMIT"):
        monkeypatch.delenv(var, raising=False)
    assert tracking.group(params) == f"tandem-{fp.params_fingerprint(params)}"
    assert fp.params_fingerprint(params) != fp.params_fingerprint(params_from_dict({"seed": 4}))
    assert fp.run_tags("params.yaml", params, tmp_path) == ["params:params.yaml",
                                                            f"params-sha:{fp.params_fingerprint(params)}"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "c"], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    monkeypatch.setenv(tracking.EXP_ENV, "lr-3e-4")
    tags = fp.run_tags(str(tmp_path / "params.study.yaml"), params, tmp_path)
    assert tags == ["params:params.study.yaml", f"params-sha:{fp.params_fingerprint(params)}",
                    f"git:{head.strip()[:12]}", "exp:lr-3e-4"]


def test_unit_tables_are_rounded_and_logged_as_one_line():
    from tandem.config import params_from_dict

    params = params_from_dict({"evaluate": {"ks": [1, 4]}})
    summaries = {"b2": {"n_problems": 8, "pass@1": 0.12499999999999999, "pass@4": 0.5, "senior_share": 0.5123,
                        "mean_tokens": 87.69791}, "b1": {"n_problems": 500, "pass@1": 0.20312499, "pass@4": 0.75,
                                                          "senior_share": 1.0, "mean_tokens": 12.0}}
    rows = fp.unit_rows(params, {"arm": "tandem", "step": 8, "mode": "solo"}, summaries)
    assert [r["benchmark"] for r in rows] == ["b1", "b2"]
    assert rows[1] == {"arm": "tandem", "step": 8, "mode": "solo", "benchmark": "b2", "problems": 8, "pass@1": 0.12,
                       "pass@4": 0.5, "senior share": 0.51, "mean tokens": 87.7}
    assert rows[0]["pass@1"] == 0.203  # 500 problems resolve a third decimal
    line = fp.result_line("evaluate-tandem-step-8-solo", rows, 1)
    assert line == "evaluate-tandem-step-8-solo: pass@1 b1 0.203, b2 0.12 (problems: 8, 500)"
    rows[1]["pass@1"] = 0.3  # a rounded 0.30 keeps its digits
    assert fp.result_line("u", rows, 1) == "u: pass@1 b1 0.203, b2 0.30 (problems: 8, 500)"


def _dvc(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A scratch DVC project (no git) with the fake dvc.yaml and params.yaml; cwd moves into it."""
    root = tmp_path / "proj"
    root.mkdir()
    assert _dvc(root, "init", "--no-scm", "-q").returncode == 0
    (root / "dvc.yaml").write_text(fake_stages.DVC_YAML)
    (root / "params.yaml").write_text(fake_stages.PARAMS_YAML)
    (root / "src.txt").write_text("source")
    monkeypatch.chdir(root)
    return root


def test_dvc_sync_detection(project, tmp_path):
    assert DvcSync.detect("params.yaml", ".").root == project
    other = tmp_path / "other.yaml"
    other.write_text("seed: 0\n")
    assert not DvcSync.detect(other, ".").enabled and "not the project's params.yaml" in \
        DvcSync.detect(other, ".").reason
    assert "out_root" in DvcSync.detect("params.yaml", str(tmp_path)).reason
    assert DvcSync.detect("params.yaml", ".", "off").reason == "turned off"
    with pytest.raises(RuntimeError, match="impossible"):
        DvcSync.detect(other, ".", "on")
    # adopt (a worker's own clone): the other params file becomes the project's params.yaml, sync stays on
    adopted = DvcSync.detect(other, ".", "adopt")
    assert adopted.root == project and "adopted" in adopted.reason
    assert (project / "params.yaml").read_text() == "seed: 0\n"


def _use_fakes(monkeypatch, rec):
    monkeypatch.setattr(fake_stages, "ACTIVE", fake_stages.modules(rec))
    monkeypatch.setattr(fp, "_stage", fake_stages.stage)


def _task_runs(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def _subflow_runs(parent_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))


def _artifacts(*flow_run_ids):
    """Every artifact of these flow runs, keyed or not."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=list(flow_run_ids))))


def _logs(*flow_run_ids):
    """The log records of these flow runs (and their task runs), once the API has them all."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    # the run's log records reach the API in batches, the last after the run has returned: send them first
    APILogWorker.drain_all(timeout=60, at_exit=False)
    with get_client(sync_client=True) as client:
        return client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=list(flow_run_ids))))


@pytest.mark.slow
def test_flow_wiring_and_dvc_agreement(project, monkeypatch, prefect_api):
    rec = fake_stages.Recorder()
    _use_fakes(monkeypatch, rec)
    before = json.loads(_dvc(project, "status", "--json").stdout or "{}")
    assert set(before) == {"prepare", "base", "train@tandem", "train@grpo", "evaluate", "analyze", "report"}

    state = fp.tandem_pipeline(params_path="params.yaml", live=False, return_state=True)
    assert state.is_completed(), state
    result = state.result()
    assert result["report"].endswith("reports/report.html") and Path(result["report"]).exists()
    assert "committing stages" in result["dvc"]

    # order: whole stages in sequence, one training run per arm, every unit before the evaluate stage task
    units = [c for c in rec.calls if c.startswith("unit-")]
    assert rec.calls[:4] == ["prepare", "base", "train-tandem", "train-grpo"]
    assert rec.calls[4:4 + len(units)] == units
    assert rec.calls[4 + len(units):] == ["evaluate-collect", "analyze", "report"]
    assert sorted(units) == sorted(["unit-tandem-0-solo", "unit-tandem-0-step", "unit-tandem-2-solo",
                                    "unit-tandem-2-step", "unit-grpo-2-solo", "unit-grpo-2-step"])

    # the Prefect view: one task run per DVC stage; the units (in the evaluation subflow) one each, with a
    # table and a progress artifact; a progress artifact per arm; the report artifact holds the report
    runs = _task_runs(state.state_details.flow_run_id)
    names = {r.name for r in runs}
    assert {"prepare", "base", "train@tandem", "train@grpo", "evaluate", "analyze", "report"} <= names
    sub = _subflow_runs(state.state_details.flow_run_id)
    assert len(sub) == 1
    evals = {r.name: r for r in _task_runs(sub[0].id)}
    assert len(evals) == 6 and all(r.state.is_completed() for r in evals.values())
    arts = _artifacts(state.state_details.flow_run_id, sub[0].id)
    # keyed: only what runs are compared by (no promotion asked for here); the rest keyless, in its task run
    keyed = {a.key: a for a in arts if a.key}
    assert set(keyed) == {"tandem-report", "evaluation-summary"}
    assert keyed["tandem-report"].type == "markdown" and "file://" not in keyed["tandem-report"].data
    assert "# r" in keyed["tandem-report"].data
    by_task: dict = {}
    for a in arts:
        if not a.key:
            by_task.setdefault(a.task_run_id, []).append(a)
    by_name = {r.name: r.id for r in [*runs, *evals.values()]}
    for arm in ("tandem", "grpo"):
        (art,) = by_task[by_name[f"train@{arm}"]]
        assert art.type == "progress" and art.data == 100.0
    for name in evals:  # one progress artifact (finished) and one pass@k table per unit, in the unit's task run
        kinds = {a.type: a for a in by_task[by_name[name]]}
        assert sorted(a.type for a in by_task[by_name[name]]) == ["progress", "table"], name
        assert kinds["progress"].data == 100.0 and kinds["table"].description.startswith(f"{name}: pass@k")
    assert set(by_task) <= {by_name[n] for n in ("train@tandem", "train@grpo", *evals)}

    # each unit logs a line per benchmark as it finishes, before its result line
    logs = _logs(state.state_details.flow_run_id, sub[0].id)
    unit = evals["evaluate-grpo-step-2-solo"].id
    lines = [lg.message for lg in sorted(logs, key=lambda lg: lg.timestamp)
             if lg.task_run_id == unit and lg.message.startswith("evaluate-")]  # not Prefect's own "Finished ..."
    assert [re.sub(r"in [0-9.]+ s$", "in - s", m) for m in lines] == [
        "evaluate-grpo-step-2-solo: b1 done (1 of 2), 4 generations in - s",
        "evaluate-grpo-step-2-solo: b2 done (2 of 2), 4 generations in - s",
        "evaluate-grpo-step-2-solo: pass@1 b1 0.50, b2 0.25 (2 problems each)"], lines

    # DVC agrees: dvc.lock records every stage and nothing is out of date
    status = _dvc(project, "status", "--json")
    assert status.returncode == 0 and json.loads(status.stdout or "{}") == {}, status.stdout + status.stderr
    assert set(yaml.safe_load((project / "dvc.lock").read_text())["stages"]) == \
        {"prepare", "base", "train@tandem", "train@grpo", "evaluate", "analyze", "report"}


@pytest.mark.slow
def test_training_failure_is_not_retried_and_not_committed(project, monkeypatch, prefect_api):
    rec = fake_stages.Recorder(fail={"train-grpo"})
    _use_fakes(monkeypatch, rec)
    state = fp.tandem_pipeline(params_path="params.yaml", live=False, return_state=True)
    assert state.is_failed()
    assert rec.calls == ["prepare", "base", "train-tandem", "train-grpo"]  # one attempt, nothing after it
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert set(lock) == {"prepare", "base", "train@tandem"}  # each arm is its own DVC stage


@pytest.mark.slow
def test_a_failed_unit_fails_the_flow_before_collect(project, monkeypatch, prefect_api):
    rec = fake_stages.Recorder(fail={"unit-grpo-2-step"})
    _use_fakes(monkeypatch, rec)
    state = fp.tandem_pipeline(params_path="params.yaml", live=False, dvc="off", return_state=True)
    assert state.is_failed()
    assert "evaluate-collect" not in rec.calls and "report" not in rec.calls
    assert not (project / "dvc.lock").exists()  # dvc="off": nothing committed


@pytest.mark.slow
def test_a_rerun_with_nothing_changed_runs_nothing(project, monkeypatch, prefect_api):
    rec = fake_stages.Recorder()
    _use_fakes(monkeypatch, rec)
    assert fp.tandem_pipeline(params_path="params.yaml", live=False, return_state=True).is_completed()
    first = list(rec.calls)
    lock = (project / "dvc.lock").read_text()
    state = fp.tandem_pipeline(params_path="params.yaml", live=False, return_state=True)
    assert state.is_completed()
    assert rec.calls == first  # dvc.lock says every stage is current: nothing ran again
    assert (project / "dvc.lock").read_text() == lock
    assert all(v == {"skipped": True} for v in state.result()["stages"].values()), state.result()["stages"]
    # every stage is a task run, in the "Skipped" state
    runs = {r.name: r.state for r in _task_runs(state.state_details.flow_run_id)}
    for name in ("prepare", "base", "train@tandem", "train@grpo", "evaluate", "analyze", "report"):
        assert runs[name].name == "Skipped" and runs[name].is_completed(), (name, runs[name])
    # a changed parameter makes its stage and everything downstream stale again (as for dvc repro)
    (project / "params.yaml").write_text(fake_stages.PARAMS_YAML.replace("\n  steps: 2\n", "\n  steps: 3\n"))
    assert fp.tandem_pipeline(params_path="params.yaml", live=False, return_state=True).is_completed()
    assert rec.calls[len(first):][:2] == ["train-tandem", "train-grpo"]
    assert "prepare" not in rec.calls[len(first):] and "base" not in rec.calls[len(first):]


@pytest.mark.slow
@pytest.mark.integration
def test_evaluation_units_on_a_local_dask_cluster(project, monkeypatch, prefect_api):
    """eval_runner='dask': the units run on a Dask cluster (local, one in-process worker) through
    prefect-dask, still one task run each, then the evaluate stage task and the rest as usual."""
    rec = fake_stages.Recorder()
    _use_fakes(monkeypatch, rec)
    state = fp.tandem_pipeline(params_path="params.yaml", live=False, eval_runner="dask", return_state=True)
    assert state.is_completed(), state
    (sub,) = _subflow_runs(state.state_details.flow_run_id)
    units = _task_runs(sub.id)
    assert len(units) == 6 and all(r.state.is_completed() for r in units)
    assert sorted(c for c in rec.calls if c.startswith("unit-")) == sorted(
        f"unit-{r.name.split('-')[1]}-{r.name.split('-')[3]}-{r.name.split('-')[4]}" for r in units)
    assert rec.calls[-3:] == ["evaluate-collect", "analyze", "report"]


def _stage_edges(flow_run_id, parent_names: dict) -> dict[str, set[str]]:
    """stage -> the stages its task runs are linked to in Prefect's graph (task-run inputs read back from the
    API, `wait_for` included), the evaluate stage being its plan, its units' subflow and its own task run."""
    runs = {r.id: r for r in _task_runs(flow_run_id)}

    def stage_of(run) -> str | None:
        if run.name == "evaluate-plan" or run.name.startswith("tandem-evaluate-units"):
            return "evaluate"
        return run.name if run.name in parent_names else None

    edges: dict[str, set[str]] = {}
    for run in runs.values():
        stage = stage_of(run)
        if stage is None:
            continue
        linked = {i.id for inputs in run.task_inputs.values() for i in inputs if getattr(i, "input_type", "") == "task_run"}
        edges.setdefault(stage, set()).update(
            s for s in (stage_of(runs[i]) for i in linked if i in runs) if s is not None and s != stage)
    return edges


@pytest.mark.slow
def test_flow_graph_is_dvc_yamls_graph_and_logs_hold_no_warning(project, monkeypatch, prefect_api):
    """Prefect draws its graph from the task runs' inputs: they must carry exactly dvc.yaml's edges, on a run
    that computes every stage and on one that skips them all; a healthy run logs nothing at WARNING."""
    from flows.dvc_sync import pipeline_stages
    from tandem.config import params_from_dict

    _use_fakes(monkeypatch, fake_stages.Recorder())
    specs = pipeline_stages(project / "dvc.yaml", params_from_dict(yaml.safe_load(fake_stages.PARAMS_YAML)).to_dict())
    expected = {s.name: set(s.after) for s in specs}
    assert expected["train@grpo"] == {"prepare", "base"} and "train@tandem" not in expected["train@grpo"]
    for _ in ("computes every stage", "skips every stage"):
        state = fp.tandem_pipeline(params_path="params.yaml", live=False, return_state=True)
        assert state.is_completed(), state
        run_id = state.state_details.flow_run_id
        assert _stage_edges(run_id, expected) == expected
        logs = _logs(run_id, *[r.id for r in _subflow_runs(run_id)])
        assert logs and not [(lg.level, lg.message) for lg in logs if lg.level >= 30]


@pytest.mark.slow
def test_evaluation_can_be_followed_while_it_runs(project, monkeypatch, prefect_api):
    """On the Prefect server, while a unit runs: its progress artifact shows how far it is, and the running
    evaluation summary holds the units finished so far (rounded); at the end, every unit."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey,
                                                ArtifactFilterTaskRunId, TaskRunFilter, TaskRunFilterName,
                                                TaskRunFilterState, TaskRunFilterStateType)
    from prefect.client.schemas.objects import StateType

    rec = fake_stages.Recorder(hold=3)  # units run one at a time: three are done when the fourth is held
    _use_fakes(monkeypatch, rec)
    monkeypatch.setattr(fp.progress, "POLL_SECONDS", 0.2)
    seen: dict = {}

    def artifacts(key, flow_run_id=None):
        """Every version of artifact `key` (of one flow run, if given), newest first."""
        flt = ArtifactFilter(key=ArtifactFilterKey(any_=[key]),
                             **({"flow_run_id": ArtifactFilterFlowRunId(any_=[flow_run_id])} if flow_run_id else {}))
        with get_client(sync_client=True) as client:
            return sorted(client.read_artifacts(artifact_filter=flt), key=lambda a: a.created, reverse=True)

    def rows(art):
        return json.loads(art.data) if isinstance(art.data, str) else art.data

    def progress_of(label):
        """The keyless progress artifacts of the running task run named `label` (the held unit)."""
        running = TaskRunFilter(name=TaskRunFilterName(any_=[label]),
                                state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.RUNNING])))
        with get_client(sync_client=True) as client:
            ids = [r.id for r in client.read_task_runs(task_run_filter=running)]
            if not ids:
                return []
            return [a for a in client.read_artifacts(artifact_filter=ArtifactFilter(
                task_run_id=ArtifactFilterTaskRunId(any_=ids))) if a.type == "progress"]

    def watch():
        try:
            assert rec.held.wait(120)
            _, arm, step, mode = rec.held_unit.split("-")
            label = fp.unit_label({"arm": arm, "step": step, "mode": mode})
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not ("progress" in seen and "summary" in seen):
                progress_arts = progress_of(label)
                if progress_arts and 0 < progress_arts[0].data < 100:
                    seen["progress"] = progress_arts[0].data
                    summary = artifacts(fp.SUMMARY_KEY, progress_arts[0].flow_run_id)
                    if summary and "3 of 6 units done" in summary[0].description:
                        seen["summary"] = rows(summary[0])
                time.sleep(0.2)
        finally:
            rec.release.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    state = fp.tandem_pipeline(params_path="params.yaml", live=False, dvc="off", return_state=True)
    watcher.join(timeout=30)
    assert state.is_completed(), state
    assert seen.get("progress") == 25.0 and "summary" in seen, seen
    units = [c for c in rec.calls if c.startswith("unit-")]
    first_three = {tuple(u.split("-")[1:]) for u in units[:3]}
    assert {(r["arm"], str(r["step"]), r["mode"]) for r in seen["summary"]} == first_three
    assert seen["summary"][0].keys() >= {"arm", "step", "mode", "benchmark", "problems", "pass@1"}
    assert {r["pass@1"] for r in seen["summary"]} == {0.5, 0.25}
    (sub,) = _subflow_runs(state.state_details.flow_run_id)
    final = artifacts(fp.SUMMARY_KEY, sub.id)
    assert len(final) == 6 and "6 of 6 units done" in final[0].description and len(rows(final[0])) == 12


@pytest.mark.slow
def test_flow_runs_and_their_tasks_carry_the_runs_tags(project, monkeypatch, prefect_api):
    """The flow run, its task runs and its evaluation subflow carry the params file, the params' fingerprint,
    the code's commit and the experiment's name (DVC_EXP_NAME)."""
    from prefect.client.orchestration import get_client

    from tasks.common import load_params

    _use_fakes(monkeypatch, fake_stages.Recorder())
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    subprocess.run(["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "c"], check=True)
    head = subprocess.run(["git", "-C", str(project), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    monkeypatch.setenv("DVC_EXP_NAME", "exp-41")
    state = fp.tandem_pipeline(params_path="params.yaml", live=False, dvc="off", return_state=True)
    assert state.is_completed(), state
    expected = {"params:params.yaml", f"params-sha:{fp.params_fingerprint(load_params('params.yaml'))}",
                f"git:{head}", "exp:exp-41"}
    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        assert expected <= set(client.read_flow_run(run_id).tags)
    (sub,) = _subflow_runs(run_id)
    assert expected <= set(sub.tags)
    tasks = [*_task_runs(run_id), *_task_runs(sub.id)]
    assert len(tasks) > 8 and all(expected <= set(t.tags) for t in tasks), [(t.name, t.tags) for t in tasks]


@pytest.mark.slow
def test_units_draw_no_bars_of_their_own_in_the_flow(project, monkeypatch, prefect_api):
    """The flow runs the evaluation units with `evaluate.progress` off, live view or not: it reports their
    progress itself (view, artifact, a log line per benchmark)."""
    rec = fake_stages.Recorder()
    _use_fakes(monkeypatch, rec)
    (project / "params.yaml").write_text(fake_stages.PARAMS_YAML.replace("\n  progress: false\n",
                                                                         "\n  progress: true\n"))
    for live in (True, False):
        rec.unit_bars.clear()
        assert fp.tandem_pipeline(params_path="params.yaml", live=live, dvc="off", return_state=True).is_completed()
        assert rec.unit_bars and set(rec.unit_bars) == {False}, (live, rec.unit_bars)


@pytest.mark.slow
def test_each_stage_is_pushed_once_committed_and_a_folder_remote_is_refused_on_an_ephemeral_worker(
        project, monkeypatch, prefect_api, tmp_path):
    """`sharing.push`: every stage that ran is pushed to the DVC remote right after its commit (task runs
    `dvc-push:<stage>`), before the run's final push; with TANDEM_EPHEMERAL_WORKER=1 a folder remote is refused
    in one line before any stage runs (tasks/durable.py)."""
    from tasks.durable import EPHEMERAL_ENV

    remote = tmp_path / "remote"
    assert _dvc(project, "remote", "add", "-d", "store", str(remote)).returncode == 0
    rec = fake_stages.Recorder()
    _use_fakes(monkeypatch, rec)
    monkeypatch.setenv(EPHEMERAL_ENV, "1")
    state = fp.tandem_training(params_path="params.yaml", live=False, sharing=fp.Sharing(push=True),
                               return_state=True)
    assert state.is_failed() and rec.calls == []
    with pytest.raises(Exception) as e:
        state.result()
    assert "is a folder" in str(e.value) and "lost with the worker" in str(e.value) and "\n" not in str(e.value)

    monkeypatch.delenv(EPHEMERAL_ENV)
    state = fp.tandem_training(params_path="params.yaml", live=False, sharing=fp.Sharing(push=True),
                               return_state=True)
    assert state.is_completed(), state
    runs = {r.name: r for r in _task_runs(state.state_details.flow_run_id)}
    stages = ["prepare", "base", "train@tandem", "train@grpo"]
    assert {f"dvc-push:{s}" for s in stages} | {"dvc-push"} <= set(runs)
    for s in stages:  # each stage's push starts after that stage and before the next one ends
        assert runs[f"dvc-push:{s}"].start_time >= runs[s].end_time
    assert sum(1 for p in remote.rglob("*") if p.is_file()) > 0
    status = _dvc(project, "status", "--cloud", "--json", *stages)  # the remote holds what they committed
    assert status.returncode == 0 and json.loads(status.stdout or "{}") == {}, status.stdout + status.stderr
