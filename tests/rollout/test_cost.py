"""The GPU cost model (`tandem/rollout/cost.py`) on tiny hand-made counts: one engine's step priced as the
roofline by hand, the one-GPU ratio of two engines that each do solo's work, the frontend floor, and the
scheduler CPU scaled with the rows (`cpu_per_row`) against taken as measured (no vLLM needed)."""

from __future__ import annotations

import pytest

from tandem.rollout.cost import GPU, GPUS, engine_time, predict


class Shape:
    n_params = 1e9

    def kv_bytes_per_token(self, nbytes: int) -> float:
        return 1000.0 * nbytes


G = GPU("test", bandwidth=1e12, flops=1e15, launch_gap=1e-3)
COUNTS = {"steps": 10.0, "context_tokens": 1000.0, "computed_tokens": 20.0, "sched_cpu_seconds": 0.02}


def _stats(engines: dict, rows: int = 32, kept: float = 320.0, frontend: float = 0.0) -> dict:
    return {"engines": engines, "rows": rows, "kept": kept, "frontend_cpu_seconds": frontend}


@pytest.mark.parametrize("per_row", [False, True])
def test_engine_time_is_the_roofline_by_hand(per_row):
    scale = 2.0
    W = 1e9 * 2 / 1e12
    K = (1000 * scale / 10) * 2000 / 1e12
    C = 2 * 1e9 * (20 * scale / 10) / 1e15
    gap = 1e-3 + 0.02 / 10 * (scale if per_row else 1.0)
    a, f = engine_time(COUNTS, Shape(), G, scale, cpu_per_row=per_row)
    assert a == pytest.approx(10 * max(W + K, C)) and f == pytest.approx(10 * gap)
    assert engine_time({"steps": 0}, Shape(), G, scale) == (0.0, 0.0)


def test_two_engines_doing_solos_work_on_one_gpu():
    # each tandem engine has solo's steps and counts: the GPU work adds, one per-step gap hides behind the other
    a, f = engine_time(COUNTS, Shape(), GPUS["h200"], 1.0)
    p = predict(_stats({"senior": COUNTS, "junior": COUNTS}), _stats({"senior": COUNTS}), Shape(), rows=32)
    assert p["predicted_gpu_tandem_over_solo"] == pytest.approx((a + f) / (2 * a + f))
    assert not p["frontend_bound"]


def test_the_frontend_floors_the_tandem_time():
    slow = _stats({"senior": COUNTS, "junior": COUNTS}, frontend=100.0)
    p = predict(slow, _stats({"senior": COUNTS}), Shape(), rows=32)
    assert p["frontend_bound"] and p["tandem_one_gpu_s"] == pytest.approx(100.0)


def test_cpu_per_row_scales_the_scheduler_gap_with_the_rows():
    t, s = _stats({"senior": COUNTS, "junior": COUNTS}), _stats({"senior": COUNTS})
    measured = predict(t, s, Shape(), rows=128)["gap_ms_per_step"]
    scaled = predict(t, s, Shape(), rows=128, cpu_per_row=True)["gap_ms_per_step"]
    launch = GPUS["h200"].launch_gap * 1e3
    assert measured == pytest.approx(launch + 2.0) and scaled == pytest.approx(launch + 2.0 * 4)
    # at the measured rows the two agree
    assert predict(t, s, Shape(), rows=32)["predicted_gpu_tandem_over_solo"] == pytest.approx(
        predict(t, s, Shape(), rows=32, cpu_per_row=True)["predicted_gpu_tandem_over_solo"])
