"""The bare-machine GPU check (scripts/gpu_check_bare.py): its CPU dry run passes every check, it refuses a GPU run
without CUDA, and its imports check can fail."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check_bare.py"
CHECKS = {"catchup == lockstep (float64)", "hf engine tokens/s (bf16 on CUDA)", "tandem GRPO steps (bf16_mixed)",
          "memory plan vs measured CUDA step peak", "imports (image + bundle)",
          "layouts: engine devices, one call per step"}


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check_bare", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_passes_every_check(tmp_path):
    r = _run("--dry", "--out", str(tmp_path), timeout=300)
    lines = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    checks = {ln["check"]: ln for ln in lines if "check" in ln}
    assert set(checks) == CHECKS, r.stdout[-3000:] + r.stderr[-3000:]
    failed = {k: v for k, v in checks.items() if not v["ok"]}
    assert not failed and r.returncode == 0, json.dumps(failed, indent=1)[:4000] + r.stderr[-3000:]
    # the same code paths as on a GPU: the catch-up kernel ran (not the fallback) and handed off, two steps trained
    assert checks["catchup == lockstep (float64)"]["kernel"] == "catch-up"
    assert all(s["handoffs"] > 5 for s in checks["catchup == lockstep (float64)"]["schedules"].values())
    train = checks["tandem GRPO steps (bf16_mixed)"]
    assert train["steps"] == 2 and train["senior_changed"] and train["junior_unchanged"]
    assert checks["memory plan vs measured CUDA step peak"]["plan_step_mib"] > 0
    lay = checks["layouts: engine devices, one call per step"]
    assert lay["calls_per_step"] == [[8], [8]] and lay["equal_to_each_for_itself"] == [True, True]
    assert lay["placement"]["shared"] == ["0", "1", "2", "3"] and lay["placement"]["dedicated"] == {
        "senior": ["2"], "junior": ["3"]}
    assert lines[-1]["gpu_check_bare"] == "done" and lines[-1]["ok"]
    assert json.loads((tmp_path / "gpu_check_bare.json").read_text()) == lines


def test_refuses_a_gpu_run_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the script would run its checks")
    r = _run(timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "no CUDA GPU" in r.stderr


def test_imports_check_flags_what_the_bundle_lacks(monkeypatch):
    g = _script()
    log = type("Log", (), {"roots": {"datasets": "tandem.train.trainer", "torch": "tandem.rollout.kernel"}})()
    assert g.check_imports(log)["ok"]
    monkeypatch.setattr(g, "BUNDLE", ("transformers", "trl", "datasets"))  # datasets' own needs left out
    r = g.check_imports(log)
    assert not r["ok"] and {"dill", "multiprocess"} <= set(r["missing_on_machine"])
    log.roots = {"wandb": "tandem.train.trainer", "tasks": "__main__"}
    r = g.check_imports(log)
    assert not r["ok"] and r["pipeline_imported"] == ["wandb", "tasks"]
