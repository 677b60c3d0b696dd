"""The vLLM GPU check for a user's own GPU: stock vLLM solo against the tandem rollout service on a random
Qwen3-4B-shaped model (bf16, Qwen3's vocabulary), 128 resident rows x 3,000 new tokens, with engine steps per
generated token, and the tandem service with vLLM's asynchronous scheduling off (production) and on.

Run from the pipeline's environment (vLLM's own, `.venv-vllm`, runs the engines):
    python benchmarks/vllm_gpu.py [--dry] [--out DIR]
`scripts/gpu_check_vllm.sh` runs it after `make vllm-env` and prints the table.

What it measures, one configuration after the other (each needs most of the GPU's memory, so they cannot be
interleaved; `--repeats` reruns each inside its engines, best of), on the same rows (prompts of the benchmark's
arithmetic problems, 8 rows each):
  solo_stock        plain vLLM (`benchmarks/vllm_stock.py`, vLLM's environment): one `AsyncLLM` engine with vLLM's
                    defaults (asynchronous scheduling as the platform decides, on on CUDA; the model runner vLLM
                    picks; CUDA graphs unless --eager), no tandem scheduler, every row decoded to `--tokens`
                    (ignore_eos), with the memory of both tandem engines (`--solo-gpu-memory`). Engine steps come
                    from vLLM's stat-logger interface (one `SchedulerStats` per executed batch).
  tandem_async_off  the rollout service as the benchmark runs it (`benchmarks/vllm_ab_service.py`, the production
                    service plus `--replay`: the engines emit real text, `vllm_replay.py`, so the random model's
                    tokens start words where text does and the word schedule hands off as on real text), senior
                    and junior both this model, `word` schedule, every row to `--tokens`; the production
                    setting: async_scheduling False (`compat.ENGINE_FIXED`).
  tandem_async_on   the same with `--async-scheduling` (async_scheduling True asked of both engines).
For each: tokens/s, tandem over stock solo, engine steps per generated token per engine (and x rows: 1.0 when every
row is in every step of that engine; each step reads the weights once on a GPU), chunks and computed tokens per
generated token, and residency: the rows that were live at once (`max_live_rows`, the service's admission;
`max_running_rows` for stock vLLM), the KV blocks the engines hold, preemptions, and what vLLM actually ran
(`async_scheduling` as each engine resolved it: the service's /health, the stock engine's config). vLLM's CPU
build forces asynchronous scheduling off whatever is asked; the record says what ran, never what was asked.
Beside them, `predicted`: the cost model's tandem/solo for the same rows, tokens and GPU with both engines on
one GPU (`tandem/rollout/cost.py`, the committed premises `tandem/rollout/premises.json`), the figure `tandem plan`
and the rollout benchmark print for that configuration, so a measured ratio reads against the prediction.

The memory plan: the KV cache of `rows` x (longest prompt + `tokens`) at bf16 plus the weights and vLLM's runtime
(`tandem.plan.VLLM_OVERHEAD_GIB`), as a share of the GPU (`kv_fit`); `--gpu-memory` defaults to the share that
holds every row (0.47 of an H200 per engine for Qwen3-4B at 128 x 3,000), capped at 0.48 so that two engines
fit one GPU; a GPU too small for every row runs them in admission waves and the record says how many were live.

Output: one JSON line on stdout (the record), and in `--out` (default docs/gpu/) `vllm-<gpu>.json` (the record)
and `vllm-<gpu>.md` (the table; `<gpu>` is the GPU's name, `cpu-dry` for a dry run on vLLM's CPU build, with
`-dry` appended for a dry run on a GPU). Exit status 1 when a configuration was not measured, a row did not
reach its length or not every row was resident; 2 when no GPU is visible without --dry.

--dry: the same code paths at a tiny shape (hidden 128, 2 layers, Qwen3's vocabulary, float32, eager) with
8 rows x 64 tokens: about 5 minutes on a 2-core CPU with vLLM's CPU build, mostly its three engine starts
(tests/rollout/test_vllm_gpu_check.py runs it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks.* and the library, from this checkout

from tandem.plan import GIB, KNOWN_SHAPES, VLLM_OVERHEAD_GIB, ModelShape  # noqa: E402
from tandem.rollout.cost import GPUS, gpu_for_memory, load_premises, predicted_ratio  # noqa: E402
from tandem.rollout.layout import resident_rows  # noqa: E402

SHAPES: dict[str, ModelShape] = {
    "qwen3-4b": ModelShape(**KNOWN_SHAPES["Qwen/Qwen3-4B-Instruct-2507"], source="Qwen3-4B's shape, random weights"),
    "tiny": ModelShape(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=384, vocab=151936,
                       tied=True, source="tiny random body (hidden 128, 2 layers), Qwen3's vocabulary"),
}
RUNS = ("solo_stock", "tandem_async_off", "tandem_async_on")
SHARE_CAP = 0.48        # per engine: two engines on one GPU
SHARE_MARGIN = 0.01     # above the share the plan needs (vLLM's sampler, CUDA graphs)
SHARE_FLOOR = 0.1       # a tiny model's engine (--dry on a GPU) still needs vLLM's working memory
GROUP = 8               # rows per prompt
PLAN_BLOCK = 16         # vLLM's KV block size on CUDA


@dataclass(frozen=True)
class Sizes:
    shape: str
    rows: int
    tokens: int
    dtype: str
    eager: bool
    repeats: int


def sizes(dry: bool, shape: str | None = None, rows: int | None = None, tokens: int | None = None,
          eager: bool | None = None, repeats: int = 1) -> Sizes:
    """The run's sizes: Qwen3-4B's shape, 128 rows x 3,000 tokens, bf16, CUDA graphs on a GPU; tiny, 8 x 64,
    float32, eager with --dry."""
    shape = shape or ("tiny" if dry else "qwen3-4b")
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    rows, tokens = rows or (8 if dry else 128), tokens or (64 if dry else 3000)
    if rows < 1 or tokens < 2 or repeats < 1:
        raise ValueError("rows >= 1, tokens >= 2 and repeats >= 1 are needed")
    return Sizes(shape, rows, tokens, "float32" if dry else "bfloat16", dry if eager is None else eager, repeats)


def kv_fit(shape: ModelShape, rows: int, context: int, gpu_bytes: float | None, share: float | None = None,
           dtype_bytes: int = 2, block_size: int = PLAN_BLOCK) -> dict:
    """One engine's memory for `rows` rows of `context` tokens (prompt + new tokens): KV at whole blocks, bf16
    weights and vLLM's runtime; the GPU share that holds them (`share_needed`), the share used (`share`, or that
    one plus a margin, within SHARE_FLOOR..SHARE_CAP) and the rows resident at it. Without a GPU (`gpu_bytes`
    None) only the bytes."""
    kv_token = shape.kv_bytes_per_token(dtype_bytes)
    kv_row = math.ceil(context / block_size) * block_size * kv_token
    weights = shape.n_params * dtype_bytes
    overhead = VLLM_OVERHEAD_GIB * GIB
    need = weights + overhead + rows * kv_row
    out: dict[str, Any] = {"rows": rows, "context_tokens": context, "kv_bytes_per_token": kv_token,
                           "kv_gib_per_row": kv_row / GIB, "kv_gib": rows * kv_row / GIB, "weights_gib": weights / GIB,
                           "runtime_gib": VLLM_OVERHEAD_GIB, "need_gib": need / GIB}
    if not gpu_bytes:
        return {**out, "gpu_gib": None, "share_needed": None, "share": share, "resident_rows": None, "fits": None}
    needed = need / gpu_bytes
    if share is None:
        share = min(max(math.ceil(needed * 100) / 100 + SHARE_MARGIN, SHARE_FLOOR), SHARE_CAP)
    resident = resident_rows(share * gpu_bytes - weights - overhead, kv_row)
    return {**out, "gpu_gib": gpu_bytes / GIB, "share_needed": round(needed, 4), "share": round(share, 2),
            "resident_rows": min(resident, rows), "fits": resident >= rows}


def gpu_info() -> tuple[str, int] | None:
    """(name, total bytes) of the GPU vLLM will use (the first of CUDA_VISIBLE_DEVICES), from nvidia-smi (this
    process opens no CUDA context); None without one."""
    cmd = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if first:
        cmd += ["-i", first]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in r.stdout.splitlines() if "," in ln]
    if r.returncode != 0 or not lines:
        return None
    name, mib = lines[0].rsplit(",", 1)
    try:
        return name.strip(), int(float(mib)) * 2**20
    except ValueError:
        return None


def slug(gpu: str | None, dry: bool) -> str:
    """The records' file stem: `vllm-<gpu name>` (`vllm-h200`), `vllm-cpu-dry` for a dry run without a GPU."""
    if not gpu:
        return "vllm-cpu-dry" if dry else "vllm-cpu"
    s = re.sub(r"[^a-z0-9]+", "-", gpu.lower().replace("nvidia", "")).strip("-") or "gpu"
    return f"vllm-{s}{'-dry' if dry else ''}"


