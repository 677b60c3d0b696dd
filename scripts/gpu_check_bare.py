#!/usr/bin/env python3
"""The GPU check for a bare borrowed machine: the library's CUDA path, from the source tree, in a few minutes.

scripts/gpu_check.sh needs the project's whole environment (the pipeline's stages, vLLM's own venv). This one
needs only what a bare GPU machine has (Python 3.12 with torch, transformers, accelerate, peft, pandas, pyarrow
preinstalled; no network) plus the few wheels `scripts/gpu_bundle.sh` brings (`BUNDLE` below: the library's
pins of transformers, trl and datasets, and datasets' dill and multiprocess). It imports the library
(`tandem/`), torch, transformers, accelerate and those wheels, nothing of the pipeline (no prefect, dvc, wandb,
great-expectations) and not math-verify (the training step scores with its own reward).

Usage (from the repository root, or from the bundle's src/):
    PYTHONPATH=. python scripts/gpu_check_bare.py [--dry] [--out DIR]
    python scripts/gpu_check_bare.py --bundle-list    # the wheels to bring, NAME==VERSION as installed here

Each check prints one JSON line {"check": name, "ok": bool, "seconds": ..., ...figures}; the exit status is 1
when any check fails. `--out DIR` also writes every line to DIR/gpu_check_bare.json.

  catchup   the hf backend's catch-up kernel is token-identical to the lockstep oracle (transformers' own
            forward, `tandem.rollout.lockstep`) on a random tiny Qwen3 in float64, as tests/rollout/
            test_engine.py compares them: word, step and token schedules, same ids, owners and finish reasons,
            senior log-probs within 1e-6, with enough handoffs that catch-up really runs.
  throughput  tokens/s of the hf engine (solo and tandem word schedule) on a pair of the mid-sized Qwen3
            below in bf16 (float32 with --dry).
  train     two tandem GRPO steps through `tandem.train.train_arm` (trl's GRPOTrainer) on a random mid-sized
            Qwen3 (about 220M parameters; tiny with --dry) under `train.precision: bf16_mixed` (fp32 master
            weights with bf16 autocast on CUDA; plain fp32 on a CPU), junior in bfloat16, gradient
            checkpointing and gradient accumulation on: finite loss, the senior changed, the junior unchanged,
            the senior's token share within 0.3..0.7.
  memory    the memory plan (`tandem.plan.plan_train_arm`) of that model and batch against the CUDA memory of
            the second training step (torch.cuda.max_memory_allocated from the start of its rollout, minus
            what was allocated then: weights, AdamW moments, junior): ok when the plan's step figure
            (max of its rollout and training phases) is within 0.75..1.25 of the measured one, the tolerance
            scripts/gpu_check.sh states for tests/memory_probe.py. The whole peak against the plan's peak (less
            its flat CUDA margin) is reported beside it. With --dry the plan is computed for the CPU and no
            peak is measured.
  layouts   each engine's device decided from the GPUs torch sees (a distinct GPU per training process,
            shared layout; one per model outside the trainer's, dedicated), and the dedicated layout's one call
            per step (`tandem.train.one_call`) across two processes (NCCL on two GPUs, else gloo), with the hf
            engine standing in for the rollout service (vLLM cannot travel here): one call per step with both
            processes' rows, rollouts equal to each process calling for itself.
  imports   every package the library and this script imported during the checks, with the declared
            dependencies of every bundled wheel, is on the bare machine's image (`IMAGE`) or in the bundle
            (`BUNDLE`), and neither the pipeline's packages (prefect, dvc, wandb, great-expectations,
            math-verify) nor its code (tasks, flows, cli) was imported.

--dry runs the same code paths on the CPU with tiny sizes (well under a minute; `make test` runs it through
tests/test_gpu_check_bare.py). Without --dry the script refuses, with one line, when torch sees no CUDA GPU.
On an H200 the whole run is sized to stay under 8 minutes (the last line gives the total seconds).
`--shape qwen3-4b` runs the throughput, training and memory checks on a Qwen3-4B-shaped pair instead (random
weights, 8 rows x 128 new tokens per step; the float64 catch-up check is skipped): the plan of the paper preset's
model against its measured step, also under 8 minutes on an H200.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Wheels the bare machine lacks (or has in another version) and the checks import: transformers (the image's
# 5.17 predates the `cache=` keyword the lockstep oracle passes), trl (the trainer), datasets (trl imports it)
# and datasets' dill and multiprocess. scripts/gpu_bundle.sh downloads them at the versions installed here.
BUNDLE = ("transformers", "trl", "datasets", "dill", "multiprocess")

# Python distributions on the bare GPU machine's image (nvidia-h200, its 'cuda' image as read 2026-11-17;
# torch 2.11, transformers 5.17, huggingface_hub 1.33, accelerate 1.15, Python 3.12): the `imports` check
# accepts a loaded distribution that is here, in BUNDLE, or a dependency of one of these installed here.
IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate
tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
PIPELINE = frozenset({"prefect", "dvc", "wandb", "great-expectations", "gto", "math-verify"})

TOLERANCE = (0.75, 1.25)   # plan / measured, as scripts/gpu_check.sh states it for tests/memory_probe.py
GPU_BUDGET_S = 480         # the whole run on an H200 (8 minutes)
MIB = 2**20


# Qwen3-4B-Instruct-2507's shape (its config.json), random weights: what the paper preset trains
QWEN3_4B = dict(hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=9728,
                vocab_size=151936, max_position=1024)
SHAPES = ("mid", "qwen3-4b")


def sizes(dry: bool, shape: str = "mid") -> dict:
    """Every size the checks use: tiny on the CPU (--dry), mid-sized on a GPU; `shape="qwen3-4b"` trains and
    measures a Qwen3-4B-shaped pair instead (with --dry: the tiny model with Qwen3's vocabulary of 151,936, the
    logits' share of the plan)."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
    if shape == "qwen3-4b":
        model = QWEN3_4B if not dry else {**sizes(True)["model"], "vocab_size": QWEN3_4B["vocab_size"]}
        return dict(model=model, catchup_prompts=8, catchup_tokens=24, tput_rows=8 if dry else 32,
                    tput_tokens=16 if dry else 64,
                    train=dict(prompts_per_step=2, group_size=4, max_new_tokens=12 if dry else 128,
                               micro_batch_size=4, kl_rows=4))
    if dry:
        return dict(model=dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                               intermediate_size=128, vocab_size=512, max_position=512),
                    catchup_prompts=8, catchup_tokens=24, tput_rows=8, tput_tokens=16,
                    train=dict(prompts_per_step=2, group_size=4, max_new_tokens=12, micro_batch_size=4,
                               kl_rows=4))
    return dict(model=dict(hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=8, head_dim=64,
                           intermediate_size=2816, vocab_size=32768, max_position=1024),
                catchup_prompts=32, catchup_tokens=64, tput_rows=64, tput_tokens=128,
                train=dict(prompts_per_step=4, group_size=4, max_new_tokens=256, micro_batch_size=4, kl_rows=4))


