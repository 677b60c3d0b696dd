"""The GPU cost model of a rollout: measured premises (counts per generated token, from vLLM's CPU build) priced on
a GPU's roofline. One model for `tandem plan` (`tandem/rollout/layout.py`), the rollout benchmark
(`benchmarks/vllm_rollout.py`) and the vLLM GPU check (`benchmarks/vllm_gpu.py`).

**Premises** (`Premises`, read from `PREMISES_FILE`, `tandem/rollout/premises.json`, which
`tandem bench rollout --backend vllm --vocab qwen3 --write-premises` writes): per engine (the tandem rollout's
senior and junior, and solo), per generated token of the rollout,
- `steps_per_row_token`: engine steps per generated token of one row (steps x rows / tokens: a rollout of rows of
  L new tokens runs L x this many steps of the engine; 1.0 when every row is in every step, as in solo);
- `rows_per_token`: rows scheduled in the engine's steps, summed, per generated token (its rows per step are
  rows x rows_per_token / steps_per_row_token);
- `computed_per_token`: tokens the engine runs through its model (decode, the partner's catch-up);
- `chunks_per_token`: session chunks added to the engine;
and the CPU per unit (`CpuPremises`): the scheduler's CPU per scheduled row (tandem, solo), per chunk added, and
the frontend's per generated token, at the measuring machine's speed. The counts are what vLLM's CPU build counts
(a GPU runs the same scheduler over the same rows); the CPU figures are priced as measured (a faster host lowers
them).

**Pricing** (decoding is memory-bound; `roofline`): a step of an engine with `r` rows at a mean context `c` costs
    max(W + K, C),  W = bf16 weight bytes / BW,  K = r c KV bytes per token / BW,  C = 2 params computed / P
with the target model's shape (`tandem/plan.py`'s `ModelShape`) and the GPU's achieved bandwidth BW and dense
bf16 throughput P (`GPUS`). Tandem's scheduler runs vLLM's synchronous scheduling, so each of its steps also pays
an exposed gap F = the launch gap + r x the scheduler's CPU per row + chunks per step x the CPU per chunk.
- `shared` (both engines on one GPU): their kernels add, one engine's gaps hide behind the other's kernels:
  T = sum over engines of steps x max(W + K, C) + max over engines of steps x F;
- `dedicated` (one GPU per model): T = the slower engine, steps x (max(W + K, C) + F);
- either way T is at least the frontend's CPU per generated token x the tokens.
Solo is stock vLLM as it runs by default on CUDA: asynchronous scheduling overlaps its scheduler's CPU with the
GPU's step, so each step is max(roofline, rows x the solo scheduler's CPU per row), no gap exposed; on a shared
GPU it has that GPU, with one GPU per model it runs data parallel 2 (half the rows on each GPU).
The ratio is tandem's tokens per second over solo's for the same rows and tokens: T_solo / T_tandem.

Assumed: a row's mean context over its rollout is prompt + L / 2; the counts per token hold at any row count
and length; every row runs to its L new tokens. Calibrate BW and the launch gap with one solo run on a GPU
(`scripts/gpu_check.sh` part 2); until then every GPU figure is a prediction.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

PREMISES_FILE = Path(__file__).with_name("premises.json")
ROLES = ("senior", "junior", "solo")


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


def weights_seconds(shape, gpu: GPU) -> float:
    """W: seconds to read the bf16 weights once at the GPU's achieved bandwidth (every step pays it)."""
    return shape.n_params * 2 / gpu.bandwidth


def mean_context(prompt_tokens: float, new_tokens: float) -> float:
    """A row's mean context over its rollout: prompt + L / 2 (the module docstring's assumption)."""
    return prompt_tokens + new_tokens / 2


