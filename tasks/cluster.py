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
  W&B group from the flow's (`carried_env`); anything else comes from the node's (its `ray start`). It yields the
  params the task runs with.
- `engine_slots(timeout, trainer_gpus)`: the dedicated layout's two engines as one-GPU actors (`EngineSlot`, one
  per model) in a placement group that packs them on one node (one rollout service drives both), with a bundle of
  the trainer's GPUs beside them when asked. Each slot reports the node and the GPU Ray gave it, read with
  `tandem.rollout.placement.visible_devices` as the service reads its own, and `placement_from_slots` turns the
  two reports into the service's `Placement`. `EngineSlot.start_service` starts the rollout service from the
  senior's slot with that placement (`VLLMService.start`, each engine under its own `CUDA_VISIBLE_DEVICES`).
- `arm_service(params)`: what `reservation` does for a train arm whose engines are actors
  (`tandem.rollout.placement.engines_on_actors`: runner ray, the vLLM backend's dedicated layout, no
  `rollout.vllm_url`): `engine_slots` with the trainer's `cluster.train_gpus` as the group's third bundle, the
  service started in the senior's slot, and the arm's task placed on the trainer's bundle with `rollout.vllm_url`
  set to the service and its secret in the task's environment (`TANDEM_VLLM_TOKEN`). The trainer attaches by URL
  as to any service (`tandem.rollout.vllm.client.shared_service`); the whole group is on one node, so the service
  listens on `rollout.vllm_host` (127.0.0.1) and the trainer pushes its weights into the service's inbox
  (`/dev/shm`, the `file` transport) as on one machine. The service, its actors and the group are removed when
  the arm ends, whether it succeeded or not.

Ray and prefect-ray are imported only when `cluster.runner` is ray (`pip install -e '.[ray]'`). Verified on a CPU
machine with a local two-node cluster whose nodes declare GPUs (tests/flows/test_ray.py; the arm's service there
is vLLM's CPU build started in the senior's slot): the CUDA path (real GPUs, the engines really on the slots'
devices) is unverified until a GPU check runs it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from tandem.config import Params

