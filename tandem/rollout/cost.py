"""The GPU cost model: a rollout's counted work priced on a GPU (`predicted_gpu_tandem_over_solo`).

The CPU build cannot time a GPU, but it counts what a GPU would do: per engine, the steps, the rows and the
context (KV tokens read) in each step, the tokens computed (prefill + decode), and the CPU the scheduler and
the frontend spend. Decoding is memory-bound, so each step of an engine costs (a roofline)

    t_step = F + max(W + K_step, C_step)
    W = weight bytes / BW                      (ModelShape.n_params x 2 bytes, bf16)
    K_step = context tokens x KV bytes per token / BW  (ModelShape.kv_bytes_per_token(2))
    C_step = 2 x n_params x computed tokens / P
    F = launch gap per step (async scheduling off: a custom scheduler) + the measured scheduler CPU per step

with the shape of the target model from `tandem/plan.py` (Qwen3-4B by default) and the GPU's bandwidth BW
and dense bf16 throughput P (`GPUS`: achieved, not peak figures). The counts are scaled from the measured
rows to `rows` (per-step rows, contexts and computed tokens scale; the number of steps does not: every row
runs concurrently). The scheduler CPU per step is the measured one, at the measured rows per step; with
`cpu_per_row` it scales with the rows too, at this machine's CPU speed (the scheduler's work is per scheduled
row: `benchmarks/sched_step.py`), which prices a GPU host's CPU no faster than the measuring one, and solo's CPU as
exposed as tandem's (a custom scheduler turns vLLM's asynchronous scheduling off for both).

- One GPU for both engines: the two engines' kernels share the GPU, so their memory and compute times add,
  while one engine's per-step CPU gap hides behind the other's kernels: T = sum over both engines' steps of
  max(W + K, C) + F x max(steps of either engine).
- One GPU per engine, against solo with data parallelism 2 (each GPU half the rows): T = the slower engine.
- Either way T is at least the frontend's CPU (measured per generated token, times the tokens).

The ratio is (tandem tokens / T_tandem) / (solo tokens / T_solo). Calibrate `F`, `BW`, `P` with one solo run
when a GPU is lent (`scripts/gpu_check.sh` part 2 prints the measured solo step time beside the model's).
`tandem/rollout/layout.py` prices a layout from the params with the same table and roofline (`roofline`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    bandwidth: float   # bytes/s achieved (~83% of the spec sheet)
    flops: float       # dense bf16 FLOP/s achieved (~60% of the spec sheet)
    launch_gap: float  # seconds of exposed per-step CPU/launch gap with CUDA graphs, synchronous scheduling
    memory_gib: float = 0.0  # device memory as torch reports it (`tandem plan` sizes a dedicated engine with it)


GPUS = {
    "h200": GPU("H200", 4.8e12 * 0.83, 989e12 * 0.6, 0.5e-3, 140.0),
    "h100": GPU("H100 SXM", 3.35e12 * 0.83, 989e12 * 0.6, 0.5e-3, 79.6),
}


def gpu_for_memory(gib: float) -> str:
    """The key of the `GPUS` entry whose memory is nearest `gib` (a params file states a GPU's memory, not its
    kind: train.gpu_memory_gib 80 prices an H100, 140 an H200)."""
    return min(GPUS, key=lambda k: abs(GPUS[k].memory_gib - gib))


def roofline(shape, gpu: GPU, context_tokens: float, computed_tokens: float) -> float:
    """GPU seconds of one engine step without the per-step gap: max(W + K, C) for a step that reads
    `context_tokens` of KV and computes `computed_tokens` (the module docstring's terms)."""
    W = shape.n_params * 2 / gpu.bandwidth
    K = context_tokens * shape.kv_bytes_per_token(2) / gpu.bandwidth
    C = 2 * shape.n_params * computed_tokens / gpu.flops
    return max(W + K, C)


def engine_time(c: dict, shape, gpu: GPU, scale: float, rows_split: float = 1.0,
                cpu_per_row: bool = False) -> tuple[float, float]:
    """(GPU seconds excluding the per-step gap, per-step gap seconds) of one engine's counted rollout.

    Uses the step-level means: the counts are sums over steps, and both terms of the roofline are linear in
    them, so the mean step is priced (a step of twice the context reads twice the KV). The scheduler CPU per
    step is taken as measured (`cpu_per_row` False) or scaled with the step's rows like the other per-step
    counts (True: the scheduler's work is per scheduled row, `benchmarks/sched_step.py`), at this machine's CPU
    speed."""
    steps = c.get("steps", 0.0)
    if not steps:
        return 0.0, 0.0
    k = scale / rows_split
    ctx = c.get("context_tokens", 0.0) * k / steps
    comp = c.get("computed_tokens", 0.0) * k / steps
    gap = gpu.launch_gap + c.get("sched_cpu_seconds", 0.0) / steps * (k if cpu_per_row else 1.0)
    return steps * roofline(shape, gpu, ctx, comp), steps * gap


def predict(tandem: dict, solo: dict, shape, gpu: str = "h200", rows: int = 128, cpu_per_row: bool = False) -> dict:
    """Predicted tandem/solo throughput ratios on one GPU and on one GPU per engine, with the terms.

    `tandem` / `solo`: the service stats of one rollout each ({"engines": {"senior": counts, "junior": ...},
    "kept", "rows", "frontend_cpu_seconds"}); `cpu_per_row`: the scheduler CPU per step scaled to `rows` with the
    other per-step counts (`engine_time`).
    """
    g = GPUS[gpu]
    ts, tj, ss = tandem["engines"]["senior"], tandem["engines"]["junior"], solo["engines"]["senior"]
    k_t = rows / max(tandem["rows"], 1)
    k_s = rows / max(solo["rows"], 1)
    front_t = tandem.get("frontend_cpu_seconds", 0.0) * k_t
    front_s = solo.get("frontend_cpu_seconds", 0.0) * k_s
    a_s, f_s = engine_time(ts, shape, g, k_t, cpu_per_row=cpu_per_row)
    a_j, f_j = engine_time(tj, shape, g, k_t, cpu_per_row=cpu_per_row)
    a_solo, f_solo = engine_time(ss, shape, g, k_s, cpu_per_row=cpu_per_row)
    T_solo = max(a_solo + f_solo, front_s)
    gap_1 = max(f_s, f_j)
    T_1 = max(a_s + a_j + gap_1, front_t)
    T_2 = max(a_s + f_s, a_j + f_j, front_t)
    # solo, data parallel 2: half the rows
    a_solo2, f_solo2 = engine_time(ss, shape, g, k_s, rows_split=2.0, cpu_per_row=cpu_per_row)
    T_solo2 = max(a_solo2 + f_solo2, front_s / 2)
    tok_t, tok_s = tandem["kept"] * k_t, solo["kept"] * k_s
    gpu_1 = (tok_t / (a_s + a_j + gap_1)) / (tok_s / (a_solo + f_solo))  # the GPU work alone, no frontend floor
    return {"gpu": g.name, "rows": rows, "model_params": shape.n_params,
            "solo_s": T_solo, "tandem_one_gpu_s": T_1, "tandem_two_gpus_s": T_2,
            "solo_tok_s": tok_s / T_solo, "tandem_one_gpu_tok_s": tok_t / T_1,
            "predicted_gpu_tandem_over_solo": (tok_t / T_1) / (tok_s / T_solo),
            "predicted_gpu_tandem_over_solo_two_gpus": (tok_t / T_2) / (tok_s / T_solo2),
            "gpu_bound_tandem_over_solo": gpu_1, "frontend_bound": T_1 == front_t,
            "weights_ms_per_step": shape.n_params * 2 / g.bandwidth * 1e3,
            "gap_ms_per_step": (f_solo / ss["steps"] * 1e3) if ss.get("steps") else 0.0}