class Report:
    """Prints each check's JSON line as it finishes and keeps them for --out."""

    def __init__(self, out: Path | None):
        self.out, self.lines = out, []

    def emit(self, line: dict) -> dict:
        self.lines.append(line)
        print(json.dumps(line), flush=True)
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "gpu_check_bare.json").write_text(json.dumps(self.lines, indent=1) + "\n")
        return line

    def run(self, name: str, fn, *args) -> dict:
        """Run one check; an exception is a failed check with its message (the other checks still run)."""
        t0 = time.perf_counter()
        try:
            figures = fn(*args)
        except Exception as e:  # noqa: BLE001 - a check that raises is a failed check, reported, not a crash
            figures = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        return self.emit({"check": name, "ok": bool(figures.pop("ok")), "seconds": round(time.perf_counter() - t0, 2),
                          **figures})


# --------------------------------------------------------------------------------------------------
# catchup: the hf catch-up kernel against the lockstep oracle (float64)
# --------------------------------------------------------------------------------------------------

def check_catchup(dev: str, sz: dict) -> dict:
    import torch

    from tandem.rollout import toy
    from tandem.rollout.engine import SamplingParams, TandemEngine
    from tandem.rollout.lockstep import lockstep_generate
    from tandem.rollout.request import RolloutSettings
    from tandem.rollout.schedule import ScheduleSpec

    tok = toy.byte_bpe_tokenizer()
    senior, junior = toy.tiny_pair(tok)  # float64, different random weights
    # steer both toward newlines and word starts so that words and steps end often (as the engine tests do)
    words = {i: 2.5 for t, i in tok.get_vocab().items() if t.startswith("Ġ")}
    for m in (senior, junior):
        toy.add_logit_bias(m, {**words, tok.convert_tokens_to_ids("Ċ"): 5.0})
    senior, junior = senior.to(dev), junior.to(dev)
    eng = TandemEngine(senior, junior, tok)
    prompts = toy.prompts(tok, sz["catchup_prompts"], seed=3)
    sp = SamplingParams(temperature=1.0, max_new_tokens=sz["catchup_tokens"])
    per, ok = {}, eng.fast
    for schedule in ("word", "step", "token"):
        settings = RolloutSettings(ScheduleSpec(schedule, max_gap_tokens=6, max_rounds=5), sp)
        fast = eng.generate(settings.request(prompts, 11))
        with torch.no_grad():
            ref = lockstep_generate(eng.pair, settings.request(prompts, 11))
        diff = max((abs(a - b) for ra, rb in zip(fast.senior_logprobs, ref.senior_logprobs)
                    for a, b in zip(ra, rb)), default=0.0)
        same = (fast.completion_ids == ref.completion_ids and fast.owner == ref.owner
                and fast.finish_reason == ref.finish_reason)
        handoffs = sum(fast.handoffs)
        per[schedule] = {"token_identical": same, "logprob_max_abs_diff": diff, "handoffs": handoffs,
                         "tokens": sum(map(len, fast.completion_ids))}
        ok = ok and same and diff <= 1e-6 and handoffs > 5
    return {"ok": ok, "device": dev, "dtype": "float64", "kernel": "catch-up" if eng.fast else "lockstep fallback",
            "rows": len(prompts), "max_new_tokens": sp.max_new_tokens, "schedules": per}