# what each group of tasks reserves on the cluster (a cluster setting per group)
GPU_SETTINGS = {"train": "train_gpus", "evaluate": "eval_gpus"}
MISSING = "cluster.runner ray needs prefect-ray and ray: pip install -e '.[ray]'"
SLOT_CPU = 0.01  # what an engine slot reserves of a CPU: the engine runs in the service's processes
TASK_CPU = 1  # what a Ray task reserves of a CPU by default: the trainer's bundle holds it
log = logging.getLogger(__name__)


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
    train arm (`train@<arm>`), plus its two engine slots when its engines are actors (`engines_on_actors`),
    `cluster.eval_gpus` for an evaluation unit (`evaluate-...`); {} when local (the run's accounting then counts
    the GPUs the flow's own machine holds)."""
    if not on_ray(params):
        return {}
    from tandem.rollout.placement import ROLE_NAMES

    train = needs(params, "train")["num_gpus"] + (len(ROLE_NAMES) if engines_on_actors(params) else 0)
    per = {"train@": train, "evaluate-": needs(params, "evaluate")["num_gpus"]}
    return {t: n for t in tasks for prefix, n in per.items() if t.startswith(prefix)}


def engines_on_actors(params: Params) -> bool:
    """Whether a train arm's rollout engines are one-GPU Ray actors beside its task (`arm_service`)."""
    from tandem.rollout.placement import engines_on_actors as on_actors

    ro = params.rollout
    return on_actors(params.cluster.runner, ro.backend, ro.vllm_layout, ro.vllm_url)


def carried_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a task on the cluster takes from the flow's environment: the run's W&B group (and a `dvc exp run`
    experiment's name), which the flow sets in its own process (`tasks.tracking.pipeline_group`)."""
    from tasks.tracking import EXP_ENV, GROUP_ENV

    env = os.environ if environ is None else environ
    return {k: env[k] for k in (GROUP_ENV, EXP_ENV) if env.get(k)}


@contextmanager
def reservation(params: Params, group: str) -> Iterator[Params]:
    """prefect-ray's `remote_options` with `needs(params, group)` and the flow's `carried_env` around the tasks
    submitted inside; yields the params they run with (`params` itself, or for a train arm whose engines are
    actors the params `arm_service` gives it). Local: nothing is reserved, `params` is yielded."""
    if not on_ray(params):
        yield params
        return
    from prefect_ray.context import remote_options

    env = carried_env()
    if group == "train" and engines_on_actors(params):
        with arm_service(params) as (task_params, options, secret):
            with remote_options(**options, runtime_env={"env_vars": {**env, **secret}}):
                yield task_params
        return
    with remote_options(**needs(params, group), **({"runtime_env": {"env_vars": env}} if env else {})):
        yield params


@contextmanager
def arm_service(params: Params) -> Iterator[tuple[Params, dict[str, Any], dict[str, str]]]:
    """One train arm's rollout service on the cluster (module docstring): yields the params the arm runs with
    (`rollout.vllm_url` the service's), the Ray options of its task (the trainer's GPUs, on the group's trainer
    bundle) and the environment that lets it in (the service's secret). The service, the slots and their group
    are removed on exit."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from tandem.errors import UserError
    from tandem.rollout.vllm.client import TOKEN_ENV, senior_start_dir
    from tasks.common import junior_of
    from tasks.train import default_io, weight_roots

    ray = _ray()
    ro, gpus = params.rollout, params.cluster.train_gpus
    inputs = default_io(params)[0]
    junior = junior_of(params, inputs).resolve()
    roots = [str(r.resolve()) for r in weight_roots(params, junior)]
    with engine_slots(ro.vllm_start_timeout, trainer_gpus=gpus) as slots:
        # the senior engine's directory, as shared_service picks it locally (read once the slots are held)
        senior = senior_start_dir(Path(inputs["base_model"]).resolve(), junior)
        try:
            started = ray.get(slots.actors["senior"].start_service.remote(str(senior), str(junior), roots, ro,
                                                                            slots.placement),
                              timeout=ro.vllm_start_timeout + 60)
        except ray.exceptions.RayTaskError as e:  # the service's own one line (ServiceStartError), not Ray's dump
            raise (e.cause if isinstance(e.cause, UserError) else e) from None
        node = slots.reports[0]["node"]
        log.info("rollout service %s (pid %s) in the senior's engine slot on Ray node %s: %s; the trainer holds "
                 "%d GPU(s) beside it", started["url"], started["pid"], node, slots.placement.describe(), gpus)
        strategy = PlacementGroupSchedulingStrategy(placement_group=slots.group,
                                                    placement_group_bundle_index=slots.trainer_bundle)
        task_params = dataclasses.replace(params, rollout=dataclasses.replace(ro, vllm_url=started["url"]))
        yield (task_params, {"num_gpus": gpus, "num_cpus": TASK_CPU, "scheduling_strategy": strategy},
               {TOKEN_ENV: started["token"]})


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

    def start_service(self, senior: str, junior: str, roots: list[str], rollout: Any, placement: Any) -> dict:
        """Start the rollout service here (the senior's slot) with both engines on their slots' devices; its URL
        (for `rollout.vllm_url`), its secret and its process id. Unverified on GPUs (module docstring)."""
        from tandem.rollout.vllm.client import LaunchOptions, VLLMService

        self.service = VLLMService.start(senior, junior, roots=roots,
                                         options=LaunchOptions.from_config(rollout, placement))
        return {"url": self.service.url, "token": self.service.token, "pid": self.service.proc.pid}

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None


@dataclass(frozen=True)
class Slots:
    """What `engine_slots` holds: the service's `Placement`, role -> actor, each slot's report (`where`), the
    placement group, and the index of the trainer's bundle in it (None without one)."""

    placement: Any
    actors: dict[str, Any]
    reports: list[dict]
    group: Any
    trainer_bundle: int | None


@contextmanager
def engine_slots(timeout: float = 600.0, trainer_gpus: int = 0) -> Iterator[Slots]:
    """The dedicated layout's engines as two one-GPU actors packed on one node, with a bundle of `trainer_gpus`
    GPUs beside them when > 0 (a train arm's task goes there). Needs a connected Ray (`ray.init`); a group no node
    can hold within `timeout` seconds is a `PlacementError` of one line. The actors and their placement group are
    removed on exit."""
    ray = _ray()
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from tandem.rollout.placement import ROLE_NAMES, PlacementError, placement_from_slots

    bundles = [{"GPU": 1, "CPU": SLOT_CPU} for _ in ROLE_NAMES]
    trainer = None
    if trainer_gpus:
        trainer = len(bundles)
        bundles.append({"GPU": trainer_gpus, "CPU": TASK_CPU})
    group = placement_group(bundles, strategy="STRICT_PACK")
    actors: dict[str, Any] = {}
    try:
        try:
            ray.get(group.ready(), timeout=timeout)
        except GetTimeoutError:
            beside = f" and the trainer's {trainer_gpus}" if trainer_gpus else ""
            raise PlacementError(f"no node of the Ray cluster had {sum(b['GPU'] for b in bundles)} GPUs free within "
                                 f"{timeout:.0f} s: one node holds both rollout engines (one GPU each){beside}, "
                                 f"packed (rollout.vllm_start_timeout)") from None
        slot = ray.remote(num_gpus=1, num_cpus=SLOT_CPU)(EngineSlot)
        for i, role in enumerate(ROLE_NAMES):
            strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i)
            actors[role] = slot.options(scheduling_strategy=strategy).remote(role)
        reports = ray.get([actors[r].where.remote() for r in ROLE_NAMES], timeout=timeout)
        placement = placement_from_slots({r["role"]: (r["node"], r["devices"]) for r in reports})
        yield Slots(placement, actors, reports, group, trainer)
    finally:
        for a in actors.values():
            try:
                ray.get(a.stop.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - a dead actor has nothing left to stop
                pass
            ray.kill(a)
        remove_placement_group(group)
