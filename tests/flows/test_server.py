"""The pipeline deployed on a real Prefect server: server, work pools, `prefect deploy` from
infra/prefect.yaml, a process worker, one triggered run of the real stages on a tiny config.

The run happens in a scratch copy of the project (its own `.dvc/`, params.yaml = tests/flows/tiny_params.yaml)
so the test also checks the two orchestrators agree: after the flow run, `dvc status` there is clean.
Everything the test starts (server, worker, the worker's flow-run process) is stopped by process group.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tandem.config import params_from_dict

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# What the copy leaves out: environments, VCS, generated outputs (top level only), caches (anywhere).
_TOP = {".venv", ".git", ".dvc", "dvc.lock", "models", "results", "reports", "metrics", "runs", "wandb", "registry",
        "scratch", ".prefect", ".pytest_cache", "dvc-remote"}


def _ignore(directory: str, names: list[str]) -> set[str]:
    rel = Path(directory).resolve().relative_to(REPO)
    out = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
    if rel == Path("."):
        out |= _TOP & set(names)
    if rel == Path("data"):
        out |= {"prepared"} & set(names)
    return out

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM the process group we created, wait, SIGKILL what is left."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _post(api: str, path: str, body: dict) -> list | dict:
    r = httpx.post(f"{api}{path}", json=body, timeout=30)
    r.raise_for_status()
    return r.json()


def _run(cmd: list[str], env: dict, cwd: Path, timeout: float = 120) -> str:
    res = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


@pytest.fixture
def project(tmp_path) -> Path:
    copy = tmp_path / "project"
    shutil.copytree(REPO, copy, ignore=_ignore)
    # every key resolved and written out: dvc.yaml may name any of them as a stage parameter
    tiny = yaml.safe_load((REPO / "tests" / "flows" / "tiny_params.yaml").read_text())
    params = params_from_dict({**tiny, "out_root": "."}).to_dict()
    (copy / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    res = subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=copy, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return copy


def test_deployment_runs_the_tiny_pipeline_on_a_real_server(project, tmp_path):
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ,
           "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
           "PREFECT_UI_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "INFO",
           # the deployment's pull step moves into the copy; the copy's code shadows the editable install
           "TANDEM_PROJECT_DIR": str(project), "TANDEM_IMAGE": "registry.invalid/tandem:test",
           "PYTHONPATH": str(project), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "DVC_NO_ANALYTICS": "1",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    prefect = str(BIN / "prefect")
    logs = tmp_path / "logs"
    logs.mkdir()
    started: list[subprocess.Popen] = []
    try:
        server = subprocess.Popen([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                  env=env, cwd=tmp_path, stdout=open(logs / "server.log", "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        started.append(server)
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (logs / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{api}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server not healthy in 180 s"
            time.sleep(1)

        _run([prefect, "work-pool", "create", "cpu", "--type", "process"], env, project)
        # the GPU pool's template is validated by the server (every placeholder declared, etc.)
        _run([prefect, "work-pool", "create", "gpu", "--type", "kubernetes", "--base-job-template",
              "infra/work-pools/gpu-kubernetes.json"], env, project)
        _run([prefect, "--no-prompt", "deploy", "--all", "--prefect-file", "infra/prefect.yaml"], env, project)

        deps = {d["name"]: d for d in _post(api, "/deployments/filter", {})}
        assert set(deps) == {"scheduled-retraining", "retraining-gpu", "evaluate-checkpoints"}
        sched = deps["scheduled-retraining"]
        assert [s["schedule"]["cron"] for s in sched["schedules"]] == ["0 3 * * 1"]
        assert sched["work_pool_name"] == "cpu" and deps["evaluate-checkpoints"]["work_pool_name"] == "gpu"
        assert sched["pull_steps"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == str(project)

        worker = subprocess.Popen([prefect, "worker", "start", "--pool", "cpu", "--name", "tandem-test",
                                   "--limit", "1"], env=env, cwd=project, stdout=open(logs / "worker.log", "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        started.append(worker)
        out = _run([prefect, "deployment", "run", "tandem-pipeline/scheduled-retraining", "--param", "tag=false"],
                   env, project)
        assert "Created flow run" in out

        # wait for the run to finish (a few minutes on 2 cores)
        deadline = time.monotonic() + 900
        while True:
            runs = _post(api, "/flow_runs/filter", {"deployments": {"id": {"any_": [sched["id"]]}}})
            state = runs[0]["state"]["type"] if runs else None
            if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
            assert worker.poll() is None, (logs / "worker.log").read_text()[-4000:]
            assert time.monotonic() < deadline, f"flow run not finished in 900 s (state {state})"
            time.sleep(3)
        run = runs[0]
        assert state == "COMPLETED", (logs / "worker.log").read_text()[-6000:]

        # every evaluation unit of the plan is a completed task run of its own
        task_runs = _post(api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}})
        by_name = {t["name"]: t["state"]["type"] for t in task_runs}
        evals = {n: s for n, s in by_name.items() if n.startswith("evaluate-") and "-step-" in n}
        plan = _plan_units(project, env)
        assert sorted(evals) == sorted(f"evaluate-{u['arm']}-step-{u['step']}-{u['mode']}" for u in plan)
        assert evals and set(evals.values()) == {"COMPLETED"}
        for name in ("prepare", "base", "train-tandem", "train-grpo", "train-commit", "evaluate-collect",
                     "analyze", "report", "promote"):
            assert by_name.get(name) == "COMPLETED", (name, by_name)

        arts = _post(api, "/artifacts/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}})
        keys = {a["key"]: a for a in arts}
        assert keys["tandem-report"]["type"] == "markdown"
        assert (project / "reports" / "report.html").resolve().as_uri() in keys["tandem-report"]["data"]
        assert sum(a["type"] == "table" for a in arts) == len(plan)

        # the outputs exist, promotion ran (first promotion), and DVC agrees with what the flow produced
        assert (project / "reports" / "report.html").stat().st_size > 10_000
        assert (project / "registry" / "promoted.json").exists()
        status = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=project, env=env,
                                capture_output=True, text=True, timeout=300)
        assert status.returncode == 0 and json.loads(status.stdout or "{}") == {}, status.stdout + status.stderr
        lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
        groups = list(dict.fromkeys(name.split("@")[0] for name in lock))  # train@<arm> -> train
        assert groups == list(yaml.safe_load((project / "dvc.yaml").read_text())["stages"])
        assert [n for n in lock if n.startswith("train@")] == ["train@tandem", "train@grpo"]
    finally:
        for proc in reversed(started):
            _stop(proc)
    assert all(p.poll() is not None for p in started)


def _plan_units(project: Path, env: dict) -> list[dict]:
    code = ("import json; from tasks.common import load_params; from tasks import evaluate; "
            "p = load_params('params.yaml'); print(json.dumps(evaluate.plan(p)))")
    out = _run([sys.executable, "-c", code], env, project)
    return json.loads(out.strip().splitlines()[-1])
