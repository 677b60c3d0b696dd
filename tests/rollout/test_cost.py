"""The GPU cost model (`tandem/rollout/cost.py`) on tiny hand-made premises: premises read off a rollout's counters,
one engine's step priced as the roofline by hand, both engines on one GPU against one GPU per model, solo as stock
vLLM runs it (asynchronous scheduling: its CPU overlapped, never added), the frontend floor, and the committed
premises file (no vLLM needed)."""

from __future__ import annotations

import json

import pytest

from tandem.rollout import cost
from tandem.rollout.cost import GPU, CpuPremises, EnginePremises, Premises


class Shape:
    n_params = 1e9  # 2e9 bytes of bf16 weights

    def kv_bytes_per_token(self, nbytes: int) -> float:
        return 1000.0 * nbytes


G = GPU("test", bandwidth=1e12, flops=1e15, launch_gap=1e-3)
CPU = CpuPremises(sched_per_row_tandem=30e-6, sched_per_row_solo=20e-6, per_chunk=10e-6, frontend_per_token=0.0)


def _premises(senior=(1.2, 0.5, 1.0, 0.13), junior=(1.7, 0.5, 1.0, 0.13), solo=(1.0, 1.0, 1.0, 0.0), cpu=CPU):
    return Premises(EnginePremises(*senior), EnginePremises(*junior), EnginePremises(*solo), cpu)


def test_premises_are_the_counters_per_generated_token():
    """steps x rows / tokens, scheduled rows / tokens, computed / tokens, chunks / tokens, per engine; the
    frontend's CPU per token from the tandem rollout; the scheduler's CPU as given (measured in isolation)."""
    t = {"kept": 3200, "rows": 32, "frontend_cpu_seconds": 0.08,
         "engines": {"senior": {"steps": 120, "scheduled_rows_sum": 1600, "computed_tokens": 3300, "chunks": 420},
                     "junior": {"steps": 170, "scheduled_rows_sum": 1600, "computed_tokens": 3200, "chunks": 410}}}
    s = {"kept": 3200, "rows": 32, "engines": {"senior": {"steps": 100, "scheduled_rows_sum": 3200,
                                                          "computed_tokens": 3232, "chunks": 32}}}
    p = cost.premises_from_stats(t, s, CPU, {"what": "hand-made"})
    assert p.senior == EnginePremises(1.2, 0.5, 3300 / 3200, 420 / 3200)
    assert p.junior.steps_per_row_token == pytest.approx(1.7) and p.solo.steps_per_row_token == 1.0
    assert p.cpu.frontend_per_token == pytest.approx(25e-6) and p.cpu.sched_per_row_tandem == 30e-6
    assert Premises.from_json(json.loads(json.dumps(p.to_json()))) == p
    with pytest.raises(ValueError, match="premises"):
        Premises.from_json({"engines": {"senior": {}}})
    with pytest.raises(ValueError, match="positive"):
        EnginePremises(0.0, 1.0, 1.0)


def test_a_tandem_step_is_the_roofline_plus_the_exposed_gap_by_hand():
    p = _premises()
    rows, ctx = 64, 600.0
    st = cost.tandem_steps(Shape(), G, p, rows, ctx)
    r = 64 * 0.5 / 1.2  # rows in one senior step
    W, K = 2e9 / 1e12, r * ctx * 2000 / 1e12
    C = 2e9 * (64 * 1.0 / 1.2) / 1e15
    assert st["senior"].rows == pytest.approx(r) and st["senior"].gpu_s == pytest.approx(max(W + K, C))
    assert st["senior"].gap_s == pytest.approx(1e-3 + r * 30e-6 + 64 * 0.13 / 1.2 * 10e-6)
    s, j = st["senior"], st["junior"]
    n_s, n_j = 1000 * 1.2, 1000 * 1.7
    # one GPU: both engines' kernels add, the longer total gap is exposed (the other's hides behind kernels)
    assert cost.tandem_seconds(Shape(), G, p, "shared", rows, 1000, ctx) == pytest.approx(
        n_s * s.gpu_s + n_j * j.gpu_s + max(n_s * s.gap_s, n_j * j.gap_s))
    # one GPU per model: the slower engine
    assert cost.tandem_seconds(Shape(), G, p, "dedicated", rows, 1000, ctx) == pytest.approx(
        max(n_s * (s.gpu_s + s.gap_s), n_j * (j.gpu_s + j.gap_s)))
    with pytest.raises(ValueError, match="layout"):
        cost.tandem_seconds(Shape(), G, p, "both", rows, 1000, ctx)


def test_solo_is_stock_vllm_with_asynchronous_scheduling():
    """Solo's scheduler CPU overlaps the GPU's step (the longer of the two), never added to it: a solo priced with
    its CPU exposed would be slower and flatter tandem."""
    p = _premises()
    rows, ctx = 8, 100.0
    gpu = 2e9 / 1e12 + rows * ctx * 2000 / 1e12
    assert cost.solo_step(Shape(), G, p, rows, ctx) == pytest.approx(gpu)
    assert cost.solo_seconds(Shape(), G, p, rows, 500, ctx) == pytest.approx(500 * gpu)
    fast = GPU("fast", bandwidth=1e16, flops=1e18, launch_gap=1e-3)
    assert cost.solo_step(Shape(), fast, p, 1000, 1.0) == pytest.approx(1000 * 20e-6)
    # data parallel 2 over the dedicated layout's GPUs: half the rows on each
    d = cost.predicted_ratio(Shape(), G, p, "dedicated", 64, 1000, 100)
    assert d["solo_s"] == pytest.approx(cost.solo_seconds(Shape(), G, p, 32, 1000, 600.0))


def test_the_frontend_floors_the_tandem_time():
    slow = _premises(cpu=CpuPremises(30e-6, 20e-6, 10e-6, frontend_per_token=1.0))
    assert cost.tandem_seconds(Shape(), G, slow, "dedicated", 4, 10, 5.0) == pytest.approx(40.0)


def test_two_engines_doing_solos_work_on_one_gpu_price_the_second_weight_read():
    """Each tandem engine with solo's steps and half its rows: on one GPU the weights are read twice per step pair."""
    half = (1.0, 0.5, 0.5, 0.0)
    p = _premises(half, half, cpu=CpuPremises(0.0, 0.0, 0.0, 0.0))
    g = GPU("nogap", bandwidth=1e12, flops=1e15, launch_gap=0.0)
    r = cost.predicted_ratio(Shape(), g, p, "shared", 16, 100, 0)
    W, K = 2e9 / 1e12, 16 * 50 * 2000 / 1e12
    assert r["predicted_tandem_over_solo"] == pytest.approx((W + K) / (2 * W + K))


def test_the_committed_premises_file_reads_and_says_what_was_measured():
    p = cost.load_premises()
    assert cost.PREMISES_FILE.name == "premises.json"
    assert p.solo.steps_per_row_token == pytest.approx(1.0, abs=0.05)  # solo: every row in every step
    assert p.senior.steps_per_row_token >= 1.0 and p.junior.steps_per_row_token >= 1.0
    assert {"what", "on", "rows", "new_tokens", "cpu_source", "rerun", "commit"} <= set(p.measured)
