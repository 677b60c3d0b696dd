"""The junior positive control end to end on a tiny model (tasks/study/control.py): the gate builds S and a junior of
its own and measures them; each seed x arm trains, evaluates and analyses with the right partner; the claims and
report are rebuilt byte for byte from the result files alone. Also: a junior that differs from the base is the one
in the rollouts, the handoff evaluation and the legibility measures, and training leaves its weights unchanged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tasks.study import control as ctl
from tasks.study.recompute import control as control_claims
from tandem.errors import BadInputError

ROOT = Path(__file__).resolve().parents[2]


def _control_dir(tmp_path: Path, seeds=(0,)) -> Path:
    out = tmp_path / "control"
    out.mkdir()
    raw = yaml.safe_load((ROOT / "tests" / "flows" / "tiny_params.yaml").read_text())
    raw["junior"].update(source="tiny", seed=1, solution_styles={"verbose": 0.7, "terse": 0.3})
    raw["evaluate"].update(temperature=0.6, top_p=1.0, top_k=0)
    raw["out_root"] = str(tmp_path / "unused")
    (out / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    reg = yaml.safe_load((ROOT / "studies" / "junior-control" / "registration.yaml").read_text())
    reg.update(params=str(out / "params.yaml"), seeds=list(seeds), steps=2, min_seeds_for_verdict=1)
    reg["statistics"]["n_boot"] = 200
    # the tiny model solves nothing: a gate that lets it through, so the rest of the path runs
    reg["gate"]["criteria"] = {"G1_share": [0.0, 1.0], "G2_solo_pass1_min": 0.0, "G3_cost_max": 1.0,
                               "G4_solo_gap_abs_max": 1.0}
    (out / "registration.yaml").write_text(yaml.safe_dump(reg, sort_keys=False))
    return out


def _later_setting(tmp_path: Path, parent: Path, seeds=(5,), steps=1) -> Path:
    """A later registered setting (`gate_from`): the parent's gate, S and J; its own horizon and seeds."""
    out = tmp_path / "later"
    out.mkdir()
    reg = yaml.safe_load((parent / "registration.yaml").read_text())
    reg.update(setting="2", gate_from=str(parent), seeds=list(seeds), steps=steps,
               params_overrides={"train": {"steps": steps, "save_every": 1}})
    (out / "registration.yaml").write_text(yaml.safe_dump(reg, sort_keys=False))
    return out


def test_runs_refuse_without_a_passed_gate(tmp_path):
    out = _control_dir(tmp_path)
    with pytest.raises(BadInputError, match="study gate"):
        ctl.run(out)


def test_a_later_setting_uses_its_parents_gate_and_has_none_of_its_own(tmp_path):
    parent = _control_dir(tmp_path)
    later = _later_setting(tmp_path, parent)
    reg = ctl.registration(later)
    assert ctl.gate_dir(reg) == parent and ctl.work_root(reg, "coded") == (parent / "work" / "coded").resolve()
    assert ctl.models_dir(reg, "coded") == (parent / "models" / "coded").resolve()
    with pytest.raises(BadInputError, match="no gate of its own"):
        ctl.gate(later)
    with pytest.raises(BadInputError, match="study gate"):  # the parent has no gate yet
        ctl.run(later)
    (parent / "gate.json").write_text(json.dumps({"passed": True, "dialect": "coded", "dialects": []}))
    assert ctl.chosen_dialect(reg) == "coded"
    assert ctl.run_root(later, 5, "grpo") == (later / "runs" / "seed-5" / "grpo").resolve()


def test_a_dialects_gate_result_is_kept_and_one_dialect_can_be_measured_alone(tmp_path):
    out = _control_dir(tmp_path)
    reg = ctl.registration(out)
    name = reg.dialects[0].name
    with pytest.raises(BadInputError, match="not registered"):
        ctl.measure_dialects(out, ["no-such-dialect"])
    kept = ctl.dialect_result_file(reg, name)
    kept.parent.mkdir(parents=True)
    kept.write_text(json.dumps({"dialect": name, "passed": False, "values": {"share": 0.1}}))
    measured = ctl.measure_dialects(out, [name])  # kept: nothing is built or measured again
    assert measured == [json.loads(kept.read_text())]
    assert not (out / "gate.json").exists() and not (out / "gate.md").exists()  # only the full gate decides