# --------------------------------------------------------------------------------------------------
# The rollout layouts without vLLM: each engine's device, and one call per training step
# --------------------------------------------------------------------------------------------------

def check_layouts(dev: str, dry: bool) -> dict:
    """Per-engine devices decided from the GPUs torch sees (`tandem.rollout.placement`: a distinct GPU per
    training process in the shared layout, one per model outside the trainer's in the dedicated one), and the
    dedicated layout's one call per step (`tandem.train.one_call.OneCallEngine`) across two processes, NCCL on
    two GPUs (gloo on the CPU with one GPU or --dry), with the hf engine standing in for the service: exactly
    one call per step with both processes' rows, rollouts equal to each process calling for itself."""
    import socket
    import subprocess

    from tandem.rollout.placement import PlacementError, place_engines, visible_devices

    visible = ["0", "1", "2", "3"] if dry else visible_devices()
    shared = [place_engines("shared", visible=visible, rank=r).senior for r in range(len(visible))]
    placement = {"visible": visible, "shared": [d[0] for d in shared]}
    ok = len(set(shared)) == len(visible)
    if len(visible) >= 3:
        d = place_engines("dedicated", visible=visible, trainer_processes=len(visible) - 2)
        placement["dedicated"] = {"senior": list(d.senior), "junior": list(d.junior)}
        ok = ok and not set(d.senior) & set(d.junior) and not set(d.senior + d.junior) & set(visible[:-2])
    try:
        place_engines("dedicated", visible=visible, rollout_devices=[0, len(visible)], trainer_processes=1)
        ok = False  # a GPU that does not exist, and one of the trainer's, must be refused
    except PlacementError:
        pass
    backend = "nccl" if dev == "cuda" and len(visible) >= 2 and not dry else "gloo"
    with tempfile.TemporaryDirectory(prefix="gpu-check-layouts-") as d, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                            "127.0.0.1", "--master_port", str(port), __file__, "--layouts-worker", d, backend],
                           env=env, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            return {"ok": False, "placement": placement, "error": (r.stdout[-1500:] + r.stderr[-2500:])}
        ranks = [json.loads((Path(d) / f"rank{i}.json").read_text()) for i in (0, 1)]
    one_call = ranks[0]["calls"] == [[8], [8]] and all(x["equal"] for x in ranks) and ranks[0]["rows"] != ranks[1]["rows"]
    return {"ok": bool(ok and one_call), "placement": placement, "backend": backend,
            "calls_per_step": ranks[0]["calls"], "equal_to_each_for_itself": [x["equal"] for x in ranks]}


