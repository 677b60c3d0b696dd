"""Benchmark and check of the vLLM rollout service (`tandem bench rollout --backend vllm --json`).

One process starts (or attaches to) the service on one model, senior and junior being the same weights, and
measures solo (the senior alone) against tandem (`word` schedule), best of `repeats` interleaved runs after a
warm-up:
- `solo_tok_s`, `tandem_tok_s`, `tandem_over_solo`: completion tokens per second;
- the counters of the tandem rollout (the service's stats; see docs/rollout.md, "Counters"): engine steps per
  engine and per generated token (`engine_steps_per_token_<role>`, and `solo_engine_steps_per_token` for the
  solo rollout: each step reads the weights once on a GPU), chunks and session starts per generated token, computed tokens per generated token (both engines),
  handoff latency in partner steps (p50, p90), idle row-steps, idle engine time, scheduler CPU per step,
  engine-core CPU per chunk, frontend CPU per generated token, decoded vs kept tokens, switch stops;
- `stream_*` (with `compare_stream`): the same tandem rollout through `AsyncLLM.generate`'s streaming
  sessions instead of the direct engine-core sessions (`service.DirectSession`), interleaved with the others
  (the benchmark's own service, `vllm_ab_service.py`, serves these alternatives):
  its ratio, latency, idle and frontend counters, GPU prediction, and whether its tokens are the same;
- `single_*` (with `compare_stream`): the direct sessions with one engine-core message per chunk instead of
  the batched submissions (`submit.py`), and their chunks back through vLLM's output path, interleaved
  likewise; `submit_requests_per_message`: the chunks one batched message carried on average;
  `submit_cpu_us_per_token` / `_per_message`: the frontend thread's CPU in encoding and sending them;
- `vllm_out_*` (with `compare_stream`): the direct sessions with batched submissions, their chunks back through
  vLLM's output path (`Router`) instead of the chunk returns (`returns.py`), interleaved likewise;
  `return_chunks_per_message`, `return_cpu_us_per_token` / `_per_message`: the chunks one returns message
  carried, and the frontend thread's CPU in receiving, decoding and handing them out;
- `premises`: the cost model's premises measured by this run (`tandem/rollout/cost.py`: engine steps, scheduled
  rows, computed tokens and chunks per generated token of the senior, the junior and solo; the frontend's CPU per
  token; the scheduler's CPU per row and chunk from the isolated step when it ran, else the committed premises'),
  which `tandem bench rollout ... --write-premises` writes to `tandem/rollout/premises.json`;
- `predicted_gpu_tandem_over_solo` (and `_two_gpus`): those premises priced by the cost model for `gpu_rows` rows of
  Qwen3-4B at this run's length (an H200 at 128 rows by default): both engines on one GPU (the `shared` layout) and
  one GPU per model (`dedicated`), by the function `tandem plan` prices a layout with;
- `logprob_max_abs_diff`: the service's log-probs against the transformers model's on the same tokens
  (teacher-forced on both engines, and the sampled senior log-probs of the tandem batch);
- `weights_synced`: one real optimizer step (AdamW on the senior's own tokens) is pushed like training does;
  true only when the service's sampled log-probs then match the updated weights and no longer the old ones.

Models: `model_dir` (default models/base when it exists, else a random tiny Qwen3 with a byte-level BPE built
here). `vocab="qwen3"`: Qwen3's real tokenizer (`qwen3_vocab.py`) on a random tiny Qwen3 body with 151,936
output rows, rows of replayed real text at full length (the engines are made to emit the project's docs and
arithmetic solutions, `vllm_replay.py`), counted at `max_new_tokens` and at a short history (`short_tokens`) so
that the per-step CPU can be compared; no log-prob or sync check there (the tokens are forced). With
`compare_vocab` (qwen3 only) a second service runs the same body on the fallback's byte-level BPE (334 tokens) and
the same rollout relabelled into it (`relabel`: word starts onto word starts, so every redraw, chunk and handoff
is the same), interleaved with the others: `small_vocab_*` and `sched_cpu_per_{row,step}_qwen3_over_small_vocab_*`
compare the engine-core CPU across vocabulary sizes with nothing else changed but the model's output rows.
With `compare_isolated` (qwen3 only), once the services have stopped, `sched_step.py` steps two real
`TandemScheduler`s alone (`rows` x `short_tokens` after 16 and after `max_new_tokens - short_tokens` tokens of
history, both table sizes, interleaved): `isolated_sched_cpu_long_over_short_*` and
`isolated_sched_cpu_qwen3_over_small_vocab_*` are the engine-core CPU per step across history and vocabulary
without the machine's other tenants, `isolated_sched_cpu_per_row_tandem_over_solo_*` the CPU per scheduled row
against a solo decode on the same scheduler (`isolated_step`: all its figures).
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.* and the library, from this checkout

from benchmarks.rollout import BenchWorkload  # noqa: E402
from tandem.rollout.core import SamplingParams  # noqa: E402
from tandem.rollout.request import RolloutSettings  # noqa: E402
from tandem.rollout.schedule import ScheduleSpec  # noqa: E402
from tandem.rollout.vllm.client import LaunchOptions  # noqa: E402
from tandem.rollout.vllm.sched import CONTEXT_BINS  # noqa: E402

TOLERANCE = 0.1
AB_SERVICE = "benchmarks.vllm_ab_service"  # the production service plus the alternatives measured here


def _hf_logprobs(model: Any, seqs: list[list[int]], starts: list[int], temperature: float = 1.0) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for s, st in zip(seqs, starts):
            logits = model(torch.tensor([s])).logits[0].double()
            lp = torch.log_softmax(logits / temperature, -1)
            out.append([float(lp[t - 1, s[t]]) for t in range(st, len(s))])
    return out


def _max_diff(a: list[list[float]], b: list[list[float]], mask: list[list[int]] | None = None) -> float:
    worst = 0.0
    for i, (x, y) in enumerate(zip(a, b)):
        for j, (u, v) in enumerate(zip(x, y)):
            if mask is None or mask[i][j]:
                worst = max(worst, abs(u - v))
    return worst


def _model_dir(model_dir: str | None) -> tuple[Path, str]:
    from benchmarks.rollout import DEFAULT_MODEL_DIR

    path = Path(model_dir or DEFAULT_MODEL_DIR)
    if path.is_dir() and any(path.glob("*.safetensors")):
        return path, str(path)
    if model_dir:
        raise FileNotFoundError(f"{model_dir}: not a model directory with *.safetensors weights")
    from tandem.rollout import toy

    tok = toy.byte_bpe_tokenizer(vocab_size=640)
    model = toy.tiny_qwen3(len(tok), seed=0, eos_token_id=tok.eos_token_id)  # head_dim 128/4 = 32
    tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-vllm-"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return tmp, (f"fallback: {DEFAULT_MODEL_DIR} not found; randomly initialised tiny Qwen3 (hidden 128, 4 layers, "
                 f"head_dim 32) with a byte-level BPE built here ({len(tok)} tokens)")


def _qwen3_model_dir(max_len: int) -> tuple[Path, str]:
    from tandem.rollout import toy
    from tandem.rollout.qwen3_vocab import QWEN3_VOCAB_ROWS, qwen3_tokenizer

    tok = qwen3_tokenizer()
    shape = toy.TinyShape(layers=2, hidden=128, heads=4, kv_heads=2, max_position=max_len)
    model = toy.tiny_qwen3(QWEN3_VOCAB_ROWS, 0, shape, eos_token_id=tok.eos_token_id)
    tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-qwen3-"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return tmp, (f"Qwen3 vocabulary ({len(tok)} tokens, {QWEN3_VOCAB_ROWS} output rows) on a random tiny Qwen3 "
                 f"body (hidden 128, 2 layers, head_dim 32), replayed real text")


def real_text_rows(tok: Any, rows: int, length: int, seed: int = 0) -> list[list[int]]:
    """`rows` windows of `length` tokens of real text: the project's documentation and README (prose,
    tables, code) interleaved with worked arithmetic solutions, tokenised as one stream, each row starting at
    its own offset."""
    import random

    from tandem.data.synthetic import generate

    root = Path(__file__).resolve().parents[1]
    docs = [p.read_text() for p in sorted((root / "docs").glob("*.md"))] + [(root / "README.md").read_text()]
    sols = [f"{p.problem}\n\n{p.solution}" for p in generate(200, 2, 8, seed=seed, prefix="replay")]
    rng = random.Random(seed)
    parts = docs + sols
    rng.shuffle(parts)
    ids = tok("\n\n".join(parts), add_special_tokens=False)["input_ids"]
    while len(ids) < length * 2:
        ids = ids + ids
    step = max(1, (len(ids) - length) // max(rows, 1))
    return [ids[i * step:i * step + length] for i in range(rows)]


def _small_vocab_model_dir(max_len: int) -> tuple[Path, Any]:
    """The Qwen3-vocabulary benchmark's body (same shape) with the fallback's byte-level BPE (334 tokens)."""
    from tandem.rollout import toy

    tok = toy.byte_bpe_tokenizer(vocab_size=640)
    shape = toy.TinyShape(layers=2, hidden=128, heads=4, kv_heads=2, max_position=max_len)
    model = toy.tiny_qwen3(len(tok), 0, shape, eos_token_id=tok.eos_token_id)
    tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-small-"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return tmp, tok


def relabel(rows: list[list[int]], src_word: Any, dst_word: Any, avoid: set[int]) -> list[list[int]]:
    """`rows` of one vocabulary's ids rewritten in another's: a word-start id (`src_word[id]`, the word
    schedule's redraw points) becomes a word-start id of the destination (`dst_word`), any other id a non-word-
    start one, never one of `avoid` (EOS, specials). The word schedule's redraws, hence every chunk, handoff
    and owner, are then the same in both vocabularies: only the vocabulary's size differs."""
    import numpy as np

    dst = np.asarray(dst_word, dtype=bool)
    ids = np.arange(len(dst))
    ok = ~np.isin(ids, sorted(avoid))
    pools = ids[ok & ~dst], ids[ok & dst]
    if not len(pools[0]) or not len(pools[1]):
        raise ValueError("the destination vocabulary needs word-start and other ids to relabel into")
    src = np.asarray(src_word, dtype=bool)
    out = []
    for r in rows:
        a = np.asarray(r, dtype=np.int64)
        w = src[a]
        m = np.where(w, pools[1][a % len(pools[1])], pools[0][a % len(pools[0])])
        out.append(m.tolist())
    return out


# the names of sched.CONTEXT_BINS' bins (tokens of mean history per scheduled row)
BIN_NAMES = (f"<{CONTEXT_BINS[0]}", *(f"{a}-{b}" for a, b in zip(CONTEXT_BINS, CONTEXT_BINS[1:])),
             f">={CONTEXT_BINS[-1]}")


def _by_bin(c: dict, num: str, den: str, scale: float = 1.0) -> dict:
    """{bin name: scale x c[num<i>] / c[den<i>]} over the history bins (None where the denominator is 0)."""
    return {name: (scale * c[f"{num}{i}"] / c[f"{den}{i}"] if c.get(f"{den}{i}") else None)
            for i, name in enumerate(BIN_NAMES)}


def _counters(st: dict, prefix: str = "") -> dict:
    """The issue's counters from one rollout's service stats."""
    e = st["engines"]
    kept = max(st["kept"], 1)
    out: dict[str, Any] = {}
    for role in ("senior", "junior"):
        c = e[role]
        steps = c["steps"]
        out[f"{prefix}engine_steps_{role}"] = int(steps)
        # engine steps per generated (kept) token of the whole rollout: what a GPU pays the weights' read for
        out[f"{prefix}engine_steps_per_token_{role}"] = steps / kept
        out[f"{prefix}engine_idle_fraction_{role}"] = max(0.0, 1 - c["busy_seconds"] / st["seconds"]) if steps else 1.0
        out[f"{prefix}sched_cpu_us_per_step_{role}"] = 1e6 * c["sched_cpu_seconds"] / steps if steps else 0.0
        out[f"{prefix}mean_rows_per_step_{role}"] = c["scheduled_rows_sum"] / steps if steps else 0.0
        # the same rollout's steps by their rows' mean history (sched.CONTEXT_BINS): flat means no growth
        by = _by_bin(c, "sched_cpu_ctx", "steps_ctx", 1e6)
        out[f"{prefix}sched_cpu_us_per_step_by_context_{role}"] = by
        short, long = by[BIN_NAMES[0]], by[BIN_NAMES[-1]]
        out[f"{prefix}sched_cpu_long_over_short_{role}"] = long / short if short and long else None
        # per scheduled row: the scheduler's work is per row, and rows per step differ between bins and passes
        out[f"{prefix}sched_cpu_us_per_row_by_context_{role}"] = _by_bin(c, "sched_cpu_ctx", "rows_ctx", 1e6)
        out[f"{prefix}sched_cpu_us_per_row_{role}"] = (1e6 * c["sched_cpu_seconds"] / c["scheduled_rows_sum"]
                                                       if c["scheduled_rows_sum"] else 0.0)
        out[f"{prefix}mean_rows_per_step_by_context_{role}"] = _by_bin(c, "rows_ctx", "steps_ctx")
    chunks = st["chunks"]  # chunks the rows sent (the engines count the same: engines.*.chunks)
    out.update({
        f"{prefix}chunks": int(chunks), f"{prefix}session_starts": st["session_starts"],
        f"{prefix}chunks_per_token": chunks / kept,
        f"{prefix}computed_tokens": int(e["senior"]["computed_tokens"] + e["junior"]["computed_tokens"]),
        f"{prefix}computed_per_token": (e["senior"]["computed_tokens"] + e["junior"]["computed_tokens"]) / kept,
        f"{prefix}handoff_latency_steps_p50": st["handoff_latency_steps_p50"],
        f"{prefix}handoff_latency_steps_p90": st["handoff_latency_steps_p90"],
        f"{prefix}idle_row_step_fraction": st["idle_row_step_fraction"],
        f"{prefix}idle_row_step_fraction_mean_step": st["idle_row_step_fraction_mean_step"],
        f"{prefix}engine_cpu_us_per_chunk": 1e6 * (e["senior"]["add_cpu_seconds"] + e["junior"]["add_cpu_seconds"])
        / max(chunks, 1),
        f"{prefix}stop_rule_us_per_token": 1e6 * (e["senior"]["rule_cpu_seconds"] + e["junior"]["rule_cpu_seconds"])
        / max(e["senior"]["rule_tokens"] + e["junior"]["rule_tokens"], 1),
        f"{prefix}frontend_cpu_us_per_token": 1e6 * st["frontend_cpu_seconds"] / kept,
        f"{prefix}decoded_tokens": int(st["decoded"]), f"{prefix}kept_tokens": int(st["kept"]),
        f"{prefix}switch_stops": int(e["senior"]["switch_stops"] + e["junior"]["switch_stops"]),
        f"{prefix}max_live_rows": st.get("max_live_rows", 0),
    })
    return out


@dataclass(frozen=True)
class VLLMBenchOptions:
    """What the vllm benchmark measures besides the workload: `vocab` (model: the model's tokenizer; qwen3:
    Qwen3's real vocabulary, replayed real text), the GPU and row count the prediction prices (`gpu`,
    `gpu_rows`), the short history of the qwen3 counters (`short_tokens`), the streaming-session A/B
    (`compare_stream`) and, with qwen3, the vocabulary A/B (`compare_vocab`) and the scheduler step in isolation
    (`compare_isolated`: `sched_step.py`)."""

    vocab: str = "model"
    gpu: str = "h200"
    gpu_rows: int = 128
    short_tokens: int = 500
    compare_stream: bool = True
    compare_vocab: bool = True
    compare_isolated: bool = True


def bench_rollout_vllm(model_dir: str | None = None, url: str | None = None,
                       work: BenchWorkload = BenchWorkload(repeats=2),
                       options: VLLMBenchOptions = VLLMBenchOptions(),
                       launch: LaunchOptions = LaunchOptions()) -> dict:
    """Run the measurements above; returns one flat dict (see the module docstring). `work.max_new_tokens`
    None = 128 (qwen3: 3000); `launch` starts the service (unless `url` attaches to a running one; the
    benchmark sets the weight roots, the replay flag, the context length of a replay and a 30-minute start)."""
    from tandem.models import load_tokenizer
    from benchmarks.rollout import _prompts
    from tandem.rollout.engine import TandemEngine
    from tandem.rollout.vllm.client import VLLMService

    n_prompts, n_samples, max_new_tokens, temperature, seed, repeats = (
        work.n_prompts, work.n_samples, work.max_new_tokens, work.temperature, work.seed, work.repeats)
    vocab, gpu, gpu_rows, short_tokens, compare_stream = (options.vocab, options.gpu, options.gpu_rows,
                                                          options.short_tokens, options.compare_stream)
    compare_vocab = options.compare_vocab and vocab == "qwen3"
    gpu_memory = launch.knobs.gpu_memory
    if vocab not in ("model", "qwen3"):
        raise ValueError(f"vocab must be model or qwen3, got {vocab!r}")
    replay = vocab == "qwen3"
    budget = max_new_tokens or (3000 if replay else 128)
    t_start = time.perf_counter()
    if replay:
        path, desc = _qwen3_model_dir(budget + 256)
    else:
        path, desc = _model_dir(model_dir)
    tok = load_tokenizer(path)
    base = _prompts(tok, n_prompts, seed)
    prompts = [p for p in base for _ in range(n_samples)]
    t0 = time.perf_counter()
    knobs = replace(launch.knobs, max_model_len=(budget + max(map(len, prompts)) + 64) if replay else 0)
    launch = replace(launch, knobs=knobs, start_timeout=1800, service=AB_SERVICE,
                     service_args=("--replay",) if replay else ())
    if url:
        svc, owned = VLLMService.attach(url), False
    else:
        svc = VLLMService.start(path, path, roots=[path], options=launch)
        owned = True
    small = None  # the vocabulary A/B: (service, model dir) of the same body on the small vocabulary
    if compare_vocab:
        small_path, _ = _small_vocab_model_dir(budget + 256)
        try:
            small = (VLLMService.start(small_path, small_path, roots=[small_path], options=launch), small_path)
        except BaseException:
            shutil.rmtree(small_path, ignore_errors=True)
            if owned:
                svc.stop()
            raise
    res: dict[str, Any] = {"backend": "vllm", "model": desc, "vocab": vocab, "vocab_size": len(tok),
                           "rows": len(prompts), "max_new_tokens": budget,
                           "layout": "both engines on one device (one service)", "vllm_gpu_memory": gpu_memory,
                           "service_start_s": time.perf_counter() - t0}
    try:
        health = svc.health()
        res["vllm_version"] = health.get("vllm")
        res["kv_blocks"], res["block_size"] = health.get("kv_blocks"), health.get("block_size")
        from transformers import AutoModelForCausalLM

        senior = None if replay else AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                                          use_safetensors=True).eval()
        eng = TandemEngine(senior if senior is not None else path, path, tok, backend="vllm",
                           vllm_options={"service": svc, "live": senior is not None})
        be = eng._backend
        sp = SamplingParams(temperature=temperature, max_new_tokens=budget)
        text = real_text_rows(tok, len(prompts), budget, seed) if replay else None

        def run(schedule: str, settings_sp: SamplingParams = sp, rows_text=text, sessions: str = "direct",
                side: tuple = (be, prompts)):
            backend, rows_prompts = side
            req = RolloutSettings(ScheduleSpec(schedule), settings_sp).request(rows_prompts, seed=seed)
            t = time.perf_counter()
            extra: dict = {"sessions": sessions}
            if rows_text:
                extra["replay"] = [r[:settings_sp.max_new_tokens] for r in rows_text]
            b = backend._generate(req, extra)
            return time.perf_counter() - t, b, dict(backend.last_stats)

        variants = [("solo", "solo", "direct"), ("tandem", "word", "direct")]
        if compare_stream:
            variants += [("tandem_stream", "word", "stream"), ("tandem_single", "word", "direct-single"),
                         ("tandem_vllm_out", "word", "direct-vllm-out")]
        sides = {}
        if small is not None:  # the same rollout relabelled into the small vocabulary, on its own service
            be_v, prompts_v, text_v = _small_vocab_side(small[0], small[1], be, prompts, text)
            sides["tandem_small_vocab"] = (text_v, (be_v, prompts_v))
            variants.append(("tandem_small_vocab", "word", "direct"))
            res["small_vocab_size"] = be_v.vocab_size
            run("word", SamplingParams(temperature=temperature, max_new_tokens=8), [r[:8] for r in text_v],
                side=(be_v, prompts_v))  # warm-up
        run("word", SamplingParams(temperature=temperature, max_new_tokens=8),
            [r[:8] for r in text] if text else None)  # warm-up
        best: dict[str, tuple[float, Any, dict]] = {}
        for _ in range(repeats):
            for name, sched, sess in variants:
                rows_text, side = sides.get(name, (text, (be, prompts)))
                dt, b, st = run(sched, sessions=sess, rows_text=rows_text, side=side)
                if name not in best or dt < best[name][0]:
                    best[name] = (dt, b, st)
        (t_s, b_s, st_s), (t_t, b_t, st_t) = best["solo"], best["tandem"]
        res["solo_tok_s"] = b_s.stats()["tokens"] / t_s
        res["tandem_tok_s"] = b_t.stats()["tokens"] / t_t
        res["tandem_over_solo"] = res["tandem_tok_s"] / res["solo_tok_s"]
        st = b_t.stats()
        res.update({"senior_fraction": st["senior_fraction"], "handoffs_per_100": st["handoffs_per_100"],
                    "mean_run_length": st["mean_run_length"], "mean_length": st["mean_length"],
                    "handoffs": sum(b_t.handoffs)})
        res.update(_counters(st_t))
        # the same rollout through AsyncLLM.generate's streaming sessions; the same direct sessions with one
        # engine-core message per chunk each way; the same with batched submissions but vLLM's output path
        for name, prefix in (("tandem_stream", "stream_"), ("tandem_single", "single_"),
                             ("tandem_vllm_out", "vllm_out_")):
            if name in best:
                _variant(res, best[name], prefix, b_t)
        if "tandem_small_vocab" in best:
            _vocab_ab(res, best["tandem_small_vocab"][1:], b_t)
        res["submit_requests_per_message"] = st_t.get("submit_requests", 0) / max(st_t.get("submit_messages", 0), 1)
        # the frontend's CPU in encoding and sending those messages, per generated token and per message
        res["submit_cpu_us_per_token"] = 1e6 * st_t.get("submit_cpu_seconds", 0.0) / max(st_t["kept"], 1)
        res["submit_cpu_us_per_message"] = (1e6 * st_t.get("submit_cpu_seconds", 0.0)
                                            / max(st_t.get("submit_messages", 0), 1))
        # the chunk returns (returns.py): chunks per message, and the frontend's CPU in taking them
        res["return_chunks_per_message"] = st_t.get("return_chunks", 0) / max(st_t.get("return_messages", 0), 1)
        res["return_cpu_us_per_token"] = 1e6 * st_t.get("return_cpu_seconds", 0.0) / max(st_t["kept"], 1)
        res["return_cpu_us_per_message"] = (1e6 * st_t.get("return_cpu_seconds", 0.0)
                                            / max(st_t.get("return_messages", 0), 1))
        res["solo_engine_steps"] = int(st_s["engines"]["senior"]["steps"])
        res["solo_engine_steps_per_token"] = st_s["engines"]["senior"]["steps"] / max(st_s["kept"], 1)
        res["solo_sched_cpu_us_per_step"] = (1e6 * st_s["engines"]["senior"]["sched_cpu_seconds"]
                                             / max(st_s["engines"]["senior"]["steps"], 1))
        res["service_stats"] = {"tandem": st_t, "solo": st_s, **{name: best[name][2] for name in VARIANTS
                                                                 if name in best}}
        res["prompt_tokens_mean"] = sum(map(len, prompts)) / len(prompts)
        res["p_senior"] = ScheduleSpec("word").p_senior
        if replay:
            if short_tokens and short_tokens < budget:
                _, _, st_short = run("word", SamplingParams(temperature=temperature, max_new_tokens=short_tokens),
                                     [r[:short_tokens] for r in text])
                res.update(_cpu_counters(st_short, "short_"))
                res["short_max_new_tokens"] = short_tokens
            res.update({"logprob_max_abs_diff": None, "weights_synced": None})
        else:
            _checks(res, eng, be, senior, prompts, b_t, sp, seed)
    finally:
        if owned:
            svc.stop()
        if small is not None:
            small[0].stop()
            shutil.rmtree(small[1], ignore_errors=True)
        if str(path).startswith(tempfile.gettempdir()) and path.name.startswith("tandem-bench-"):
            shutil.rmtree(path, ignore_errors=True)  # the model this benchmark built for itself
    if replay and options.compare_isolated and short_tokens and budget - short_tokens > 16:
        # after the services have stopped: the scheduler step alone, the history and vocabulary questions
        # without the machine's other tenants
        _isolated(res, launch, len(prompts), short_tokens, budget - short_tokens)
    _predict(res, options)  # after the isolated step, whose scheduler CPU the premises take when it ran
    res["seconds"] = time.perf_counter() - t_start
    return res


