"""The rollout layout's price: rows per engine, resident rows, admission waves and the predicted tandem/solo on a
GPU, computed from the params before anything runs (`tandem plan`'s rollout section).

`tandem/rollout/cost.py` prices the counters of a rollout that ran; this module prices a layout from the
design's counts per generated token, as measured on CPU with Qwen3's vocabulary (the constants below, each with
where it was measured), with the same GPU table and roofline (`cost.GPUS`, `cost.roofline`). Pure arithmetic:
no torch, no vLLM.

Layouts (`rollout.vllm_layout`):
- `shared`: each training process starts a service whose two engines share its GPU (`rollout.vllm_gpu_memory`
  of it each). Tandem on one GPU: the two engines' kernels add, one engine's per-step gap hides behind the
  other's kernels. Solo: one stock engine on the same GPU with the memory of both (twice the share).
- `dedicated`: a rollout service on GPUs of its own, one GPU per model (`rollout.vllm_gpu_memory` of each).
  Tandem: the slower engine sets the time. Solo: stock vLLM with data parallelism 2 on the same two GPUs (half
  the rows each).

Per engine, KV per row at full length = (prompt + max new tokens) x KV bytes per token (bf16); resident rows =
(GPU memory x share - bf16 weights - runtime) / KV per row. Rows beyond the resident ones wait for admission:
with rows of one length they run in waves, one after the other (the waiting counted as idle time; tandem's
parked sessions keep their KV, so a tandem engine admits only what it can hold to the end). The price of a
wave of `n` rows, `L` new tokens each, at a mean context `c` = prompt + L/2:

- tandem (both engines hold every row's session; a row is in one engine's batch at a time, idle during
  handoffs): each engine runs S = L / (1 - IDLE_ROW_STEPS) steps (engine steps per generated token of a row:
  1 / (1 - idle), 1.15; solo's 1), with n (1 - idle) p rows in its steps (p: the engine's authorship share,
  `rollout.p_senior`), computing COMPUTED_PER_TOKEN tokens per row-step. Step = roofline + gap, the gap
  exposed (the tandem scheduler runs vLLM's synchronous scheduling): the GPU's launch gap plus the
  scheduler's CPU per scheduled row and per chunk added. Floored by the frontend's CPU per generated token.
- solo (stock vLLM, asynchronous scheduling: its scheduler's CPU overlaps the GPU's step, no gap exposed):
  L steps of n rows, each max(roofline, the scheduler's CPU of n rows).

The ratio is tandem tokens per second over solo's on the same GPUs: T_solo / T_tandem for the same rows and
tokens. Assumed: every row runs to its max new tokens (the replay benchmark's mode; RL rows that end at EOS
earlier are not modelled), prompts at their budget (`train.max_prompt_tokens`), the measuring machine's CPU
speed for the per-row CPU (a faster host lowers the tandem gap), the counts of 32 rows x 3,000 tokens holding
at any row count.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from tandem.rollout.cost import GPU, roofline
from tandem.rollout.placement import LAYOUTS  # declared once, where the layouts are placed

# The design's counts per generated token: docs/results.md ("The vLLM rollout service"), Qwen3's vocabulary,
# 32 rows x 3,000 tokens of replayed text on vLLM's CPU build 0.32.0
IDLE_ROW_STEPS = 0.13        # share of a row's life in no engine's batch (handoffs), measured by the engines
COMPUTED_PER_TOKEN = 2.010   # tokens run through a model per generated token, both engines (catch-up included)
CHUNKS_PER_TOKEN = 0.262     # session chunks (authorship turns) added per generated token, both engines
FRONTEND_CPU_PER_TOKEN = 41e-6  # the service's frontend CPU per generated token (chunk returns)
# The scheduler's CPU per step, isolated (benchmarks/sched_step.py; docs/vllm-measurements.md, "The
# scheduler's CPU at 128 rows"): tandem 27-29 us per scheduled row, solo 19-20 us, plus 11-13 us per chunk added
SCHED_CPU_PER_ROW_TANDEM = 28e-6
SCHED_CPU_PER_ROW_SOLO = 19.5e-6
CHUNK_ADD_CPU = 12e-6


def resident_rows(room_bytes: float, kv_row_bytes: float) -> int:
    """Rows whose KV at full length fits in `room_bytes` (an engine's share less its weights and runtime)."""
    return max(int(room_bytes // kv_row_bytes), 0) if kv_row_bytes > 0 else 0


def waves(rows: int, resident: int) -> list[int]:
    """The rows of each admission wave: full waves of `resident` rows, then the rest ([] when nothing fits)."""
    if resident <= 0:
        return []
    full, rest = divmod(rows, resident)
    return [resident] * full + ([rest] if rest else [])


def tandem_step(shape, gpu: GPU, rows: float, context: float, p_senior: float = 0.5) -> tuple[list, list]:
    """([senior, junior] GPU seconds of one step, [senior, junior] exposed gap seconds) with `rows` rows live:
    n (1 - idle) p rows in a step of the engine that authors a share p of the tokens."""
    gpu_s, gaps = [], []
    for p in (p_senior, 1.0 - p_senior):
        r = rows * (1.0 - IDLE_ROW_STEPS) * p  # rows in one of this engine's steps
        gpu_s.append(roofline(shape, gpu, r * context, r * COMPUTED_PER_TOKEN))
        gaps.append(gpu.launch_gap + r * SCHED_CPU_PER_ROW_TANDEM + r * CHUNKS_PER_TOKEN * CHUNK_ADD_CPU)
    return gpu_s, gaps


def tandem_seconds(shape, gpu: GPU, layout: str, rows: float, new_tokens: int, context: float,
                   p_senior: float = 0.5) -> float:
    """Seconds of one tandem wave of `rows` rows (module docstring): both engines' steps on one GPU (`shared`) or
    the slower engine on its own GPU (`dedicated`), floored by the frontend's CPU."""
    steps = new_tokens / (1.0 - IDLE_ROW_STEPS)
    gpu_s, gaps = tandem_step(shape, gpu, rows, context, p_senior)
    if layout == "shared":
        t = steps * (sum(gpu_s) + max(gaps))
    else:
        t = steps * max(g + f for g, f in zip(gpu_s, gaps))
    return max(t, rows * new_tokens * FRONTEND_CPU_PER_TOKEN)


def solo_step(shape, gpu: GPU, rows: float, context: float) -> float:
    """Seconds of one solo step of `rows` rows on one GPU: stock vLLM's asynchronous scheduling overlaps the
    scheduler's CPU with the GPU's work, so the step is the longer of the two (no gap exposed)."""
    return max(roofline(shape, gpu, rows * context, rows), rows * SCHED_CPU_PER_ROW_SOLO)


def solo_seconds(shape, gpu: GPU, rows: float, new_tokens: int, context: float) -> float:
    """Seconds of one solo wave of `rows` rows on one GPU (L steps)."""
    return new_tokens * solo_step(shape, gpu, rows, context)


@dataclass
class LayoutPrice:
    """A rollout layout and its price (`price_layout`); the byte figures in GiB in `to_json`."""

    layout: str
    gpu: str
    rows_per_engine: int
    kv_bytes_per_row: float
    room_bytes: float          # one tandem engine's KV room: share x GPU memory - weights - runtime
    resident_rows: int
    waves: list[int]
    solo_rows_per_gpu: int
    solo_resident_rows: int
    solo_waves: list[int]
    mean_context: float
    engine_steps_per_token: dict[str, float]
    computed_per_token: dict[str, float]
    tandem_s: float | None
    solo_s: float | None
    predicted_tandem_over_solo: float | None
    step_ms: dict[str, float] = field(default_factory=dict)  # the first wave's step terms, milliseconds
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("kv_bytes_per_row", "room_bytes"):
            d[k.replace("_bytes", "_gib")] = round(d.pop(k) / 2**30, 3)
        for k in ("tandem_s", "solo_s", "predicted_tandem_over_solo", "mean_context"):
            d[k] = None if d[k] is None else round(d[k], 3)
        d["admission_waves"] = len(self.waves)
        return d


@dataclass(frozen=True)
class RolloutLayout:
    """What a layout is priced for: `layout` (LAYOUTS), `rows` one engine holds in a rollout call, the prompt and
    new tokens of a row, `share` (`rollout.vllm_gpu_memory`) of a GPU of `gpu_bytes` per engine,
    `runtime_bytes` (vLLM's activations and CUDA graphs inside the reservation) and the senior's authorship
    share `p_senior`."""

    layout: str
    rows: int
    prompt_tokens: int
    new_tokens: int
    share: float
    gpu_bytes: float
    runtime_bytes: float = 0.0
    p_senior: float = 0.5

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}: choose one of {LAYOUTS}")
        if self.rows < 1 or self.prompt_tokens < 0 or self.new_tokens < 1:
            raise ValueError(f"a layout prices >= 1 row of >= 1 new token (got rows {self.rows}, prompt "
                             f"{self.prompt_tokens}, new tokens {self.new_tokens})")
        if not 0.0 < self.share <= 1.0 or not 0.0 <= self.p_senior <= 1.0:
            raise ValueError(f"share is a GPU's memory share in (0, 1] and p_senior a probability (got "
                             f"{self.share}, {self.p_senior})")


def price_layout(shape, gpu: GPU, spec: RolloutLayout) -> LayoutPrice:
    """The layout's rows, residency and predicted tandem/solo (module docstring)."""
    layout, rows, prompt_tokens, new_tokens = spec.layout, spec.rows, spec.prompt_tokens, spec.new_tokens
    share, gpu_bytes, runtime_bytes, p_senior = spec.share, spec.gpu_bytes, spec.runtime_bytes, spec.p_senior
    kv_row = (prompt_tokens + new_tokens) * shape.kv_bytes_per_token(2)
    fixed = shape.n_params * 2 + runtime_bytes
    room = share * gpu_bytes - fixed
    resident = resident_rows(room, kv_row)
    tw = waves(rows, resident)
    # solo: one engine with both shares on the shared GPU; data parallelism 2 over the two dedicated GPUs
    if layout == "shared":
        solo_rows, solo_room = rows, 2 * share * gpu_bytes - fixed
    else:
        solo_rows, solo_room = math.ceil(rows / 2), room
    solo_res = resident_rows(solo_room, kv_row)
    sw = waves(solo_rows, solo_res)
    ctx = prompt_tokens + new_tokens / 2
    notes = []
    t_t = t_s = ratio = None
    terms: dict[str, float] = {}
    if tw and sw:
        g, f = tandem_step(shape, gpu, tw[0], ctx, p_senior)
        terms = {"weights": shape.n_params * 2 / gpu.bandwidth * 1e3, "tandem_gpu_senior": g[0] * 1e3,
                 "tandem_gpu_junior": g[1] * 1e3, "tandem_gap_senior": f[0] * 1e3, "tandem_gap_junior": f[1] * 1e3,
                 "solo": solo_step(shape, gpu, sw[0], ctx) * 1e3}
        terms = {k: round(v, 3) for k, v in terms.items()}
        t_t = sum(tandem_seconds(shape, gpu, layout, n, new_tokens, ctx, p_senior) for n in tw)
        t_s = sum(solo_seconds(shape, gpu, n, new_tokens, ctx) for n in sw)
        ratio = t_s / t_t
        if len(tw) > 1:
            notes.append(f"{resident} of {rows} rows resident per engine: {len(tw)} admission waves (the rest "
                         f"wait, counted as idle)")
    else:
        notes.append("no row fits an engine at full length: no prediction")
    live = 1.0 - IDLE_ROW_STEPS
    return LayoutPrice(layout, gpu.name, rows, kv_row, room, resident, tw, solo_rows, solo_res, sw, ctx,
                       {"tandem": round(1.0 / live, 3), "solo": 1.0},
                       {"tandem": COMPUTED_PER_TOKEN, "solo": 1.0}, t_t, t_s, ratio, terms, notes)
