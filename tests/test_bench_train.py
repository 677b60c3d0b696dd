"""`tandem bench train` on a tiny base: both arms timed in one process, phase split and ratio reported."""

from __future__ import annotations

import pytest

from train_fixtures import build_base, write_prepared


@pytest.mark.slow
def test_bench_train_reports_both_arms_and_the_ratio(tmp_path):
    from cli.main import load_benchmark

    mod = load_benchmark("bench_train")
    PHASES, bench_train = mod.PHASES, mod.bench_train
    from tandem.config import params_from_dict

    build_base(tmp_path / "models" / "base")
    write_prepared(tmp_path / "data" / "prepared", n_train=16, n_val=4)
    params = params_from_dict({"out_root": str(tmp_path),
                               "rollout": {"batch_size": 8},
                               "train": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8,
                                         "kl_rows": 2, "cpu_threads": 1}})
    res = bench_train(params, steps=2)
    for arm in ("tandem", "grpo"):
        assert res[f"{arm}_step_s"] > 0
        assert res[f"{arm}_step_s"] >= sum(res[f"{arm}_{p}_s"] for p in PHASES) - 1e-6
    assert res["grpo_senior_fraction"] == 1.0 and 0.0 < res["tandem_senior_fraction"] < 1.0
    assert res["tandem_over_grpo"] == pytest.approx(res["tandem_step_s"] / res["grpo_step_s"])
    assert not list((tmp_path / "models").glob("checkpoints*"))  # benchmarks leave no checkpoints behind


def test_bench_train_needs_the_base_and_data(tmp_path):
    from cli.main import load_benchmark

    bench_train = load_benchmark("bench_train").bench_train
    from tandem.config import params_from_dict

    with pytest.raises(FileNotFoundError, match="base stage"):
        bench_train(params_from_dict({"out_root": str(tmp_path)}))
