"""Each vLLM engine's device (`tandem.rollout.placement`), with fake `LOCAL_RANK` and fake visible GPUs: a distinct
GPU per training process in the shared layout and per model in the dedicated one, what the service's engine
starts get (`service.engine_envs`, `service.parallel_kwargs`, the client's flags; engines sharing a GPU start in
turn, checked on a fake vLLM), and one-line refusals of GPUs that do not exist or overlap. The CUDA path (engines
really landing there) needs a GPU check."""

from __future__ import annotations

import pytest

from tandem.config import ParamsError, RolloutConfig
from tandem.rollout.placement import (DEVICE_ENV, Placement, PlacementError, layout_gpus, place_engines,
                                      placement_for, visible_devices)

EIGHT = [str(i) for i in range(8)]
TEN = [str(i) for i in range(10)]


def test_visible_devices_reads_cuda_visible_devices_else_counts():
    assert visible_devices({DEVICE_ENV: "4,5, 6"}) == ["4", "5", "6"]
    assert visible_devices({DEVICE_ENV: "GPU-aa,GPU-bb"}) == ["GPU-aa", "GPU-bb"]
    assert visible_devices({DEVICE_ENV: ""}) == []  # CUDA_VISIBLE_DEVICES="" hides every GPU
    assert visible_devices({}, count=3) == ["0", "1", "2"]
    assert visible_devices({}, count=0) == []


def test_shared_puts_each_rank_on_its_own_gpu_for_both_engines():
    envs = []
    for rank in range(8):
        p = place_engines("shared", visible=EIGHT, rank=rank)
        assert p.env("senior") == p.env("junior") == {DEVICE_ENV: str(rank)}
        envs.append(p.env("senior")[DEVICE_ENV])
    assert len(set(envs)) == 8  # a distinct GPU per rank
    # a process restricted to GPUs 4..7 names the physical GPU of its rank
    p = place_engines("shared", visible=["4", "5", "6", "7"], rank=2)
    assert p.senior == p.junior == ("6",)


def test_dedicated_puts_each_model_on_its_own_gpu_outside_the_trainers():
    p = place_engines("dedicated", visible=TEN, rollout_devices=[8, 9], trainer_processes=8)
    assert p.env("senior") == {DEVICE_ENV: "8"} and p.env("junior") == {DEVICE_ENV: "9"}
    # empty: the two after the trainer's
    assert place_engines("dedicated", visible=TEN, trainer_processes=8) == p
    # a tensor-parallel group per model, the senior's first
    q = place_engines("dedicated", visible=[str(i) for i in range(12)], rollout_devices=[8, 9, 10, 11],
                      trainer_processes=8)
    assert q.senior == ("8", "9") and q.junior == ("10", "11")
    # positions map to the names the process sees
    r = place_engines("dedicated", visible=["GPU-a", "GPU-b", "GPU-c"], rollout_devices=[1, 2])
    assert r.env("junior") == {DEVICE_ENV: "GPU-c"}


@pytest.mark.parametrize("kw, words", [
    (dict(layout="dedicated", visible=EIGHT, rollout_devices=[8, 9], trainer_processes=6), "does not exist"),
    (dict(layout="dedicated", visible=TEN, rollout_devices=[7, 8], trainer_processes=8), "one of the trainer's"),
    (dict(layout="dedicated", visible=TEN, rollout_devices=[9, 9], trainer_processes=8), "twice"),
    (dict(layout="dedicated", visible=TEN, rollout_devices=[7, 8, 9], trainer_processes=2), "2k"),
    (dict(layout="dedicated", visible=EIGHT, trainer_processes=8), "does not exist"),
    (dict(layout="shared", visible=EIGHT, rank=8), "LOCAL_RANK 8"),
    (dict(layout="shared", visible=EIGHT, rank=0, rollout_devices=[1, 2]), "leave it empty"),
])
def test_missing_or_overlapping_devices_are_one_line(kw, words):
    layout = kw.pop("layout")
    with pytest.raises(PlacementError, match=words) as e:
        place_engines(layout, **kw)
    assert "\n" not in str(e.value)


def test_no_gpu_places_nothing_and_a_placement_refuses_overlap():
    p = place_engines("dedicated", visible=[], rollout_devices=[8, 9], trainer_processes=8)
    assert not p.placed and p.env("senior") == {}  # vLLM's CPU build: the engines inherit
    with pytest.raises(PlacementError, match="overlap"):
        Placement("dedicated", ("3",), ("3",))
    with pytest.raises(PlacementError, match="as many devices"):
        Placement("dedicated", ("3", "4"), ("5",))


def test_placement_for_reads_local_rank_and_the_rollout_section():
    ro = RolloutConfig(backend="vllm", vllm_layout="shared")
    assert placement_for(ro, 4, environ={"LOCAL_RANK": "3", DEVICE_ENV: "0,1,2,3"}).senior == ("3",)
    ro = RolloutConfig(backend="vllm", vllm_layout="dedicated", vllm_gpu_memory=0.9, vllm_devices=[4, 5])
    p = placement_for(ro, 4, environ={"LOCAL_RANK": "0", DEVICE_ENV: "0,1,2,3,4,5"})
    assert (p.senior, p.junior) == (("4",), ("5",))
    with pytest.raises(PlacementError, match="LOCAL_RANK"):
        placement_for(ro, 4, environ={"LOCAL_RANK": "x"})


def test_the_rollout_section_checks_vllm_devices():
    with pytest.raises(ParamsError, match="vllm_devices"):
        RolloutConfig(backend="vllm", vllm_layout="shared", vllm_devices=[2, 3])
    with pytest.raises(ParamsError, match="vllm_devices"):
        RolloutConfig(backend="vllm", vllm_layout="dedicated", vllm_gpu_memory=0.9, vllm_devices=[2, 3, 4])
    with pytest.raises(ParamsError, match="vllm_devices"):
        RolloutConfig(backend="vllm", vllm_layout="dedicated", vllm_gpu_memory=0.9, vllm_devices=[2, 2])


