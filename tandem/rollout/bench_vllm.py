"""Benchmark and check of the vLLM rollout service (`tandem bench rollout --backend vllm --json`).

One process starts (or attaches to) the service on one model (models/base when it exists, else a random tiny
Qwen3 saved to a temporary directory), senior and junior being the same weights, and measures:
- `solo_tok_s`, `tandem_tok_s` (word schedule), `tandem_over_solo`: completion tokens per second, best of
  `repeats` interleaved runs after a warm-up; `decoded_tokens` vs `kept_tokens` of the tandem runs (turns stop
  where authorship may change, so nothing decoded is thrown away), turns and rounds per call;
- `logprob_max_abs_diff`: the largest difference between the service's log-probs and the transformers model's
  on the same token sequences: teacher-forced (both engines, temperature 1) and the sampled senior log-probs of
  the tandem batch;
- `weights_synced`: one real optimizer step (AdamW on the senior's own tokens) is pushed to the service like
  training does; true only when the service's sampled log-probs then match the updated weights
  (`synced_new_diff`) and no longer the old ones (`synced_old_diff`). The prompts' KV blocks were cached
  under the old weights, so this also checks the prefix-cache reset.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tandem.rollout.core import SamplingParams

TOLERANCE = 0.1


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
    from tandem.rollout.bench import DEFAULT_MODEL_DIR

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


def bench_rollout_vllm(model_dir: str | None = None, url: str | None = None, n_prompts: int = 8,
                       n_samples: int = 8, max_new_tokens: int = 128, temperature: float = 1.0, seed: int = 0,
                       repeats: int = 2, dtype: str = "auto", python: str | None = None) -> dict:
    """Run the measurements above; returns one flat dict (see the module docstring)."""
    from tandem.models import load_tokenizer
    from tandem.rollout.bench import _prompts
    from tandem.rollout.vllm_client import VLLMEngine, VLLMService

    t_start = time.perf_counter()
    path, desc = _model_dir(model_dir)
    from transformers import AutoModelForCausalLM

    senior = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, use_safetensors=True).eval()
    tok = load_tokenizer(path)
    base = _prompts(tok, n_prompts, seed)
    prompts = [p for p in base for _ in range(n_samples)]
    t0 = time.perf_counter()
    if url:
        svc, owned = VLLMService.attach(url), False
    else:
        svc, owned = VLLMService.start(path, path, python=python, dtype=dtype), True
    res: dict[str, Any] = {"backend": "vllm", "model": desc, "rows": len(prompts), "max_new_tokens": max_new_tokens,
                           "service_start_s": time.perf_counter() - t0}
    try:
        health = svc.health()
        res["vllm_version"] = health.get("vllm")
        eng = VLLMEngine(senior, path, tok, svc, live=True)
        sp = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
        eng.generate(prompts[:4], "word", SamplingParams(temperature=temperature, max_new_tokens=8), seed=seed)
        best: dict[str, tuple[float, Any, dict]] = {}
        for _ in range(repeats):
            for name, sched in (("solo", "solo"), ("tandem", "word")):
                t = time.perf_counter()
                b = eng.generate(prompts, sched, sp, seed=seed)
                dt = time.perf_counter() - t
                if name not in best or dt < best[name][0]:
                    best[name] = (dt, b, dict(eng.last_stats))
        (t_s, b_s, st_s), (t_t, b_t, st_t) = best["solo"], best["tandem"]
        res["solo_tok_s"] = b_s.stats()["tokens"] / t_s
        res["tandem_tok_s"] = b_t.stats()["tokens"] / t_t
        res["tandem_over_solo"] = res["tandem_tok_s"] / res["solo_tok_s"]
        st = b_t.stats()
        res.update({"senior_fraction": st["senior_fraction"], "handoffs_per_100": st["handoffs_per_100"],
                    "mean_run_length": st["mean_run_length"], "mean_length": st["mean_length"],
                    "decoded_tokens": st_t["decoded"], "kept_tokens": st_t["kept"],
                    "tandem_turns": st_t["turns"], "tandem_rounds": st_t["rounds"], "solo_rounds": st_s["rounds"]})

        # log-probs against the transformers model on the same sequences
        rows = list(range(0, len(prompts), max(1, len(prompts) // 16)))[:16]
        seqs = [prompts[i] + b_t.completion_ids[i] for i in rows]
        starts = [len(prompts[i]) for i in rows]
        ref = _hf_logprobs(senior, seqs, starts)
        tf_senior = _max_diff(eng.score(seqs, starts, "senior"), ref)
        tf_junior = _max_diff(eng.score(seqs, starts, "junior"), ref)  # same weights as the senior here
        ref_t = _hf_logprobs(senior, seqs, starts, temperature) if temperature != 1.0 else ref
        sampled = _max_diff([b_t.senior_logprobs[i] for i in rows], ref_t, [b_t.owner[i] for i in rows])
        res.update({"logprob_diff_teacher_forced_senior": tf_senior, "logprob_diff_teacher_forced_junior": tf_junior,
                    "logprob_diff_sampled": sampled, "logprob_max_abs_diff": max(tf_senior, tf_junior, sampled)})

        # one optimizer step, pushed as in training; the prompts' blocks are cached under the old weights
        old = copy.deepcopy(senior)
        opt = torch.optim.AdamW(senior.parameters(), lr=1e-2)
        senior.train()
        batch = [prompts[i] + b_t.completion_ids[i] for i in rows[:8]]
        loss = 0.0
        for s, stt in zip(batch, starts[:8]):
            logits = senior(torch.tensor([s])).logits[0, stt - 1:-1]
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(s[stt:]))
        loss.backward()
        opt.step()
        senior.eval()
        t = time.perf_counter()
        eng.push_weights()
        res["push_s"] = time.perf_counter() - t
        after = eng.generate(prompts[:16], "solo", sp, seed=seed + 1)
        seqs2 = [p + c for p, c in zip(prompts[:16], after.completion_ids)]
        st2 = [len(p) for p in prompts[:16]]
        new_diff = _max_diff(after.senior_logprobs, _hf_logprobs(senior, seqs2, st2, temperature))
        old_diff = _max_diff(after.senior_logprobs, _hf_logprobs(old, seqs2, st2, temperature))
        res.update({"synced_new_diff": new_diff, "synced_old_diff": old_diff,
                    "weights_synced": bool(new_diff <= TOLERANCE and old_diff > max(10 * new_diff, 0.01))})
    finally:
        if owned:
            svc.stop()
    res["seconds"] = time.perf_counter() - t_start
    return res


if __name__ == "__main__":  # python -m tandem.rollout.bench_vllm [model_dir]
    import json
    import sys

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps(bench_rollout_vllm(sys.argv[1] if len(sys.argv) > 1 else None)))