# --------------------------------------------------------------------------------------------------
# The model and the rows
# --------------------------------------------------------------------------------------------------

def build_model(shape: ModelShape, max_position: int, dtype: str, root: Path) -> tuple[Path, Any]:
    """A random Qwen3 of `shape` in `dtype` with Qwen3's tokenizer, saved to root/model (on the CPU: this process
    keeps no GPU memory); (path, tokenizer)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tandem.rollout.qwen3_vocab import qwen3_tokenizer

    tok = qwen3_tokenizer()
    cfg = Qwen3Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                      max_position_embeddings=max_position, tie_word_embeddings=shape.tied,
                      eos_token_id=tok.eos_token_id, pad_token_id=None, bos_token_id=None)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # built in its dtype: 8 GB for Qwen3-4B in bf16, not 16
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = Qwen3ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    path = root / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    return path, tok


def make_rows(tok: Any, rows: int, tokens: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, replayed text): `rows` prompts, GROUP rows per arithmetic problem (the benchmark's prompts), and
    `rows` windows of `tokens` tokens of real text (`vllm_rollout.real_text_rows`)."""
    from benchmarks.rollout import _prompts
    from benchmarks.vllm_rollout import real_text_rows

    base = _prompts(tok, max(1, math.ceil(rows / GROUP)), seed)
    prompts = [p for p in base for _ in range(GROUP)][:rows]
    return prompts, real_text_rows(tok, rows, tokens, seed)


