"""The rollout layouts for real, with vLLM's CPU build (`.venv-vllm`) on tiny models: a service placed on fake GPUs
starts each engine-core process with its own `CUDA_VISIBLE_DEVICES` and says so in /health (the CPU build
ignores the variable: the CUDA path, engines really landing there, needs a GPU check). Slow (a service start);
skips without `.venv-vllm` unless TANDEM_REQUIRE_VLLM=1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.rollout.placement import DEVICE_ENV, place_engines
from tandem.rollout.vllm.client import LaunchOptions, VLLMService
from tandem.rollout.vllm.knobs import EngineKnobs
from tandem.rollout.vllm.lifecycle import group_members
from vllm_fixtures import need_vllm, tiny_dirs

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def engine_core_envs(service_pid: int) -> list[str | None]:
    """`CUDA_VISIBLE_DEVICES` of each engine-core process of the service (vLLM titles them VLLM::EngineCore)."""
    out = []
    for pid in group_members(service_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if "EngineCore" in cmd:
            vals = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(DEVICE_ENV.encode() + b"=")]
            out.append(vals[0] if vals else None)
    return out


def test_dedicated_engines_start_on_devices_of_their_own(tmp_path):
    need_vllm()
    from tandem.rollout import toy

    tok = toy.byte_bpe_tokenizer()
    dirs = tiny_dirs(tmp_path, tok)
    # four fake GPUs seen by the training processes: the trainer's two, then one per model
    placement = place_engines("dedicated", visible=["0", "1", "2", "3"], trainer_processes=2)
    svc = VLLMService.start(dirs["senior"], dirs["junior"], roots=[tmp_path], options=LaunchOptions(
        knobs=EngineKnobs(dtype="float32", max_model_len=256, kv_blocks=16), start_timeout=1800,
        placement=placement, log_path=tmp_path / "service.log"))
    try:
        info = svc.health()
        assert info["layout"] == "dedicated"
        assert info["devices"] == {"senior": f"{DEVICE_ENV}=2", "junior": f"{DEVICE_ENV}=3"}
        assert sorted(engine_core_envs(svc.proc.pid)) == ["2", "3"]  # one engine core per model, each its GPU
        log = (tmp_path / "service.log").read_text()
        assert f"engine senior started on {DEVICE_ENV}=2" in log and f"engine junior started on {DEVICE_ENV}=3" in log
    finally:
        svc.stop()


WORKER = r"""
import json, os, sys, types
from pathlib import Path
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from tandem.config import RolloutConfig
from tandem.rollout import toy
from tandem.rollout.core import SamplingParams
from tandem.rollout.engine import TandemEngine
from tandem.rollout.request import RolloutSettings
from tandem.rollout.vllm.client import VLLMService, engine_from_config
from tandem.train.one_call import OneCallEngine, step_engine
from tandem.train.rollout import TandemRollout
from tandem.train.stats import StepStats

root, out = Path(sys.argv[1]), Path(sys.argv[2])
acc = Accelerator(cpu=True)
rank = acc.process_index
tok = toy.byte_bpe_tokenizer()
senior, junior = str(root / "senior"), str(root / "junior")
rollout = RolloutConfig(backend="vllm", vllm_layout="dedicated", vllm_gpu_memory=0.9, vllm_dtype="float32",
                        vllm_max_model_len=256, vllm_start_timeout=1800)
engine = step_engine(lambda: engine_from_config(senior, junior, tok, rollout, live=False, roots=[root],
                                                trainer_processes=acc.num_processes), rollout, acc)
assert isinstance(engine, OneCallEngine) and (engine.engine is not None) == acc.is_main_process
settings = RolloutSettings("word", SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=24),
                           max_gap_tokens=6)
run = types.SimpleNamespace(engine=engine, tokenizer=tok, seed=7, base=None, junior=None,
                            geometry=types.SimpleNamespace(step_of=lambda s: s),
                            spec=types.SimpleNamespace(name="tandem", schedule="word", group_size=2),
                            train=types.SimpleNamespace(kl_rows=0))
model = types.SimpleNamespace(training=False, eval=lambda: None, train=lambda mode=True: None)
trainer = types.SimpleNamespace(accelerator=acc, model=model, state=types.SimpleNamespace(global_step=0))
texts = ["The sum of two and two is", "Write the answer:", "Step one.", "Let x be"]
mine = [t for t in texts[2 * rank:2 * rank + 2] for _ in range(2)]  # 2 prompts x group 2 per process

def steps(fn):
    got = []
    for step in (0, 1):
        trainer.state.global_step = step
        acc.wait_for_everyone()  # the service's count brackets every process's calls of the step
        calls0 = svc.health()["calls"] if svc is not None else 0
        acc.wait_for_everyone()
        res = fn(mine, trainer)
        acc.wait_for_everyone()
        calls = (svc.health()["calls"] - calls0) if svc is not None else None
        got.append({"out": res, "metrics": {k: v for k, v in fn.stats.values.items() if k.startswith("rollout/")},
                    "service_calls": calls})
    return got

svc = engine.engine._backend.service if acc.is_main_process else None
one = steps(TandemRollout(run, settings, StepStats()))
# each process calls for itself, on the same service, with the same seeds
where = [[svc.url, svc.token] if acc.is_main_process else None]
broadcast_object_list(where, from_process=0)
if acc.is_main_process:
    own = engine.engine
else:
    own = TandemEngine(senior, junior, tok, backend="vllm",
                       vllm_options={"service": VLLMService.attach(where[0][0], where[0][1])})
run.engine = own
each = steps(TandemRollout(run, settings, StepStats()))
acc.wait_for_everyone()  # the other process is done with the service before the main one stops it
(out / f"rank{rank}.json").write_text(json.dumps({"one": one, "each": each}))
print("ok", flush=True)
"""


def test_dedicated_layout_makes_one_call_per_step_with_every_process_rows(tmp_path):
    """Two training processes (gloo), the dedicated layout, 2 steps: one service call per step carrying both
    processes' rows (the service's own count and the step's `rollout/*` metrics), and the rollouts equal those
    of each process calling for itself with the same seeds."""
    import json
    import os
    import socket
    import subprocess
    import sys

    need_vllm()
    from tandem.rollout import toy

    tiny_dirs(tmp_path, toy.byte_bpe_tokenizer())
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), DEVICE_ENV: "0,1,2,3", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                        "127.0.0.1", "--master_port", str(port), str(script), str(tmp_path), str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=1500, cwd=str(repo))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    for i, got in enumerate(ranks):
        for one, each in zip(got["one"], got["each"]):
            assert one["out"] == each["out"], f"process {i}: one call's rollouts differ from its own call's"
            assert one["metrics"] == {"rollout/service_calls": 1.0, "rollout/rows_per_call": 8.0}
            assert each["metrics"] == {"rollout/service_calls": 1.0, "rollout/rows_per_call": 4.0}
            assert len(one["out"]["completion_ids"]) == 4 and any(map(len, one["out"]["completion_ids"]))
    assert [s["service_calls"] for s in ranks[0]["one"]] == [1, 1]  # the service served one call per step
    assert [s["service_calls"] for s in ranks[0]["each"]] == [2, 2]  # one per process and step
    assert ranks[0]["one"][0]["out"] != ranks[1]["one"][0]["out"]  # each process got its own rows back
