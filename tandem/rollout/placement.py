"""Where the rollout service's two vLLM engines run: each engine's GPU(s), decided once from the layout, the
process's place and the GPUs it sees (`place_engines`), then handed to each engine as its environment.

vLLM 0.32 has no engine argument naming a device: its engine-core process, spawned by `AsyncLLM`, inherits the
environment of the process that starts it, and its single-process (`uni`) executor runs the model on the first
GPU that environment shows (`CUDA_VISIBLE_DEVICES`, vLLM's `device_control_env_var` on CUDA). So the service
sets that variable to the engine's device(s) while it starts the engine (`service.EngineHost`), as trl's
`vllm-serve` and Ray's placement do; a group of several devices runs the engine tensor-parallel over them.

Layouts (`rollout.vllm_layout`):
- `shared`: every training process starts its own service; both engines on the process's own GPU, the one at
  position `LOCAL_RANK` of the GPUs it sees (accelerate's local rank), with `rollout.vllm_gpu_memory` of it each.
- `dedicated`: one service for the run, on GPUs set aside for rollout (`rollout.vllm_devices`: positions among
  the GPUs the training processes see; one per model, or a tensor-parallel group of k per model, the senior's
  first; empty = the two after the trainer's), which must exist and lie outside the trainer's (positions
  0 .. train.num_processes - 1).

Pure: the standard library only (the service imports it in vLLM's environment). A GPU is named by its entry in
`CUDA_VISIBLE_DEVICES` (an index or a UUID), else by its index. On a machine without GPUs (vLLM's CPU build)
nothing is placed unless GPUs are named (`visible`), which is how the tests exercise the rules. The CUDA path
(the engines really landing on those GPUs) is unverified until a GPU check runs it (scripts/gpu_check.sh).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Sequence

from tandem.errors import UserError

DEVICE_ENV = "CUDA_VISIBLE_DEVICES"  # vLLM's device_control_env_var on CUDA
LAYOUTS = ("shared", "dedicated")
ROLE_NAMES = ("senior", "junior")


class PlacementError(UserError, ValueError):
    """The GPUs a layout names do not exist, or overlap each other or the trainer's (one line)."""


@dataclass(frozen=True)
class Placement:
    """Each engine's devices (names as `CUDA_VISIBLE_DEVICES` takes them); empty = the engine inherits the
    service's environment (nothing placed: the CPU build)."""

    layout: str
    senior: tuple[str, ...] = ()
    junior: tuple[str, ...] = ()

    def __post_init__(self):
        if len(self.senior) != len(self.junior):
            raise PlacementError(f"the senior's and the junior's engines need as many devices each (got "
                                 f"{list(self.senior)} and {list(self.junior)})")
        if self.layout == "dedicated" and set(self.senior) & set(self.junior):
            raise PlacementError(f"the dedicated layout gives each model devices of its own; the senior's "
                                 f"{list(self.senior)} and the junior's {list(self.junior)} overlap")

    @property
    def placed(self) -> bool:
        return bool(self.senior)

    def devices(self, role: str) -> tuple[str, ...]:
        return self.senior if role == "senior" else self.junior

    def env(self, role: str) -> dict[str, str]:
        """The environment that puts engine `role` on its devices ({} when nothing is placed)."""
        d = self.devices(role)
        return {DEVICE_ENV: ",".join(d)} if d else {}

    def to_argv(self) -> list[str]:
        """The service's flags for this placement (`service.main` parses them back with `from_argv`)."""
        return ["--senior-devices", ",".join(self.senior), "--junior-devices", ",".join(self.junior),
                "--layout", self.layout]

    @classmethod
    def from_argv(cls, layout: str, senior: str, junior: str) -> "Placement":
        def split(s: str) -> tuple[str, ...]:
            return tuple(x.strip() for x in s.split(",") if x.strip())

        return cls(layout, split(senior), split(junior))

    def describe(self) -> str:
        if not self.placed:
            return "engines inherit the service's devices (nothing placed)"
        return ", ".join(f"{r} -> {DEVICE_ENV}={','.join(self.devices(r))}" for r in ROLE_NAMES)


def visible_devices(environ: Mapping[str, str] | None = None, count: int | None = None) -> list[str]:
    """The GPUs this process sees: the entries of `CUDA_VISIBLE_DEVICES` when it is set, else `count` indices
    (default: torch's device count, 0 without CUDA)."""
    env = os.environ if environ is None else environ
    raw = env.get(DEVICE_ENV)
    if raw is not None:
        return [x.strip() for x in raw.split(",") if x.strip()]
    if count is None:
        try:
            import torch

            count = torch.cuda.device_count()
        except Exception:  # noqa: BLE001 - no torch or no driver: no GPU
            count = 0
    return [str(i) for i in range(count)]


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """The process's local rank (accelerate's `LOCAL_RANK`; 0 when it runs alone)."""
    env = os.environ if environ is None else environ
    raw = env.get("LOCAL_RANK", "0") or "0"
    if not raw.strip().isdigit():
        raise PlacementError(f"LOCAL_RANK={raw!r} is not a process index")
    return int(raw)


def rollout_positions(devices: Sequence[int], trainer_processes: int) -> list[int]:
    """`rollout.vllm_devices`, or the two positions after the trainer's when it is empty."""
    return list(devices) if devices else [trainer_processes, trainer_processes + 1]