# --------------------------------------------------------------------------------------------------
# The three configurations
# --------------------------------------------------------------------------------------------------

def _vllm_env() -> dict:
    """The environment the service gets (client.VLLMService.start), for the stock engine: the same CPU-build
    settings, vLLM's own model runner (nothing forced)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV", "VLLM_USE_V2_MODEL_RUNNER",
                                                            "VLLM_ENABLE_V1_MULTIPROCESSING")}
    for k, v in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_WORKER_MULTIPROC_METHOD", "spawn"),
                 ("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("OMP_NUM_THREADS", "1"), ("HF_HUB_OFFLINE", "1"),
                 ("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1")):
        env.setdefault(k, v)
    return env


def run_stock(path: Path, prompts: list, sz: Sizes, gpu_memory: float, max_model_len: int, work: Path,
              python: str | None, timeout_s: float = 3600.0) -> dict:
    """Stock vLLM solo (`benchmarks/vllm_stock.py` in vLLM's environment, in a process group of its own, ended
    whole after `timeout_s` per rollout plus half an hour to start): its JSON line."""
    from tandem.rollout.vllm.client import LaunchOptions

    py = LaunchOptions(python=python).vllm_python()
    pf = work / "prompts.json"
    pf.write_text(json.dumps(prompts))
    cmd = [str(py), str(ROOT / "benchmarks" / "vllm_stock.py"), "--model", str(path), "--prompts", str(pf),
           "--tokens", str(sz.tokens), "--gpu-memory", str(gpu_memory), "--max-model-len", str(max_model_len),
           "--dtype", sz.dtype, "--repeats", str(sz.repeats), *(["--eager"] if sz.eager else [])]
    log = work / "solo_stock.log"  # vLLM logs to stdout: both streams go to the log, the result is its last line
    limit = 1800 + (sz.repeats + 1) * timeout_s
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_vllm_env(), cwd=ROOT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except BaseException as e:  # its engine core too: the whole group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if isinstance(e, subprocess.TimeoutExpired):
                raise RuntimeError(f"stock vLLM did not finish within {limit:.0f} s (log: {log})") from None
            raise
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith('{"vllm"')]
    if rc != 0 or not lines:
        tail = " | ".join(log.read_text().strip().splitlines()[-5:])[-1500:]
        raise RuntimeError(f"stock vLLM exited with {rc}: {tail}")
    return json.loads(lines[-1])


@dataclass(frozen=True)
class TandemCase:
    """What every tandem configuration runs on: the model directory and its tokenizer, the rows' prompts and
    replayed text, the engines' context length, vLLM's Python (None: `.venv-vllm`) and the rollout's timeout."""

    path: Path
    tok: Any
    prompts: list
    text: list
    max_model_len: int
    python: str | None
    timeout_s: float = 3600.0


