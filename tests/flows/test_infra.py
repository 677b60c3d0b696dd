"""infra/: the deployments point at real flows with real parameters, the GPU pool template is consistent,
the accelerate and vLLM files parse, and the image pins what pyproject pins. (The deployments are also
deployed on a real server in tests/flows/test_server.py.)"""

from __future__ import annotations

import datetime
import inspect
import json
import re
from pathlib import Path

import pytest
import yaml

import flows.pipeline as fp

INFRA = Path(__file__).resolve().parents[2] / "infra"
REPO = INFRA.parent


def _prefect_yaml() -> dict:
    return yaml.safe_load((INFRA / "prefect.yaml").read_text())


def test_deployments_name_existing_flows_and_parameters():
    deps = {d["name"]: d for d in _prefect_yaml()["deployments"]}
    assert set(deps) == {"scheduled-retraining", "training", "evaluation", "retraining-gpu", "evaluate-checkpoints"}
    for d in deps.values():
        path, func = d["entrypoint"].split(":")
        assert (REPO / path).exists(), path
        fn = getattr(fp, func)
        assert set(d["parameters"]) <= set(inspect.signature(fn.fn).parameters), d["name"]
        # Prefect validates a deployment's parameters against the signature: the sharing group becomes a model
        assert isinstance(fn.validate_parameters(d["parameters"])["sharing"], fp.Sharing), d["name"]
    assert deps["scheduled-retraining"]["entrypoint"].endswith(":tandem_pipeline")
    assert deps["evaluate-checkpoints"]["entrypoint"].endswith(":tandem_evaluation")
    assert deps["scheduled-retraining"]["work_pool"]["name"] == "cpu"
    assert deps["evaluate-checkpoints"]["work_pool"]["name"] == "gpu"
    assert deps["scheduled-retraining"]["parameters"]["promote"] is True


def _secret_name(key: str) -> bool:
    return key.endswith(("_KEY", "_TOKEN", "_SECRET", "_PASSWORD")) or key.startswith("AWS_")


def test_deployments_are_stateless_and_limited():
    """Every deployment clones the code at a ref, fetches tags and `dvc pull`s; writes state back (push and
    publish); runs one at a time; a GPU run on another params file adopts it (DVC sync stays on)."""
    for d in _prefect_yaml()["deployments"]:
        steps = [next(iter(s)) for s in d["pull"]]
        assert steps[0] == "prefect.deployments.steps.git_clone", d["name"]
        assert d["pull"][0]["prefect.deployments.steps.git_clone"]["branch"] == "{{ $TANDEM_GIT_REF }}"
        scripts = [next(iter(s.values())).get("script", "") for s in d["pull"]]
        assert any("dvc pull" in s for s in scripts) and any("fetch" in s and "--tags" in s for s in scripts)
        assert d["concurrency_limit"]["limit"] == 1, d["name"]
        p = d["parameters"]
        assert p["sharing"]["push"] and p["sharing"]["publish"] and p["dvc"] == "adopt", d["name"]
        env = d["work_pool"]["job_variables"]["env"]
        assert not any(_secret_name(k) for k in env), "secrets by reference only"
        assert "tasks" in env["PREFECT_LOGGING_EXTRA_LOGGERS"]
    gpu = next(d for d in _prefect_yaml()["deployments"] if d["name"] == "retraining-gpu")
    assert gpu["parameters"]["params_path"] == "params.paper.yaml"
    token = gpu["pull"][0]["prefect.deployments.steps.git_clone"]["access_token"]
    assert token.startswith("{{ prefect.blocks.secret.")


def _gpu_template() -> dict:
    return json.loads((INFRA / "work-pools" / "gpu-kubernetes.json").read_text())


def test_gpu_template_fits_the_kubernetes_workers_schema():
    """Checked against prefect-kubernetes' own default template and job configuration model."""
    from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

    default = KubernetesWorker.get_default_base_job_template()
    t = _gpu_template()
    assert set(default["job_configuration"]) == set(t["job_configuration"])
    fields = set(KubernetesWorkerJobConfiguration.model_fields)
    assert set(t["job_configuration"]) <= fields, set(t["job_configuration"]) - fields
    # every variable the worker itself sets or reads keeps its type
    for k in ("name", "env", "labels", "command", "namespace", "image", "image_pull_policy", "finished_job_ttl",
              "stream_output", "annotations"):
        ours, theirs = _types(t["variables"]["properties"][k]), _types(default["variables"]["properties"][k])
        assert ours and ours <= theirs, (k, ours, theirs)