def test_the_service_starts_each_engine_under_its_devices():
    """The client's flags round-trip to the service's placement; engines on distinct devices start one after the
    other, each under its own CUDA_VISIBLE_DEVICES, engines sharing a GPU together; a group runs
    tensor-parallel."""
    from tandem.rollout.vllm.client import LaunchOptions
    from tandem.rollout.vllm.service import engine_envs, parallel_kwargs

    p = place_engines("dedicated", visible=TEN, rollout_devices=[8, 9], trainer_processes=8)
    argv = LaunchOptions(placement=p).placement.to_argv()
    back = Placement.from_argv(argv[5], argv[1], argv[3])
    assert back == p
    assert engine_envs(p) == engine_envs(p, False) == [{1: {DEVICE_ENV: "8"}}, {0: {DEVICE_ENV: "9"}}]
    shared = place_engines("shared", visible=EIGHT, rank=5)
    # on a GPU two engines sharing it start in turn (each sizes its KV cache from the GPU's free memory)
    assert engine_envs(shared) == [{1: {DEVICE_ENV: "5"}}, {0: {DEVICE_ENV: "5"}}]
    # vLLM's CPU build (an explicit KV cache size): together
    assert engine_envs(shared, sized_by_free_memory=False) == [{1: {DEVICE_ENV: "5"}, 0: {DEVICE_ENV: "5"}}]
    assert engine_envs(Placement("shared"), False) == [{1: {}, 0: {}}]
    assert parallel_kwargs(1) == {} and parallel_kwargs(2) == {"tensor_parallel_size": 2,
                                                               "distributed_executor_backend": "mp"}


def test_layout_gpus_counts_every_position_the_node_must_show():
    assert layout_gpus("shared", 8) == 8
    assert layout_gpus("dedicated", 4) == 6 and layout_gpus("dedicated", 4, (4, 5)) == 6  # the two after
    assert layout_gpus("dedicated", 4, (6, 9)) == 10  # positions 4, 5, 7, 8 unused but still on the node
    assert layout_gpus("dedicated", 2, (2, 3, 4, 5)) == 6  # a tensor-parallel pair per model


@pytest.mark.parametrize("cpu", [False, True])
def test_engines_sharing_a_gpu_start_in_turn_with_their_share_each(monkeypatch, tmp_path, cpu):
    """`EngineHost._start` with a fake vLLM: on a GPU the junior's engine starts only once the senior's is up
    (vLLM sizes each engine's KV cache from the GPU's free memory at its start), each under the placement's
    CUDA_VISIBLE_DEVICES and asking for its own share (`gpu_memory_utilization`) with synchronous scheduling;
    on vLLM's CPU build (explicit KV size) both start at once."""
    import asyncio
    import os
    import sys
    import threading
    import time
    import types

    from tandem.rollout.vllm.compat import ENGINE_FIXED
    from tandem.rollout.vllm.engines import EngineHost, EngineSpec
    from tandem.rollout.vllm.knobs import EngineKnobs

    events, lock = [], threading.Lock()

    class Args:
        def __init__(self, **kw):
            self.kw = kw

    class Engine:
        async def collective_rpc(self, name):
            return [name]

    class AsyncLLM:
        @staticmethod
        def from_engine_args(args):
            role = "senior" if args.kw["model"] == "S" else "junior"
            with lock:
                events.append(("start", role, os.environ.get(DEVICE_ENV), args.kw))
            time.sleep(0.3)  # profiling, KV allocation, CUDA graphs
            with lock:
                events.append(("up", role))
            return Engine()

    platform = types.SimpleNamespace(is_cpu=lambda: cpu)
    fake = {"vllm": types.ModuleType("vllm"), "vllm.engine": types.ModuleType("vllm.engine"),
            "vllm.engine.arg_utils": types.SimpleNamespace(AsyncEngineArgs=Args),
            "vllm.platforms": types.SimpleNamespace(current_platform=platform),
            "vllm.v1": types.ModuleType("vllm.v1"), "vllm.v1.engine": types.ModuleType("vllm.v1.engine"),
            "vllm.v1.engine.async_llm": types.SimpleNamespace(AsyncLLM=AsyncLLM)}
    for k, v in fake.items():
        monkeypatch.setitem(sys.modules, k, v)
    host = EngineHost()
    host.stats_files = {0: tmp_path / "j", 1: tmp_path / "s"}
    placement = place_engines("shared", visible=EIGHT, rank=3)
    spec = EngineSpec("S", "J", EngineKnobs(gpu_memory=0.3, dtype="bfloat16"), placement=placement)
    before = os.environ.get(DEVICE_ENV)
    engines = asyncio.run(host._start(spec))
    assert set(engines) == {0, 1}
    order = [e[:2] for e in events]
    if cpu:
        assert order[:2] in ([("start", "senior"), ("start", "junior")], [("start", "junior"), ("start", "senior")])
    else:
        assert order == [("start", "senior"), ("up", "senior"), ("start", "junior"), ("up", "junior")]
    for e in events:
        if e[0] == "start":
            assert e[2] == "3"  # the process's own GPU (LOCAL_RANK 3), set while vLLM spawns the engine core
            kw = e[3]
            assert kw["gpu_memory_utilization"] == 0.3 and kw["distributed_executor_backend"] == "uni"
            assert all(kw[k] == v for k, v in ENGINE_FIXED.items())
    assert os.environ.get(DEVICE_ENV) == before  # the process's environment restored after the starts