# the A/B variants of the tandem rollout whose counts are priced too: (service stats name, prefix, layouts)
VARIANTS = {"tandem_single": ("single_", ("shared", "dedicated")), "tandem_vllm_out": ("vllm_out_", ("shared", "dedicated")),
            "tandem_stream": ("stream_", ("shared",))}
PREDICTED = {"shared": "predicted_gpu_tandem_over_solo", "dedicated": "predicted_gpu_tandem_over_solo_two_gpus"}


def _cpu_premises() -> tuple:
    """(CpuPremises, source) when the isolated scheduler step did not run: the committed premises' CPU figures."""
    from tandem.rollout.cost import load_premises

    committed = load_premises()
    return committed.cpu, committed.measured.get("cpu_source", "the committed premises (tandem/rollout/premises.json)")


def _predict(res: dict, options: VLLMBenchOptions) -> None:
    """This run's premises (`cost.premises_from_stats`: the tandem and solo rollouts' counts per generated token;
    the scheduler's CPU per row and chunk from the isolated step when it ran, else the committed premises') under
    `premises`, and the cost model's tandem/solo for `options.gpu_rows` rows of Qwen3-4B at this run's length on
    `options.gpu`: both engines on one GPU (`predicted_gpu_tandem_over_solo`) and one GPU per model (`_two_gpus`),
    the same function `tandem plan` prices a layout with (`cost.predicted_ratio`)."""
    import subprocess

    from tandem.machine import cpu as cpu_info
    from tandem.plan import KNOWN_SHAPES, ModelShape
    from tandem.rollout.cost import GPUS, CpuPremises, predicted_ratio, premises_from_stats

    iso = res.get("isolated_step")
    if iso:
        mean = lambda key: sum(iso[key.format(r)] for r in ("senior", "junior")) / 2e6  # noqa: E731  us -> s
        cpu = CpuPremises(mean("qwen3_long_{}_us_per_row"), iso["solo_long_us_per_row"] / 1e6,
                          mean("qwen3_long_{}_add_us_per_chunk"), 0.0)
        cpu_source = (f"the isolated scheduler step of this run (benchmarks/sched_step.py, {iso['rows']} rows, "
                      f"Qwen3's table, {iso['history'][-1]} tokens of history)")
    else:
        cpu, cpu_source = _cpu_premises()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[1], timeout=10).stdout.strip()
    except OSError:
        commit = ""
    st = res["service_stats"]
    measured = {"what": (f"tandem (word schedule) and solo rollouts of {res['rows']} rows x {res['max_new_tokens']} "
                         f"tokens on {res['model']}"),
                "on": f"vLLM {res.get('vllm_version')} CPU build, {cpu_info()['model']}, {os.cpu_count()} vCPUs",
                "vocab": res["vocab"], "rows": res["rows"], "new_tokens": res["max_new_tokens"],
                "p_senior": res["p_senior"], "senior_fraction": res.get("senior_fraction"), "commit": commit,
                "cpu_source": cpu_source,
                "rerun": "tandem bench rollout --backend vllm --vocab qwen3 --json --write-premises"}
    prem = premises_from_stats(st["tandem"], st["solo"], cpu, measured)
    res["premises"] = prem.to_json()
    shape = ModelShape(**KNOWN_SHAPES["Qwen/Qwen3-4B-Instruct-2507"], source="Qwen3-4B")
    gpu = GPUS[options.gpu]
    args = (options.gpu_rows, res["max_new_tokens"], res["prompt_tokens_mean"])
    for layout, key in PREDICTED.items():
        p = predicted_ratio(shape, gpu, prem, layout, *args)
        res[key] = p["predicted_tandem_over_solo"]
        res.setdefault("predicted_gpu", {})[layout] = {k: v for k, v in p.items() if k != "predicted_tandem_over_solo"}
    for name, (prefix, layouts) in VARIANTS.items():
        if name in st:
            other = premises_from_stats(st[name], st["solo"], cpu)
            for layout in layouts:
                res[f"{prefix}{PREDICTED[layout]}"] = predicted_ratio(shape, gpu, other, layout, *args)[
                    "predicted_tandem_over_solo"]