def _types(prop: dict) -> set[str]:
    """JSON-schema types a variable accepts (null aside), from `type` or `anyOf`."""
    found = {prop["type"]} if "type" in prop else {a.get("type") for a in prop.get("anyOf", [])}
    if "additionalProperties" in prop:
        found.add("object")
    return found - {None, "null"}


def _render(deployment: str, flow_name: str) -> dict:
    """The Job manifest the Kubernetes worker would submit for a run of `deployment` (no cluster needed)."""
    import asyncio
    import uuid

    import jsonschema
    from prefect.client.schemas.objects import Flow, FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    t = _gpu_template()
    d = next(x for x in _prefect_yaml()["deployments"] if x["name"] == deployment)
    job_vars = json.loads(json.dumps(d["work_pool"]["job_variables"]).replace("{{ $TANDEM_IMAGE }}",
                                                                              "registry.example.com/tandem:abc"))
    schema = {k: v for k, v in t["variables"].items() if k != "definitions"}
    jsonschema.validate(job_vars, {**schema, "definitions": t["variables"].get("definitions", {})})
    values = {k: v["default"] for k, v in t["variables"]["properties"].items() if "default" in v}
    values.update(job_vars)
    cfg = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(t, values))
    run = FlowRun(id=uuid.uuid4(), name="brave-otter", flow_id=uuid.uuid4(), deployment_id=uuid.uuid4())
    cfg.prepare_for_flow_run(run, flow=Flow(id=run.flow_id, name=flow_name))
    return cfg.job_manifest


