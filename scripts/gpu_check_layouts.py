#!/usr/bin/env python3
"""The rollout layouts with vLLM on a GPU machine (part of scripts/gpu_check.sh): each engine on a device of its
own, and one service call per training step in the dedicated layout.

    PYTHONPATH=. .venv/bin/python scripts/gpu_check_layouts.py [--dry] [--out DIR]

Each check prints one JSON line {"check", "ok", ...}; the exit status is 1 when one fails.

  placement  a service on tiny random models, placed by `tandem.rollout.placement` over the GPUs this process
             sees: dedicated over the last two when there are two or more (the senior's engine on one, the
             junior's on the other), else shared on GPU 0. Each engine-core process must carry its engine's
             `CUDA_VISIBLE_DEVICES`, /health must name it, and on a GPU `nvidia-smi` must show each engine
             core's process on the GPU it was placed on.
  one_call   two training processes (gloo) and the dedicated layout, 2 steps of `TandemRollout`: one service call
             per step with both processes' rows (the service's own count and the step's `rollout/*` metrics),
             rollouts equal to each process calling for itself with the same seeds. Needs two GPUs for the
             service (the training processes run on the CPU); skipped (ok null) with one.

--dry runs both on the CPU with vLLM's CPU build and four fake GPUs (the CPU build ignores the variable):
tests/rollout/test_vllm_layouts.py runs it that way. Until this script has passed on GPUs, the CUDA path of the
layouts (engines really landing on their GPUs, the one call over a GPU service) is unverified.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

FAKE_GPUS = "0,1,2,3"  # --dry: what the training processes "see"; the trainer's two, then one per model

WORKER = r"""
import json, sys, types
from pathlib import Path
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from tandem.config import RolloutConfig
from tandem.rollout import toy
from tandem.rollout.core import SamplingParams
from tandem.rollout.engine import TandemEngine
from tandem.rollout.request import RolloutSettings
from tandem.rollout.schedule import ScheduleSpec
from tandem.rollout.vllm.client import VLLMService, engine_from_config
from tandem.train.one_call import OneCallEngine, step_engine
from tandem.train.rollout import TandemRollout
from tandem.train.stats import StepStats

root, out, trainers = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
acc = Accelerator(cpu=True)
rank = acc.process_index
tok = toy.byte_bpe_tokenizer()
senior, junior = str(root / "senior"), str(root / "junior")
rollout = RolloutConfig(backend="vllm", vllm_layout="dedicated", vllm_gpu_memory=0.9, vllm_dtype="float32",
                        vllm_max_model_len=256, vllm_start_timeout=1800)
engine = step_engine(lambda: engine_from_config(senior, junior, tok, rollout, live=False, roots=[root],
                                                trainer_processes=trainers), rollout, acc)
assert isinstance(engine, OneCallEngine) and (engine.engine is not None) == acc.is_main_process
settings = RolloutSettings(ScheduleSpec("word", max_gap_tokens=6),
                           SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=24))
run = types.SimpleNamespace(engine=engine, tokenizer=tok, seed=7, base=None, junior=None,
                            geometry=types.SimpleNamespace(step_of=lambda s: s),
                            spec=types.SimpleNamespace(name="tandem", schedule="word", group_size=2),
                            train=types.SimpleNamespace(kl_rows=0))
model = types.SimpleNamespace(training=False, eval=lambda: None, train=lambda mode=True: None)
trainer = types.SimpleNamespace(accelerator=acc, model=model, state=types.SimpleNamespace(global_step=0))
texts = ["The sum of two and two is", "Write the answer:", "Step one.", "Let x be"]
mine = [t for t in texts[2 * rank:2 * rank + 2] for _ in range(2)]  # 2 prompts x group 2 per process
svc = engine.engine._backend.service if acc.is_main_process else None

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


def tiny_models(root: Path) -> None:
    """Two random tiny Qwen3 models (the byte-level tokenizer's vocabulary) saved under root/senior, root/junior."""
    from tandem.rollout import toy

    tok = toy.byte_bpe_tokenizer()
    for name, seed in (("senior", 1), ("junior", 2)):
        m = toy.tiny_qwen3(len(tok), seed, toy.TinyShape(layers=2, hidden=128, heads=4, kv_heads=2),
                           eos_token_id=tok.eos_token_id)
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)


def engine_core_envs(service_pid: int) -> list[tuple[int, str | None]]:
    """(pid, `CUDA_VISIBLE_DEVICES`) of each engine-core process of the service (vLLM titles them EngineCore)."""
    from tandem.rollout.placement import DEVICE_ENV
    from tandem.rollout.vllm.lifecycle import group_members

    out = []
    for pid in group_members(service_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if "EngineCore" in cmd:
            vals = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(DEVICE_ENV.encode() + b"=")]
            out.append((pid, vals[0] if vals else None))
    return out


def gpu_of_pids() -> dict[int, str]:
    """pid -> the index of the GPU it computes on, from nvidia-smi ({} without it)."""
    try:
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    index = {u.strip(): i.strip() for i, u in (ln.split(",") for ln in gpus.splitlines() if ln.strip())}
    return {int(p): index.get(u.strip(), u.strip()) for p, u in (ln.split(",") for ln in apps.splitlines()
                                                               if ln.strip())}


