"""`tandem study --recompute`: the committed studies rebuilt on the study package from their committed files alone
give back their committed claims and results byte for byte."""

from __future__ import annotations

import shutil
import subprocess
import sys
import os
from pathlib import Path

import pytest

from tandem.errors import BadInputError
from tasks.study import recompute as rc

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ("claims.json", "report.md", "report.html")


def _copy(tmp_path: Path, rel: str, names: tuple[str, ...]) -> Path:
    """The committed files `names` of `rel` at the same place under a new project root (`<tmp>/studies/...`)."""
    dst = tmp_path / rel
    dst.mkdir(parents=True, exist_ok=True)
    for n in names:
        src = ROOT / rel / n
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst / n)
    return dst


def _committed(rel: str, name: str) -> bytes:
    return (ROOT / rel / name).read_bytes()  # the file as checked out (git diff --stat studies/ checks it)


@pytest.mark.parametrize("rel", ["studies/junior-control", "studies/junior-control/coded-100"])
def test_each_control_recomputes_to_its_committed_bytes(tmp_path, rel, monkeypatch):
    monkeypatch.setattr(rc, "CODE_ROOT", tmp_path)
    _copy(tmp_path, "studies/junior-control", ("registration.yaml", "gate.json"))
    (tmp_path / "studies/junior-control/params.yaml").write_text((ROOT / "studies/junior-control/params.yaml").read_text())
    out = _copy(tmp_path, rel, ("registration.yaml", "results"))
    for name in COMMITTED:
        (out / name).unlink(missing_ok=True)
    kind, doc = rc.recompute(out)
    assert kind == "control" and doc["registration"] == f"{rel}/registration.yaml"
    for name in COMMITTED + ("figures/dose-curve.png",):
        assert (out / name).read_bytes() == _committed(rel, name), name


def test_the_pilot_redoes_its_decisions_to_its_committed_result(tmp_path, monkeypatch):
    monkeypatch.setattr(rc, "CODE_ROOT", tmp_path)
    _copy(tmp_path, "studies", ("registration.yaml",))
    (tmp_path / "studies" / "pilot").mkdir()
    doc = __import__("json").loads(_committed("studies/pilot", "result.json"))
    flipped = {**doc, "verdict": "room", "variants": {k: {**v, "lengths": [{**r, "room": True} for r in v["lengths"]]}
                                                      for k, v in doc["variants"].items()}}
    (tmp_path / "studies/pilot/result.json").write_text(__import__("json").dumps(flipped))  # decisions to redo
    kind, _ = rc.recompute(tmp_path / "studies" / "pilot")
    assert kind == "pilot"
    for name in ("result.json", "result.md"):
        assert (tmp_path / "studies/pilot" / name).read_bytes() == _committed("studies/pilot", name), name


def test_a_record_without_results_is_read_and_left_as_it_is(tmp_path):
    out = _copy(tmp_path, "studies/first-study", ("claims.json", "report.md"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    kind, doc = rc.recompute(out)
    assert kind == "record" and doc["n_seeds"] == 3 and "nothing was rewritten" in rc.summary(kind, doc)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_folder_with_nothing_to_recompute_is_refused(tmp_path):
    with pytest.raises(BadInputError, match="nothing|no registration"):
        rc.recompute(tmp_path)


def test_the_command_recomputes_the_committed_control_in_place_without_changes():
    """`tandem study --recompute --out studies/junior-control/coded-100` on the project's own folder."""
    out = ROOT / "studies" / "junior-control" / "coded-100"
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    r = subprocess.run([sys.executable, "-m", "cli", "study", "--recompute", "--out",
                        "studies/junior-control/coded-100"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "J1: tandem-naive - grpo dialect_share" in r.stdout and "bug indicators fired: none" in r.stdout
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after.keys() == before.keys() and all(after[p] == before[p] for p in before)


def test_runs_on_a_gated_rebuild_are_pooled_and_named_with_their_build(tmp_path, monkeypatch):
    """A run that trained from a rebuild of S and J (a registered rebuild amendment) names its build; the claims
    pool the builds, and claims.json and the report say which run trained from which build, each build's gate
    values, and the claims whose two arms in a seed come from different builds."""
    import json

    rel = "studies/junior-control/coded-100"
    monkeypatch.setattr(rc, "CODE_ROOT", tmp_path)
    _copy(tmp_path, "studies/junior-control", ("registration.yaml", "gate.json"))
    _copy(tmp_path, "studies/junior-control", ("params.yaml",))
    out = _copy(tmp_path, rel, ("registration.yaml", "results"))
    base = json.loads((ROOT / rel / "claims.json").read_text())
    gate = json.loads((ROOT / "studies/junior-control/gate.json").read_text())
    gate["dialects"][-1]["hashes"] = {"S": "e" * 64, "J": "f" * 64}
    gate["dialects"][-1]["values"]["share"] = 0.5
    gpath = "studies/junior-control/rebuilds/eeee-ffff/gate.json"
    (tmp_path / gpath).parent.mkdir(parents=True)
    (tmp_path / gpath).write_text(json.dumps({**gate, "amendment": "A1"}))
    f = out / "results" / "seed-6" / "tandem-self.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "build": {"S": "e" * 64, "J": "f" * 64, "gate": gpath}}))
    kind, doc = rc.recompute(out)
    assert [c["estimate"] for c in doc["claims"]] == [c["estimate"] for c in base["claims"]]  # pooled as before
    registered, rebuild = doc["builds"]
    assert registered["gate"].endswith("studies/junior-control/gate.json")
    assert "seed 6 tandem-self" not in registered["runs"]
    assert rebuild == {**rebuild, "gate": gpath, "S": "e" * 64, "runs": ["seed 6 tandem-self"], "passed": True}
    assert rebuild["values"]["share"] == 0.5 and doc["mixed_build_seeds"] == {"J2": [6]}
    assert doc["bug_indicators"]["B2"]["fired"] is base["bug_indicators"]["B2"]["fired"]
    md = (out / "report.md").read_text()
    assert "Builds of S and J" in md and "J2 compares, in seed(s) 6, two runs" in md
