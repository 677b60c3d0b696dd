"""The pipeline on a Ray cluster (`cluster.runner: ray`, tasks/cluster.py, prefect-ray): a local cluster of two
nodes (`ray.cluster_utils.Cluster`, one CPU and two declared GPUs each, no real GPU) runs the flow's train arms and
evaluation units, each as a Ray task holding its GPUs; the rollout engines of the dedicated layout are one-GPU
actors, each seeing the device Ray gave it. The flow's stages are the fakes of tests/flows/fake_stages.py, set up
in every Ray worker by tests/flows/ray_fakes.py, which records where each call ran.

Declared GPUs only: Ray sets each task's and actor's `CUDA_VISIBLE_DEVICES` from its reservation without a GPU
behind it, which is what these tests check; a real device under it is unverified here."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray", reason="cluster.runner ray needs ray and prefect-ray: pip install -e '.[ray]'")
pytest.importorskip("prefect_ray", reason="cluster.runner ray needs ray and prefect-ray: pip install -e '.[ray]'")

import ray  # noqa: E402

import flows.pipeline as fp  # noqa: E402
from tandem.config import ParamsError, params_from_dict  # noqa: E402
from tandem.rollout.placement import PlacementError, placement_from_slots  # noqa: E402
from tasks import cluster  # noqa: E402
from tests.flows import fake_stages, ray_fakes  # noqa: E402
from tests.flows.test_pipeline import _stage_edges, _use_fakes, project  # noqa: E402,F401 - project: a fixture

REPO = Path(__file__).resolve().parents[2]
GPUS_PER_NODE = 2
STORE = 100 * 1024 * 1024  # each node's object store: the machine is small and shared


def _cluster_params(**values) -> str:
    raw = yaml.safe_load(fake_stages.PARAMS_YAML)
    raw["cluster"].update(values)
    return yaml.safe_dump(raw, sort_keys=False)


@pytest.fixture
def ray_cluster(project, tmp_path):
    """Two nodes of one CPU and two declared GPUs each, started from the project directory (the workers' own),
    with the fakes set up in every worker; shut down whatever happens."""
    from ray.cluster_utils import Cluster

    # the workers import the fakes from the repository (the tests are not installed; conftest.py puts the
    # repository on this process's sys.path only)
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    log = tmp_path / "calls.jsonl"
    log.touch()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": GPUS_PER_NODE,
                                                          "object_store_memory": STORE, "include_dashboard": False})
    try:
        nodes.add_node(num_cpus=1, num_gpus=GPUS_PER_NODE, object_store_memory=STORE)
        nodes.wait_for_nodes()
        ray.init(address=nodes.address, logging_level="WARNING", log_to_driver=False,
                 runtime_env={"worker_process_setup_hook": "tests.flows.ray_fakes.install",
                              "env_vars": {ray_fakes.LOG_ENV: str(log), "PYTHONPATH": pythonpath}})
        yield nodes, log
    finally:
        ray.shutdown()
        nodes.shutdown()


def _calls(log) -> dict[str, dict]:
    return {c["call"]: c for c in map(json.loads, log.read_text().splitlines())}


def test_cluster_settings_are_checked():
    raw = yaml.safe_load(fake_stages.PARAMS_YAML)
    p = params_from_dict(raw, strict=True)
    assert p.cluster.runner == "local" and cluster.runner(p) is None and cluster.eval_runner(p, "dask") is None
    for values, rule in [({"ray_address": "auto"}, "cluster.ray_address: 'auto' -> names a Ray cluster"),
                         ({"train_gpus": 1}, "cluster.train_gpus: 1 -> cluster.train_gpus and cluster.eval_gpus"),
                         ({"runner": "ray", "ray_address": "not an address"}, "cluster.ray_address"),
                         ({"runner": "slurm"}, "cluster.runner")]:
        bad = {**raw, "cluster": {**raw["cluster"], **values}}
        with pytest.raises(ParamsError, match=rule):
            params_from_dict(bad, strict=True)
    two = {**raw, "cluster": {**raw["cluster"], "runner": "ray", "train_gpus": 1},
           "train": {**raw["train"], "num_processes": 2, "prompts_per_step": 2}}
    with pytest.raises(ParamsError, match=r"cluster.train_gpus: 1 -> must hold the 2 GPUs one train arm uses"):
        params_from_dict(two, strict=True)
    dedicated = {**two, "cluster": {**two["cluster"], "train_gpus": 3},
                 "rollout": {**raw["rollout"], "backend": "vllm", "vllm_layout": "dedicated"}}
    with pytest.raises(ParamsError, match=r"cluster.train_gpus: 3 -> must hold the 4 GPUs"):  # 2 trainer + 2 engines
        params_from_dict(dedicated, strict=True)
    dedicated["cluster"]["train_gpus"] = 4
    assert params_from_dict(dedicated, strict=True).cluster.train_gpus == 4
    on_ray = params_from_dict({**raw, "cluster": {**raw["cluster"], "runner": "ray", "train_gpus": 2,
                                                   "eval_gpus": 1, "ray_address": "ray://head:10001"}}, strict=True)
    assert cluster.needs(on_ray, "train") == {"num_gpus": 2} and cluster.needs(on_ray, "evaluate") == {"num_gpus": 1}
    assert cluster.runner(on_ray).address == "ray://head:10001"
    with pytest.raises(ValueError, match="eval_runner 'dask' with cluster.runner ray"):
        cluster.eval_runner(on_ray, "dask")
    machines = {**raw, "cluster": {**raw["cluster"], "runner": "ray"},
                "train": {**raw["train"], "num_machines": 2, "num_processes": 2, "prompts_per_step": 2,
                          "shared_storage": True}}
    with pytest.raises(ParamsError, match=r"cluster.runner: 'ray' -> runner ray runs a train arm as one Ray task"):
        params_from_dict(machines, strict=True)


def test_engine_placement_from_slots_is_one_node_and_distinct_devices():
    p = placement_from_slots({"senior": ("n1", ["3"]), "junior": ("n1", ["5"])})
    assert p.layout == "dedicated" and p.env("senior") == {"CUDA_VISIBLE_DEVICES": "3"} and p.junior == ("5",)
    with pytest.raises(PlacementError, match="different nodes"):
        placement_from_slots({"senior": ("n1", ["0"]), "junior": ("n2", ["0"])})
    with pytest.raises(PlacementError, match="overlap"):
        placement_from_slots({"senior": ("n1", ["0"]), "junior": ("n1", ["0"])})
    with pytest.raises(PlacementError, match="the junior's engine slot sees no GPU"):
        placement_from_slots({"senior": ("n1", ["0"]), "junior": ("n1", [])})


@pytest.mark.slow
@pytest.mark.integration
def test_train_and_evaluate_tasks_and_engine_slots_on_a_two_node_ray_cluster(project, ray_cluster, monkeypatch,
                                                                              prefect_api):
    nodes, log = ray_cluster
    node_ids = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(node_ids) == 2
    (project / "params.yaml").write_text(_cluster_params(runner="ray", train_gpus=GPUS_PER_NODE, eval_gpus=1))
    _use_fakes(monkeypatch, ray_fakes.PlacedRecorder())  # the stages that stay in the flow's process
    monkeypatch.setenv(ray_fakes.LOG_ENV, str(log))

    state = fp.tandem_pipeline(params_path="params.yaml", live=False, return_state=True)
    assert state.is_completed(), state
    # Prefect's graph is still dvc.yaml's: the arms submitted to the cluster wait for prepare and base, and
    # evaluate for both arms
    from flows.dvc_sync import pipeline_stages

    specs = pipeline_stages(project / "dvc.yaml", fp.load_params("params.yaml").to_dict())
    expected = {s.name: set(s.after) for s in specs}
    assert _stage_edges(state.state_details.flow_run_id, expected) == expected
    calls = _calls(log)
    driver = os.getpid()
    # prepare, base, collect, analyze and report ran in the flow's process; nothing else did
    assert {n for n, c in calls.items() if c["pid"] == driver} == {"prepare", "base", "evaluate-collect", "analyze",
                                                                  "report"}
    remote = {n: c for n, c in calls.items() if c["pid"] != driver}
    arms, units = ["train-tandem", "train-grpo"], [n for n in remote if n.startswith("unit-")]
    assert sorted(remote) == sorted(arms + units) and len(units) == 6
    # every stage call joined the run's W&B group: the flow's own and those on the cluster alike
    assert len({c["group"] for c in calls.values()}) == 1 and calls["prepare"]["group"], calls
    for name, c in remote.items():
        gpus = GPUS_PER_NODE if name in arms else 1
        # a Ray worker on a node of the cluster, holding the GPUs its stage reserves, and seeing exactly them
        assert c["node"] in node_ids, (name, c)
        assert len(c["ray_gpu_ids"]) == gpus and c["visible"] == ",".join(c["ray_gpu_ids"]), (name, c)
        assert all(0 <= int(g) < GPUS_PER_NODE for g in c["ray_gpu_ids"]), (name, c)

    # the dedicated layout's engines: two rollout services at once need four one-GPU slots, two per node
    with cluster.engine_slots(timeout=120) as (first, actors, reports_a), \
            cluster.engine_slots(timeout=120) as (second, _, reports_b):
        reports = reports_a + reports_b
        # the senior's slot starts the service through the production launcher, with the slots' placement: here
        # it stops at the missing vLLM interpreter, the first thing the launcher checks
        rollout = dataclasses.replace(fp.load_params("params.yaml").rollout, vllm_python=str(project / "no-python"))
        with pytest.raises(ray.exceptions.RayTaskError, match="no vLLM interpreter at .*no-python"):
            ray.get(actors["senior"].start_service.remote(str(project), str(project), [str(project)], rollout,
                                                          first), timeout=120)
    seen = [(r["node"], r["devices"][0]) for r in reports]
    assert all(r["devices"] == r["ray_gpu_ids"] and len(r["devices"]) == 1 for r in reports), reports
    assert len(set(seen)) == 4 and {n for n, _ in seen} == node_ids, seen
    for placement, rs in ((first, reports_a), (second, reports_b)):
        assert len({r["node"] for r in rs}) == 1  # one service drives both engines: one node
        by_role = {r["role"]: r["devices"] for r in rs}
        assert placement.env("senior") == {"CUDA_VISIBLE_DEVICES": by_role["senior"][0]}
        assert placement.env("junior") == {"CUDA_VISIBLE_DEVICES": by_role["junior"][0]}


def test_the_kuberay_recipe_runs_the_pinned_ray_from_one_shared_project_directory():
    """infra/kuberay/raycluster.yaml: the Ray version of the `ray` extra, and every pod (head and GPU workers)
    starting Ray in the same project directory on the same shared volume (stage tasks read and write out_root and
    commit DVC there); GPUs only on the workers."""
    root = REPO
    pin = re.search(r'"ray\[default\]==([\d.]+)"', (root / "pyproject.toml").read_text()).group(1)
    claim, ray_cluster = yaml.safe_load_all((root / "infra" / "kuberay" / "raycluster.yaml").read_text())
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    spec = ray_cluster["spec"]
    assert ray_cluster["kind"] == "RayCluster" and spec["rayVersion"] == pin
    pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
    for pod in pods:
        (c,) = pod["containers"]
        assert c["workingDir"].startswith("/workspace/")
        assert {"name": "workspace", "mountPath": "/workspace"} in c["volumeMounts"]
        assert {"name": "workspace", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}} in pod["volumes"]
    assert len({p["containers"][0]["workingDir"] for p in pods}) == 1
    assert spec["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    assert all(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] > 0
               for g in spec["workerGroupSpecs"])
    extras = re.search(r"pip install -e '\.\[([a-z0-9,]+)\]'", (root / "infra" / "Dockerfile").read_text())
    assert extras and {"pipeline", "ray"} <= set(extras.group(1).split(","))  # the image installs the ray extra
