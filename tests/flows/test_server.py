"""The deployments on a real Prefect server with real process workers that keep no state.

A bare git repository (`origin`) holds a copy of the project with a tiny params.yaml
(tests/flows/tiny_params.yaml) and a local DVC remote. `prefect deploy` registers infra/prefect.yaml
against it. Then three workers, each started in its own empty directory with its own PREFECT_HOME, each
flow run in a fresh temporary directory (the process worker's default):

1. runs the `training` deployment: its pull steps clone origin and `dvc pull` (nothing yet); it trains and
   pushes the checkpoints to the DVC remote and dvc.lock + metrics to origin;
2. runs the `evaluation` deployment: a fresh clone pulls those checkpoints, evaluates them (train stages are
   not part of this flow), reports, promotes (GTO tags) and pushes;
3. runs `scheduled-retraining`: a fresh clone sees every stage up to date (each a task run in the "Skipped"
   state) and the promotion (the gate says "already promoted", the report artifact says so).

Along the way: every stage has a task run, stage logs reach the run's logs, progress artifacts exist (keyless,
in their task runs), the only keyed artifacts are the report (which holds the report), the promotion decision
and the evaluation summary, flow runs carry the run's tags, every deployment carries a concurrency limit. Everything the test starts
(workers and their flow-run processes) is stopped by process group; the server is the session's
(tests/flows/conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
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
_TOP = {".venv", ".venv-vllm", ".tandem.lock", ".git", ".dvc", "dvc.lock", "models", "results", "reports", "metrics", "runs", "wandb", "registry",
        "scratch", ".prefect", ".pytest_cache", "dvc-remote"}
STAGES = ("prepare", "base", "junior", "train@tandem", "train@grpo", "evaluate", "analyze", "report")

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _ignore(directory: str, names: list[str]) -> set[str]:
    rel = Path(directory).resolve().relative_to(REPO)
    out = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
    if rel == Path("."):
        out |= _TOP & set(names)
    if rel == Path("data"):
        out |= {"prepared"} & set(names)
    return out


def _flow_runs_below(pid: int) -> list[int]:
    """The flow-run processes (`python -m prefect.engine`) a worker started and that still run (Linux /proc)."""
    from train_fixtures import descendants

    out = []
    for p in descendants(pid):
        try:
            if b"prefect.engine" in Path(f"/proc/{p}/cmdline").read_bytes():
                out.append(p)
        except OSError:
            continue
    return out


def _let_flow_runs_exit(worker: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until the worker's flow-run processes have exited. A flow run reports its final state before its
    process ships its last log batch; stopping the worker's process group at once would kill it mid-flush
    (a loaded machine widens that window) and lose the run's last log lines."""
    deadline = time.monotonic() + timeout
    while worker.poll() is None and _flow_runs_below(worker.pid) and time.monotonic() < deadline:
        time.sleep(0.5)


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


def _run(cmd: list[str], env: dict, cwd: Path, timeout: float = 300) -> str:
    res = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def _git(cwd: Path, *args: str) -> str:
    return _run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], dict(os.environ), cwd)


class Api:
    def __init__(self, url: str):
        self.url = url

    def post(self, path: str, body: dict) -> list | dict:
        r = httpx.post(f"{self.url}{path}", json=body, timeout=30)
        r.raise_for_status()
        return r.json()

    def get(self, path: str) -> dict:
        r = httpx.get(f"{self.url}{path}", timeout=30)
        r.raise_for_status()
        return r.json()

    def task_runs(self, flow_run_id: str) -> dict[str, dict]:
        runs = self.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
        return {t["name"]: t for t in runs}

    def subflows(self, flow_run_id: str) -> list[dict]:
        return self.post("/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [flow_run_id]}}})

    def artifacts(self, *flow_run_ids: str) -> dict[str, dict]:
        """The keyed artifacts of these flow runs, by key."""
        arts = self.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": list(flow_run_ids)}}})
        return {a["key"]: a for a in arts if a.get("key")}

    def task_artifacts(self, flow_run_id: str) -> dict[str, list[dict]]:
        """The keyless artifacts of a flow run's task runs, by task run name."""
        names = {t["id"]: n for n, t in self.task_runs(flow_run_id).items()}
        arts = self.post("/artifacts/filter", {"artifacts": {"task_run_id": {"any_": list(names)}}})
        out: dict[str, list[dict]] = {}
        for a in arts:
            if not a.get("key"):
                out.setdefault(names[a["task_run_id"]], []).append(a)
        return out

    def wait_log(self, flow_run_id: str, needle: str, timeout: float = 90.0) -> str:
        """The run's logs once they contain `needle`: workers ship log records in batches, so the last lines
        can reach the API a little after the run's final state."""
        deadline = time.time() + timeout
        while True:
            text = self.logs(flow_run_id)
            if needle in text or time.time() > deadline:
                return text
            time.sleep(1.0)

    def logs(self, flow_run_id: str) -> str:
        out, offset = [], 0
        while True:
            page = self.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "offset": offset,
                                              "limit": 200})
            out += [entry["message"] for entry in page]
            if len(page) < 200:
                return "\n".join(out)
            offset += 200