def check_placement(root: Path, visible: list[str], dry: bool) -> dict:
    """The `placement` check (module docstring) over `visible` GPUs."""
    from tandem.rollout.placement import DEVICE_ENV, place_engines
    from tandem.rollout.vllm.client import LaunchOptions, VLLMService
    from tandem.rollout.vllm.knobs import EngineKnobs

    n = len(visible)
    if n >= 2:
        placement = place_engines("dedicated", visible=visible, rollout_devices=[n - 2, n - 1],
                                  trainer_processes=n - 2)
        share = 0.3
    else:
        placement = place_engines("shared", visible=visible, rank=0)
        share = 0.2
    svc = VLLMService.start(root / "senior", root / "junior", roots=[root], options=LaunchOptions(
        knobs=EngineKnobs(dtype="float32", max_model_len=256, kv_blocks=16, gpu_memory=share), start_timeout=1800,
        placement=placement, log_path=root / "placement.log"))
    try:
        info = svc.health()
        want = {r: f"{DEVICE_ENV}={','.join(placement.devices(r))}" for r in ("senior", "junior")}
        cores = engine_core_envs(svc.proc.pid)
        envs = sorted(v or "" for _, v in cores)
        ok = info.get("devices") == want and envs == sorted(",".join(placement.devices(r))
                                                             for r in ("senior", "junior"))
        res = {"check": "placement", "layout": placement.layout, "devices": info.get("devices"),
               "engine_core_env": envs}
        if not dry:
            on = gpu_of_pids()
            where = sorted(on.get(pid, "?") for pid, _ in cores)
            res["engine_core_gpus"] = where
            ok = ok and where == envs  # each engine core computes on the GPU it was placed on
        res["ok"] = bool(ok)
        return res
    finally:
        svc.stop()


def check_one_call(root: Path, visible_env: str, trainers: int, timeout: float = 1500) -> dict:
    """The `one_call` check (module docstring): `trainers` positions before the service's two GPUs among
    `visible_env` (CUDA_VISIBLE_DEVICES of the training processes)."""
    out = root / "one_call"
    out.mkdir(exist_ok=True)
    script = root / "one_call_worker.py"
    script.write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": visible_env, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                        "127.0.0.1", "--master_port", str(port), str(script), str(root), str(out), str(trainers)],
                       env=env, capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
    if r.returncode != 0:
        return {"check": "one_call", "ok": False, "error": (r.stdout[-2000:] + r.stderr[-4000:])}
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1)]
    same = all(one["out"] == each["out"] for got in ranks for one, each in zip(got["one"], got["each"]))
    metrics = [one["metrics"] for got in ranks for one in got["one"]]
    own_metrics = [each["metrics"] for got in ranks for each in got["each"]]
    calls = [s["service_calls"] for s in ranks[0]["one"]]
    own_calls = [s["service_calls"] for s in ranks[0]["each"]]
    ok = (same and calls == [1, 1] and own_calls == [2, 2]
          and all(m == {"rollout/service_calls": 1.0, "rollout/rows_per_call": 8.0} for m in metrics)
          and all(m == {"rollout/service_calls": 1.0, "rollout/rows_per_call": 4.0} for m in own_metrics)
          and ranks[0]["one"][0]["out"] != ranks[1]["one"][0]["out"]
          and all(len(one["out"]["completion_ids"]) == 4 for got in ranks for one in got["one"]))
    return {"check": "one_call", "ok": bool(ok), "service_calls_per_step": calls,
            "service_calls_per_step_each_for_itself": own_calls, "metrics": metrics[0],
            "rollouts_equal_each_for_itself": same}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="on the CPU with vLLM's CPU build and four fake GPUs")
    ap.add_argument("--out", default=None, help="also write the JSON lines to DIR/gpu_check_layouts.json")
    ap.add_argument("--only", choices=("placement", "one_call"), default=None)
    a = ap.parse_args(argv)
    from tandem.rollout.placement import visible_devices

    if a.dry:
        visible = FAKE_GPUS.split(",")
    else:
        visible = visible_devices()
        if not visible:
            print("gpu_check_layouts: no CUDA GPU visible (use --dry on a CPU)", file=sys.stderr)
            return 1
    results = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tandem-layouts-") as d:
        root = Path(d)
        tiny_models(root)
        if a.only in (None, "placement"):
            results.append(check_placement(root, visible, a.dry))
            print(json.dumps(results[-1]), flush=True)
        if a.only in (None, "one_call"):
            if a.dry:
                results.append(check_one_call(root, FAKE_GPUS, trainers=2))
            elif len(visible) >= 2:  # the training processes run on the CPU; the service on the last two GPUs
                results.append(check_one_call(root, ",".join(visible), trainers=len(visible) - 2))
            else:
                results.append({"check": "one_call", "ok": None, "why": "needs two GPUs for the service"})
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"check": "total", "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "gpu_check_layouts.json").write_text("\n".join(json.dumps(r) for r in results) + "\n")
    return 1 if any(r["ok"] is False for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
