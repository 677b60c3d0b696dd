"""The vLLM GPU check's pure parts (`benchmarks/vllm_gpu.py`), no vLLM needed: the memory plan that makes 128 rows x
3,000 tokens of Qwen3-4B resident, the sizes, the record's file names, its checks and Markdown table (figures only
where a run was measured, the scheduling that ran beside what was asked), the refusal without a GPU, and the
benchmark service's `--async-scheduling` flag (production keeps `compat.ENGINE_FIXED`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import load_benchmark
from tandem.rollout.vllm.knobs import EngineKnobs
from tandem.rollout.vllm.service import EngineSpec

vg = load_benchmark("vllm_gpu")
ROOT = Path(__file__).resolve().parents[2]
H200 = 143771 * 2**20  # nvidia-smi's memory.total of an H200, MiB
H100 = 81559 * 2**20


def test_qwen3_4b_at_128_rows_of_3000_tokens_fits_two_engines_on_an_h200_only():
    shape = vg.SHAPES["qwen3-4b"]
    assert shape.n_params == 4_022_468_096 and shape.kv_bytes_per_token(2) == 36 * 8 * 128 * 2 * 2
    fit = vg.kv_fit(shape, 128, 3100, H200)
    # 128 x 3,104 tokens (whole 16-token blocks) x 144 KiB: 54.6 GiB of KV, with 7.5 GiB of weights and 1.5 of runtime
    assert fit["kv_gib"] == pytest.approx(128 * 194 * 16 * 147456 / 2**30) and 54 < fit["kv_gib"] < 55
    assert fit["share_needed"] == pytest.approx(fit["need_gib"] * 2**30 / H200, abs=1e-4)
    assert fit["share"] == 0.47 and fit["fits"] and fit["resident_rows"] == 128
    assert 2 * fit["share"] <= 0.96  # both engines on the one GPU
    small = vg.kv_fit(shape, 128, 3100, H100)  # capped at 0.48 per engine: the rest wait for admission
    assert small["share"] == vg.SHARE_CAP and not small["fits"] and 60 < small["resident_rows"] < 128
    asked = vg.kv_fit(shape, 128, 3100, H200, share=0.3)
    assert asked["share"] == 0.3 and not asked["fits"]
    assert asked["resident_rows"] == int((0.3 * H200 - shape.n_params * 2 - 1.5 * 2**30) // (194 * 16 * 147456))
    cpu = vg.kv_fit(shape, 128, 3100, None)
    assert cpu["share"] is None and cpu["resident_rows"] is None and cpu["need_gib"] == fit["need_gib"]


def test_sizes_and_record_names():
    gpu, dry = vg.sizes(False), vg.sizes(True)
    assert (gpu.shape, gpu.rows, gpu.tokens, gpu.dtype, gpu.eager) == ("qwen3-4b", 128, 3000, "bfloat16", False)
    assert (dry.shape, dry.rows, dry.tokens, dry.dtype, dry.eager) == ("tiny", 8, 64, "float32", True)
    assert vg.sizes(False, rows=64, eager=True).rows == 64
    with pytest.raises(ValueError):
        vg.sizes(False, shape="qwen3-8b")
    assert vg.slug("NVIDIA H200", False) == "vllm-h200"
    assert vg.slug("NVIDIA GeForce RTX 4090", True) == "vllm-geforce-rtx-4090-dry"
    assert vg.slug(None, True) == "vllm-cpu-dry"


def _record(cpu: bool, failed: str | None = None) -> dict:
    solo = {"tok_s": 1000.0, "rows": 8, "complete_rows": 8, "preemptions": 0, "max_running_rows": 8,
            "async_scheduling": not cpu, "async_scheduling_requested": "default", "engine_steps_per_row_token": 1.016,
            "computed_per_token": 1.4, "kv_blocks": 900}
    tandem = {"tok_s": 520.0, "rows": 8, "complete_rows": 8, "preemptions": 0, "max_live_rows": 8, "kv_blocks": 500,
              "engine_steps_per_row_token_senior": 1.15, "engine_steps_per_row_token_junior": 1.12,
              "chunks_per_token": 0.262, "computed_per_token": 2.01}
    runs = {"solo_stock": solo,
            "tandem_async_off": {**tandem, "async_scheduling_requested": False,
                                 "async_scheduling": {"senior": False, "junior": False}},
            "tandem_async_on": {**tandem, "tok_s": 400.0, "async_scheduling_requested": True,
                                "async_scheduling": {"senior": not cpu, "junior": not cpu}}}
    if failed:
        runs[failed] = {"error": "RuntimeError: the engines | did not start\nmore"}
    rec = {"dry": cpu, "gpu": None if cpu else "NVIDIA H200", "platform_cpu": cpu, "date": "2026-01-01",
           "vllm": "0.32.0", "device": "cpu" if cpu else "NVIDIA H200", "shape": "qwen3-4b", "shape_desc": "Qwen3-4B",
           "n_params": 4022468096, "dtype": "bfloat16", "enforce_eager": False, "rows": 8, "max_new_tokens": 3000,
           "max_prompt_tokens": 90, "repeats": 1, "solo_gpu_memory": 0.9, "runs": runs,
           "kv_fit": vg.kv_fit(vg.SHAPES["qwen3-4b"], 8, 3090, None if cpu else H200)}
    rec["checks"] = vg.checks(rec)
    return rec


def test_checks_and_table_on_a_gpu_record():
    rec = _record(cpu=False)
    c = rec["checks"]
    assert c["all_measured"] and c["rows_complete"] and c["rows_resident"]
    assert c["async_scheduling_as_asked"] == {"solo_stock": None, "tandem_async_off": True, "tandem_async_on": True}
    t = vg.table(rec)
    assert "| stock vLLM solo | vLLM's default -> on | 1,000.0 | 1.00 | 1.02 | - | 1.400 | 8 / 8; 900; 0 |" in t
    assert ("| tandem, async scheduling off (production) | off -> off | 520.0 | 0.52 | 1.15 / 1.12 | 0.262 | 2.010 "
            "| 8 / 8; 500; 0 |") in t
    assert "| tandem, async scheduling on | on -> on | 400.0 | 0.40 |" in t
    assert "forces it off" not in t and "Memory: each tandem engine 0.02 of the GPU" not in t
    assert "NVIDIA H200" in t and "CUDA graphs" in t


def test_the_table_says_what_the_cpu_build_ran_and_never_fills_an_unmeasured_run():
    rec = _record(cpu=True, failed="tandem_async_on")
    c = rec["checks"]
    assert not c["all_measured"] and c["rows_complete"] and c["rows_resident"]
    t = vg.table(rec)
    assert "| tandem, async scheduling on | not measured: RuntimeError: the engines / did not start | | | | | | |" in t
    assert "| tandem, async scheduling off (production) | off -> off |" in t
    assert "vLLM's default -> off" in t and "no figure here is a GPU figure" in t
    rec = _record(cpu=True)
    assert rec["checks"]["async_scheduling_as_asked"]["tandem_async_on"] is False
    assert "| on -> off (vLLM's CPU build forces it off) |" in vg.table(rec)
    rec["runs"]["tandem_async_off"]["max_live_rows"] = 5  # an admission wave: not every row resident
    assert not vg.checks(rec)["rows_resident"]


def test_write_outputs_names_the_files_in_the_record(tmp_path):
    rec = _record(cpu=True)
    js, md = vg.write_outputs(rec, tmp_path / "gpu")
    assert (js.name, md.name) == ("vllm-cpu-dry.json", "vllm-cpu-dry.md")
    assert rec["files"] == {"json": str(js), "md": str(md)} and md.read_text() == vg.table(rec)


def test_refuses_a_gpu_run_without_a_gpu(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi is here: the benchmark would run")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_gpu.py"), "--out", str(tmp_path)], cwd=ROOT,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == "" and not any(tmp_path.iterdir())
    assert len(r.stderr.strip().splitlines()) == 1 and "no CUDA GPU" in r.stderr


def test_the_benchmark_service_asks_for_async_scheduling_only_with_its_flag(monkeypatch):
    ab = load_benchmark("vllm_ab_service")
    seen = {}

    def fake_main(argv, service_cls):
        seen.update(argv=argv, cls=service_cls)
        return 0

    monkeypatch.setattr(ab.production, "main", fake_main)
    monkeypatch.setattr(ab.ABService, "async_scheduling", False)
    monkeypatch.setattr(ab.ABService, "replay", False)
    svc = object.__new__(ab.ABService)
    svc.stats_files = {0: "/s0", 1: "/s1"}
    spec = EngineSpec("/m", "/m", EngineKnobs())
    assert svc._engine_kwargs(spec, "/m", 1, False)["async_scheduling"] is False  # compat.ENGINE_FIXED
    assert ab.main(["--senior", "/m", "--replay", "--async-scheduling"]) == 0
    assert seen["argv"] == ["--senior", "/m"] and seen["cls"] is ab.ABService
    assert ab.ABService.async_scheduling and ab.ABService.replay
    for role in (0, 1):
        kw = svc._engine_kwargs(spec, "/m", role, False)
        assert kw["async_scheduling"] is True and kw["logits_processors"] == [ab.REPLAY_PROCESSOR]
