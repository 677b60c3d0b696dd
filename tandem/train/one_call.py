"""Several training processes on one rollout service (the dedicated layout, or a service attached with
`rollout.vllm_url`): the step's rows reach it as one call (`OneCallEngine`), as trl's vLLM server mode does.

Every process hands its rows (prompt token ids and global row ids) to the main process (`gather_object`), which
alone holds a client of the service: it makes one `generate` over all of them, and sends the result back to
every process (`broadcast_object_list`); each process keeps its own rows. Weights are pushed by the main process
only (its engine is the one `VLLMWeightSync` finds live); the others take the module's state dict too, so
that a sharded model's gather, a collective, is entered by every process. The noise of a row depends on
(seed, row id, position) only, so the rollouts equal those of each process calling for itself with the same
seed (tests/rollout/test_vllm_layouts.py checks it with vLLM's CPU build and two gloo processes).

`step_engine` builds the engine a training process uses: this one for `rollout.backend: vllm` with more than one
process sharing one service (`rollout.vllm_layout: dedicated`, or any layout attached to `rollout.vllm_url`), else
the engine itself (one service per process in the shared layout). Either way a service gets one weight push and
one reload per step (tests/rollout/test_one_push.py: two gloo processes on one fake service). The CUDA path (NCCL
instead of gloo, the service on its own GPUs) is unverified until a GPU check runs it.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Callable

from tandem.rollout.core import RolloutBatch

# the per-row columns of a RolloutBatch, in its field order (`timings` is the batch's, not a row's)
_ROW_COLUMNS = tuple(f.name for f in fields(RolloutBatch) if f.name != "timings")


def one_service(rollout: Any, processes: int) -> bool:
    """Whether several training processes share one rollout service: the dedicated layout's, or a service
    attached with `rollout.vllm_url` (every process would attach to the same one). Then one process calls and
    pushes for all: each pushing its own weights would reload the service once per process and step, and a
    process's call naming its own weights would meet another's (409, or a reload in the middle of the step)."""
    return (rollout.backend == "vllm" and processes > 1
            and (rollout.vllm_layout == "dedicated" or bool(rollout.vllm_url)))


def step_engine(build: Callable[[], Any], rollout: Any, accelerator: Any) -> Any:
    """The rollout engine of this training process: `build()` (a client of its own service, or the hf engine),
    or, when several processes share one service (`one_service`), a `OneCallEngine` whose main process alone
    builds one."""
    n = int(getattr(accelerator, "num_processes", 1) or 1)
    if one_service(rollout, n):
        return OneCallEngine(build() if accelerator.is_main_process else None, accelerator)
    return build()


class OneCallEngine:
    """`generate(request)` on every process, one service call in all (module docstring). `engine`: the main
    process's `TandemEngine` (None on the others); `last_calls`: the rows of each service call of the last
    step (the same list on every process)."""

    live = True

    def __init__(self, engine: Any | None, accelerator: Any):
        if accelerator.is_main_process and engine is None:
            raise ValueError("the main process makes the step's one call: it needs the engine")
        self.engine, self.accelerator = engine, accelerator
        self.last_calls: list[int] = []

    def generate(self, request: Any) -> RolloutBatch:
        from accelerate.utils import broadcast_object_list, gather_object

        mine = (tuple(request.prompts), tuple(request.row_ids))
        parts = gather_object([mine])  # every process's rows, in process order
        payload: list = [None]
        if self.accelerator.is_main_process:
            prompts = [p for ps, _ in parts for p in ps]
            rows = [r for _, rs in parts for r in rs]
            batch = self.engine.generate(request.settings.request(prompts, seed=request.seed, row_ids=rows))
            payload = [{"batch": {name: getattr(batch, name) for name in _ROW_COLUMNS}, "timings": dict(batch.timings),
                        "sizes": [len(ps) for ps, _ in parts], "calls": list(getattr(self.engine, "last_calls", []))}]
        broadcast_object_list(payload, from_process=0)
        got = payload[0]
        self.last_calls = got["calls"]
        i = self.accelerator.process_index
        lo = sum(got["sizes"][:i])
        hi = lo + got["sizes"][i]
        return RolloutBatch(**{name: list(col[lo:hi]) for name, col in got["batch"].items()}, timings=got["timings"])

    def push_weights(self, module: Any | None = None) -> dict:
        """The main process pushes the senior to the service; the others take the module's state dict (a
        sharded model gathers it collectively) and drop it."""
        if self.engine is not None:
            return self.engine.push_weights(module)
        if module is not None and hasattr(module, "state_dict"):
            module.state_dict()
        return {}
