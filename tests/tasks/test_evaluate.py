"""Stage `evaluate`: checkpoints, content hashes, result keys, pass@k summaries, the full stage, crash + rerun,
and a raw benchmark file with a model directory given by params alone."""

from __future__ import annotations

import csv
import itertools
import json
import shutil
from pathlib import Path

import pytest

from tandem.config import params_from_dict
from tandem.checkpoints import list_checkpoints
from tandem.evaluation import EvalSettings, content_hash, result_key, summarize_benchmark
from tandem.rollout.schedule import ScheduleSpec
from tests.tasks import eval_fixtures as F

import tasks.evaluate as ev


# --------------------------------------------------------------------------------------------------
# Library helpers (fast)
# --------------------------------------------------------------------------------------------------

def _fake_checkpoint(d, weights: bytes = b"w", marker: bool = True):
    F.fake_model_dir(d, weights, marker=marker)


def test_list_checkpoints_orders_steps_and_refuses_partial_dirs(tmp_path):
    from tandem.errors import CheckpointError

    arm = tmp_path / "ckpt" / "grpo"
    for name in ("step-10", "step-2", ".step-30.tmpab12", "step-x", "notes", "checkpoint-12", "step-0"):
        _fake_checkpoint(arm / name)
    _fake_checkpoint(arm / "step-20", marker=False)  # training never finished it
    (arm / "step-30").mkdir()  # an empty folder
    (arm / "step-40").write_text("a file, not a checkpoint")
    with pytest.raises(CheckpointError) as exc:  # never skipped in silence
        list_checkpoints(tmp_path / "ckpt", "grpo", tmp_path / "base")
    assert all(f"step-{n}" in str(exc.value) for n in (20, 30, 40)) and "step-10 " not in str(exc.value)
    for name in ("step-20", "step-30"):
        shutil.rmtree(arm / name)
    (arm / "step-40").unlink()
    got = list_checkpoints(tmp_path / "ckpt", "grpo", tmp_path / "base")  # names that are not step-<N> stay ignored
    assert [(c.step, c.path.name) for c in got] == [(0, "base"), (2, "step-2"), (10, "step-10")]
    assert [c.step for c in list_checkpoints(tmp_path / "ckpt", "tandem", tmp_path / "base")] == [0]


def test_final_selection_lists_the_base_and_each_arms_last_checkpoint(tmp_path):
    from tandem.errors import CheckpointError

    ck = tmp_path / "ckpt"
    for step in (4, 2):
        _fake_checkpoint(ck / "grpo" / f"step-{step}", weights=f"w{step}".encode())
    _fake_checkpoint(ck / "grpo" / "step-6", marker=False)  # unfinished: an error, never "the last" in its place
    _fake_checkpoint(tmp_path / "base")
    with pytest.raises(CheckpointError, match="step-6 .missing tandem_state.json"):
        list_checkpoints(ck, "grpo", tmp_path / "base", "final")
    shutil.rmtree(ck / "grpo" / "step-6")
    final = list_checkpoints(ck, "grpo", tmp_path / "base", "final")
    assert [(c.step, c.path.name) for c in final] == [(0, "base"), (4, "step-4")]
    assert [c.step for c in list_checkpoints(ck, "grpo", tmp_path / "base", "all")] == [0, 2, 4]
    assert [c.step for c in list_checkpoints(ck, "tandem", tmp_path / "base", "final")] == [0]
    with pytest.raises(ValueError, match="all, final|'all', 'final'"):
        list_checkpoints(ck, "grpo", tmp_path / "base", "last")
    # the stage follows evaluate.checkpoints
    inputs = {"checkpoints": ck, "base_model": tmp_path / "base"}
    for which, steps in (("final", [0, 4]), ("all", [0, 2, 4])):
        params = params_from_dict({"train": {"arms": ["grpo", "tandem"]}, "evaluate": {"checkpoints": which}})
        got = ev._all_checkpoints(params, inputs)
        assert [c.step for c in got["grpo"]] == steps and [c.step for c in got["tandem"]] == [0]


def test_content_hash_follows_weight_bytes_only(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"weights-1")
    (b / "config.json").write_text("{}")  # not a weight file
    assert content_hash(a) == content_hash(b)
    (b / "model.safetensors").write_bytes(b"weights-2")
    assert content_hash(a) != content_hash(b)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        content_hash(tmp_path / "empty")


