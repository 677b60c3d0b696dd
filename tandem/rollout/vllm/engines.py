"""The rollout service's two vLLM engines: how each is started (`EngineSpec`, `engine_kwargs`, each on the devices
its placement gives it: `engine_envs`, `parallel_kwargs`), and the part of the service that runs them
(`EngineHost`: start, the frontend's sockets, weight loads, counters, shutdown).

vLLM is imported inside the functions (`check_vllm` first sets the engine environment, `compat.ENGINE_ENV`). The
patches of the engine core (`submit`, `returns`: installed by `sched.TandemScheduler` when the engine core
builds it) and of the workers (`worker.install_patches`) are installed by explicit calls at engine start
(`EngineHost._start` calls every worker's `tandem_install_patches`), never when a module is imported.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.rollout.placement import Placement
from tandem.rollout.vllm.compat import ENGINE_ENV, ENGINE_FIXED, check_version
from tandem.rollout.vllm.knobs import EngineKnobs
from tandem.rollout.vllm.returns import Returns
from tandem.rollout.vllm.sessions import Router
from tandem.rollout.vllm.submit import Submitter

ROLES = {"senior": 1, "junior": 0}
ROLE_NAMES = {1: "senior", 0: "junior"}
LOG = logging.getLogger("tandem.vllm.service")


def resolve_dtype(dtype: str, model_dir: str) -> str:
    """`auto` keeps a float32 checkpoint in float32: vLLM's own `auto` serves float32 models in half precision,
    whose log-probs then differ from the trainer's float32 recomputation (measured: up to 0.46 nats on the
    tiny base)."""
    if dtype != "auto":
        return dtype
    cfg_path = Path(model_dir) / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    return "float32" if (cfg.get("dtype") or cfg.get("torch_dtype")) == "float32" else "auto"


@dataclass(frozen=True)
class EngineSpec:
    """How the service starts its two engines: the models, the engines' seed, their knobs
    (`knobs.EngineKnobs`, the flags the client passed) and each engine's devices (`placement.Placement`)."""

    senior: str
    junior: str
    knobs: EngineKnobs = EngineKnobs()
    seed: int = 0
    placement: Placement = Placement("shared")


def engine_envs(placement: Placement, sized_by_free_memory: bool = True) -> list[dict[int, dict[str, str]]]:
    """The engines' starts, in order: each a {role: environment} of engines started together, each engine under
    its own `CUDA_VISIBLE_DEVICES` (the environment is the process's, and vLLM spawns the engine-core process from
    it: `placement` module docstring). The senior first.

    Engines start together only when they share one environment and do not size their KV caches from the
    device's free memory (`sized_by_free_memory` False: vLLM's CPU build, whose KV cache has an explicit size).
    On a GPU vLLM 0.32 sizes an engine's KV cache by profiling (`gpu_worker.determine_available_memory`:
    the requested share of the GPU less what the profile run saw consumed, read as whole-device free memory,
    "assuming the other processes using the same GPU did not change their memory usage during the
    profiling"): two engines starting at once on one GPU would each count the other's allocations as their
    own, or fail its assertion when the other frees memory. So on a GPU the second engine starts after the first
    is up (`AsyncLLM.from_engine_args` returns once the engine core has allocated its KV cache)."""
    envs = {ROLES[name]: placement.env(name) for name in ("senior", "junior")}
    if envs[1] == envs[0] and not sized_by_free_memory:
        return [envs]
    return [{1: envs[1]}, {0: envs[0]}]


def engine_kwargs(knobs: EngineKnobs, model: str, role: int, seed: int, stats_file: str, dtype: str,
                  is_cpu: bool) -> dict[str, Any]:
    """The `AsyncEngineArgs` of one engine (role 1: the senior, 0: the junior): the knobs, the tandem scheduler
    and worker, and the settings the service relies on whatever the platform's defaults (`compat.ENGINE_FIXED`:
    synchronous scheduling)."""
    kw: dict[str, Any] = dict(model=model, dtype=dtype, enforce_eager=knobs.enforce_eager,
                              enable_prefix_caching=True, seed=seed, gpu_memory_utilization=knobs.gpu_memory,
                              scheduler_cls="tandem.rollout.vllm.sched.TandemScheduler",
                              worker_extension_cls="tandem.rollout.vllm.worker.TandemWorker",
                              additional_config={"tandem_stats": stats_file},
                              max_num_seqs=knobs.max_num_seqs, disable_log_stats=True,
                              # one device per engine: the worker runs inside the engine-core process (no extra
                              # process to start), and collective_rpc reaches it there
                              distributed_executor_backend="uni", **ENGINE_FIXED)
    if role == 1:
        # processed_logprobs: the sampled token's log-prob after temperature, log_softmax(logits / T), which is
        # what trl recomputes (training uses top-p 1 and no top-k).
        kw["logprobs_mode"] = "processed_logprobs"
    if knobs.max_model_len:
        kw["max_model_len"] = knobs.max_model_len
    if knobs.kv_blocks:
        kw["num_gpu_blocks_override"] = knobs.kv_blocks
    if knobs.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = knobs.max_num_batched_tokens
    if knobs.block_size:
        kw["block_size"] = knobs.block_size
    elif is_cpu:
        # The CPU build defaults to 128-token KV blocks (its attention wants multiples of 32); the first chunk of
        # a session shares the group's prompt blocks through the prefix cache
        kw["block_size"] = 32
    return kw


