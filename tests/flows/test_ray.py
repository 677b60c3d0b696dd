"""The pipeline on a Ray cluster (`cluster.runner: ray`, tasks/cluster.py, prefect-ray): a local cluster of two
nodes (`ray.cluster_utils.Cluster`, one CPU and two declared GPUs each, no real GPU) runs the flow's train arms and
evaluation units, each as a Ray task holding its GPUs; the rollout engines of the dedicated layout are one-GPU
actors, each seeing the device Ray gave it. The flow's stages are the fakes of tests/flows/fake_stages.py, set up
in every Ray worker by tests/flows/ray_fakes.py, which records where each call ran. With three declared GPUs per
node and vLLM's CPU build (`.venv-vllm`; skipped without it unless TANDEM_REQUIRE_VLLM=1), the flow starts each
arm's rollout service in its senior's engine slot and the arm attaches to it by URL (about 3 minutes).

Declared GPUs only: Ray sets each task's and actor's `CUDA_VISIBLE_DEVICES` from its reservation without a GPU
behind it, which is what these tests check; a real device under it is unverified here."""

from __future__ import annotations

import contextlib
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
from tandem.rollout.vllm import lifecycle  # noqa: E402
from tandem.rollout.vllm.client import ServiceStartError  # noqa: E402
from tasks import cluster  # noqa: E402
from tests.flows import fake_stages, ray_fakes  # noqa: E402
from tests.flows.test_pipeline import _stage_edges, _use_fakes, project  # noqa: E402,F401 - project: a fixture
from vllm_fixtures import need_vllm  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GPUS_PER_NODE = 2
STORE = 100 * 1024 * 1024  # each node's object store: the machine is small and shared


def _cluster_params(**values) -> str:
    return _params(cluster=values)


def _params(**sections) -> str:
    """The fakes' params file with `sections` merged in, key by key."""
    raw = yaml.safe_load(fake_stages.PARAMS_YAML)
    for name, values in sections.items():
        raw[name].update(values)
    return yaml.safe_dump(raw, sort_keys=False)


@contextlib.contextmanager
def _local_cluster(tmp_path, gpus: int, cpus: int, hook: str):
    """Two nodes of `cpus` CPUs and `gpus` declared GPUs each, started from the project directory (the workers'
    own), with `hook` (a setup function of tests/flows/ray_fakes.py) run in every worker; shut down whatever
    happens. Yields the cluster and the file the fakes log their calls to."""
    from ray.cluster_utils import Cluster

    # the workers import the fakes from the repository (the tests are not installed; conftest.py puts the
    # repository on this process's sys.path only)
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    log = tmp_path / "calls.jsonl"
    log.touch()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "num_gpus": gpus,
                                                          "object_store_memory": STORE, "include_dashboard": False})
    try:
        nodes.add_node(num_cpus=cpus, num_gpus=gpus, object_store_memory=STORE)
        nodes.wait_for_nodes()
        ray.init(address=nodes.address, logging_level="WARNING", log_to_driver=False,
                 runtime_env={"worker_process_setup_hook": hook,
                              "env_vars": {ray_fakes.LOG_ENV: str(log), "PYTHONPATH": pythonpath}})
        yield nodes, log
    finally:
        ray.shutdown()
        nodes.shutdown()