def test_result_key_changes_with_everything_that_shapes_the_distribution():
    s = EvalSettings()
    base = result_key("h", "solo", "b", "r", s)
    changed = [result_key("h2", "solo", "b", "r", s), result_key("h", "solo", "b2", "r", s),
               result_key("h", "solo", "b", "r2", s), result_key("h", "step", "b", "r", s, junior_hash="j")]
    for field, value in [("n_samples", 4), ("temperature", 1.0), ("top_p", 1.0), ("top_k", 0),
                         ("max_new_tokens", 7), ("seed", 3)]:
        changed.append(result_key("h", "solo", "b", "r", EvalSettings(**{field: value})))
    assert len({base, *changed}) == len(changed) + 1
    # batch size changes the random stream, not the distribution; mode-specific settings only where used
    assert result_key("h", "solo", "b", "r", EvalSettings(batch_size=3)) == base
    assert result_key("h", "solo", "b", "r", EvalSettings(schedule=ScheduleSpec(p_senior=0.3, max_rounds=2))) == base
    step = result_key("h", "step", "b", "r", s, junior_hash="j")
    assert result_key("h", "step", "b", "r", EvalSettings(schedule=ScheduleSpec(max_rounds=2)), junior_hash="j") != step
    assert result_key("h", "step", "b", "r", s, junior_hash="j2") != step
    assert result_key("h", "word", "b", "r", EvalSettings(schedule=ScheduleSpec(p_senior=0.3)), junior_hash="j") != \
        result_key("h", "word", "b", "r", s, junior_hash="j")
    with pytest.raises(ValueError, match="junior_hash"):
        result_key("h", "word", "b", "r", s)
    with pytest.raises(ValueError, match="unknown evaluation mode"):
        result_key("h", "greedy", "b", "r", s)


def test_plan_lists_each_distinct_weights_and_mode_once(tmp_path):
    F.fake_model_dir(tmp_path / "models" / "base", b"base", marker=False)
    for arm, body in (("tandem", b"t"), ("grpo", b"base")):  # grpo's step-5 happens to equal the base
        _fake_checkpoint(tmp_path / "models" / "checkpoints" / arm / "step-5", body)
    p = params_from_dict({"out_root": str(tmp_path), "train": {"arms": ["tandem", "grpo", "kl_reg"]},
                          "evaluate": {"modes": ["solo", "step"]}})
    units = ev.plan(p)
    assert [(u["arm"], u["step"], u["mode"]) for u in units] == [
        ("tandem", 0, "solo"), ("tandem", 0, "step"), ("tandem", 5, "solo"), ("tandem", 5, "step")]
    # without solo mode the junior floor (the junior alone, solo) is its own unit: params refuse such a run
    # (analyze needs solo), so only the planner itself meets it
    from tandem.eval_cache import plan_units

    p2 = params_from_dict({"out_root": str(tmp_path), "train": {"arms": ["tandem"]}})
    inputs, _ = ev.default_io(p2)
    units = plan_units(ev._all_checkpoints(p2, inputs), ["word"], ev.junior_dir(p2, inputs))
    assert [(u["arm"], u["step"], u["mode"]) for u in units] == [
        ("tandem", 0, "word"), ("tandem", 5, "word"), ("junior", 0, "solo")]


def _brute_passk(scores: list[float], k: int) -> float:
    subsets = list(itertools.combinations(scores, k))
    return sum(any(x > 0.5 for x in sub) for sub in subsets) / len(subsets)


def test_summarize_benchmark_groups_by_problem_and_matches_enumeration():
    scores = {"p1": [1, 0, 0, 1], "p2": [0, 0, 0, 0], "p3": [1, 1, 1, 0]}
    recs = []
    for pid, sc in scores.items():
        for i, s in enumerate(sc):
            recs.append({"id": pid, "sample": i, "score": float(s), "completion_ids": [1] * (i + 1),
                         "owner": [1, 0][: (i % 2) + 1], "finish_reason": "eos" if i else "length", "handoffs": i % 2})
    got = summarize_benchmark(recs, [1, 2, 4])
    for k in (1, 2, 4):
        want = sum(_brute_passk(s, k) for s in scores.values()) / 3
        assert got[f"pass@{k}"] == pytest.approx(want)
    assert got["n_problems"] == 3 and got["n_generations"] == 12
    assert got["mean_tokens"] == pytest.approx(2.5)
    assert got["senior_share"] == pytest.approx((1 + 0.5) / 2)
    assert got["finish_reasons"] == {"eos": 9, "length": 3}
    with pytest.raises(ValueError, match="at least k samples"):
        summarize_benchmark(recs, [8])


