"""The rollout layouts for real, with vLLM's CPU build (`.venv-vllm`) on tiny models, through the layouts' GPU check
in its dry form (`scripts/gpu_check_layouts.py --dry`: four fake GPUs, which the CPU build ignores):

- placement: a dedicated service's engine-core processes each carry their own `CUDA_VISIBLE_DEVICES` (the
  positions after the trainer's two), and /health and the log name engine -> device;
- one call: two training processes (gloo), the dedicated layout, 2 steps of `TandemRollout`: one service call
  per step with both processes' rows (the service's count and the step's `rollout/*` metrics), rollouts equal to
  each process calling for itself with the same seeds.

The CUDA path (engines really landing on their GPUs) needs the script without --dry on GPUs. Slow; skips without
`.venv-vllm` unless TANDEM_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tandem.rollout.placement import DEVICE_ENV
from vllm_fixtures import need_vllm

pytestmark = [pytest.mark.slow, pytest.mark.integration]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_layouts.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("gpu_check_layouts", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dedicated_engines_start_on_devices_of_their_own(tmp_path, check):
    need_vllm()
    check.tiny_models(tmp_path)
    res = check.check_placement(tmp_path, check.FAKE_GPUS.split(","), dry=True)
    assert res["ok"], res
    assert res["devices"] == {"senior": f"{DEVICE_ENV}=2", "junior": f"{DEVICE_ENV}=3"}
    assert res["engine_core_env"] == ["2", "3"]  # one engine core per model, each on its own GPU
    log = (tmp_path / "placement.log").read_text()
    assert f"engine senior started on {DEVICE_ENV}=2" in log and f"engine junior started on {DEVICE_ENV}=3" in log
    # the worker patches, installed by the explicit call at engine start (the CPU build runs the V1 runner)
    assert log.count("worker patches [{'row_arrays': True, 'cpu_generator_rewind': True}]") == 2, log[-3000:]


def test_dedicated_layout_makes_one_call_per_step_with_every_process_rows(tmp_path, check):
    need_vllm()
    check.tiny_models(tmp_path)
    res = check.check_one_call(tmp_path, check.FAKE_GPUS, trainers=2)
    assert res["ok"], res
    assert res["service_calls_per_step"] == [1, 1] and res["service_calls_per_step_each_for_itself"] == [2, 2]
    assert res["metrics"] == {"rollout/service_calls": 1.0, "rollout/rows_per_call": 8.0}
    assert res["rollouts_equal_each_for_itself"]
