"""The vLLM GPU check (`benchmarks/vllm_gpu.py`, `scripts/gpu_check_vllm.sh`) in its dry run on vLLM's CPU build:
stock vLLM solo and the tandem service with asynchronous scheduling off and on all measured at 8 rows x 64 tokens of
a tiny Qwen3-vocabulary model, engine steps per token counted for every engine, every row complete and resident,
the JSON record and its Markdown table written, and the scheduling each engine actually ran recorded (off on the
CPU build, whatever was asked). Without `.venv-vllm` it skips, unless TANDEM_REQUIRE_VLLM=1."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_fixtures import need_vllm

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_measures_solo_and_both_tandem_runs(tmp_path):
    need_vllm()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_gpu.py"), "--dry", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, r.stdout[-2000:] + r.stderr[-4000:]
    rec = json.loads(lines[-1])
    runs = rec["runs"]
    assert r.returncode == 0 and rec["ok"], json.dumps({k: v.get("error") for k, v in runs.items()}) + r.stderr[-3000:]
    assert rec["dry"] and rec["rows"] == 8 and rec["max_new_tokens"] == 64 and rec["shape"] == "tiny"
    assert set(runs) == {"solo_stock", "tandem_async_off", "tandem_async_on"}
    for name, run in runs.items():
        assert "error" not in run, (name, run)
        assert math.isfinite(run["tok_s"]) and run["tok_s"] > 0, name
        assert run["tokens"] == 8 * 64 and run["complete_rows"] == 8, name
        assert run["preemptions"] == 0, name
    solo = runs["solo_stock"]
    # stock vLLM's steps through its stat-logger interface: every row in every decode step
    assert solo["steps_counted_by"] == "iteration_details" and solo["engine_steps"] > 0
    assert 0.9 <= solo["engine_steps_per_row_token"] <= 1.3 and solo["max_running_rows"] == 8
    assert solo["engine_steps_per_token"] == pytest.approx(solo["engine_steps_per_row_token"] / 8)
    assert solo["computed_per_token"] >= 1.0 and solo["generated_tokens_counted"] == 8 * 64
    for name in ("tandem_async_off", "tandem_async_on"):
        run = runs[name]
        for role in ("senior", "junior"):
            assert run[f"engine_steps_{role}"] > 0 and run[f"engine_steps_per_token_{role}"] > 0, (name, role)
            assert run[f"engine_steps_per_row_token_{role}"] > 0, (name, role)
        assert 0 < run["chunks_per_token"] < 1 and run["computed_per_token"] > 1, name
        assert run["max_live_rows"] == 8 and run["kv_blocks"] > 0 and run["resident_rows_kv"] >= 8, name
        assert run["async_scheduling_requested"] is (name == "tandem_async_on")
        assert rec[f"{name}_over_solo"] == pytest.approx(run["tok_s"] / solo["tok_s"])
    assert rec["checks"]["all_measured"] and rec["checks"]["rows_complete"] and rec["checks"]["rows_resident"]
    # the record on disk is the line printed, and its table names every run
    js, md = Path(rec["files"]["json"]), Path(rec["files"]["md"])
    assert js.parent == tmp_path and json.loads(js.read_text()) == rec
    table = md.read_text()
    for row in ("| stock vLLM solo |", "| tandem, async scheduling off (production) |",
                "| tandem, async scheduling on |"):
        assert row in table
    assert "not measured" not in table
    # what vLLM ran, as each engine resolved it: the CPU build forces asynchronous scheduling off
    if rec["platform_cpu"]:
        assert js.name == "vllm-cpu-dry.json" and rec["gpu"] is None
        assert solo["async_scheduling"] is False and solo["async_scheduling_requested"] == "default"
        for name in ("tandem_async_off", "tandem_async_on"):
            assert runs[name]["async_scheduling"] == {"senior": False, "junior": False}, name
        assert rec["checks"]["async_scheduling_as_asked"] == {"solo_stock": None, "tandem_async_off": True,
                                                              "tandem_async_on": False}
        assert "| on -> off (vLLM's CPU build forces it off) |" in table
        assert "vLLM's default -> off" in table and "no figure here is a GPU figure" in table