def test_load_benchmarks_reads_raw_files_caps_and_reports_missing(tmp_path):
    raw = tmp_path / "math500.jsonl"
    raw.write_text("".join(json.dumps({"id": f"m{i}", "problem": f"What is ${i}+1$?", "answer": f"\\frac{{{i}}}{{2}}"})
                           + "\n" for i in range(5)))
    p = params_from_dict({"out_root": str(tmp_path), "evaluate": {"benchmark_files": {"math500": str(raw)},
                                                                  "max_problems": 3}})
    inputs, _ = ev.default_io(p)
    got = ev.load_benchmarks(p, inputs)
    assert list(got) == ["math500"] and [r["id"] for r in got["math500"]] == ["m0", "m1", "m2"]
    assert got["math500"][0]["prompt"].startswith("What is $0+1$?") and "\\boxed{}" in got["math500"][0]["prompt"]
    p2 = params_from_dict({"out_root": str(tmp_path), "evaluate": {"benchmarks": ["aime24"]}})
    with pytest.raises(FileNotFoundError, match="aime24"):
        ev.load_benchmarks(p2, ev.default_io(p2)[0])


# --------------------------------------------------------------------------------------------------
# The stage on a tiny checkpoint tree
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return F.build_tree(tmp_path_factory.mktemp("evaltree"), steps=(2,), n_problems=2)


def _outputs(root: Path) -> dict:
    return {"metrics": root / "metrics" / "eval.json", "generations": root / "results" / "generations",
            "plots": root / "metrics" / "plots" / "eval", "cache": root / "results" / "cache" / "evaluate"}