def _isolated(res: dict, launch: LaunchOptions, rows: int, tokens: int, long_history: int) -> None:
    """`sched_step.py` in vLLM's environment (`rows` x `tokens` after 16 and `long_history` tokens of history);
    its figures under `isolated_step`, its two flatness ratios per engine (CPU per step, Qwen3's table at the
    long history over the short one, and over the small table at the long history) and its CPU per scheduled row
    over solo's (the same scheduler, plain requests) as `isolated_*`."""
    import json
    import subprocess

    from tandem.rollout.vllm.client import REPO_ROOT

    py = launch.vllm_python()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    cmd = [str(py), str(REPO_ROOT / "benchmarks" / "sched_step.py"), "--rows", str(rows), "--tokens", str(tokens),
           "--history", "16", str(long_history)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"the isolated scheduler step ({' '.join(cmd)}) failed: {r.stderr.strip()[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    res["isolated_step"] = out
    res["isolated_schedules_equal"] = out["schedules_equal"]
    for role in ("senior", "junior"):
        res[f"isolated_sched_cpu_long_over_short_{role}"] = out[f"qwen3_long_over_short_{role}_step"]
        res[f"isolated_sched_cpu_qwen3_over_small_vocab_{role}"] = out[f"qwen3_over_small_long_{role}_step"]
        # per scheduled row against solo's at about the same rows per step: the cost of the chunks themselves
        res[f"isolated_sched_cpu_per_row_tandem_over_solo_{role}"] = out[f"qwen3_long_{role}_over_solo_row"]


def _variant(res: dict, run: tuple, prefix: str, b_t: Any) -> None:
    """One A/B variant of the tandem rollout (best (seconds, batch, stats)): its ratio to solo, whether its
    tokens equal the reference rollout's, and its latency, idle, frontend and scheduler-CPU-per-step counters,
    under `prefix`."""
    t, b, st = run
    res[f"{prefix}tandem_over_solo"] = b.stats()["tokens"] / t / res["solo_tok_s"]
    res[f"{prefix}tokens_equal"] = b.completion_ids == b_t.completion_ids
    res.update({k: v for k, v in _counters(st, prefix=prefix).items()
                if "latency" in k or "idle" in k or "frontend" in k
                or k in (f"{prefix}sched_cpu_us_per_step_senior", f"{prefix}sched_cpu_us_per_step_junior")})


def _cpu_counters(st: dict, prefix: str) -> dict:
    """The CPU counters of one rollout (scheduler, per token, per chunk, rows per step), under `prefix`."""
    return {k: v for k, v in _counters(st, prefix=prefix).items()
            if "sched_cpu" in k or "per_token" in k or "per_chunk" in k or "rows_per_step" in k}


def _small_vocab_side(svc: Any, path: Path, be: Any, prompts: list, text: list) -> tuple[Any, list, list]:
    """The vocabulary A/B's backend on the small-vocabulary service, and the prompts and replayed text
    relabelled into its vocabulary (`relabel`)."""
    from tandem.models import load_tokenizer
    from tandem.rollout.engine import TandemEngine

    tok = load_tokenizer(path)
    be_v = TandemEngine(path, path, tok, backend="vllm", vllm_options={"service": svc, "live": False})._backend
    avoid = set(map(int, be_v.eos_ids)) | set(map(int, tok.all_special_ids))
    src, dst = be.tables.word_start_V.tolist(), be_v.tables.word_start_V.tolist()
    return be_v, relabel(prompts, src, dst, avoid), relabel(text, src, dst, avoid)


def _vocab_ab(res: dict, small: tuple, b_t: Any) -> None:
    """The vocabulary A/B's figures: the small vocabulary's scheduler CPU beside the Qwen3 run's, their ratios,
    and whether both rollouts had the same schedule (owners and lengths)."""
    b_v, st_v = small
    res["small_vocab_schedule_equal"] = (b_v.owner == b_t.owner
                                         and [len(c) for c in b_v.completion_ids] == [len(c) for c in b_t.completion_ids])
    res.update(_cpu_counters(st_v, "small_vocab_"))
    for role in ("senior", "junior"):
        for what in ("row", "step"):
            a, b = res[f"sched_cpu_us_per_{what}_{role}"], res[f"small_vocab_sched_cpu_us_per_{what}_{role}"]
            res[f"sched_cpu_per_{what}_qwen3_over_small_vocab_{role}"] = a / b if b else None


def _checks(res: dict, eng: Any, be: Any, senior: Any, prompts: list, b_t: Any, sp: SamplingParams,
            seed: int) -> None:
    """Log-probs against transformers and the weight sync after a real optimizer step (sampled at
    `sp.temperature`)."""
    from tandem.rollout.toy import rollout

    temperature = sp.temperature

    rows = list(range(0, len(prompts), max(1, len(prompts) // 16)))[:16]
    seqs = [prompts[i] + b_t.completion_ids[i] for i in rows]
    starts = [len(prompts[i]) for i in rows]
    ref = _hf_logprobs(senior, seqs, starts)
    tf_senior = _max_diff(be.score(seqs, starts, "senior"), ref)
    tf_junior = _max_diff(be.score(seqs, starts, "junior"), ref)  # same weights as the senior here
    ref_t = _hf_logprobs(senior, seqs, starts, temperature) if temperature != 1.0 else ref
    sampled = _max_diff([b_t.senior_logprobs[i] for i in rows], ref_t, [b_t.owner[i] for i in rows])
    res.update({"logprob_diff_teacher_forced_senior": tf_senior, "logprob_diff_teacher_forced_junior": tf_junior,
                "logprob_diff_sampled": sampled, "logprob_max_abs_diff": max(tf_senior, tf_junior, sampled)})
    # one optimizer step, pushed as in training; the prompts' KV blocks were cached under the old weights
    old = copy.deepcopy(senior)
    opt = torch.optim.AdamW(senior.parameters(), lr=1e-2)
    senior.train()
    loss = 0.0
    for s, stt in zip(seqs[:8], starts[:8]):
        logits = senior(torch.tensor([s])).logits[0, stt - 1:-1]
        loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(s[stt:]))
    loss.backward()
    opt.step()
    senior.eval()
    t = time.perf_counter()
    eng.push_weights()
    res["push_s"] = time.perf_counter() - t
    after = rollout(eng, prompts[:16], "solo", sp, seed=seed + 1)
    seqs2 = [p + c for p, c in zip(prompts[:16], after.completion_ids)]
    st2 = [len(p) for p in prompts[:16]]
    new_diff = _max_diff(after.senior_logprobs, _hf_logprobs(senior, seqs2, st2, temperature))
    old_diff = _max_diff(after.senior_logprobs, _hf_logprobs(old, seqs2, st2, temperature))
    res.update({"synced_new_diff": new_diff, "synced_old_diff": old_diff,
                "weights_synced": bool(new_diff <= TOLERANCE and old_diff > max(10 * new_diff, 0.01))})


if __name__ == "__main__":  # python benchmarks/vllm_rollout.py [model_dir]
    import json
    import sys

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps(bench_rollout_vllm(sys.argv[1] if len(sys.argv) > 1 else None)))
