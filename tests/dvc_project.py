"""A copy of the project with every stage committed on placeholder outputs, for cheap `dvc status` checks.

The code, dvc.yaml, params.yaml and .dvcignore are copied; each output is a one-line file; `dvc commit -f`
records them, so `dvc status` starts clean and then lists exactly the stages an edit makes stale.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import yaml

REPO = Path(__file__).resolve().parents[1]

_FILES = ["data/raw/x.jsonl", "data/prepared/train.jsonl", "data/prepared/val.jsonl", "data/prepared/eval/b.jsonl",
          "metrics/data.json", "models/base/config.json", "metrics/base.json", "models/junior/tandem_junior.json",
          "metrics/junior.json", "results/generations/x.jsonl",
          "metrics/eval.json", "metrics/plots/eval/x.csv", "metrics/analysis.json", "metrics/plots/analysis/x.csv",
          "reports/report.md", "reports/report.html", "reports/figures/x.png", "reports/data-docs/index.html"]
_FILES += [f"metrics/headline/{s}.json" for s in ("data", "base", "junior", "eval", "analysis")]


def arm_files(arm: str) -> list[str]:
    """The placeholder outputs of `train@<arm>`."""
    return [f"models/checkpoints/{arm}/step-1/config.json", f"metrics/train_{arm}.json",
            f"metrics/plots/train/{arm}.csv", f"metrics/headline/train_{arm}.json"]


def write_placeholders(proj: Path, files: list[str]) -> None:
    for f in files:
        (proj / f).parent.mkdir(parents=True, exist_ok=True)
        (proj / f).write_text("{}\n")


def committed_project(proj: Path) -> Callable[..., subprocess.CompletedProcess]:
    """Build the copy in `proj` (params.yaml's arms trained), commit every stage; returns a `dvc` runner."""
    proj.mkdir()
    for d in ("cli", "tandem", "tasks", "flows"):
        shutil.copytree(REPO / d, proj / d, ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("dvc.yaml", "params.yaml", ".dvcignore"):
        shutil.copy(REPO / f, proj / f)
    arms = yaml.safe_load((REPO / "params.yaml").read_text())["train"]["arms"]
    write_placeholders(proj, _FILES + [f for arm in arms for f in arm_files(arm)])

    def dvc(*args: str) -> subprocess.CompletedProcess:
        res = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=proj, capture_output=True, text=True,
                             timeout=300, env={**os.environ, "DVC_NO_ANALYTICS": "1"})
        assert res.returncode == 0, res.stdout + res.stderr
        return res

    dvc("init", "--no-scm", "-q")
    dvc("commit", "-f", "-q")
    return dvc


def stale(dvc: Callable[..., subprocess.CompletedProcess]) -> set[str]:
    """The stages `dvc status` lists as changed."""
    return set(json.loads(dvc("status", "--json").stdout or "{}"))