def layouts_worker(out: str, backend: str) -> int:
    """One of the two processes of `check_layouts`: 2 steps of one call (the main's engine) against each process
    calling for itself, with the same seeds."""
    import torch
    from accelerate import Accelerator

    from tandem.rollout import toy
    from tandem.rollout.engine import SamplingParams, TandemEngine
    from tandem.rollout.request import RolloutSettings
    from tandem.rollout.schedule import ScheduleSpec
    from tandem.train.one_call import OneCallEngine

    acc = Accelerator(cpu=backend == "gloo")
    dev = acc.device
    torch.set_num_threads(1)
    tok = toy.byte_bpe_tokenizer()
    senior, junior = toy.tiny_pair(tok)
    eng = TandemEngine(senior.to(dev), junior.to(dev), tok)
    calls: list = []

    class Counted:  # the service stand-in: counts the rows of each call
        def generate(self, request):
            calls.append(len(request))
            return eng.generate(request)

    one = OneCallEngine(Counted() if acc.is_main_process else None, acc)
    settings = RolloutSettings(ScheduleSpec("word", max_gap_tokens=6), SamplingParams(temperature=1.0, max_new_tokens=16))
    prompts = toy.prompts(tok, 8, seed=3)[4 * acc.process_index:4 * acc.process_index + 4]
    rows = range(4 * acc.process_index, 4 * acc.process_index + 4)
    per_step, equal, mine = [], True, []
    for step in (0, 1):
        n0 = len(calls)
        got = one.generate(settings.request(prompts, seed=100 + step, row_ids=rows))
        per_step.append(calls[n0:])
        own = eng.generate(settings.request(prompts, seed=100 + step, row_ids=rows))
        equal = equal and got.completion_ids == own.completion_ids and got.owner == own.owner and all(
            abs(a - b) <= 1e-9 for ra, rb in zip(got.senior_logprobs, own.senior_logprobs) for a, b in zip(ra, rb))
        mine.append(got.completion_ids)
    acc.wait_for_everyone()
    Path(out, f"rank{acc.process_index}.json").write_text(json.dumps({"calls": per_step, "equal": equal,
                                                                      "rows": mine}))
    return 0


# --------------------------------------------------------------------------------------------------
# The mid-sized model, its params and rows
# --------------------------------------------------------------------------------------------------

def make_params(dev: str, sz: dict, max_prompt_tokens: int):
    """The params of the training check: the model section sizes the plan, the train section the run."""
    import torch

    from tandem.config import params_from_dict

    train = {"arms": ["tandem"], "steps": 2, "save_every": 2, "warmup_steps": 0, "learning_rate": 2e-5,
             "report_to": "none", "val_every": 0, "precision": "bf16_mixed", "gradient_checkpointing": True,
             "max_prompt_tokens": max_prompt_tokens, **sz["train"]}
    if dev == "cuda":
        train["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return params_from_dict({"model": {"source": "tiny", "dtype": "bfloat16", **sz["model"]}, "train": train,
                             "rollout": {"backend": "hf", "schedule": "word"}})