def run_tandem(case: TandemCase, sz: Sizes, gpu_memory: float | None, async_on: bool) -> dict:
    """The benchmark's service (`--replay`, and `--async-scheduling` with `async_on`), the word schedule over
    every row to `sz.tokens` after a short warm-up, best of `sz.repeats`: its figures. A rollout that sends
    nothing back for `case.timeout_s` (the client's request timeout, which retries once on a live service) fails
    the configuration: a scheduler that stalls is a finding."""
    path, tok, prompts, text = case.path, case.tok, case.prompts, case.text
    max_model_len, python, timeout_s = case.max_model_len, case.python, case.timeout_s

    from benchmarks.vllm_rollout import AB_SERVICE, _counters
    from tandem.rollout.core import SamplingParams
    from tandem.rollout.engine import TandemEngine
    from tandem.rollout.request import RolloutSettings
    from tandem.rollout.schedule import ScheduleSpec
    from tandem.rollout.vllm.client import LaunchOptions, VLLMService
    from tandem.rollout.vllm.knobs import EngineKnobs

    knobs = EngineKnobs(dtype=sz.dtype, max_model_len=max_model_len, gpu_memory=gpu_memory or 0.35,
                        enforce_eager=sz.eager, max_num_seqs=max(256, sz.rows))
    launch = LaunchOptions(python=python, knobs=knobs, start_timeout=1800, service=AB_SERVICE,
                           service_args=("--replay", *(("--async-scheduling",) if async_on else ())))
    t0 = time.perf_counter()
    svc = VLLMService.start(path, path, roots=[path], options=launch)
    try:
        start_s = time.perf_counter() - t0
        health = svc.health()
        be = TandemEngine(path, path, tok, backend="vllm", vllm_options={"service": svc, "live": False})._backend
        be.request_timeout = timeout_s

        def run(n: int) -> tuple[float, Any, dict]:
            sp = SamplingParams(temperature=1.0, max_new_tokens=n)
            req = RolloutSettings(ScheduleSpec("word"), sp).request(prompts, seed=0)
            t = time.perf_counter()
            b = be._generate(req, {"sessions": "direct", "replay": [r[:n] for r in text]})
            return time.perf_counter() - t, b, dict(be.last_stats)

        run(min(8, sz.tokens))  # warm-up
        best = None
        for _ in range(sz.repeats):
            out = run(sz.tokens)
            if best is None or out[0] < best[0]:
                best = out
    finally:
        svc.stop()
    dt, b, st = best
    tokens = b.stats()["tokens"]
    c = _counters(st)
    eng = st["engines"]
    block = int(health.get("block_size") or 0)
    context = max(map(len, prompts)) + sz.tokens
    out = {"async_scheduling_requested": async_on, "async_scheduling": health.get("async_scheduling"),
           "vllm": health.get("vllm"), "kv_blocks": health.get("kv_blocks"), "block_size": block,
           "resident_rows_kv": (int(health["kv_blocks"]) // math.ceil(context / block)
                                if block and health.get("kv_blocks") else None),
           "gpu_memory": gpu_memory, "enforce_eager": sz.eager, "dtype": sz.dtype, "start_s": start_s,
           "rows": len(prompts), "max_new_tokens": sz.tokens, "tokens": tokens,
           "complete_rows": sum(len(r) == sz.tokens for r in b.completion_ids), "seconds": dt,
           "tok_s": tokens / dt, "senior_fraction": b.stats()["senior_fraction"], "handoffs": sum(b.handoffs),
           "preemptions": int(sum(eng[r].get("preemptions", 0) for r in ("senior", "junior")))}
    for role in ("senior", "junior"):
        out[f"engine_steps_{role}"] = c[f"engine_steps_{role}"]
        out[f"engine_steps_per_token_{role}"] = c[f"engine_steps_per_token_{role}"]
        out[f"engine_steps_per_row_token_{role}"] = c[f"engine_steps_{role}"] * len(prompts) / max(tokens, 1)
        out[f"mean_rows_per_step_{role}"] = c[f"mean_rows_per_step_{role}"]
        out[f"max_scheduled_rows_{role}"] = int(eng[role].get("max_scheduled_rows", 0))
    for k in ("chunks", "chunks_per_token", "computed_per_token", "handoff_latency_steps_p50",
              "handoff_latency_steps_p90", "idle_row_step_fraction", "max_live_rows", "decoded_tokens",
              "kept_tokens", "switch_stops"):
        out[k] = c[k]
    return out