def test_the_gate_page_shows_how_many_samples_each_difference_rests_on():
    from tandem.study.control import gate_markdown

    doc = json.loads((ROOT / "studies" / "jargon-smollm2" / "gate.json").read_text())
    rows = {line.split(" | ")[0][2:]: line for line in gate_markdown(doc).split("## Dialect `reversed`")[1].splitlines()
            if line.startswith("| G")}
    assert "(n 551 dialect-first, 6 keyed-first)" in rows["G3"]  # (S, J)'s step samples
    assert "(n 551 dialect-first, 5 keyed-first)" in rows["G4"]  # S's solo samples
    assert "keyed-first" not in rows["G1"] + rows["G2"]


@pytest.mark.slow
def test_the_control_end_to_end_with_a_junior_of_its_own(tmp_path):
    out = _control_dir(tmp_path)
    g = ctl.gate(out)
    compact = g["dialects"][0]
    # each dialect's result is kept as soon as it is measured (a gate stopped later keeps it)
    assert json.loads(ctl.dialect_result_file(ctl.registration(out), "compact").read_text()) == compact
    assert compact["dialect"] == "compact" and set(compact["measures"]) == {
        "S_solo", "J_solo", "SJ_step", "SS_step", "SJ_word", "SS_word"}
    S, J = compact["hashes"]["S"], compact["hashes"]["J"]
    assert S != J  # a junior of its own, built by the junior stage with the base's tokenizer
    # the six measurements side by side, one process each, give the very same samples
    reg = ctl.registration(out)
    d = reg.dialect("compact")
    par = ctl.gate_measures(ctl.dialect_params(reg, d), d.style, ctl.classifier(reg.classifier), reg.keyed_styles,
                            jobs=2)
    assert par["measures"] == compact["measures"] and par["hashes"] == compact["hashes"]
    if not g["passed"]:  # the tiny model writes no dialect: let the compact dialect through for the path below
        g.update(passed=True, dialect="compact", dialects=[compact])
        (out / "gate.json").write_text(json.dumps(g))
    assert (out / "gate.md").read_text().startswith("# The gate")

    written = ctl.run(out, jobs=1)
    assert sorted(p.name for p in written) == ["grpo.json", "tandem-naive.json", "tandem-self.json"]
    res = {a: json.loads(ctl.result_file(out, 0, a).read_text()) for a in ("grpo", "tandem-naive", "tandem-self")}
    # the partner everywhere: J for grpo and tandem-naive, S for tandem-self, one hash across the stages
    for arm, want in (("grpo", J), ("tandem-naive", J), ("tandem-self", S)):
        h = res[arm]["hashes"]
        assert {h["junior_gate"], h["junior_train"], h["junior_eval"], h["junior_analysis"]} == {want}, arm
        assert h["junior_weights_before"] == h["junior_weights_after"] and res[arm]["junior_unchanged"]
    # the seed's arms evaluated and analysed into one cache each: step 0 (the same key) once
    for name in ("evaluate", "analyze"):
        assert {(ctl.run_root(out, 0, a) / "scratch" / name).resolve() for a in res} == {ctl.seed_cache(out, 0, name)}
    # one analysis entry per distinct (checkpoint weights, partner weights) of the seed's runs
    pairs = set()
    for a in res:
        ev_doc = json.loads((ctl.run_root(out, 0, a) / "metrics" / "eval.json").read_text())
        pairs |= {(c["hash"], ev_doc["junior"]["hash"]) for arm in ev_doc["arms"].values() for c in arm["checkpoints"]}
    assert len(list(ctl.seed_cache(out, 0, "analyze").glob("*.json"))) == len(pairs) >= 2
    naive = res["tandem-naive"]
    assert set(naive["evaluation"]["checkpoints"]) == {"0", "1", "2"}
    assert set(naive["evaluation"]["checkpoints"]["2"]) == {"solo", "step"}
    assert set(naive["training"]) == {"1", "2"} and "dialect_share_rollout" in naive["training"]["1"]
    # legibility against J, drift against S: KL to S is 0 at step 0 (the senior is S) while KL to J is not
    at0 = next(iter(next(iter(naive["analysis"]["0"].values())).values()))
    assert at0["kl_mean"] == 0.0 and at0["kl_junior_mean"] > 0.0

    doc = control_claims(out)
    assert [c["id"] for c in doc["claims"]] == ["J1", "J2", "H1", "L1"]
    assert all(c["verdict"] in ("holds", "fails", "inconclusive") for c in doc["claims"])
    assert set(doc["bug_indicators"]) == {f"B{i}" for i in range(1, 8)}
    assert doc["dose"]["tandem-naive"]["steps"] == [0, 1, 2]
    first = {f: (out / f).read_bytes() for f in ("claims.json", "report.md", "report.html")}
    assert "Dose curve" in first["report.md"].decode().split("## ")[1]  # the dose curve comes first
    shutil.rmtree(out / "runs")  # the results alone rebuild the claims
    for f in first:
        (out / f).unlink()
    control_claims(out)
    assert {f: (out / f).read_bytes() for f in first} == first

    # a later registered setting trains from the same gated S and J with its own horizon and seeds
    later = _later_setting(tmp_path, out, seeds=(5,), steps=1)
    (res5,) = ctl.run(later, arms=["grpo"], jobs=1)
    got = json.loads(res5.read_text())
    assert got["seed"] == 5 and got["steps"] == 1 and set(got["evaluation"]["checkpoints"]) == {"0", "1"}
    assert got["hashes"]["junior_gate"] == J
    params = yaml.safe_load((ctl.run_root(later, 5, "grpo") / "params.yaml").read_text())
    assert params["train"]["steps"] == 1 and params["train"]["save_every"] == 1 and params["seed"] == 5


