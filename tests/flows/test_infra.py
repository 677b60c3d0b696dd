"""infra/: the deployments point at real flows with real parameters, the GPU pool template is consistent,
the accelerate and vLLM files parse, and the image pins what pyproject pins. (The deployments are also
deployed on a real server in tests/flows/test_server.py.)"""

from __future__ import annotations

import datetime
import inspect
import json
import re
import shutil
import subprocess
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
    assert set(deps) == {"scheduled-retraining", "retraining-gpu", "evaluate-checkpoints"}
    for d in deps.values():
        path, func = d["entrypoint"].split(":")
        assert (REPO / path).exists(), path
        fn = getattr(fp, func)
        assert set(d["parameters"]) <= set(inspect.signature(fn.fn).parameters), d["name"]
    assert deps["scheduled-retraining"]["entrypoint"].endswith(":tandem_pipeline")
    assert deps["evaluate-checkpoints"]["entrypoint"].endswith(":tandem_evaluation")
    assert deps["scheduled-retraining"]["work_pool"]["name"] == "cpu"
    assert deps["evaluate-checkpoints"]["work_pool"]["name"] == "gpu"
    assert deps["scheduled-retraining"]["parameters"]["promote"] is True


def test_schedule_is_a_valid_cron():
    import cronsim

    (sched,) = next(d for d in _prefect_yaml()["deployments"] if d["name"] == "scheduled-retraining")["schedules"]
    nxt = next(cronsim.CronSim(sched["cron"], datetime.datetime(2026, 1, 1)))
    assert nxt == datetime.datetime(2026, 1, 5, 3, 0)  # the first Monday, 03:00
    assert sched["timezone"] == "UTC"


def test_gpu_template_declares_every_placeholder_and_requests_gpus():
    t = json.loads((INFRA / "work-pools" / "gpu-kubernetes.json").read_text())
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


def test_vllm_server_files():
    docs = list(yaml.safe_load_all((INFRA / "vllm" / "vllm-server.yaml").read_text()))
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert {d["metadata"]["labels"]["role"] for d in deployments} == {"senior", "junior"}
    for d in deployments:
        (c,) = d["spec"]["template"]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["command"][0] == "/opt/tandem/infra/vllm/serve.sh"
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n", str(INFRA / "vllm" / "serve.sh")]).returncode == 0


def test_image_pins_match_the_project():
    docker = (INFRA / "Dockerfile").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    torch_pin = re.search(r'"torch==([^"]+)"', pyproject).group(1)
    assert f"torch=={torch_pin}" in docker
    assert re.search(r"^FROM python:3\.11", docker, re.M) and 'requires-python = ">=3.11,<3.12"' in pyproject
    vllm_max = re.search(r'"vllm<=([^"]+)"', pyproject).group(1)
    assert f"VLLM_VERSION:-{vllm_max}" in (INFRA / "vllm" / "serve.sh").read_text()


def test_served_deployments_mirror_prefect_yaml():
    from flows.deploy import deployment_spec, runner_deployment

    d = runner_deployment("scheduled-retraining")
    assert d.entrypoint == "flows/pipeline.py:tandem_pipeline"
    assert d.parameters == deployment_spec("scheduled-retraining")["parameters"]
    (s,) = d.schedules
    assert (s.schedule.cron, s.schedule.timezone) == ("0 3 * * 1", "UTC")
    assert runner_deployment("evaluate-checkpoints").schedules == []
    with pytest.raises(KeyError, match="no deployment"):
        deployment_spec("nope")
