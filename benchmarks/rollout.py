"""Rollout throughput benchmark (`tandem bench rollout --json`): one process, one model, one batch.

Measures completion tokens per second of
- `solo`     : the engine, senior alone (`schedule="solo"`);
- `tandem`   : the engine, `word` schedule, catch-up prefill;
- `lockstep` : the paper's algorithm (both models decode every token) on the same hand-written kernel, so the
               ratio `tandem_over_lockstep` compares algorithms only;
- `lockstep_hf`: the same algorithm through transformers' own forward (the test oracle; what a straightforward
               implementation of the paper costs here), measured once;
- `generate` : plain `model.generate` (sampling, left padding), senior alone;
on P prompts x S samples (default 8 x 8) with `max_new_tokens` (default 128). The same weights serve as senior
and junior (the junior is a deep copy, so nothing is shared that a real pair would not share); then every
tandem rollout must equal the solo rollout token for token (same logits, same noise), which the result reports
as `tandem_equals_solo`, a free end-to-end check, next to `tandem_equals_lockstep`.

A second, latency-bound measurement (`*_b1`) runs one row: there a forward costs about the same for one token
or a chunk of tokens, which is the regime (like GPU decoding) in which catch-up beats lockstep.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.rollout.engine import SamplingParams
from tandem.rollout.factory import make_engine
from tandem.rollout.lockstep import lockstep_generate
from tandem.rollout.request import RolloutSettings
from tandem.rollout.schedule import ScheduleSpec
from tandem.rollout.toy import rollout

DEFAULT_MODEL_DIR = "models/base"


def _load(model_dir: str | None) -> tuple[Any, Any, str]:
    """(model, tokenizer, description); a random tiny Qwen3 + a trained-here tokenizer when no model dir."""
    path = Path(model_dir) if model_dir else Path(DEFAULT_MODEL_DIR)
    if path.is_dir() and any(path.glob("*.safetensors")):
        try:
            from tandem.models import load_model, load_tokenizer
            model, tok = load_model(path), load_tokenizer(path)
        except ImportError:
            from transformers import AutoModelForCausalLM, AutoTokenizer
            model = AutoModelForCausalLM.from_pretrained(str(path), use_safetensors=True)
            tok = AutoTokenizer.from_pretrained(str(path))
        return model.eval(), tok, str(path)
    if model_dir:
        raise FileNotFoundError(f"{model_dir}: not a model directory with *.safetensors weights")
    from tandem.rollout import toy

    tok = toy.byte_bpe_tokenizer(vocab_size=640)
    model = toy.tiny_qwen3(len(tok), seed=0, eos_token_id=tok.eos_token_id)
    return model, tok, (f"fallback: {DEFAULT_MODEL_DIR} not found; randomly initialised tiny Qwen3 "
                        f"(hidden 128, 4 layers) with a byte-level BPE built here ({len(tok)} tokens)")


def _prompts(tok: Any, n: int, seed: int) -> list[list[int]]:
    from tandem.data.prompts import render_prompt, user_message
    from tandem.data.synthetic import generate

    probs = generate(n, 2, 8, seed=seed, prefix="bench")
    return [tok(render_prompt(user_message(p.problem), tok), add_special_tokens=False)["input_ids"] for p in probs]


def _timed(fns: dict[str, Any], repeats: int) -> dict[str, tuple[float, Any]]:
    """Best wall time and last result of each function; the functions take turns within every repeat, so a
    change of load on a shared machine hits them alike."""
    best: dict[str, tuple[float, Any]] = {k: (float("inf"), None) for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
            best[k] = (min(best[k][0], dt), out)
    return best


def _hf_generate(model: Any, tok: Any, prompts: list[list[int]], max_new: int, temperature: float, seed: int):
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    L = max(map(len, prompts))
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p)
        mask[b, L - len(p):] = 1
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                             top_k=None, top_p=None, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=pad)
    n = 0
    for row in out[:, L:].tolist():
        n += row.index(eos) + 1 if eos in row else len(row)
    return n


@dataclass(frozen=True)
class BenchWorkload:
    """What a rollout benchmark generates and how often: P prompts x S samples, the token budget (None = the
    benchmark's default: 128 here), the sampling temperature and seed, and the timed repeats (best kept)."""

    n_prompts: int = 8
    n_samples: int = 8
    max_new_tokens: int | None = None
    temperature: float = 1.0
    seed: int = 0
    repeats: int = 3


@dataclass(frozen=True)
class HFBenchParts:
    """The optional measurements of `bench_rollout`: plain `model.generate`, lockstep through transformers'
    own forward, and the one-row (latency-bound) runs."""

    generate: bool = True
    lockstep_hf: bool = True
    latency_bound: bool = True


def bench_rollout(model_dir: str | None = None, work: BenchWorkload = BenchWorkload(),
                  parts: HFBenchParts = HFBenchParts(), num_threads: int | None = 1) -> dict:
    """Tokens/s of solo, tandem (word), lockstep and `model.generate`, their ratios, and schedule diagnostics.

    `model_dir` None uses models/base when it exists, else a random tiny Qwen3 (said in `model`).
    `num_threads` sets torch's intra-op threads for the measurement (restored after; None keeps torch's
    setting). One is the default: tiny models gain nothing from more, and on a shared machine two threads per
    op were measured up to 40x slower. Each timing is the best of `work.repeats` runs after one warm-up, the
    measured functions taking turns within each repeat.
    """
    n_prompts, n_samples, temperature, seed, repeats = (work.n_prompts, work.n_samples, work.temperature,
                                                        work.seed, work.repeats)
    max_new_tokens = work.max_new_tokens or 128
    include_generate, include_lockstep_hf, latency_bound = parts.generate, parts.lockstep_hf, parts.latency_bound
    t_start = time.perf_counter()
    old_threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        model, tok, desc = _load(model_dir)
        base = _prompts(tok, n_prompts, seed)
        prompts = [p for p in base for _ in range(n_samples)]
        # The junior is a copy: the same weights, but nothing shared that a real tandem pair would not share.
        junior = copy.deepcopy(model)
        engine = make_engine(model, junior, tok)
        sp = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)

        def solo(ps=prompts):
            return rollout(engine, ps, "solo", sp, seed=seed)

        def tandem(ps=prompts):
            return rollout(engine, ps, "word", sp, seed=seed)

        def lockstep(ps=prompts, forward="fast"):
            with torch.no_grad():
                return lockstep_generate(engine.pair, RolloutSettings(ScheduleSpec("word"), sp).request(ps, seed), forward=forward)

        rollout(engine, prompts[:4], "word", SamplingParams(temperature=temperature, max_new_tokens=8), seed=seed)
        res: dict[str, Any] = {"model": desc, "rows": len(prompts), "max_new_tokens": max_new_tokens,
                               "threads": torch.get_num_threads(),
                               "kernel": "catch-up" if engine.fast else "lockstep-fallback"}
        fns: dict[str, Any] = {"solo": solo, "tandem": tandem, "lockstep": lockstep}
        if include_generate:
            fns["generate"] = lambda: _hf_generate(model, tok, prompts, max_new_tokens, temperature, seed)
        runs = _timed(fns, repeats)
        (t_solo, b_solo), (t_tan, b_tan), (t_lock, b_lock) = runs["solo"], runs["tandem"], runs["lockstep"]
        res["solo_tok_s"] = b_solo.stats()["tokens"] / t_solo
        res["tandem_tok_s"] = b_tan.stats()["tokens"] / t_tan
        res["lockstep_tok_s"] = b_lock.stats()["tokens"] / t_lock
        if include_lockstep_hf:
            t_lhf, b_lhf = _timed({"hf": lambda: lockstep(forward="hf")}, 1)["hf"]
            res["lockstep_hf_tok_s"] = b_lhf.stats()["tokens"] / t_lhf
        if include_generate:
            t_gen, n_gen = runs["generate"]
            res["generate_tok_s"] = n_gen / t_gen
        res["tandem_over_solo"] = res["tandem_tok_s"] / res["solo_tok_s"]
        res["tandem_over_lockstep"] = res["tandem_tok_s"] / res["lockstep_tok_s"]
        if include_lockstep_hf:
            res["tandem_over_lockstep_hf"] = res["tandem_tok_s"] / res["lockstep_hf_tok_s"]
        if include_generate:
            res["solo_over_generate"] = res["solo_tok_s"] / res["generate_tok_s"]
        st = b_tan.stats()
        res.update({"senior_fraction": st["senior_fraction"], "handoffs_per_100": st["handoffs_per_100"],
                    "mean_run_length": st["mean_run_length"], "mean_length": st["mean_length"],
                    "tandem_equals_solo": b_tan.completion_ids == b_solo.completion_ids,
                    "tandem_equals_lockstep": b_tan.completion_ids == b_lock.completion_ids})
        if latency_bound:
            one = prompts[:1]
            b1 = _timed({"solo": lambda: solo(one), "tandem": lambda: tandem(one),
                         "lockstep": lambda: lockstep(one)}, repeats)
            (t1s, o1s), (t1t, o1t), (t1l, o1l) = b1["solo"], b1["tandem"], b1["lockstep"]
            res["solo_tok_s_b1"] = o1s.stats()["tokens"] / t1s
            res["tandem_tok_s_b1"] = o1t.stats()["tokens"] / t1t
            res["lockstep_tok_s_b1"] = o1l.stats()["tokens"] / t1l
            res["tandem_over_solo_b1"] = res["tandem_tok_s_b1"] / res["solo_tok_s_b1"]
            res["tandem_over_lockstep_b1"] = res["tandem_tok_s_b1"] / res["lockstep_tok_s_b1"]
        res["seconds"] = time.perf_counter() - t_start
        return res
    finally:
        torch.set_num_threads(old_threads)


if __name__ == "__main__":  # python benchmarks/rollout.py [model_dir]
    import json
    import sys

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps(bench_rollout(sys.argv[1] if len(sys.argv) > 1 else None,
                                   num_threads=int(os.environ.get("BENCH_THREADS", "1")) or None)))