# --------------------------------------------------------------------------------------------------
# The record and its table
# --------------------------------------------------------------------------------------------------

def prediction(shape: ModelShape, gpu: tuple[str, int] | None, rows: int, tokens: int, prompt_tokens: float,
               premises_path: Path | None = None) -> dict:
    """The cost model's tandem/solo for this check's configuration (both tandem engines on one GPU, stock solo
    with their memory: the `shared` layout of `tandem/rollout/cost.py`), from the committed premises: the figure
    `tandem plan` and the rollout benchmark print for the same rows, tokens and GPU. The GPU's kind is the `GPUS`
    entry named in the device's name (H200, H100), else the one nearest its memory; without a GPU an H200."""
    prem = load_premises(premises_path)  # None: the committed file
    key = "h200"
    if gpu:
        key = next((k for k in GPUS if k in gpu[0].lower()), None) or gpu_for_memory(gpu[1] / GIB)
    p = predicted_ratio(shape, GPUS[key], prem, "shared", rows, tokens, prompt_tokens)
    return {**p, "premises": prem.measured.get("what"), "premises_commit": prem.measured.get("commit")}


def checks(rec: dict) -> dict:
    """What the record must show: every configuration measured at a finite positive rate, every row at its
    length, every row resident at once (no admission wave, no preemption); and, reported, whether each run's
    scheduling is what was asked (the CPU build forces it off)."""
    runs, rows = rec["runs"], rec["rows"]
    done = {k: v for k, v in runs.items() if "error" not in v}
    live = {k: v.get("max_live_rows", v.get("max_running_rows")) for k, v in done.items()}
    asked = {"solo_stock": None, "tandem_async_off": False, "tandem_async_on": True}
    as_asked = {}
    for k, v in done.items():
        ran = v.get("async_scheduling")  # the stock engine's bool; the service's {"senior": .., "junior": ..}
        if isinstance(ran, dict):
            ran = ran["senior"] if len(set(ran.values())) == 1 else None
        as_asked[k] = None if asked[k] is None else (ran == asked[k])
    return {
        "all_measured": set(done) == set(RUNS)
        and all(math.isfinite(v["tok_s"]) and v["tok_s"] > 0 for v in done.values()),
        "rows_complete": bool(done) and all(v["complete_rows"] == rows for v in done.values()),
        "rows_resident": bool(done) and all(live[k] == rows and v.get("preemptions", 0) == 0
                                            for k, v in done.items()),
        "async_scheduling_as_asked": as_asked,
    }