def test_a_run_begun_with_a_cache_of_its_own_moves_it_into_the_seeds_shared_one(tmp_path, monkeypatch):
    shared = tmp_path / "runs" / "seed-0" / "eval-cache"
    shared.mkdir(parents=True)
    (shared / "a.jsonl").write_text("records of a")
    (shared / "a.json").write_text("summary of a")
    own = tmp_path / "runs" / "seed-0" / "grpo" / "scratch" / "evaluate"
    own.mkdir(parents=True)
    for name in ("a.json", "a.jsonl", "b.json", "b.jsonl"):
        (own / name).write_text(f"own {name}")
    moved = []
    real_replace = ctl.os.replace
    monkeypatch.setattr(ctl.os, "replace", lambda a, b: (moved.append(Path(a).name), real_replace(a, b)))
    ctl.share_dir(own, shared)
    assert own.is_symlink() and own.resolve() == shared.resolve()
    # the entry the shared cache held stays; the run's own entry moves, its records before its summary
    assert {f.name: f.read_text() for f in shared.iterdir()} == {
        "a.jsonl": "records of a", "a.json": "summary of a", "b.jsonl": "own b.jsonl", "b.json": "own b.json"}
    assert moved == ["b.jsonl", "b.json"]
    fresh = tmp_path / "runs" / "seed-0" / "tandem-naive" / "scratch" / "evaluate"
    ctl.share_dir(fresh, shared)
    ctl.share_dir(fresh, shared)  # a resumed run: the link is already there
    assert fresh.resolve() == shared.resolve() and len(list(fresh.iterdir())) == 4


def test_recompute_refuses_a_control_without_results_and_keeps_its_gate_page(tmp_path):
    # setting 1 of the SmolLM2 control: its gate failed, nothing trained; no zero-seed claims.json is written
    out = tmp_path / "jargon"
    src = ROOT / "studies" / "jargon-smollm2"
    out.mkdir()
    for f in ("registration.yaml", "registration.md", "params.yaml", "gate.json"):
        shutil.copy(src / f, out / f)
    with pytest.raises(BadInputError, match="no results to compute claims from: its gate did not pass"):
        control_claims(out)
    assert not (out / "claims.json").exists()
    assert (out / "gate.md").read_text() == (src / "gate.md").read_text()  # the published result, re-rendered


def test_the_gate_page_reads_a_dialects_share_under_its_style():
    # setting 2's second jargon, `reversed-long`, writes the style `reversed`: its share is that style's
    from tandem.study.control import gate_markdown

    doc = json.loads((ROOT / "studies" / "jargon-smollm2" / "setting-2" / "gate.json").read_text())
    page = gate_markdown(doc).split("## Dialect `reversed-long`")[1]
    row = next(line for line in page.splitlines() if line.startswith("| S_solo | 800 |"))
    assert row.split(" | ")[3] == "0.797"  # = G1's dialect share
