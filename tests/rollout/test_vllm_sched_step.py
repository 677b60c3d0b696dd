"""The scheduler step in isolation (`benchmarks/sched_step.py`), run as `tandem bench rollout --vocab
qwen3` runs it (`vllm_rollout._isolated`: vLLM's environment, a subprocess): two real `TandemScheduler`s stepped as a
tandem rollout's engine cores. Every chunk the stop rule ends must be where the frontend's schedule switches
authors and every row must end at its budget (the harness raises otherwise), the four cases (two vocabulary
sizes x two history lengths) must run the same schedule token by token, paused sessions must wait outside
vLLM's waiting queue, the solo reference must decode every row to the budget, and the figures must be there and finite. Impossible settings are refused before vLLM is imported."""

from __future__ import annotations

import math

import pytest

from cli.main import load_benchmark
from tandem.rollout.vllm.client import LaunchOptions
from vllm_fixtures import need_vllm

stepbench = load_benchmark("sched_step")
_isolated = load_benchmark("vllm_rollout")._isolated


def test_isolated_step_runs_one_schedule_in_every_case():
    need_vllm()
    res: dict = {}
    _isolated(res, LaunchOptions(), rows=6, tokens=120, long_history=400)
    out = res["isolated_step"]
    assert res["isolated_schedules_equal"] is True and out["history"] == [16, 400]
    assert 0.3 < out["senior_share"] < 0.7 and 0.1 < out["chunks_per_token"] < 0.5
    # paused sessions wait outside vLLM's waiting queue (sched.TandemScheduler's parking), and there were some
    assert out["parked_max"] > 0 and out["parked_in_waiting_queue_max"] == 0
    for role in ("senior", "junior"):
        for key in (f"isolated_sched_cpu_long_over_short_{role}", f"isolated_sched_cpu_qwen3_over_small_vocab_{role}",
                    f"isolated_sched_cpu_per_row_tandem_over_solo_{role}"):
            assert math.isfinite(res[key]) and res[key] > 0
        for vocab in ("qwen3", "small"):
            for hist in ("short", "long"):
                assert out[f"{vocab}_{hist}_{role}_us_per_step"] > 0
                assert out[f"{vocab}_{hist}_{role}_rows_per_step"] >= 1
    # the solo reference decoded every row of half the rows to the budget, all of them in each decode step
    for hist in ("short", "long"):
        assert out[f"solo_{hist}_rows_per_step"] == 3 and out[f"solo_{hist}_us_per_row"] > 0


@pytest.mark.parametrize("kw", [{"history": (400, 16)}, {"rows": 0}, {"tokens": 1}, {"repeats": 0}])
def test_stepbench_refuses_impossible_settings(kw):
    with pytest.raises(ValueError, match="the isolated step needs"):
        stepbench.measure(**kw)