def solo_rows_per_gpu(layout: str, rows: int) -> int:
    """The rows stock solo runs on each GPU against tandem's `rows`: all of them on the shared GPU, half (rounded
    up) with data parallelism 2 over the dedicated layout's two GPUs."""
    return rows if layout == "shared" else -(-rows // 2)


def roofline(shape, gpu: GPU, context_tokens: float, computed_tokens: float) -> float:
    """GPU seconds of one engine step without the per-step gap: max(W + K, C) for a step that reads
    `context_tokens` of KV and computes `computed_tokens` (the module docstring's terms)."""
    W = weights_seconds(shape, gpu)
    K = context_tokens * shape.kv_bytes_per_token(2) / gpu.bandwidth
    C = 2 * shape.n_params * computed_tokens / gpu.flops
    return max(W + K, C)


# --------------------------------------------------------------------------------------------------
# Premises
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EnginePremises:
    """One engine's counts per generated token of the rollout (module docstring)."""

    steps_per_row_token: float
    rows_per_token: float
    computed_per_token: float
    chunks_per_token: float = 0.0

    def __post_init__(self):
        if self.steps_per_row_token <= 0 or self.rows_per_token <= 0 or self.computed_per_token < 0 \
                or self.chunks_per_token < 0:
            raise ValueError(f"an engine's premises are positive counts per generated token (steps and rows > 0), "
                             f"got {self}")

    def per_step(self, rows: float, per_token: float) -> float:
        """A count per generated token (one of this engine's) as a count per step of it when `rows` rows run."""
        return rows * per_token / self.steps_per_row_token

    def rows_per_step(self, rows: float) -> float:
        """Rows in one of this engine's steps when `rows` rows run."""
        return self.per_step(rows, self.rows_per_token)


@dataclass(frozen=True)
class CpuPremises:
    """CPU seconds per unit at the measuring machine's speed: the scheduler per scheduled row (tandem, solo), per
    chunk added to an engine, and the frontend per generated token (tandem's service)."""

    sched_per_row_tandem: float
    sched_per_row_solo: float
    per_chunk: float
    frontend_per_token: float

    def __post_init__(self):
        if min(asdict(self).values()) < 0:
            raise ValueError(f"CPU seconds are >= 0, got {self}")


@dataclass(frozen=True)
class Premises:
    """What the cost model prices: the three engines' counts, the CPU per unit, and where they were measured
    (`measured`: what, on what, how to rerun; `cpu_source`: where the CPU figures come from)."""

    senior: EnginePremises
    junior: EnginePremises
    solo: EnginePremises
    cpu: CpuPremises
    measured: dict = field(default_factory=dict, compare=False)

    def engine(self, role: str) -> EnginePremises:
        if role not in ROLES:
            raise ValueError(f"role {role!r}: one of {ROLES}")
        return getattr(self, role)

    def to_json(self) -> dict:
        d = {r: asdict(self.engine(r)) for r in ROLES}
        return {"engines": d, "cpu_seconds": asdict(self.cpu), "measured": dict(self.measured)}

    @classmethod
    def from_json(cls, d: dict) -> "Premises":
        try:
            engines = {r: EnginePremises(**d["engines"][r]) for r in ROLES}
            return cls(**engines, cpu=CpuPremises(**d["cpu_seconds"]), measured=d.get("measured", {}))
        except (KeyError, TypeError) as e:
            raise ValueError(f"premises: expected engines.{{senior,junior,solo}} and cpu_seconds as "
                             f"`Premises.to_json` writes them ({e})") from None


def load_premises(path: str | Path | None = None) -> Premises:
    """The committed premises (`PREMISES_FILE`, read once per process: `tandem plan` prices several layouts with
    them) or another file of the same form (read at each call)."""
    if path is None:
        return _committed_premises()
    return Premises.from_json(json.loads(Path(path).read_text()))


@functools.lru_cache(maxsize=1)
def _committed_premises() -> Premises:
    return load_premises(PREMISES_FILE)


def write_premises(premises: Premises, path: str | Path = PREMISES_FILE) -> Path:
    """Write `premises` as `load_premises` reads them; a write to `PREMISES_FILE` is what later loads read."""
    Path(path).write_text(json.dumps(premises.to_json(), indent=1, sort_keys=True) + "\n")
    if Path(path).resolve() == PREMISES_FILE.resolve():
        _committed_premises.cache_clear()
    return Path(path)


def engine_premises(counts: dict, kept: float, rows: int) -> EnginePremises:
    """One engine's premises from the service's counters of one rollout (`engines.<role>`), `kept` generated
    tokens over `rows` rows."""
    kept = max(float(kept), 1.0)
    return EnginePremises(steps_per_row_token=counts["steps"] * rows / kept,
                          rows_per_token=counts["scheduled_rows_sum"] / kept,
                          computed_per_token=counts["computed_tokens"] / kept,
                          chunks_per_token=counts.get("chunks", 0.0) / kept)


def premises_from_stats(tandem: dict, solo: dict, cpu: CpuPremises, measured: dict | None = None) -> Premises:
    """Premises from the service stats of one tandem and one solo rollout (the benchmark's `service_stats`:
    {"engines": {"senior": counts, "junior": ...}, "kept", "rows", "frontend_cpu_seconds"}). The frontend's CPU per
    token is the tandem rollout's own; the scheduler's CPU per row and chunk are `cpu`'s (they are measured in
    isolation, `benchmarks/sched_step.py`: inside the service they include the model runner's work)."""
    cpu = replace(cpu, frontend_per_token=tandem.get("frontend_cpu_seconds", 0.0) / max(float(tandem["kept"]), 1.0))
    e = tandem["engines"]
    return Premises(engine_premises(e["senior"], tandem["kept"], tandem["rows"]),
                    engine_premises(e["junior"], tandem["kept"], tandem["rows"]),
                    engine_premises(solo["engines"]["senior"], solo["kept"], solo["rows"]), cpu,
                    dict(measured or {}))


# --------------------------------------------------------------------------------------------------
# Pricing
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepPrice:
    """One engine's step in a rollout of `rows` rows: its rows, GPU seconds (roofline) and exposed gap."""

    steps_per_row_token: float
    rows: float
    gpu_s: float
    gap_s: float


def tandem_steps(shape, gpu: GPU, premises: Premises, rows: float, context: float) -> dict[str, StepPrice]:
    """The senior's and the junior's step when `rows` rows run at a mean context of `context` tokens."""
    out = {}
    for role in ("senior", "junior"):
        e = premises.engine(role)
        r = e.rows_per_step(rows)
        gap = gpu.launch_gap + r * premises.cpu.sched_per_row_tandem \
            + e.per_step(rows, e.chunks_per_token) * premises.cpu.per_chunk
        gpu_s = roofline(shape, gpu, r * context, e.per_step(rows, e.computed_per_token))
        out[role] = StepPrice(e.steps_per_row_token, r, gpu_s, gap)
    return out


def tandem_seconds(shape, gpu: GPU, premises: Premises, layout: str, rows: float, new_tokens: int,
                   context: float) -> float:
    """Seconds of one tandem rollout of `rows` rows x `new_tokens` (module docstring): `shared` adds both engines'
    kernels and the longer gap; `dedicated` is the slower engine; floored by the frontend's CPU."""
    steps = tandem_steps(shape, gpu, premises, rows, context)
    n = {r: new_tokens * s.steps_per_row_token for r, s in steps.items()}
    if layout == "shared":
        t = sum(n[r] * s.gpu_s for r, s in steps.items()) + max(n[r] * s.gap_s for r, s in steps.items())
    elif layout == "dedicated":
        t = max(n[r] * (s.gpu_s + s.gap_s) for r, s in steps.items())
    else:
        raise ValueError(f"layout {layout!r}: shared or dedicated")
    return max(t, rows * new_tokens * premises.cpu.frontend_per_token)


def solo_step(shape, gpu: GPU, premises: Premises, rows: float, context: float) -> float:
    """Seconds of one solo step with `rows` rows on one GPU: stock vLLM's asynchronous scheduling overlaps the
    scheduler's CPU with the GPU's work, so the step is the longer of the two (no gap exposed)."""
    e = premises.solo
    r = e.rows_per_step(rows)
    return max(roofline(shape, gpu, r * context, e.per_step(rows, e.computed_per_token)),
               r * premises.cpu.sched_per_row_solo)


def solo_seconds(shape, gpu: GPU, premises: Premises, rows: float, new_tokens: int, context: float) -> float:
    """Seconds of one solo rollout of `rows` rows x `new_tokens` on one GPU."""
    return new_tokens * premises.solo.steps_per_row_token * solo_step(shape, gpu, premises, rows, context)


def predicted_ratio(shape, gpu: GPU, premises: Premises, layout: str, rows: int, new_tokens: int,
                    prompt_tokens: float) -> dict:
    """Tandem/solo for `rows` rows, all resident, of `prompt_tokens` + `new_tokens` in `layout` (solo: on the
    shared GPU; data parallel 2 over the dedicated layout's two GPUs), with both times in seconds."""
    ctx = mean_context(prompt_tokens, new_tokens)
    t = tandem_seconds(shape, gpu, premises, layout, rows, new_tokens, ctx)
    s = solo_seconds(shape, gpu, premises, solo_rows_per_gpu(layout, rows), new_tokens, ctx)
    return {"layout": layout, "gpu": gpu.name, "rows": rows, "new_tokens": new_tokens, "tandem_s": t, "solo_s": s,
            "predicted_tandem_over_solo": s / t}