@pytest.fixture
def ray_cluster(project, tmp_path):
    """Two nodes of one CPU and two declared GPUs each, the fakes set up in every worker."""
    with _local_cluster(tmp_path, GPUS_PER_NODE, 1, "tests.flows.ray_fakes.install") as got:
        yield got


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
    with pytest.raises(ParamsError, match=r"cluster.train_gpus: 1 -> must hold the 2 GPUs of one train arm's trainer"):
        params_from_dict(two, strict=True)
    # the dedicated layout's engines are Ray actors of their own: the arm's reservation is the trainer's, exactly
    dedicated = {**two, "cluster": {**two["cluster"], "train_gpus": 4},
                 "rollout": {**raw["rollout"], "backend": "vllm", "vllm_layout": "dedicated"}}
    for gpus in (0, 1, 4):
        dedicated["cluster"]["train_gpus"] = gpus
        with pytest.raises(ParamsError, match=rf"cluster.train_gpus: {gpus} -> must be the trainer's 2 GPUs "
                                              r"\(train.num_processes\) under cluster.runner ray .* one-GPU Ray actors"):
            params_from_dict(dedicated, strict=True)
    dedicated["cluster"]["train_gpus"] = 2
    p_actors = params_from_dict(dedicated, strict=True)
    assert cluster.engines_on_actors(p_actors) and cluster.needs(p_actors, "train") == {"num_gpus": 2}
    # the arm's GPUs in the run's accounting: the trainer's and its two engine slots'
    assert cluster.reserved_gpus(p_actors, ["train@tandem", "prepare"]) == {"train@tandem": 4}
    positions = {**dedicated, "rollout": {**dedicated["rollout"], "vllm_devices": [2, 3]}}
    with pytest.raises(ParamsError, match=r"rollout.vllm_devices: \[2, 3\] -> names GPU positions on one machine"):
        params_from_dict(positions, strict=True)
    # a service named by rollout.vllm_url runs elsewhere: the arm holds its trainer's GPUs (or none)
    attached = {**dedicated, "rollout": {**dedicated["rollout"], "vllm_url": "http://node:8471"}}
    for gpus in (0, 2, 3):
        attached["cluster"] = {**dedicated["cluster"], "train_gpus": gpus}
        assert not cluster.engines_on_actors(params_from_dict(attached, strict=True))
    attached["cluster"]["train_gpus"] = 1
    with pytest.raises(ParamsError, match=r"cluster.train_gpus: 1 -> must hold the 2 GPUs of one train arm's trainer"):
        params_from_dict(attached, strict=True)
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
    with cluster.engine_slots(timeout=120) as slots_a, cluster.engine_slots(timeout=120) as slots_b:
        (first, actors, reports_a), (second, reports_b) = (slots_a.placement, slots_a.actors, slots_a.reports), \
            (slots_b.placement, slots_b.reports)
        reports = reports_a + reports_b
        # the senior's slot starts the service through the production launcher, with the slots' placement: here
        # it stops at the missing vLLM interpreter, the first thing the launcher checks
        rollout = dataclasses.replace(fp.load_params("params.yaml").rollout, vllm_python=str(project / "no-python"))
        with pytest.raises(ray.exceptions.RayTaskError, match="no vLLM interpreter at .*no-python"):
            ray.get(actors["senior"].start_service.remote(str(project), str(project), [str(project)], rollout,
                                                          first), timeout=120)
    # an arm whose engines are actors needs its trainer's GPU and both engines' on one node: no node has three,
    # which is one line once rollout.vllm_start_timeout has passed, and nothing stays reserved
    p = fp.load_params("params.yaml")
    packed = dataclasses.replace(p, cluster=dataclasses.replace(p.cluster, train_gpus=1), rollout=dataclasses.replace(
        p.rollout, backend="vllm", vllm_layout="dedicated", vllm_start_timeout=5.0))
    with pytest.raises(PlacementError, match=r"^no node of the Ray cluster had 3 GPUs free within 5 s: one node holds "
                                             r"both rollout engines \(one GPU each\) and the trainer's 1, packed"):
        with cluster.reservation(packed, "train"):
            pass
    assert _free_gpus(2 * GPUS_PER_NODE), ray.available_resources()
    seen = [(r["node"], r["devices"][0]) for r in reports]
    assert all(r["devices"] == r["ray_gpu_ids"] and len(r["devices"]) == 1 for r in reports), reports
    assert len(set(seen)) == 4 and {n for n, _ in seen} == node_ids, seen
    for placement, rs in ((first, reports_a), (second, reports_b)):
        assert len({r["node"] for r in rs}) == 1  # one service drives both engines: one node
        by_role = {r["role"]: r["devices"] for r in rs}
        assert placement.env("senior") == {"CUDA_VISIBLE_DEVICES": by_role["senior"][0]}
        assert placement.env("junior") == {"CUDA_VISIBLE_DEVICES": by_role["junior"][0]}


SERVICE_GPUS = 3  # per node: one arm's trainer and its two engine slots, packed on one node


@pytest.fixture
def ray_service_cluster(project, tmp_path):
    """Two nodes of two CPUs and three declared GPUs each (one node holds an arm's trainer and both engine slots),
    with a base stage that saves a tiny model and an arm that uses its rollout service in every worker."""
    need_vllm()
    with _local_cluster(tmp_path, SERVICE_GPUS, 2, "tests.flows.ray_fakes.install_service_arm") as got:
        yield got