@pytest.mark.slow
def test_evaluate_writes_every_arm_checkpoint_mode_and_benchmark(tree, monkeypatch):
    calls: list = []
    F.use_engine(monkeypatch, calls)
    p = F.small_params(tree)
    inputs, outputs = ev.default_io(p)
    flat = ev.run(p, inputs, outputs)
    doc = json.loads(outputs["metrics"].read_text())
    benches = ["arith-long", "arith-short"]
    # 4 distinct models (base + one checkpoint per arm) x 3 modes x 2 benchmarks, one engine call each
    assert len(calls) == 4 * 3 * 2
    assert sorted(doc["arms"]) == sorted(F.ARMS) and sorted(doc["settings"]["benchmarks"]) == benches
    for arm in F.ARMS:
        cks = doc["arms"][arm]["checkpoints"]
        assert [c["step"] for c in cks] == [0, 2]
        assert cks[0]["hash"] == doc["junior"]["hash"] and cks[1]["hash"] != cks[0]["hash"]
        for c in cks:
            for mode in ("solo", "step", "word"):
                mb = c["modes"][mode]
                assert set(mb["benchmarks"]) == set(benches)
                for b in benches:
                    s = mb["benchmarks"][b]
                    assert s["n_problems"] == 2 and s["n_generations"] == 8
                    assert all(0.0 <= s[f"pass@{k}"] <= 1.0 for k in (1, 2, 4))
                    assert s["pass@1"] <= s["pass@2"] <= s["pass@4"]
                    gen = tree / "results" / "generations" / arm / f"step-{c['step']}" / mode / f"{b}.jsonl"
                    rows = [json.loads(x) for x in gen.read_text().splitlines()]
                    assert len(rows) == 8 and [r["sample"] for r in rows[:4]] == [0, 1, 2, 3]
                    for r in rows:
                        assert len(r["owner"]) == len(r["completion_ids"]) > 0
                        assert set(r) >= {"id", "prompt_ids", "text", "score", "answer", "finish_reason"}
                        if mode == "solo":
                            assert set(r["owner"]) == {1}
                    assert sum(r["score"] for r in rows) / 8 == pytest.approx(s["pass@1"])
                assert mb["macro"]["pass@1"] == pytest.approx(sum(mb["benchmarks"][b]["pass@1"] for b in benches) / 2)
            assert c["modes"]["solo"]["macro"]["senior_share"] == 1.0
        # the word schedule mixes authors
        assert 0.0 < cks[1]["modes"]["word"]["macro"]["senior_share"] < 1.0
    assert doc["junior"]["modes"]["solo"] == doc["arms"]["grpo"]["checkpoints"][0]["modes"]["solo"]
    assert (tree / "results" / "generations" / "junior" / "step-0" / "solo" / "arith-short.jsonl").exists()
    assert set(flat) >= {f"{a}/{m}/pass@{k}" for a in F.ARMS for m in ("solo", "step", "word") for k in (1, 2, 4)}
    with open(tree / "metrics" / "plots" / "eval" / "grpo.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["step"] for r in table] == ["0", "2"]
    assert {"solo/pass@1", "word/senior_share", "step/arith-short/pass@4", "junior/pass@2"} <= set(table[0])
    # a second run finds everything cached
    calls.clear()
    ev.run(p, inputs, outputs)
    assert calls == []


@pytest.mark.slow
def test_crash_mid_evaluate_then_rerun_skips_completed_results(tree, tmp_path, monkeypatch):
    p = F.small_params(tree)
    inputs, _ = ev.default_io(p)
    outputs = _outputs(tmp_path)
    calls: list = []
    F.use_engine(monkeypatch, calls, fail_after=5)
    with pytest.raises(RuntimeError, match="simulated crash"):
        ev.run(p, inputs, outputs)
    done = {f: f.stat().st_mtime_ns for f in outputs["cache"].glob("*.json")}
    assert len(done) == 5 and not outputs["metrics"].exists()
    calls2: list = []
    F.use_engine(monkeypatch, calls2)
    ev.run(p, inputs, outputs)
    assert len(calls2) == 4 * 3 * 2 - 5  # only what was missing
    assert {f: f.stat().st_mtime_ns for f in done} == done  # completed results untouched
    assert len(list(outputs["cache"].glob("*.json"))) == 24 and outputs["metrics"].exists()


@pytest.mark.slow
def test_raw_benchmark_file_and_model_directory_through_params_alone(tree, tmp_path):
    model_dir = tmp_path / "some-hf-model"
    shutil.copytree(tree / "models" / "base", model_dir)
    raw = tmp_path / "math500.jsonl"
    rows = [{"id": "math500/1", "problem": "Compute $\\frac{1}{2} + \\frac{1}{2}$.", "answer": "1"},
            {"id": "math500/2", "problem": "Simplify $\\sqrt{8}$.", "answer": "2\\sqrt{2}"}]
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    p = params_from_dict({
        "out_root": str(out), "model": {"source": "path", "path": str(model_dir)}, "train": {"arms": ["grpo"]},
        "evaluate": {"benchmark_files": {"math500": str(raw)}, "modes": ["solo"], "n_samples": 2, "ks": [1, 2],
                     "max_new_tokens": 8, "progress": False, "score_workers": 1}})
    flat = ev.run(p, *ev.default_io(p))
    doc = json.loads((out / "metrics" / "eval.json").read_text())
    assert doc["junior"]["path"] == str(model_dir)
    assert doc["arms"]["grpo"]["checkpoints"][0]["modes"]["solo"]["benchmarks"]["math500"]["n_generations"] == 4
    assert "grpo/solo/pass@2" in flat and "junior/solo/pass@1" in flat


@pytest.mark.slow
def test_parallel_workers_reproduce_the_sequential_results(tree, tmp_path):
    """Seeds depend on (seed, mode, benchmark, row), never on the process: two workers give the same numbers."""
    p = F.small_params(tree)
    inputs, _ = ev.default_io(p)
    seq, par = _outputs(tmp_path / "seq"), _outputs(tmp_path / "par")
    ev.run(p, inputs, seq)
    ev.run(F.small_params(tree, workers=2), inputs, par)

    def strip(d):
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if k != "seconds"}
        return [strip(v) for v in d] if isinstance(d, list) else d

    a, b = (json.loads(o["metrics"].read_text()) for o in (seq, par))
    assert strip(a["arms"]) == strip(b["arms"])
    assert sorted(f.name for f in seq["cache"].glob("*.json")) == sorted(f.name for f in par["cache"].glob("*.json"))