def layout_gpus(layout: str, trainer_processes: int, devices: Sequence[int] = ()) -> int:
    """The GPUs one node must show for `layout`: shared, the trainer's (`train.num_processes`); dedicated, every
    position up to the rollout service's last one (`rollout_positions`; the trainer holds 0 .. processes - 1)."""
    if layout == "shared":
        return trainer_processes
    return max(trainer_processes, max(rollout_positions(devices, trainer_processes)) + 1)


def engines_on_actors(runner: str, backend: str, layout: str, url: str) -> bool:
    """Whether a train arm's rollout engines are one-GPU actors of a cluster scheduler (`cluster.runner` ray, the
    vLLM backend's dedicated layout, no service named by `rollout.vllm_url`): the arm's own reservation then holds
    the trainer's GPUs only, and its service runs in the senior's actor (tasks/cluster.py)."""
    return runner == "ray" and backend == "vllm" and layout == "dedicated" and not url


def place_engines(layout: str, *, visible: Sequence[str], rank: int = 0, rollout_devices: Sequence[int] = (),
                  trainer_processes: int = 1) -> Placement:
    """Each engine's devices for `layout` (module docstring), given the GPUs the process sees (`visible`), its
    local rank and, for `dedicated`, `rollout.vllm_devices` and `train.num_processes`. No GPU visible: nothing is
    placed (vLLM's CPU build). A device that does not exist or overlaps is a `PlacementError` of one line."""
    if layout not in LAYOUTS:
        raise PlacementError(f"rollout.vllm_layout {layout!r}: choose one of {LAYOUTS}")
    if not visible:
        return Placement(layout)
    seen = f"{len(visible)} GPU(s) visible ({DEVICE_ENV}={','.join(visible)})"
    if layout == "shared":
        if not 0 <= rank < len(visible):
            raise PlacementError(f"rollout.vllm_layout shared puts each training process's engines on its own "
                                 f"GPU, but LOCAL_RANK {rank} has none: {seen}")
        if rollout_devices:
            raise PlacementError("rollout.vllm_devices names the rollout service's GPUs of the dedicated layout; "
                                 "with rollout.vllm_layout shared each process's engines use its own GPU: leave "
                                 "it empty")
        return Placement(layout, (visible[rank],), (visible[rank],))
    pos = rollout_positions(rollout_devices, trainer_processes)
    if len(pos) < 2 or len(pos) % 2:
        raise PlacementError(f"rollout.vllm_devices lists {len(pos)} GPU(s): name one per model (2) or a "
                             f"tensor-parallel group per model (2k, the senior's first)")
    dup = sorted({p for p in pos if pos.count(p) > 1})
    if dup:
        raise PlacementError(f"rollout.vllm_devices names GPU {dup[0]} twice: each engine needs GPUs of its own")
    missing = [p for p in pos if not 0 <= p < len(visible)]
    if missing:
        raise PlacementError(f"rollout.vllm_devices names GPU {missing[0]}, which does not exist: {seen}")
    trainer = [p for p in pos if p < trainer_processes]
    if trainer:
        raise PlacementError(f"rollout.vllm_devices names GPU {trainer[0]}, one of the trainer's (0.."
                             f"{trainer_processes - 1}, train.num_processes {trainer_processes}): the dedicated "
                             f"layout keeps the rollout engines off the trainer's GPUs")
    k = len(pos) // 2
    return Placement(layout, tuple(visible[p] for p in pos[:k]), tuple(visible[p] for p in pos[k:]))


def placement_for(rollout, trainer_processes: int, environ: Mapping[str, str] | None = None,
                  count: int | None = None) -> Placement:
    """The placement of this process's service from the `rollout` params section, its `LOCAL_RANK` and the GPUs
    it sees (`visible_devices`)."""
    return place_engines(rollout.vllm_layout, visible=visible_devices(environ, count), rank=local_rank(environ),
                         rollout_devices=tuple(rollout.vllm_devices), trainer_processes=trainer_processes)


def placement_from_slots(slots: Mapping[str, tuple[str, Sequence[str]]]) -> Placement:
    """The dedicated layout's placement from what a cluster scheduler gave each engine: role -> (node, the
    devices that engine's slot sees). Ray reserves the GPUs of a one-GPU actor per engine and sets the actor's
    `CUDA_VISIBLE_DEVICES` (read there by `visible_devices`, as by any process); the service that drives both
    engines runs on one node, so the slots must share it, each see at least one device, and not overlap
    (`Placement`). A slot that sees no device or sits on another node is a `PlacementError` of one line."""
    missing = [r for r in ROLE_NAMES if r not in slots]
    if missing:
        raise PlacementError(f"no engine slot for the {missing[0]}: the dedicated layout places both engines")
    nodes = {slots[r][0] for r in ROLE_NAMES}
    if len(nodes) != 1:
        raise PlacementError(f"the senior's and the junior's engine slots landed on different nodes "
                             f"({', '.join(sorted(nodes))}): one rollout service drives both, on one node")
    empty = [r for r in ROLE_NAMES if not slots[r][1]]
    if empty:
        raise PlacementError(f"the {empty[0]}'s engine slot sees no GPU ({DEVICE_ENV} empty): reserve one GPU "
                             f"per engine")
    return Placement("dedicated", tuple(slots["senior"][1]), tuple(slots["junior"][1]))