@pytest.mark.slow
@pytest.mark.integration
def test_an_arm_attaches_to_its_rollout_service_started_in_the_senior_engine_slot(project, ray_service_cluster,
                                                                                  monkeypatch, prefect_api):
    """`cluster.runner: ray` with the vLLM backend's dedicated layout: for each arm the flow places the two engines
    as one-GPU actors and the trainer's GPU beside them on one node, starts the rollout service (vLLM's CPU build)
    in the senior's slot, and runs the arm attached to it by URL; the service, the actors and the group are gone
    once the arm has ended, the failed second arm's too."""
    nodes, log = ray_service_cluster
    (project / "params.yaml").write_text(_params(
        train={"arms": ["tandem", ray_fakes.FAILING_ARM]},
        rollout={"backend": "vllm", "vllm_layout": "dedicated", "vllm_dtype": "float32", "vllm_max_model_len": 256,
                 "vllm_start_timeout": 1200.0},
        cluster={"runner": "ray", "train_gpus": 1}))
    _use_fakes(monkeypatch, ray_fakes.PlacedRecorder())
    monkeypatch.setattr(fake_stages, "ACTIVE", ray_fakes.service_modules(ray_fakes.PlacedRecorder()))
    monkeypatch.setenv(ray_fakes.LOG_ENV, str(log))
    held = []  # what the flow reserved for each arm (tasks.cluster.engine_slots, in this process)
    real_slots = cluster.engine_slots

    @contextlib.contextmanager
    def watched(*args, **kwargs):
        with real_slots(*args, **kwargs) as slots:
            held.append(slots)
            yield slots

    monkeypatch.setattr(cluster, "engine_slots", watched)

    state = fp.tandem_pipeline(params_path="params.yaml", live=False, stages=["training"], return_state=True)
    assert state.is_failed() and f"fake failure in train-{ray_fakes.FAILING_ARM}" in str(state.result(raise_on_failure=False))
    calls = _calls(log)
    assert len(held) == 2  # one service per arm, one after the other
    for name, slots in zip(("tandem", ray_fakes.FAILING_ARM), held):
        slot = {r["role"]: r for r in slots.reports}
        arm, svc = calls[f"train-{name}"], calls[f"service-{name}"]
        engines = {slot["senior"]["devices"][0], slot["junior"]["devices"][0]}
        # the trainer's task ran on the engines' node, holding one GPU (its reservation) and no engine's
        assert arm["pid"] not in (os.getpid(), slot["senior"]["pid"], slot["junior"]["pid"])
        assert arm["node"] == slot["senior"]["node"] == slot["junior"]["node"], (arm, slot)
        assert len(arm["ray_gpu_ids"]) == 1 and arm["visible"] == arm["ray_gpu_ids"][0], arm
        assert len(engines) == 2 and not engines & set(arm["ray_gpu_ids"]), (arm, slot)
        # the service ran in the senior's slot (its parent process), each engine core on its slot's device
        assert svc["parent"] == slot["senior"]["pid"], (svc, slot)
        assert svc["devices"] == {r: f"CUDA_VISIBLE_DEVICES={slot[r]['devices'][0]}" for r in ("senior", "junior")}
        assert svc["engine_cores"] == sorted(engines), svc
        # the trainer attached by URL, pushed its weights into the service's inbox, the engine rolled out on them
        assert svc["url"].startswith("http://127.0.0.1:") and svc["transport"] == "file", svc
        assert svc["senior"] == svc["pushed"] and svc["reloads"] >= 1 and svc["calls"] == 2, svc
        assert all(svc["tokens"]) and svc["logprobs_moved"], svc
        # torn down once the arm ended, failed or not: the service's process, both actors, the group
        assert not Path(f"/proc/{svc['pid']}").exists()
        for actor in slots.actors.values():
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.where.remote(), timeout=60)
        from ray.util import placement_group_table

        assert placement_group_table(slots.group)["state"] == "REMOVED"
        assert not lifecycle.group_members(svc["pid"])  # nor any engine core
    assert calls["service-tandem"]["url"] != calls[f"service-{ray_fakes.FAILING_ARM}"]["url"]
    # a service that cannot start is its own one line (not Ray's wrapper), and nothing stays reserved
    p = fp.load_params("params.yaml")
    broken = dataclasses.replace(p, rollout=dataclasses.replace(p.rollout, vllm_python=str(project / "no-python")))
    with pytest.raises(ServiceStartError, match=r"^vllm backend: no vLLM interpreter at .*no-python") as got:
        with cluster.reservation(broken, "train"):
            pass
    assert not isinstance(got.value, ray.exceptions.RayError)
    assert _free_gpus(2 * SERVICE_GPUS), ray.available_resources()
    assert "vllm_url: ''" in (project / "params.yaml").read_text()  # the URL lived in each arm's params only
    assert _free_gpus(2 * SERVICE_GPUS), ray.available_resources()


def _free_gpus(n: int, within: float = 30.0) -> bool:
    """Whether the cluster shows `n` GPUs free within `within` seconds (releases reach the scheduler late)."""
    import time

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if ray.available_resources().get("GPU", 0) == n:
            return True
        time.sleep(0.5)
    return False


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