@pytest.fixture
def origin(tmp_path) -> tuple[Path, Path]:
    """A bare git repository holding the project with a tiny params.yaml, and its local DVC remote."""
    seed, bare, remote = tmp_path / "seed", tmp_path / "origin.git", tmp_path / "dvc-remote"
    shutil.copytree(REPO, seed, ignore=_ignore)
    tiny = yaml.safe_load((REPO / "tests" / "flows" / "tiny_params.yaml").read_text())
    # every key resolved and written out: dvc.yaml may name any of them as a stage parameter
    (seed / "params.yaml").write_text(yaml.safe_dump(params_from_dict({**tiny, "out_root": "."}).to_dict(),
                                                     sort_keys=False))
    remote.mkdir()
    _git(seed, "init", "-q", "-b", "main")
    _run([sys.executable, "-m", "dvc", "init", "-q"], dict(os.environ), seed)
    _run([sys.executable, "-m", "dvc", "config", "core.analytics", "false"], dict(os.environ), seed)
    _run([sys.executable, "-m", "dvc", "remote", "add", "-d", "store", str(remote)], dict(os.environ), seed)
    _git(seed, "add", "-A")
    _git(seed, "commit", "-q", "-m", "tiny tandem project")
    _git(tmp_path, "clone", "-q", "--bare", str(seed), str(bare))
    return bare, remote