def test_rendered_gpu_job_manifest(prefect_api):  # rendering resolves block references through an API
    m = _render("retraining-gpu", "tandem-pipeline")
    assert m["kind"] == "Job" and m["spec"]["backoffLimit"] == 0
    (c,) = m["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "registry.example.com/tandem:abc"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8 and c["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert c["args"][:3] == ["prefect", "flow-run", "execute"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PREFECT__FLOW_RUN_ID"] and env["WANDB_MODE"] == "online" and env["TANDEM_EVAL_WORKERS"] == "4"
    assert not any(_secret_name(k) for k in env)  # secrets: only through the secret reference
    assert c["envFrom"] == [{"secretRef": {"name": "tandem-secrets", "optional": False}}]
    vols = {v["name"]: v for v in m["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in vols["workspace"] and c["workingDir"] == "/workspace"
    assert m["metadata"]["labels"]["prefect.io/flow-name"] == "tandem-pipeline"
    one = _render("evaluate-checkpoints", "tandem-evaluation")
    assert one["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_schedule_is_a_valid_cron():
    import cronsim

    (sched,) = next(d for d in _prefect_yaml()["deployments"] if d["name"] == "scheduled-retraining")["schedules"]
    nxt = next(cronsim.CronSim(sched["cron"], datetime.datetime(2026, 1, 1)))
    assert nxt == datetime.datetime(2026, 1, 5, 3, 0)  # the first Monday, 03:00
    assert sched["timezone"] == "UTC"


def test_gpu_template_declares_every_placeholder_and_requests_gpus():
    t = _gpu_template()
    used = set(re.findall(r"\{\{\s*([a-z_]+)\s*\}\}", json.dumps(t["job_configuration"])))
    assert used <= set(t["variables"]["properties"]), used - set(t["variables"]["properties"])
    (container,) = t["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert container["image"] == "{{ image }}"
    gpu_jobs = [d for d in _prefect_yaml()["deployments"] if d["work_pool"]["name"] == "gpu"]
    for d in gpu_jobs:  # job variables a deployment sets must exist in the template
        assert set(d["work_pool"]["job_variables"]) <= set(t["variables"]["properties"]), d["name"]


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_deepspeed_configs(stage):
    from accelerate.commands.config.config_args import ClusterConfig

    cfg = ClusterConfig.from_yaml_file(str(INFRA / "accelerate" / f"deepspeed_zero{stage}.yaml"))
    assert cfg.distributed_type == "DEEPSPEED"
    assert cfg.deepspeed_config["zero_stage"] == stage and cfg.mixed_precision == "bf16"


def test_image_pins_match_the_project():
    docker = (INFRA / "Dockerfile").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    torch_pin = re.search(r'"torch==([^"]+)"', pyproject).group(1)
    assert f"torch=={torch_pin}" in docker
    assert re.search(r"^FROM python:3\.11", docker, re.M) and 'requires-python = ">=3.11,<3.12"' in pyproject
    vllm = re.search(r"^VLLM_VERSION := (\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
    assert f'"vllm=={vllm}"' in docker  # the image's vLLM is the one the rollout service is tested with


def test_served_deployments_mirror_prefect_yaml():
    from flows.deploy import deployment_spec, runner_deployment

    d = runner_deployment("scheduled-retraining")
    assert d.entrypoint == "flows/pipeline.py:tandem_pipeline"
    # a served run either publishes or does not promote: a tag must land on a commit whose dvc.lock is the run's
    assert d.parameters == {**deployment_spec("scheduled-retraining")["parameters"], "dvc": "auto",
                            "promote": False, "sharing": {"publish": False, "push": False}}
    published = runner_deployment("scheduled-retraining", publish=True).parameters
    assert published["promote"] is True and published["sharing"] == {"publish": True, "push": True}
    assert "promote" not in runner_deployment("training").parameters  # tandem-training never promotes
    (s,) = d.schedules
    assert (s.schedule.cron, s.schedule.timezone) == ("0 3 * * 1", "UTC")
    assert runner_deployment("evaluate-checkpoints").schedules == []
    assert d.concurrency_limit == 1 and d.parameters["dvc"] == "auto" and d.parameters["sharing"]["publish"] is False
    with pytest.raises(KeyError, match="no deployment"):
        deployment_spec("nope")


def _dockerfile_defaults() -> tuple[dict, dict]:
    """The Dockerfile's ARG defaults and ENV values (ARG references substituted)."""
    text = (INFRA / "Dockerfile").read_text().replace("\\\n", " ")
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    env: dict = {}
    for line in re.findall(r"^ENV (.+)$", text, re.M):
        for k, v in re.findall(r"(\w+)=(\S+)", line):
            env[k] = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], v)
    return args, env


def test_the_documented_image_carries_vllm_where_the_presets_point():
    """The documented build command builds vLLM in (WITH_VLLM defaults to 1 and no documented command turns it
    off), into the venv whose interpreter the image names in TANDEM_VLLM_PYTHON, and the presets, loaded with the
    image's environment, run that interpreter (rollout.vllm_python, overridden); a missing interpreter is one
    line naming the setting."""
    from tandem.rollout.vllm.client import LaunchOptions, ServiceStartError
    from tasks.common import load_params

    args, env = _dockerfile_defaults()
    assert args["WITH_VLLM"] == "1"
    docker = (INFRA / "Dockerfile").read_text()
    assert re.search(r'python -m venv "\$VLLM_VENV" && "\$VLLM_VENV/bin/pip" install "vllm==', docker)
    image_python = env["TANDEM_VLLM_PYTHON"]
    assert image_python == f"{args['VLLM_VENV']}/bin/python" == "/opt/vllm/bin/python"
    documented = re.findall(r"docker build -f infra/Dockerfile[^\n]*", (INFRA / "README.md").read_text())
    assert documented and all("WITH_VLLM" not in cmd for cmd in documented)
    for preset in ("params.paper.yaml", "params.paper-dedicated.yaml"):
        p = load_params(REPO / preset, environ=env)
        assert p.rollout.backend == "vllm" and p.rollout.vllm_python == image_python
        assert LaunchOptions.from_config(p.rollout).python == image_python
    with pytest.raises(ServiceStartError) as e:
        LaunchOptions(python="/opt/no-such-vllm/bin/python").vllm_python()
    assert "\n" not in str(e.value) and "rollout.vllm_python" in str(e.value) and "TANDEM_VLLM_PYTHON" in str(e.value)
