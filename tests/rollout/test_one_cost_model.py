"""One cost model for the plan, the rollout benchmark and the vLLM GPU check (`tandem/rollout/cost.py`), no vLLM
needed: a benchmark run whose counters are the committed premises file's (`tandem/rollout/premises.json`) derives
those premises back and writes them unchanged; from that file `tandem plan`'s rollout price, the benchmark's
`predicted_gpu_tandem_over_solo` (`_two_gpus`) and the GPU check's `predicted` agree for the same layout, rows,
tokens and GPU."""

from __future__ import annotations

import pytest
import yaml

from cli.main import load_benchmark
from tandem.config import params_from_dict
from tandem.plan import KNOWN_SHAPES, ModelShape, plan_rollout
from tandem.rollout import cost

vb = load_benchmark("vllm_rollout")
vg = load_benchmark("vllm_gpu")
H200 = 143771 * 2**20  # nvidia-smi's memory.total of an H200, MiB
ROWS, TOKENS, PROMPT = 128, 3000, 256


def _stats_of(p: cost.Premises, rows: int = 32, new: int = 1000) -> dict:
    """The service stats of a tandem and a solo rollout whose counters give premises `p` (the inverse of
    `cost.premises_from_stats`)."""
    kept = rows * new

    def counts(e: cost.EnginePremises) -> dict:
        return {"steps": e.steps_per_row_token * kept / rows, "scheduled_rows_sum": e.rows_per_token * kept,
                "computed_tokens": e.computed_per_token * kept, "chunks": e.chunks_per_token * kept}

    tandem = {"kept": kept, "rows": rows, "frontend_cpu_seconds": p.cpu.frontend_per_token * kept,
              "engines": {"senior": counts(p.senior), "junior": counts(p.junior)}}
    solo = {"kept": kept, "rows": rows, "engines": {"senior": counts(p.solo)}}
    return {"tandem": tandem, "solo": solo}


def _bench_res(p: cost.Premises) -> dict:
    return {"service_stats": _stats_of(p), "rows": 32, "max_new_tokens": TOKENS, "model": "replayed text",
            "vocab": "qwen3", "p_senior": 0.5, "senior_fraction": 0.5, "prompt_tokens_mean": PROMPT,
            "vllm_version": "0.32.0"}


def _params(layout: str):
    """params.paper-dedicated.yaml with a step's 128 rows in one call of one engine pair, every row resident on
    an H200 (256-token prompts): `layout` shared (one training process, 0.49 of the GPU per engine) or
    dedicated (0.9 of each engine's GPU)."""
    raw = yaml.safe_load(open("params.paper-dedicated.yaml").read())
    raw["train"]["max_prompt_tokens"] = PROMPT
    if layout == "shared":
        raw["train"].update(num_processes=1, sharding="none")
        raw["rollout"].update(vllm_layout="shared", vllm_gpu_memory=0.49, vllm_devices=[])
    return params_from_dict(raw)


def test_the_benchmark_writes_back_the_premises_its_counters_measured(tmp_path):
    committed = cost.load_premises()
    res = _bench_res(committed)
    vb._predict(res, vb.VLLMBenchOptions(vocab="qwen3", gpu="h200", gpu_rows=ROWS))
    again = cost.Premises.from_json(res["premises"])
    for role in cost.ROLES:
        for k, v in vars(committed.engine(role)).items():
            assert getattr(again.engine(role), k) == pytest.approx(v, rel=1e-12), (role, k)
    assert again.cpu.frontend_per_token == pytest.approx(committed.cpu.frontend_per_token)
    assert again.cpu.sched_per_row_tandem == committed.cpu.sched_per_row_tandem  # not measured here: the file's
    written = cost.write_premises(again, tmp_path / "premises.json")
    assert cost.load_premises(written) == again
    assert {"what", "on", "cpu_source", "rerun", "commit"} <= set(res["premises"]["measured"])


@pytest.mark.parametrize("layout", ["shared", "dedicated"])
def test_plan_benchmark_and_gpu_check_predict_one_ratio_per_layout(layout):
    """Acceptance: the three predicted ratios for one layout agree to 0.01 from the one premises file."""
    shape = ModelShape(**KNOWN_SHAPES["Qwen/Qwen3-4B-Instruct-2507"])
    plan = plan_rollout(_params(layout), shape)
    assert plan["layout"] == layout and plan["rows_per_engine"] == ROWS and plan["admission_waves"] == 1
    res = _bench_res(cost.load_premises())
    vb._predict(res, vb.VLLMBenchOptions(vocab="qwen3", gpu="h200", gpu_rows=ROWS))
    bench = res[vb.PREDICTED[layout]]
    figures = [plan["predicted_tandem_over_solo"], bench]
    if layout == "shared":  # the GPU check runs both engines on one GPU
        figures.append(vg.prediction(shape, ("NVIDIA H200", H200), ROWS, TOKENS, PROMPT)["predicted_tandem_over_solo"])
    assert max(figures) - min(figures) <= 0.01, figures
    assert 0.0 < bench < 1.5


def test_the_isolated_scheduler_step_sets_the_premises_cpu():
    """With the isolated step run (`--vocab qwen3` with its comparisons), the scheduler's CPU per row and chunk
    written to the premises are that run's (us -> s), not the committed file's."""
    res = _bench_res(cost.load_premises())
    res["isolated_step"] = {"rows": 32, "history": [16, 2500], "qwen3_long_senior_us_per_row": 30.0,
                            "qwen3_long_junior_us_per_row": 26.0, "solo_long_us_per_row": 20.0,
                            "qwen3_long_senior_add_us_per_chunk": 11.0, "qwen3_long_junior_add_us_per_chunk": 13.0}
    vb._predict(res, vb.VLLMBenchOptions(vocab="qwen3", gpu="h200", gpu_rows=ROWS))
    cpu = res["premises"]["cpu_seconds"]
    assert cpu["sched_per_row_tandem"] == pytest.approx(28e-6) and cpu["sched_per_row_solo"] == pytest.approx(20e-6)
    assert cpu["per_chunk"] == pytest.approx(12e-6)
    assert "isolated scheduler step of this run" in res["premises"]["measured"]["cpu_source"]


def test_the_gpu_checks_table_prints_the_prediction_beside_the_measurement():
    shape = ModelShape(**KNOWN_SHAPES["Qwen/Qwen3-4B-Instruct-2507"])
    pr = vg.prediction(shape, ("NVIDIA H100 80GB HBM3", 81559 * 2**20), ROWS, TOKENS, PROMPT)
    assert pr["gpu"] == "H100 SXM" and pr["layout"] == "shared"
    rec = {"runs": {}, "rows": ROWS, "max_new_tokens": TOKENS, "n_params": shape.n_params, "predicted": pr}
    t = vg.table(rec)
    assert f"**{pr['predicted_tandem_over_solo']:.2f}**" in t and "both engines on one H100 SXM" in t
