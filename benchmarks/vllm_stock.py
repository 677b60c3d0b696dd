"""Stock vLLM solo: one plain `AsyncLLM` engine (no tandem scheduler, worker or service; vLLM's own defaults,
asynchronous scheduling included where the platform turns it on) decoding every row to a fixed length.

The solo baseline of `benchmarks/vllm_gpu.py`, which runs it in vLLM's environment. Each row is one
`AsyncLLM.generate` request (its prompt's token ids, `max_tokens` = `--tokens`, `ignore_eos`, temperature 1,
final output only), all rows at once, after a short warm-up of the same rows. Engine steps are counted through
vLLM's stat-logger interface (a `StatLoggerBase` passed to `AsyncLLM.from_engine_args(stat_loggers=...)`, with
`enable_logging_iteration_details`): one `SchedulerStats` per executed step, its `iteration_details` giving
the rows and tokens the step computed; `IterationStats` give the generated tokens and preemptions.

Prints one JSON line: tokens/s, engine steps (and per generated token, and per token of one row: 1.0 when every
row is in every step), rows per step, computed tokens per generated token, the most rows running and waiting
at once, preemptions, and what vLLM actually ran (`async_scheduling` as resolved in the engine's config, the
model runner, KV blocks and block size, the device).

Usage (vLLM's Python): `.venv-vllm/bin/python benchmarks/vllm_stock.py --model DIR --prompts FILE.json
--tokens 3000 [--gpu-memory 0.9] [--max-model-len N] [--dtype bfloat16] [--eager] [--async-scheduling
default|on|off] [--repeats 1]`; FILE.json holds one list of token ids per row.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time

# the step counts of the engine's stat loggers (one logger per engine; this process runs one engine)
TALLY: dict[str, float] = {}


def _reset() -> None:
    TALLY.clear()
    TALLY.update(records=0, steps=0, rows_sum=0, computed_tokens=0, generated_tokens=0, preemptions=0,
                 max_running=0, max_waiting=0, details=0)


def _logger_cls():
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepTally(StatLoggerBase):
        """Counts the engine's executed steps from the stats vLLM sends with each step's outputs."""

        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                TALLY["records"] += 1  # one per update_from_output: one per executed batch
                TALLY["max_running"] = max(TALLY["max_running"], scheduler_stats.num_running_reqs)
                TALLY["max_waiting"] = max(TALLY["max_waiting"], scheduler_stats.num_waiting_reqs)
                d = getattr(scheduler_stats, "iteration_details", None)
                if d is not None and not d.is_dummy:  # a step that computed tokens
                    TALLY["details"] += 1
                    TALLY["steps"] += 1
                    TALLY["rows_sum"] += d.num_ctx_requests + d.num_generation_requests
                    TALLY["computed_tokens"] += d.num_ctx_tokens + d.num_generation_tokens
            if iteration_stats is not None:
                TALLY["generated_tokens"] += iteration_stats.num_generation_tokens
                TALLY["preemptions"] += iteration_stats.num_preempted_reqs

        def log_engine_initialized(self):
            pass

    return StepTally


async def _rollout(engine, prompts: list[list[int]], tokens: int, tag: str) -> tuple[float, list[int]]:
    """All rows at once to `tokens` new tokens each; (seconds, new tokens per row)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0,
                        output_kind=RequestOutputKind.FINAL_ONLY)

    async def one(i: int, p: list[int]) -> int:
        n = 0
        async for out in engine.generate(TokensPrompt(prompt_token_ids=list(p)), sp, request_id=f"{tag}-{i}"):
            n = len(out.outputs[0].token_ids)
        return n

    t0 = time.perf_counter()
    lengths = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    dt = time.perf_counter() - t0
    await asyncio.sleep(0.2)  # the last step's stats reach the logger after its outputs
    return dt, list(lengths)


async def _main(a: argparse.Namespace) -> dict:
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    prompts = json.loads(open(a.prompts).read())
    kw = dict(model=a.model, dtype=a.dtype, seed=0, gpu_memory_utilization=a.gpu_memory,
              enforce_eager=a.eager, max_num_seqs=max(a.max_num_seqs, len(prompts)), disable_log_stats=True,
              enable_logging_iteration_details=True)
    if a.max_model_len:
        kw["max_model_len"] = a.max_model_len
    if a.async_scheduling != "default":
        kw["async_scheduling"] = a.async_scheduling == "on"
    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw), stat_loggers=[_logger_cls()])
    start_s = time.perf_counter() - t0
    cfg = engine.vllm_config
    try:
        _reset()
        await _rollout(engine, prompts, min(8, a.tokens), "warm")
        best = None
        for r in range(a.repeats):
            _reset()
            dt, lengths = await _rollout(engine, prompts, a.tokens, f"run{r}")
            if best is None or dt < best[0]:
                best = (dt, lengths, dict(TALLY))
    finally:
        engine.shutdown()
    dt, lengths, t = best
    tokens = sum(lengths)
    rows = len(prompts)
    steps = t["steps"] if t["details"] else t["records"]  # without iteration details: one record per batch
    device = "cpu"
    if not current_platform.is_cpu():
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else current_platform.device_name
    return {
        "vllm": vllm.__version__, "device": device, "platform_cpu": bool(current_platform.is_cpu()),
        "async_scheduling_requested": a.async_scheduling,
        "async_scheduling": bool(cfg.scheduler_config.async_scheduling),  # what the engine ran
        "model_runner_v2": bool(getattr(cfg, "use_v2_model_runner", False)),
        "enforce_eager": bool(cfg.model_config.enforce_eager), "dtype": str(cfg.model_config.dtype),
        "kv_blocks": int(cfg.cache_config.num_gpu_blocks or 0), "block_size": int(cfg.cache_config.block_size),
        "max_num_seqs": int(cfg.scheduler_config.max_num_seqs), "gpu_memory": a.gpu_memory,
        "rows": rows, "max_new_tokens": a.tokens, "tokens": tokens,
        "complete_rows": sum(n == a.tokens for n in lengths),
        "seconds": dt, "tok_s": tokens / dt, "start_s": start_s,
        "steps_counted_by": "iteration_details" if t["details"] else "scheduler_stats records",
        "engine_steps": int(steps), "engine_steps_per_token": steps / max(tokens, 1),
        "engine_steps_per_row_token": steps * rows / max(tokens, 1),
        "mean_rows_per_step": t["rows_sum"] / steps if steps and t["details"] else None,
        "computed_per_token": t["computed_tokens"] / max(tokens, 1) if t["details"] else None,
        "generated_tokens_counted": int(t["generated_tokens"]), "preemptions": int(t["preemptions"]),
        "max_running_rows": int(t["max_running"]), "max_waiting_rows": int(t["max_waiting"]),
        "stat_records": int(t["records"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="a JSON file: one list of token ids per row")
    ap.add_argument("--tokens", type=int, required=True, help="new tokens per row (ignore_eos)")
    ap.add_argument("--gpu-memory", type=float, default=0.9)
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs; vLLM's default is off)")
    ap.add_argument("--async-scheduling", choices=("default", "on", "off"), default="default")
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    out = asyncio.run(_main(a))
    gc.collect()  # the engine, shut down, is freed now rather than at interpreter exit
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
