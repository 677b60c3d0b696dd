"""The rollout layout's price (`tandem/rollout/layout.py`) on tiny hand-made shapes: resident rows from the memory
share, admission waves when rows outnumber them, one GPU per model against both engines on one GPU, and solo
priced as stock vLLM with asynchronous scheduling (its CPU overlapped, tandem's gap added)."""

from __future__ import annotations

import pytest

from tandem.rollout import layout as L
from tandem.rollout.cost import GPU, GPUS, gpu_for_memory, roofline


class Shape:
    n_params = 1e9  # 2e9 bytes of bf16 weights

    def kv_bytes_per_token(self, nbytes: int) -> float:
        return 5e5 * nbytes  # 1e6 bytes per token in bf16


G = GPU("test", bandwidth=1e12, flops=1e15, launch_gap=1e-3)


def test_resident_rows_and_waves_by_hand():
    assert L.resident_rows(2.5e9, 1e9) == 2 and L.resident_rows(-1.0, 1e9) == 0
    assert L.waves(5, 2) == [2, 2, 1] and L.waves(4, 4) == [4] and L.waves(3, 8) == [3] and L.waves(3, 0) == []
    # 0.4 x 10 GB - 2 GB of weights - 0 runtime = 2 GB of room; a row of 100 + 900 tokens holds 1 GB: 2 rows
    p = L.price_layout(Shape(), G, L.RolloutLayout("dedicated", rows=5, prompt_tokens=100, new_tokens=900,
                                                          share=0.4, gpu_bytes=10e9))
    assert p.kv_bytes_per_row == 1e9 and p.room_bytes == pytest.approx(2e9)
    assert p.resident_rows == 2 and p.waves == [2, 2, 1] and p.to_json()["admission_waves"] == 3
    assert any("3 admission waves" in n for n in p.notes)
    # solo, data parallel over the two GPUs: 3 rows on a GPU with the same 2 rows of room: waves [2, 1]
    assert p.solo_rows_per_gpu == 3 and p.solo_waves == [2, 1]
    # the waves are priced one after the other: the rows waiting count as idle time
    ctx = 100 + 900 / 2
    t = sum(L.tandem_seconds(Shape(), G, "dedicated", n, 900, ctx) for n in (2, 2, 1))
    s = sum(L.solo_seconds(Shape(), G, n, 900, ctx) for n in (2, 1))
    assert p.tandem_s == pytest.approx(t) and p.solo_s == pytest.approx(s)
    assert p.predicted_tandem_over_solo == pytest.approx(s / t)


def test_shared_gives_solo_both_shares_and_nothing_fits_means_no_prediction():
    p = L.price_layout(Shape(), G, L.RolloutLayout("shared", rows=5, prompt_tokens=100, new_tokens=900,
                                                          share=0.4, gpu_bytes=10e9))
    # tandem: 2 rows per engine (2 GB of room each); solo: one engine with both shares, 0.8 x 10 - 2 = 6 rows
    assert p.resident_rows == 2 and p.solo_rows_per_gpu == 5 and p.solo_resident_rows == 6 and p.solo_waves == [5]
    none = L.price_layout(Shape(), G, L.RolloutLayout("shared", rows=5, prompt_tokens=100, new_tokens=900,
                                                             share=0.2, gpu_bytes=10e9))
    assert none.resident_rows == 0 and none.predicted_tandem_over_solo is None and none.notes
    with pytest.raises(ValueError, match="layout"):
        L.price_layout(Shape(), G, L.RolloutLayout("two", rows=1, prompt_tokens=1, new_tokens=1,
                                                          share=0.1, gpu_bytes=1e9))


def test_one_gpu_per_model_against_both_engines_on_one_gpu_by_hand():
    rows, new, ctx = 64, 1000, 600.0
    live = 1 - L.IDLE_ROW_STEPS
    steps = new / live
    r = rows * live * 0.5  # rows in one step of either engine (p_senior 0.5)
    W = 2e9 / 1e12
    K = r * ctx * 1e6 / 1e12
    C = 2 * 1e9 * r * L.COMPUTED_PER_TOKEN / 1e15
    gpu = max(W + K, C)
    gap = 1e-3 + r * L.SCHED_CPU_PER_ROW_TANDEM + r * L.CHUNKS_PER_TOKEN * L.CHUNK_ADD_CPU
    # one GPU: the two engines' kernels add, one gap per step pair (the other's hides behind the kernels)
    assert L.tandem_seconds(Shape(), G, "shared", rows, new, ctx) == pytest.approx(steps * (2 * gpu + gap))
    # one GPU per model: each engine on its own GPU, the step with its gap
    assert L.tandem_seconds(Shape(), G, "dedicated", rows, new, ctx) == pytest.approx(steps * (gpu + gap))
    # an uneven authorship share: the busier engine sets the pace
    g80, f80 = L.tandem_step(Shape(), G, rows, ctx, p_senior=0.8)
    assert g80[0] > g80[1] and L.tandem_seconds(Shape(), G, "dedicated", rows, new, ctx, 0.8) == pytest.approx(
        steps * (g80[0] + f80[0]))
    assert L.tandem_step(Shape(), G, rows, ctx)[0][0] == pytest.approx(roofline(Shape(), G, r * ctx, r * L.COMPUTED_PER_TOKEN))


def test_solo_is_stock_vllm_with_asynchronous_scheduling():
    # GPU-bound: the step is the roofline, no launch gap or scheduler CPU added
    rows, ctx = 8, 100.0
    gpu = 2e9 / 1e12 + rows * ctx * 1e6 / 1e12
    assert L.solo_step(Shape(), G, rows, ctx) == pytest.approx(gpu)
    assert L.solo_seconds(Shape(), G, rows, 500, ctx) == pytest.approx(500 * gpu)
    # CPU-bound (a fast GPU): the scheduler's CPU sets the step, overlapped rather than added
    fast = GPU("fast", bandwidth=1e16, flops=1e18, launch_gap=1e-3)
    assert L.solo_step(Shape(), fast, 1000, 1.0) == pytest.approx(1000 * L.SCHED_CPU_PER_ROW_SOLO)
    # tandem's gap is exposed (synchronous scheduling) and the frontend's CPU floors its time
    floor = 1000 * 500 * L.FRONTEND_CPU_PER_TOKEN
    assert L.tandem_seconds(Shape(), fast, "dedicated", 1000, 500, 1.0) >= floor
    assert L.tandem_seconds(Shape(), fast, "dedicated", 1, 500, 1.0) == pytest.approx(
        500 / (1 - L.IDLE_ROW_STEPS) * (roofline(Shape(), fast, 0.435 * 1.0, 0.435 * L.COMPUTED_PER_TOKEN)
                                        + 1e-3 + 0.435 * (L.SCHED_CPU_PER_ROW_TANDEM
                                                          + L.CHUNKS_PER_TOKEN * L.CHUNK_ADD_CPU)))


def test_steps_per_token_and_the_gpu_table():
    p = L.price_layout(Shape(), G, L.RolloutLayout("dedicated", rows=4, prompt_tokens=10, new_tokens=90,
                                                          share=0.9, gpu_bytes=100e9))
    assert p.engine_steps_per_token == {"tandem": round(1 / (1 - L.IDLE_ROW_STEPS), 3), "solo": 1.0}
    assert p.computed_per_token["tandem"] == L.COMPUTED_PER_TOKEN and set(p.step_ms) >= {"weights", "solo"}
    assert gpu_for_memory(80) == "h100" and gpu_for_memory(139.8) == "h200" and gpu_for_memory(141) == "h200"
    assert all(g.memory_gib > 0 for g in GPUS.values())
