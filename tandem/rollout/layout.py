"""The rollout layout's price: rows per engine, resident rows, admission waves and the predicted tandem/solo on a
GPU, computed from the params before anything runs (`tandem plan`'s rollout section).

Pure arithmetic (no torch, no vLLM) over the cost model of `tandem/rollout/cost.py`: its measured premises
(`cost.PREMISES_FILE`: engine steps, scheduled rows, computed tokens and chunks per generated token of each engine,
the CPU per row, chunk and token) priced on its GPU table and roofline. This module adds what the params decide:

Layouts (`rollout.vllm_layout`):
- `shared`: each training process starts a service whose two engines share its GPU (`rollout.vllm_gpu_memory`
  of it each). Solo: one stock engine on the same GPU with the memory of both (twice the share).
- `dedicated`: a rollout service on GPUs of its own, one GPU per model (`rollout.vllm_gpu_memory` of each).
  Solo: stock vLLM with data parallelism 2 on the same two GPUs (half the rows each).

Per engine, KV per row at full length = (prompt + max new tokens) x KV bytes per token (bf16); resident rows =
(GPU memory x share - bf16 weights - runtime) / KV per row. Rows beyond the resident ones wait for admission:
with rows of one length they run in waves, one after the other (the waiting counted as idle time; tandem's
parked sessions keep their KV, so a tandem engine admits only what it can hold to the end). Each wave is priced
by `cost.tandem_seconds` / `cost.solo_seconds` at a mean context of prompt + L/2.

Assumed: every row runs to its max new tokens (the replay benchmark's mode; RL rows that end at EOS earlier are
not modelled), prompts at their budget (`train.max_prompt_tokens`), the premises' counts per token holding at any
row count and length, and the measuring machine's CPU speed for the per-row CPU (a faster host lowers the tandem
gap).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tandem.rollout.cost import (GPU, ROLES, Premises, load_premises, mean_context, solo_rows_per_gpu, solo_seconds,
                                 solo_step, tandem_seconds, tandem_steps, weights_seconds)
from tandem.rollout.placement import LAYOUTS  # declared once, where the layouts are placed


def resident_rows(room_bytes: float, kv_row_bytes: float) -> int:
    """Rows whose KV at full length fits in `room_bytes` (an engine's share less its weights and runtime)."""
    return max(int(room_bytes // kv_row_bytes), 0) if kv_row_bytes > 0 else 0


def waves(rows: int, resident: int) -> list[int]:
    """The rows of each admission wave: full waves of `resident` rows, then the rest ([] when nothing fits)."""
    if resident <= 0:
        return []
    full, rest = divmod(rows, resident)
    return [resident] * full + ([rest] if rest else [])


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


def price_layout(shape, gpu: GPU, spec: RolloutLayout, premises: Premises | None = None) -> LayoutPrice:
    """The layout's rows, residency and predicted tandem/solo (module docstring), priced with `premises`
    (default: the committed file, `cost.PREMISES_FILE`)."""
    prem = premises if premises is not None else load_premises()
    layout, rows, prompt_tokens, new_tokens = spec.layout, spec.rows, spec.prompt_tokens, spec.new_tokens
    share, gpu_bytes, runtime_bytes = spec.share, spec.gpu_bytes, spec.runtime_bytes
    kv_row = (prompt_tokens + new_tokens) * shape.kv_bytes_per_token(2)
    fixed = shape.n_params * 2 + runtime_bytes
    room = share * gpu_bytes - fixed
    resident = resident_rows(room, kv_row)
    tw = waves(rows, resident)
    # solo: one engine with both shares on the shared GPU; data parallelism 2 over the two dedicated GPUs
    solo_rows = solo_rows_per_gpu(layout, rows)
    solo_room = 2 * share * gpu_bytes - fixed if layout == "shared" else room
    solo_res = resident_rows(solo_room, kv_row)
    sw = waves(solo_rows, solo_res)
    ctx = mean_context(prompt_tokens, new_tokens)
    notes = []
    t_t = t_s = ratio = None
    terms: dict[str, float] = {}
    if tw and sw:
        st = tandem_steps(shape, gpu, prem, tw[0], ctx)
        terms = {"weights": weights_seconds(shape, gpu) * 1e3,
                 "tandem_gpu_senior": st["senior"].gpu_s * 1e3, "tandem_gpu_junior": st["junior"].gpu_s * 1e3,
                 "tandem_gap_senior": st["senior"].gap_s * 1e3, "tandem_gap_junior": st["junior"].gap_s * 1e3,
                 "solo": solo_step(shape, gpu, prem, sw[0], ctx) * 1e3}
        terms = {k: round(v, 3) for k, v in terms.items()}
        t_t = sum(tandem_seconds(shape, gpu, prem, layout, n, new_tokens, ctx) for n in tw)
        t_s = sum(solo_seconds(shape, gpu, prem, n, new_tokens, ctx) for n in sw)
        ratio = t_s / t_t
        if len(tw) > 1:
            notes.append(f"{resident} of {rows} rows resident per engine: {len(tw)} admission waves (the rest "
                         f"wait, counted as idle)")
    else:
        notes.append("no row fits an engine at full length: no prediction")
    measured_p = prem.measured.get("p_senior")
    if measured_p is not None and abs(measured_p - spec.p_senior) > 0.05:
        notes.append(f"the premises were measured at a senior share of {measured_p}, this run's is "
                     f"{spec.p_senior}: the engines' counts are priced as measured")
    steps = {r: round(prem.engine(r).steps_per_row_token, 3) for r in ROLES}
    computed = {"tandem": round(prem.senior.computed_per_token + prem.junior.computed_per_token, 3),
                "solo": round(prem.solo.computed_per_token, 3)}
    return LayoutPrice(layout, gpu.name, rows, kv_row, room, resident, tw, solo_rows, solo_res, sw, ctx,
                       steps, computed, t_t, t_s, ratio, terms, notes)