def test_stateless_workers_train_evaluate_promote(origin, tmp_path, prefect_api):
    from prefect.settings import PREFECT_API_URL

    bare, remote = origin
    api = Api(PREFECT_API_URL.value())
    env = {**os.environ, "PREFECT_API_URL": api.url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_LOGGING_LEVEL": "INFO", "TANDEM_GIT_URL": bare.as_uri(), "TANDEM_GIT_REF": "main",
           "TANDEM_IMAGE": "registry.invalid/tandem:test", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
           "DVC_NO_ANALYTICS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)  # the flow runs the code of its clone, nothing else
    prefect = str(BIN / "prefect")
    checkout = tmp_path / "deployer"
    _git(tmp_path, "clone", "-q", bare.as_uri(), str(checkout))

    # pools and deployments (the GPU ones too: their pull steps and job variables must deploy). The GPU
    # deployments' git token is a Secret block, which must exist to deploy and stays a reference.
    from prefect.blocks.system import Secret

    Secret(value="not-a-real-token").save("tandem-git-token", overwrite=True)
    pools = {p["name"] for p in api.post("/work_pools/filter", {})}
    if "cpu" not in pools:
        _run([prefect, "work-pool", "create", "cpu", "--type", "process"], env, checkout)
    if "gpu" not in pools:
        _run([prefect, "work-pool", "create", "gpu", "--type", "kubernetes", "--base-job-template",
              "infra/work-pools/gpu-kubernetes.json"], env, checkout)
    _run([prefect, "--no-prompt", "deploy", "--all", "--prefect-file", "infra/prefect.yaml"], env, checkout)
    deps = {d["name"]: d for d in api.post("/deployments/filter", {})}
    expected = {"scheduled-retraining", "training", "evaluation", "retraining-gpu", "evaluate-checkpoints"}
    assert expected <= set(deps)
    for name in expected:  # one run at a time per deployment: each writes dvc.lock and the tags
        d = deps[name]
        limit = (d.get("global_concurrency_limit") or {}).get("limit", d.get("concurrency_limit"))
        assert limit == 1, (name, d.get("concurrency_limit"), d.get("global_concurrency_limit"))
        assert d["pull_steps"][0]["prefect.deployments.steps.git_clone"]["repository"] == bare.as_uri()
    assert [s["schedule"]["cron"] for s in deps["scheduled-retraining"]["schedules"]] == ["0 3 * * 1"]
    gpu_clone = deps["retraining-gpu"]["pull_steps"][0]["prefect.deployments.steps.git_clone"]
    assert gpu_clone["access_token"] == "{{ prefect.blocks.secret.tandem-git-token }}"  # by reference
    assert "not-a-real-token" not in json.dumps(deps["retraining-gpu"])

    def run_on_fresh_worker(deployment: str, label: str) -> dict:
        """A new worker in an empty directory runs one flow run of `deployment`; returns the finished run."""
        home, workdir = tmp_path / f"{label}-home", tmp_path / f"{label}-worker"
        workdir.mkdir()
        wenv = {**env, "PREFECT_HOME": str(home)}
        run = api.post(f"/deployments/{deps[deployment]['id']}/create_flow_run", {})
        log = tmp_path / f"{label}.log"
        worker = subprocess.Popen([prefect, "worker", "start", "--pool", "cpu", "--name", label, "--limit", "1"],
                                  env=wenv, cwd=workdir, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while True:
                state = api.get(f"/flow_runs/{run['id']}")["state"]
                if state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                    break
                assert worker.poll() is None, log.read_text()[-4000:]
                assert time.monotonic() < deadline, f"{deployment}: not finished in 600 s ({state['type']})"
                time.sleep(3)
        finally:
            _let_flow_runs_exit(worker)
            _stop(worker)
        assert state["type"] == "COMPLETED", f"{deployment}: {state}\n{log.read_text()[-6000:]}"
        assert not any(workdir.iterdir()), "the worker keeps nothing in its directory"
        return api.get(f"/flow_runs/{run['id']}")

    # 1. training on a fresh worker: checkpoints to the DVC remote, dvc.lock and metrics to origin
    train_run = run_on_fresh_worker("training", "w1")
    runs = api.task_runs(train_run["id"])
    for name in ("prepare", "base", "junior", "train@tandem", "train@grpo", "dvc-push", "git-commit", "git-push"):
        assert runs[name]["state"]["type"] == "COMPLETED", (name, runs.get(name, {}).get("state"))
    assert not any(n.startswith(("evaluate", "analyze", "report")) for n in runs)
    logs = api.wait_log(train_run["id"], "train@grpo: done")
    assert "base: corpus" in logs and "train@grpo: done" in logs and "DVC sync: committing" in logs
    arts = api.task_artifacts(train_run["id"])
    assert {a["data"] for arm in ("tandem", "grpo") for a in arts[f"train@{arm}"] if a["type"] == "progress"} == {100.0}
    assert not api.artifacts(train_run["id"])  # nothing keyed: no report, evaluation or promotion here
    run_tags = set(train_run["tags"])  # the deployment's, then the run's own
    assert {"tandem", "training", "params:params.yaml"} <= run_tags
    assert {t.split(":")[0] for t in run_tags if ":" in t} == {"params", "params-sha", "git"}
    lock = yaml.safe_load(_git(bare, "show", "main:dvc.lock"))["stages"]
    assert set(lock) == {"prepare", "base", "junior", "train@tandem", "train@grpo"}
    assert "metrics/train_grpo.json" in _git(bare, "ls-tree", "-r", "--name-only", "main")
    assert sum(1 for p in remote.rglob("*") if p.is_file()) > 10  # checkpoints, base model, data pushed

    # 2. evaluation on a second fresh worker: pulls the checkpoints, evaluates, reports, promotes, pushes
    eval_run = run_on_fresh_worker("evaluation", "w2")
    runs = api.task_runs(eval_run["id"])
    for name in ("evaluate-plan", "evaluate", "analyze", "report", "report-artifact", "promote", "git-push"):
        assert runs[name]["state"]["type"] == "COMPLETED", (name, runs.get(name, {}).get("state"))
    assert not any(n.startswith(("prepare", "base", "train")) for n in runs)  # no training here
    (units_run,) = api.subflows(eval_run["id"])
    units = api.task_runs(units_run["id"])
    assert units and all(n.startswith("evaluate-") and "-step-" in n for n in units)
    assert {u["state"]["type"] for u in units.values()} == {"COMPLETED"}
    unit_arts = api.task_artifacts(units_run["id"])
    assert all(sorted(a["type"] for a in unit_arts[n]) == ["progress", "table"] for n in units)
    arts = api.artifacts(eval_run["id"], units_run["id"])
    assert set(arts) == {"tandem-report", "tandem-promotion", "evaluation-summary"}
    assert "Promotion: promoted" in arts["tandem-promotion"]["data"]
    report = arts["tandem-report"]
    assert report["type"] == "markdown" and "file://" not in report["data"]
    assert "Promotion gate**: passes" in report["data"] and "|" in report["data"]  # the report's tables
    tags = _git(bare, "tag", "--list").split()
    assert {"tandem-model@v1.0.0", "tandem-model#prod#1"} <= set(tags)
    lock = yaml.safe_load(_git(bare, "show", "main:dvc.lock"))["stages"]
    assert {"evaluate", "analyze", "report"} <= set(lock)
    assert "promotion: promoted" in api.wait_log(eval_run["id"], "promotion: promoted")

    # 3. scheduled retraining on a third fresh worker: nothing changed, so every stage is a Skipped task run,
    # and it sees the promotion of worker 2
    sched_run = run_on_fresh_worker("scheduled-retraining", "w3")
    runs = api.task_runs(sched_run["id"])
    for name in STAGES:
        assert runs[name]["state"]["name"] == "Skipped", (name, runs[name]["state"])
    assert runs["promote"]["state"]["type"] == "COMPLETED"
    logs = api.wait_log(sched_run["id"], "already promoted")
    assert "already promoted" in logs and "up to date in dvc.lock, skipped" in logs
    arts = api.artifacts(sched_run["id"])
    assert "already promoted" in arts["tandem-report"]["data"]
    assert "kept the promoted checkpoint" in arts["tandem-promotion"]["data"]
    assert set(_git(bare, "tag", "--list").split()) == set(tags)  # no second promotion