def make_models(params, tok, dev: str):
    """(senior, junior): one random Qwen3 of the params' model section built on `dev`, the senior in float32
    (the master weights of bf16_mixed), the junior an equal copy in model.dtype (bfloat16)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    m = params.model
    cfg = Qwen3Config(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                      num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                      num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim or m.hidden_size // m.num_heads,
                      max_position_embeddings=m.max_position, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]), torch.device(dev):
        torch.manual_seed(0)
        senior = Qwen3ForCausalLM(cfg).float()
    senior.generation_config.eos_token_id = tok.eos_token_id
    junior = copy.deepcopy(senior).to(getattr(torch, m.dtype))
    return senior, junior


def train_rows(n: int = 32) -> list[dict]:
    """Prepared rows (id, problem, answer, prompt) from the toy arithmetic corpus."""
    from tandem.data.prompts import user_message
    from tandem.rollout import toy

    rows = []
    for i, text in enumerate(toy.corpus(n, seed=5)):
        problem = text.split("\n\n")[0]
        rows.append({"id": f"gpu-check-{i}", "problem": problem, "prompt": user_message(problem),
                     "answer": re.search(r"\\boxed\{(\d+)\}", text).group(1)})
    return rows


# --------------------------------------------------------------------------------------------------
# throughput: the hf engine in bf16
# --------------------------------------------------------------------------------------------------

def check_throughput(dev: str, sz: dict) -> dict:
    import torch

    from tandem.rollout import toy
    from tandem.rollout.engine import SamplingParams, TandemEngine

    tok = toy.byte_bpe_tokenizer()
    params = make_params(dev, sz, 64)
    senior, junior = make_models(params, tok, dev)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    senior, junior = senior.to(dtype).eval(), junior.to(dtype).eval()
    eng = TandemEngine(senior, junior, tok)
    prompts = [p for p in toy.prompts(tok, sz["tput_rows"] // 4, seed=0) for _ in range(4)]
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    out = {}
    for schedule in ("solo", "word"):
        toy.rollout(eng, prompts[:8], schedule, SamplingParams(max_new_tokens=8), seed=1)  # warm-up
        sync()
        t0 = time.perf_counter()
        b = toy.rollout(eng, prompts, schedule, SamplingParams(max_new_tokens=sz["tput_tokens"]), seed=0)
        sync()
        dt = time.perf_counter() - t0
        st = b.stats()
        out[schedule] = {"tok_s": round(st["tokens"] / dt, 1), "seconds": round(dt, 3), "tokens": st["tokens"],
                         "senior_fraction": round(st["senior_fraction"], 3)}
    del senior, junior, eng
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {"ok": all(v["tokens"] > 0 and v["tok_s"] > 0 for v in out.values()), "device": dev,
            "dtype": str(dtype).removeprefix("torch."), "kernel": "catch-up", "rows": len(prompts),
            "max_new_tokens": sz["tput_tokens"], **{f"{k}_tok_s": v["tok_s"] for k, v in out.items()},
            "tandem_over_solo": round(out["word"]["tok_s"] / out["solo"]["tok_s"], 3), "schedules": out}


# --------------------------------------------------------------------------------------------------
# train + memory: two tandem GRPO steps, and the plan against the second step's CUDA memory
# --------------------------------------------------------------------------------------------------

class MemoryProbeEngine:
    """The run's engine, unchanged, noting at each rollout (the start of a training step) the CUDA memory then
    allocated and resetting the peak: after the run, max_memory_allocated is the last step's peak."""

    def __init__(self, engine, cuda: bool):
        self.engine, self.cuda, self.base_bytes = engine, cuda, []

    def generate(self, request):
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.base_bytes.append(torch.cuda.memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        return self.engine.generate(request)

    def __getattr__(self, name):
        if name == "engine":  # not yet set (a copy under construction): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)


def alternating_reward(texts, golds, **_):
    """1, 0, 1, 0... within each group: every group has reward variance, so every step moves the senior (a
    random model never writes a correct answer, and math-verify is not needed for this check)."""
    return [float(i % 2 == 0) for i in range(len(texts))]


def check_train(dev: str, sz: dict, workdir: Path, memory: dict) -> dict:
    import torch

    from tandem.data.prompts import render_prompt
    from tandem.plan import CUDA_OVERHEAD_GIB, GIB, model_shape, plan_train_arm
    from tandem.precision import precision_plan
    from tandem.rollout import toy
    from tandem.rollout.factory import make_engine
    from tandem.train import ArmRun, train_arm, weights_hash

    tok = toy.byte_bpe_tokenizer()
    rows = train_rows()
    longest = max(len(tok(render_prompt(r["prompt"], tok), add_special_tokens=False)["input_ids"]) for r in rows)
    params = make_params(dev, sz, longest)
    senior, junior = make_models(params, tok, dev)
    before = weights_hash(senior), weights_hash(junior)
    shape = model_shape(params)
    plan = plan_train_arm(params, "tandem", shape, device=dev)
    probe = MemoryProbeEngine(make_engine(senior, junior, tok, "hf"), cuda=dev == "cuda")
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    res = train_arm(ArmRun("tandem", senior, junior, tok, rows, params.train, params.rollout, workdir / "tandem",
                           engine=probe, score_fn=alternating_reward, progress=False))
    s = res.summary
    prec = precision_plan(params.train.precision, params.model.dtype, dev)
    figures = {"device": dev, "precision": params.train.precision, "autocast": prec.autocast,
               "senior_dtype": prec.senior_dtype, "junior_dtype": prec.frozen_dtype,
               "n_params": shape.n_params, "n_params_model": sum(p.numel() for p in senior.parameters()),
               "rows_per_step": params.train.prompts_per_step * params.train.group_size,
               "micro_batch_size": params.train.micro_batch_size, "seq_tokens": longest + params.train.max_new_tokens,
               "steps": s["steps"], "loss_finite": s["loss_finite"], "senior_fraction": s["senior_fraction"],
               "senior_changed": weights_hash(senior) != before[0],
               "junior_unchanged": s["junior_unchanged"] and weights_hash(junior) == before[1],
               "reward_mean": s["reward_mean"], "step_seconds": s["step_seconds"],
               "phase_seconds": s["phase_seconds"]}
    figures["ok"] = (s["steps"] == params.train.steps and s["loss_finite"] and figures["senior_changed"]
                     and figures["junior_unchanged"] and 0.3 < s["senior_fraction"] < 0.7)

    # memory: the plan's figures, and on CUDA the second step's measured peak above what it started with
    persistent = sum(plan.persistent.values())
    plan_step = plan.peak_bytes - persistent  # max(rollout phase, training phase)
    memory.update({"device": dev, "plan_step_mib": round(plan_step / MIB, 1),
                   "plan_rollout_mib": round(sum(plan.rollout.values()) / MIB, 1),
                   "plan_training_phase_mib": round(plan.training_phase_bytes / MIB, 1),
                   "plan_persistent_mib": {k: round(v / MIB, 1) for k, v in plan.persistent.items()},
                   "plan_fits": plan.fits, "tolerance": list(TOLERANCE)})
    if dev != "cuda":
        memory.update({"measured": None, "skipped": "no CUDA: the plan is computed for the CPU, no peak measured",
                       "ok": plan_step > 0 and math.isfinite(plan.peak_bytes)})
        return figures
    peak = torch.cuda.max_memory_allocated()
    base = probe.base_bytes[-1]
    measured_step = peak - base
    margin = CUDA_OVERHEAD_GIB * GIB
    ratio = plan_step / measured_step
    memory.update({"measured_step_mib": round(measured_step / MIB, 1), "measured_base_mib": round(base / MIB, 1),
                   "plan_base_mib": round((persistent - margin) / MIB, 1),
                   "ratio": round(ratio, 3), "measured_peak_mib": round(peak / MIB, 1),
                   "plan_peak_less_margin_mib": round((plan.peak_bytes - margin) / MIB, 1),
                   "peak_ratio": round((plan.peak_bytes - margin) / peak, 3),
                   "steps_measured": len(probe.base_bytes),
                   "ok": len(probe.base_bytes) == params.train.steps and TOLERANCE[0] <= ratio <= TOLERANCE[1]})
    return figures


# --------------------------------------------------------------------------------------------------
# imports: what the checks loaded is on the image or in the bundle
# --------------------------------------------------------------------------------------------------

class ImportLog:
    """Records the top-level packages that the library (`tandem.*`) and this script import themselves, by
    wrapping `__import__` from the start of the run. Optional integrations that third-party packages probe
    for (transformers imports wandb when it is installed) are not the library's needs and are not recorded."""

    def __init__(self):
        import builtins

        self.roots: dict[str, str] = {}
        self._orig = builtins.__import__

        def hook(name, globals=None, locals=None, fromlist=(), level=0):
            importer = (globals or {}).get("__name__") or ""
            if level == 0 and importer.split(".")[0] in ("tandem", "__main__"):
                self.roots.setdefault(name.split(".")[0], importer)
            return self._orig(name, globals, locals, fromlist, level)

        builtins.__import__ = hook


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def check_imports(log: ImportLog) -> dict:
    """What the library and this script import, with the declared dependencies of every bundled wheel, must be
    on the image or in the bundle; the image's own packages bring their dependencies there. None of the
    pipeline's packages (PIPELINE) may be imported, nor the pipeline's code (tasks, flows, cli)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    owners = md.packages_distributions()
    stdlib = set(sys.stdlib_module_names)
    own = ("tandem", "tasks", "flows", "cli")  # this repository's packages (the last three: the pipeline)
    roots = {_norm(d) for t in log.roots if t not in stdlib and t not in own for d in owners.get(t, (t,))}
    bundle = {_norm(b) for b in BUNDLE}

    def requires(dist: str) -> set[str]:
        try:
            reqs = md.requires(dist) or []
        except md.PackageNotFoundError:
            return set()
        out = set()
        for r in map(Requirement, reqs):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                out.add(_norm(r.name))
        return out

    needed, todo = set(roots), [d for d in roots if d not in IMAGE]
    while todo:  # expand what the machine does not have already (the bundle's own declared needs)
        for r in requires(todo.pop()) - needed:
            needed.add(r)
            if r not in IMAGE:
                todo.append(r)
    missing = sorted(needed - IMAGE - bundle)
    pipeline = sorted(roots & PIPELINE)
    pipeline_code = sorted(t for t in log.roots if t in own[1:])
    return {"ok": not missing and not pipeline and not pipeline_code, "imported_by_library": sorted(roots),
            "bundle": sorted(bundle), "missing_on_machine": missing, "pipeline_imported": pipeline + pipeline_code}


# --------------------------------------------------------------------------------------------------

def bundle_list() -> list[str]:
    """NAME==VERSION of every BUNDLE wheel, at the version installed in this interpreter (the project's pins)."""
    import importlib.metadata as md

    return [f"{name}=={md.version(name)}" for name in BUNDLE]


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "trl", "datasets", "accelerate", "pyarrow", "pandas", "huggingface-hub",
                 "tokenizers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="the same code paths on the CPU with tiny sizes")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON lines to OUT/gpu_check_bare.json")
    ap.add_argument("--bundle-list", action="store_true", help="print the wheels to bring (NAME==VERSION) and exit")
    ap.add_argument("--shape", choices=SHAPES, default="mid",
                    help="the model the throughput, training and memory checks use: mid (~220M, the default) or "
                         "qwen3-4b (Qwen3-4B's shape, random weights; the float64 catch-up check is skipped)")
    ap.add_argument("--layouts-worker", nargs=2, metavar=("OUT", "BACKEND"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.layouts_worker:
        return layouts_worker(*args.layouts_worker)
    if args.bundle_list:
        print("\n".join(bundle_list()))
        return 0
    t_start = time.perf_counter()
    log = ImportLog()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if not args.dry and not torch.cuda.is_available():
        print("gpu_check_bare: no CUDA GPU visible (torch sees none); run with --dry for the CPU dry run",
              file=sys.stderr)
        return 2
    dev = "cpu" if args.dry else "cuda"
    if args.dry:
        torch.set_num_threads(1)  # tiny models; one thread is steadiest on a busy machine
    sz = sizes(args.dry, args.shape)
    rep = Report(args.out)
    rep.emit({"gpu_check_bare": "start", "dry": args.dry, "device": dev,
              "gpu": torch.cuda.get_device_name(0) if dev == "cuda" else None, "shape": args.shape,
              **versions()})
    if args.shape == "mid":  # the kernel's equality needs no big model; float64 at 4B would only cost minutes
        rep.run("catchup == lockstep (float64)", check_catchup, dev, sz)
    rep.run("hf engine tokens/s (bf16 on CUDA)", check_throughput, dev, sz)
    rep.run("layouts: engine devices, one call per step", check_layouts, dev, args.dry)
    workdir = Path(tempfile.mkdtemp(prefix="gpu-check-bare-"))
    memory: dict = {}
    try:
        rep.run("tandem GRPO steps (bf16_mixed)", check_train, dev, sz, workdir, memory)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if "ok" not in memory:
        memory = {"ok": False, "error": "the training check did not reach the memory figures", **memory}
    rep.emit({"check": "memory plan vs measured CUDA step peak", "ok": bool(memory.pop("ok")), **memory})
    rep.run("imports (image + bundle)", check_imports, log)
    total = time.perf_counter() - t_start
    failed = [ln["check"] for ln in rep.lines if "check" in ln and not ln["ok"]]
    rep.emit({"gpu_check_bare": "done", "ok": not failed, "failed": failed, "total_seconds": round(total, 1),
              "within_gpu_budget": args.dry or total <= GPU_BUDGET_S})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