def parallel_kwargs(devices: int) -> dict[str, Any]:
    """The engine arguments of an engine placed on `devices` GPUs: tensor-parallel over a group of several (vLLM's
    multiprocess executor, one worker per GPU); nothing for one GPU or none (the `uni` executor of
    `engine_kwargs`). Unverified on CUDA until a GPU check runs it."""
    if devices <= 1:
        return {}
    return {"tensor_parallel_size": devices, "distributed_executor_backend": "mp"}


def check_vllm() -> str:
    """Set the engine environment (`compat.ENGINE_ENV`, before vLLM is imported: the engine-core processes
    inherit it), then import vLLM and refuse a version outside the fence; returns the installed version."""
    os.environ.update(ENGINE_ENV)
    import vllm

    check_version(vllm.__version__)
    return vllm.__version__


class EngineHost:
    """The engines' side of the service (`service.Service` is one): started on an event loop of the service's own
    (`_run`), each on its devices; the frontend's submission and return sockets; weight loads; counters."""

    async def _routers(self) -> dict:
        return {r: Router(e) for r, e in self.engines.items()}

    async def _returns(self) -> dict:
        out = {}
        for r, e in self.engines.items():
            ret = Returns(e, f"ipc://{self.inbox}/returns-{ROLE_NAMES[r]}", self.routers[r].sessions)
            await ret.start()
            out[r] = ret
        return out

    async def _submitters(self) -> dict:
        out = {}
        for r, e in self.engines.items():
            s = Submitter(e, f"ipc://{self.inbox}/submit-{ROLE_NAMES[r]}")
            await s.start()
            out[r] = s
        return out

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, spec: EngineSpec) -> dict:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        def args(role: int) -> AsyncEngineArgs:
            model = spec.senior if role == 1 else spec.junior
            return AsyncEngineArgs(**self._engine_kwargs(spec, model, role, current_platform.is_cpu()))

        loop = asyncio.get_running_loop()
        engines: dict = {}
        # on a GPU one engine after the other (`engine_envs`: each sizes its KV cache from the device's free
        # memory); on vLLM's CPU build engines on the same devices start at once (each engine core in its own
        # processes: about half the start time). The process's environment names the engine's devices while vLLM
        # spawns its engine core. The engines' queues and sockets bind to this loop when first used.
        for group in engine_envs(spec.placement, sized_by_free_memory=not current_platform.is_cpu()):
            env = next(iter(group.values()))
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                started = await asyncio.gather(*(loop.run_in_executor(None, AsyncLLM.from_engine_args, args(r))
                                                 for r in group))
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            engines.update(zip(group, started))
            for r in group:  # the workers' patches, by an explicit call once the engine is up (worker.py)
                got = await engines[r].collective_rpc("tandem_install_patches")
                LOG.info("engine %s: worker patches %s", ROLE_NAMES[r], got)
            for r in group:
                LOG.info("engine %s started on %s", ROLE_NAMES[r], self.device_text(spec.placement, r))
        return engines

    @staticmethod
    def device_text(placement: Placement, role: int) -> str:
        """Where engine `role` runs, as /health and the log say it."""
        env = placement.env(ROLE_NAMES[role])
        return ",".join(f"{k}={v}" for k, v in env.items()) or "the service's devices (nothing placed)"

    def _engine_kwargs(self, spec: EngineSpec, model: str, role: int, is_cpu: bool) -> dict[str, Any]:
        """One engine's `AsyncEngineArgs` (`engine_kwargs`; a hook for the benchmark's service)."""
        kw = engine_kwargs(spec.knobs, model, role, spec.seed, str(self.stats_files[role]),
                           resolve_dtype(spec.knobs.dtype, model), is_cpu)
        return {**kw, **parallel_kwargs(len(spec.placement.devices(ROLE_NAMES[role])))}

    def shutdown(self) -> None:
        for s in [*getattr(self, "submitters", {}).values(), *getattr(self, "returns", {}).values()]:
            s.close()
        for e in getattr(self, "engines", {}).values():
            try:
                e.shutdown()
            except Exception:  # noqa: BLE001 - shutting down anyway
                LOG.exception("engine shutdown")
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def _load(self, role: int, path: str) -> None:
        eng = self.engines[role]
        await eng.collective_rpc("tandem_load_weights", args=(path,))
        ok = await eng.reset_prefix_cache()
        if not ok:  # blocks still in use: cached KV from the old weights could be reused
            raise RuntimeError(f"the {ROLE_NAMES[role]} engine refused to reset its prefix cache after a load")

    def counters(self) -> dict[int, dict]:
        import numpy as np

        from tandem.rollout.vllm.sched import FIELDS

        out = {}
        for r, f in self.stats_files.items():
            a = np.fromfile(f, dtype=np.float64, count=len(FIELDS))
            out[r] = dict(zip(FIELDS, (float(x) for x in a)))
        return out

    def socket_counters(self) -> dict[str, float]:
        """The frontend's own sockets, summed over both engines: the batched submissions (messages sent, the chunk
        requests they carried, the CPU of sending them; no messages with one message per chunk) and the chunk
        returns (messages and chunks taken, the CPU of taking them; none through vLLM's output path)."""
        subs, rets = list(self.submitters.values()), list(self.returns.values())
        return {"submit_messages": sum(s.messages for s in subs), "submit_requests": sum(s.requests for s in subs),
                "submit_cpu_seconds": sum(s.send_cpu_seconds for s in subs),
                "return_messages": sum(x.messages for x in rets), "return_chunks": sum(x.chunks for x in rets),
                "return_cpu_seconds": sum(x.cpu_seconds for x in rets)}