def _f(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def _async_text(run: dict, name: str, cpu: bool) -> str:
    asked = {"solo_stock": "vLLM's default", "tandem_async_off": "off", "tandem_async_on": "on"}[name]
    ran = run.get("async_scheduling")
    if isinstance(ran, dict):
        vals = set(ran.values())
        ran = vals.pop() if len(vals) == 1 else None
        ran_txt = ("on" if ran else "off") if ran is not None else " / ".join(
            f"{k} {'on' if v else 'off'}" for k, v in run["async_scheduling"].items())
    else:
        ran_txt = "not reported" if ran is None else ("on" if ran else "off")
    note = " (vLLM's CPU build forces it off)" if cpu and name != "solo_stock" and asked == "on" else ""
    return f"{asked} -> {ran_txt}{note}"


def table(rec: dict) -> str:
    """The record as Markdown: a header naming what ran, one row per configuration (figures only where measured)."""
    cpu = bool(rec.get("platform_cpu"))
    fit = rec.get("kv_fit") or {}
    head = [f"# vLLM check: stock solo against tandem ({rec.get('gpu') or 'no GPU: vLLM CPU build'}"
            f"{', dry run' if rec.get('dry') else ''})", "",
            f"Written by `python benchmarks/vllm_gpu.py{' --dry' if rec.get('dry') else ''}` on {rec.get('date')}: "
            f"vLLM {rec.get('vllm')}, {rec.get('device')}; model: {rec.get('shape_desc')} ({rec.get('shape')}, "
            f"{rec.get('n_params'):,} parameters, {rec.get('dtype')}, "
            f"{'eager' if rec.get('enforce_eager') else 'CUDA graphs'}); {rec.get('rows')} rows x "
            f"{rec.get('max_new_tokens'):,} new tokens (prompts up to {rec.get('max_prompt_tokens')} tokens, "
            f"{GROUP} rows a prompt), best of {rec.get('repeats')}.",
            ""]
    if fit.get("share") is not None and not cpu:
        head += [f"Memory: each tandem engine {fit['share']} of the GPU (KV for {fit['rows']} rows x "
                 f"{fit['context_tokens']:,} tokens: {fit['need_gib']:.1f} GiB with weights and runtime, "
                 f"{fit['share_needed']} needed; {fit['resident_rows']} rows resident by the plan), stock solo "
                 f"{rec.get('solo_gpu_memory')}.", ""]
    head += ["| run | async scheduling asked -> ran | tokens/s | over stock solo | engine steps x rows / generated "
             "tokens (senior / junior) | chunks per token | computed per token | rows live at once / rows; "
             "KV blocks; preemptions |",
             "|---|---|---|---|---|---|---|---|"]
    names = {"solo_stock": "stock vLLM solo", "tandem_async_off": "tandem, async scheduling off (production)",
             "tandem_async_on": "tandem, async scheduling on"}
    body = []
    solo = rec["runs"].get("solo_stock", {})
    for name in RUNS:
        r = rec["runs"].get(name)
        if r is None or "error" in r:
            why = "not run" if r is None else str(r["error"]).splitlines()[0][:200].replace("|", "/")
            body.append(f"| {names[name]} | not measured: {why} | | | | | | |")
            continue
        if name == "solo_stock":
            steps = _f(r.get("engine_steps_per_row_token"))
            chunks, live = "-", r.get("max_running_rows")
            ratio = "1.00"
        else:
            steps = f"{_f(r['engine_steps_per_row_token_senior'])} / {_f(r['engine_steps_per_row_token_junior'])}"
            chunks, live = _f(r.get("chunks_per_token"), 3), r.get("max_live_rows")
            ratio = _f(r["tok_s"] / solo["tok_s"]) if solo.get("tok_s") else "-"
        body.append(f"| {names[name]} | {_async_text(r, name, cpu)} | {_f(r['tok_s'], 1)} | {ratio} | {steps} | "
                    f"{chunks} | {_f(r.get('computed_per_token'), 3)} | {_f(live)} / {r['rows']}; "
                    f"{_f(r.get('kv_blocks'))}; {_f(r.get('preemptions'))} |")
    c = rec.get("checks", {})
    pr = rec.get("predicted") or {}
    foot = []
    if pr:
        foot += ["", f"Predicted by the cost model (`tandem/rollout/cost.py`, both engines on one {pr['gpu']}, from the "
                 f"committed premises: {pr.get('premises')}): tandem over stock solo "
                 f"**{pr['predicted_tandem_over_solo']:.2f}** (tandem {pr['tandem_s']:.1f} s, solo {pr['solo_s']:.1f} s)."]
    foot += ["",
            "Engine steps x rows / generated tokens: 1.00 when every row is in every step of that engine (each step "
            "reads the weights once on a GPU); the raw steps per generated token are in the JSON record. Tandem runs "
            "replay real text through the benchmark's service (`benchmarks/vllm_ab_service.py --replay`), senior "
            "and junior the same weights, on vLLM's V1 model runner (`compat.ENGINE_ENV`); stock solo samples the "
            f"random model with `ignore_eos`, on the model runner vLLM chose "
            f"({ {True: 'V2', False: 'V1'}.get(rec.get('solo_model_runner_v2'), 'not reported') }).",
            "",
            f"Checks: every run measured {c.get('all_measured')}, every row at its length {c.get('rows_complete')}, "
            f"every row resident at once {c.get('rows_resident')}."]
    if cpu:
        foot += ["", "vLLM's CPU build: asynchronous scheduling is forced off by the platform, so both tandem runs "
                 "ran with it off whatever was asked, and no figure here is a GPU figure."]
    return "\n".join(head + body + foot) + "\n"


def write_outputs(rec: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = slug(rec.get("gpu"), bool(rec.get("dry")))
    js, md = out / f"{stem}.json", out / f"{stem}.md"
    rec["files"] = {"json": str(js), "md": str(md)}
    js.write_text(json.dumps(rec, indent=1) + "\n")
    md.write_text(table(rec))
    return js, md


# --------------------------------------------------------------------------------------------------

def _log(msg: str) -> None:
    print(f"vllm_gpu: {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="the same code paths at a tiny shape, 8 rows x 64 tokens")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "gpu", help="where the .json and .md records go")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="qwen3-4b (default), tiny (--dry)")
    ap.add_argument("--rows", type=int, default=None, help="rows (default 128; --dry 8)")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per row (default 3000; --dry 64)")
    ap.add_argument("--gpu-memory", type=float, default=None,
                    help="GPU share per tandem engine (default: what holds every row, at most 0.48)")
    ap.add_argument("--solo-gpu-memory", type=float, default=None,
                    help="GPU share of the stock solo engine (default: both tandem engines' share, at most 0.9)")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=None,
                    help="enforce_eager for every engine (default: off on a GPU, as params.paper.yaml; on with --dry)")
    ap.add_argument("--repeats", type=int, default=1, help="timed rollouts per configuration (best of)")
    ap.add_argument("--rollout-timeout", type=float, default=None,
                    help="seconds a rollout may run without an answer before its configuration counts as failed "
                         "(the service's request is retried once; default 3600, --dry 300)")
    ap.add_argument("--python", default=None, help="vLLM's Python (default .venv-vllm/bin/python)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    gpu = gpu_info()
    if gpu is None and not a.dry:
        print("vllm_gpu: no CUDA GPU visible (nvidia-smi answers none); run with --dry for the CPU dry run",
              file=sys.stderr)
        return 2
    sz = sizes(a.dry, a.shape, a.rows, a.tokens, a.eager, a.repeats)
    limit = a.rollout_timeout or (300.0 if a.dry else 3600.0)
    shape = SHAPES[sz.shape]
    work = Path(tempfile.mkdtemp(prefix="tandem-vllm-gpu-"))
    runs: dict[str, dict] = {}
    rec: dict[str, Any] = {"vllm_gpu": "record", "dry": a.dry, "gpu": gpu[0] if gpu else None,
                           "date": time.strftime("%Y-%m-%d"), "shape": sz.shape, "shape_desc": shape.source,
                           "shape_figures": {k: v for k, v in asdict(shape).items() if k != "source"},
                           "n_params": shape.n_params, "dtype": sz.dtype, "enforce_eager": sz.eager,
                           "rows": sz.rows, "max_new_tokens": sz.tokens, "repeats": sz.repeats, "runs": runs}
    try:
        _log(f"building a random {sz.shape} model ({shape.n_params / 1e9:.2f}B parameters, {sz.dtype}) in {work}")
        path, tok = build_model(shape, sz.tokens + 512, sz.dtype, work)
        prompts, text = make_rows(tok, sz.rows, sz.tokens)
        longest = max(map(len, prompts))
        max_model_len = longest + sz.tokens + 64
        fit = kv_fit(shape, sz.rows, longest + sz.tokens, gpu[1] if gpu else None, a.gpu_memory)
        if gpu and not fit["fits"]:
            _log(f"{sz.rows} rows x {longest + sz.tokens} tokens need {fit['share_needed']} of the GPU per engine; "
                 f"at {fit['share']} only {fit['resident_rows']} are resident (the rest wait for admission)")
        share = fit["share"] if gpu else None
        solo_share = a.solo_gpu_memory or (min(0.9, round(2 * share, 2)) if share else 0.9)
        rec.update(max_prompt_tokens=longest, max_model_len=max_model_len, kv_fit=fit, gpu_memory_per_engine=share,
                   solo_gpu_memory=solo_share,
                   predicted=prediction(shape, gpu, sz.rows, sz.tokens, sum(map(len, prompts)) / len(prompts)))
        case = TandemCase(path, tok, prompts, text, max_model_len, a.python, limit)
        steps = (("solo_stock", lambda: run_stock(path, prompts, sz, solo_share, max_model_len, work, a.python,
                                                   limit)),
                 ("tandem_async_off", lambda: run_tandem(case, sz, share, False)),
                 ("tandem_async_on", lambda: run_tandem(case, sz, share, True)))
        for name, fn in steps:
            _log(f"{name}: {sz.rows} rows x {sz.tokens} tokens")
            t0 = time.perf_counter()
            try:
                runs[name] = fn()
            except Exception as e:  # noqa: BLE001 - a configuration that fails is recorded as not measured
                runs[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            _log(f"{name}: {json.dumps({k: runs[name].get(k) for k in ('tok_s', 'error')})} "
                 f"({time.perf_counter() - t0:.0f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    solo = runs.get("solo_stock", {})
    rec.update(vllm=solo.get("vllm") or next((r.get("vllm") for r in runs.values() if r.get("vllm")), None),
               device=solo.get("device") or (gpu[0] if gpu else "cpu"),
               platform_cpu=solo.get("platform_cpu", gpu is None),
               solo_model_runner_v2=solo.get("model_runner_v2"))
    for name in ("tandem_async_off", "tandem_async_on"):
        r = runs.get(name, {})
        if "tok_s" in r and solo.get("tok_s"):
            rec[f"{name}_over_solo"] = r["tok_s"] / solo["tok_s"]
    rec["checks"] = checks(rec)
    c = rec["checks"]
    rec["ok"] = bool(c["all_measured"] and c["rows_complete"] and c["rows_resident"])
    rec["seconds"] = round(time.perf_counter() - t_start, 1)
    js, md = write_outputs(rec, a.out)
    _log(f"wrote {js} and {md}")
    print(json.dumps(rec), flush=True)
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
