"""The rollout layout's price (`tandem/rollout/layout.py`) on tiny hand-made shapes: resident rows from the memory
share, admission waves when rows outnumber them, each wave priced by the cost model (`tandem/rollout/cost.py`)
with the given premises, solo with both shares on a shared GPU and data parallel over the dedicated layout's two."""

from __future__ import annotations

import pytest

from tandem.rollout import cost
from tandem.rollout import layout as L
from tandem.rollout.cost import GPU, GPUS, CpuPremises, EnginePremises, Premises, gpu_for_memory


class Shape:
    n_params = 1e9  # 2e9 bytes of bf16 weights

    def kv_bytes_per_token(self, nbytes: int) -> float:
        return 5e5 * nbytes  # 1e6 bytes per token in bf16


G = GPU("test", bandwidth=1e12, flops=1e15, launch_gap=1e-3)
P = Premises(EnginePremises(1.2, 0.5, 1.0, 0.13), EnginePremises(1.7, 0.5, 1.0, 0.13), EnginePremises(1.0, 1.0, 1.0),
             CpuPremises(30e-6, 20e-6, 10e-6, 25e-6), {"p_senior": 0.5})


def test_resident_rows_and_waves_by_hand():
    assert L.resident_rows(2.5e9, 1e9) == 2 and L.resident_rows(-1.0, 1e9) == 0
    assert L.waves(5, 2) == [2, 2, 1] and L.waves(4, 4) == [4] and L.waves(3, 8) == [3] and L.waves(3, 0) == []
    # 0.4 x 10 GB - 2 GB of weights - 0 runtime = 2 GB of room; a row of 100 + 900 tokens holds 1 GB: 2 rows
    p = L.price_layout(Shape(), G, L.RolloutLayout("dedicated", rows=5, prompt_tokens=100, new_tokens=900,
                                                   share=0.4, gpu_bytes=10e9), P)
    assert p.kv_bytes_per_row == 1e9 and p.room_bytes == pytest.approx(2e9)
    assert p.resident_rows == 2 and p.waves == [2, 2, 1] and p.to_json()["admission_waves"] == 3
    assert any("3 admission waves" in n for n in p.notes)
    # solo, data parallel over the two GPUs: 3 rows on a GPU with the same 2 rows of room: waves [2, 1]
    assert p.solo_rows_per_gpu == 3 and p.solo_waves == [2, 1]
    # the waves are priced one after the other by the cost model: the rows waiting count as idle time
    ctx = 100 + 900 / 2
    t = sum(cost.tandem_seconds(Shape(), G, P, "dedicated", n, 900, ctx) for n in (2, 2, 1))
    s = sum(cost.solo_seconds(Shape(), G, P, n, 900, ctx) for n in (2, 1))
    assert p.tandem_s == pytest.approx(t) and p.solo_s == pytest.approx(s)
    assert p.predicted_tandem_over_solo == pytest.approx(s / t)


def test_one_wave_is_the_cost_models_predicted_ratio():
    """All rows resident: the layout's price is `cost.predicted_ratio` (what the benchmark and the GPU check print)."""
    for layout in ("shared", "dedicated"):
        p = L.price_layout(Shape(), G, L.RolloutLayout(layout, rows=16, prompt_tokens=50, new_tokens=200,
                                                       share=0.45, gpu_bytes=100e9), P)
        r = cost.predicted_ratio(Shape(), G, P, layout, 16, 200, 50)
        assert p.waves == [16] and p.predicted_tandem_over_solo == pytest.approx(r["predicted_tandem_over_solo"])
        assert p.tandem_s == pytest.approx(r["tandem_s"]) and p.solo_s == pytest.approx(r["solo_s"])


def test_shared_gives_solo_both_shares_and_nothing_fits_means_no_prediction():
    p = L.price_layout(Shape(), G, L.RolloutLayout("shared", rows=5, prompt_tokens=100, new_tokens=900,
                                                   share=0.4, gpu_bytes=10e9), P)
    # tandem: 2 rows per engine (2 GB of room each); solo: one engine with both shares, 0.8 x 10 - 2 = 6 rows
    assert p.resident_rows == 2 and p.solo_rows_per_gpu == 5 and p.solo_resident_rows == 6 and p.solo_waves == [5]
    none = L.price_layout(Shape(), G, L.RolloutLayout("shared", rows=5, prompt_tokens=100, new_tokens=900,
                                                      share=0.2, gpu_bytes=10e9), P)
    assert none.resident_rows == 0 and none.predicted_tandem_over_solo is None and none.notes
    with pytest.raises(ValueError, match="layout"):
        L.price_layout(Shape(), G, L.RolloutLayout("two", rows=1, prompt_tokens=1, new_tokens=1,
                                                   share=0.1, gpu_bytes=1e9), P)


def test_the_premises_are_reported_and_a_different_senior_share_noted():
    spec = L.RolloutLayout("dedicated", rows=4, prompt_tokens=10, new_tokens=90, share=0.9, gpu_bytes=100e9)
    p = L.price_layout(Shape(), G, spec, P)
    assert p.engine_steps_per_token == {"senior": 1.2, "junior": 1.7, "solo": 1.0}
    assert p.computed_per_token == {"tandem": 2.0, "solo": 1.0} and set(p.step_ms) >= {"weights", "solo"}
    assert not p.notes
    other = L.price_layout(Shape(), G, L.RolloutLayout("dedicated", 4, 10, 90, 0.9, 100e9, p_senior=0.8), P)
    assert any("senior share of 0.5" in n for n in other.notes)
    assert gpu_for_memory(80) == "h100" and gpu_for_memory(139.8) == "h200" and gpu_for_memory(141) == "h200"
    assert all(g.memory_gib > 0 for g in GPUS.values())
