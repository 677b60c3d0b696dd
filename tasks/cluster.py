"""Placement on a Ray cluster (`cluster.runner: ray`), through prefect-ray: the task runner the flow runs each train
arm and each evaluation unit on, the GPUs each of those tasks reserves, and the dedicated layout's rollout engines
as one-GPU Ray actors, so that Ray decides each engine's device.

- `runner(params)`: None for `cluster.runner: local` (the flow runs every task on this machine, as always), else
  prefect-ray's `RayTaskRunner` on `cluster.ray_address` (empty: a Ray instance started for the run; `auto`: the
  cluster this machine joined with `ray start`; `ray://host:10001`: Ray Client). A Ray connection already open
  in the process (a test's local cluster) is used as it is.
- `reservation(params, group)`: prefect-ray's `remote_options(num_gpus=...)` around a task's submission:
  `cluster.train_gpus` for a train arm, `cluster.eval_gpus` for an evaluation unit. Ray starts the task on a node
  with that many free GPUs and sets its `CUDA_VISIBLE_DEVICES` to them. The task's environment gets the run's
  W&B group from the flow's (`carried_env`); anything else comes from the node's (its `ray start`).
- `engine_slots(params)`: the dedicated layout's two engines as one-GPU actors (`EngineSlot`, one per model) in a
  placement group that packs them on one node (one rollout service drives both). Each slot reports the node and
  the GPU Ray gave it, read with `tandem.rollout.placement.visible_devices` as the service reads its own, and
  `placement_from_slots` turns the two reports into the service's `Placement`. `EngineSlot.start_service`
  starts the rollout service from the senior's slot with that placement (`VLLMService.start`, each engine
  under its own `CUDA_VISIBLE_DEVICES`). The flow does not start a train arm's service this way yet: an arm on
  Ray starts its own, on positions of the GPUs its task reserved (docs/operations.md "Ray").

Ray and prefect-ray are imported only when `cluster.runner` is ray (`pip install -e '.[ray]'`). Verified on a CPU
machine with a local two-node cluster whose nodes declare GPUs (tests/flows/test_ray.py): the CUDA path (real
GPUs, a real vLLM service started in a slot) is unverified until a GPU check runs it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Mapping

from tandem.config import Params

# what each group of tasks reserves on the cluster (a cluster setting per group)
GPU_SETTINGS = {"train": "train_gpus", "evaluate": "eval_gpus"}
MISSING = "cluster.runner ray needs prefect-ray and ray: pip install -e '.[ray]'"


def on_ray(params: Params) -> bool:
    return params.cluster.runner == "ray"


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError(MISSING) from None
    return ray


def runner(params: Params):
    """prefect-ray's `RayTaskRunner` for `cluster.runner: ray`, None for local."""
    if not on_ray(params):
        return None
    try:
        from prefect_ray import RayTaskRunner
    except ImportError:
        raise ValueError(MISSING) from None
    return RayTaskRunner(address=params.cluster.ray_address or None)


def eval_runner(params: Params, requested: str):
    """The evaluation units' task runner when the cluster decides it (None: the flow's `eval_runner` does). On a
    Ray cluster the units run there: an `eval_runner` other than `threads` (Dask) is one line of refusal."""
    if not on_ray(params):
        return None
    if requested != "threads":
        raise ValueError(f"eval_runner {requested!r} with cluster.runner ray: the evaluation units run on the Ray "
                         f"cluster; leave eval_runner 'threads' or set cluster.runner local")
    return runner(params)


def needs(params: Params, group: str) -> dict[str, Any]:
    """Ray's resource options for one task of `group` (train or evaluate)."""
    return {"num_gpus": getattr(params.cluster, GPU_SETTINGS[group])}


def reserved_gpus(params: Params, tasks: list[str]) -> dict[str, int]:
    """The GPUs each of `tasks` (the flow's task names) reserved on the Ray cluster: `cluster.train_gpus` for a
    train arm (`train@<arm>`), `cluster.eval_gpus` for an evaluation unit (`evaluate-...`); {} when local (the
    run's accounting then counts the GPUs the flow's own machine holds)."""
    if not on_ray(params):
        return {}
    group = {"train@": "train", "evaluate-": "evaluate"}
    return {t: needs(params, g)["num_gpus"] for t in tasks for prefix, g in group.items() if t.startswith(prefix)}


def carried_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a task on the cluster takes from the flow's environment: the run's W&B group (and a `dvc exp run`
    experiment's name), which the flow sets in its own process (`tasks.tracking.pipeline_group`)."""
    from tasks.tracking import EXP_ENV, GROUP_ENV

    env = os.environ if environ is None else environ
    return {k: env[k] for k in (GROUP_ENV, EXP_ENV) if env.get(k)}


def reservation(params: Params, group: str):
    """prefect-ray's `remote_options` with `needs(params, group)` and the flow's `carried_env` (a no-op context
    when local)."""
    if not on_ray(params):
        return nullcontext()
    from prefect_ray.context import remote_options

    carried = carried_env()
    return remote_options(**needs(params, group), **({"runtime_env": {"env_vars": carried}} if carried else {}))


class EngineSlot:
    """One rollout engine's place on the cluster: a Ray actor holding one GPU (made remote by `engine_slots`)."""

    def __init__(self, role: str):
        self.role = role
        self.service = None

    def where(self) -> dict[str, Any]:
        """The node this slot runs on and the devices it sees (Ray set its `CUDA_VISIBLE_DEVICES`)."""
        import ray

        from tandem.rollout.placement import visible_devices

        return {"role": self.role, "node": ray.get_runtime_context().get_node_id(), "devices": visible_devices(),
                "ray_gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def start_service(self, senior: str, junior: str, roots: list[str], rollout: Any, placement: Any) -> str:
        """Start the rollout service here (the senior's slot) with both engines on their slots' devices; its URL
        for `rollout.vllm_url`. Unverified on GPUs (module docstring)."""
        from tandem.rollout.vllm.client import LaunchOptions, VLLMService

        self.service = VLLMService.start(senior, junior, roots=roots,
                                         options=LaunchOptions.from_config(rollout, placement))
        return self.service.url

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None


@contextmanager
def engine_slots(timeout: float = 600.0) -> Iterator[tuple[Any, dict[str, Any], list[dict]]]:
    """The dedicated layout's engines as two one-GPU actors packed on one node: yields (the service's
    `Placement`, role -> actor, each slot's report). Needs a connected Ray (`ray.init`); the actors and their
    placement group are removed on exit."""
    ray = _ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from tandem.rollout.placement import ROLE_NAMES, placement_from_slots

    group = placement_group([{"GPU": 1, "CPU": 0.01} for _ in ROLE_NAMES], strategy="STRICT_PACK")
    actors: dict[str, Any] = {}
    try:
        ray.get(group.ready(), timeout=timeout)
        slot = ray.remote(num_gpus=1, num_cpus=0.01)(EngineSlot)
        for i, role in enumerate(ROLE_NAMES):
            strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i)
            actors[role] = slot.options(scheduling_strategy=strategy).remote(role)
        reports = ray.get([actors[r].where.remote() for r in ROLE_NAMES], timeout=timeout)
        placement = placement_from_slots({r["role"]: (r["node"], r["devices"]) for r in reports})
        yield placement, actors, reports
    finally:
        for a in actors.values():
            try:
                ray.get(a.stop.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - a dead actor has nothing left to stop
                pass
            ray.kill(a)
        remove_placement_group(group)
