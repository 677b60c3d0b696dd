"""Tests for the `prepare` stage: synthetic and jsonl sources, output shape, determinism, disjoint splits,
and the acceptance test: one bad row of each kind -> a report naming every id and rule, no outputs, an error."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tandem.config import params_from_dict
from tandem.data.prompts import user_message
from tandem.rewards import score
from tasks import prepare
from tasks.common import read_json, read_jsonl, read_metrics
from tandem.data.reader import DataFileError
from tasks.validation import DataValidationError, normalise_problem

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "prepare"
REPO = Path(__file__).resolve().parents[2]

# every bad row of fixtures/prepare/bad_train.jsonl, and the rule it breaks (eval.jsonl repeats id e2)
BAD_ROWS = {
    ("train", "dup", "unique_id"),
    ("train", "(no id: bad_train.jsonl:5)", "id_not_null"),
    ("train", "null-problem", "problem_not_null"),
    ("train", "no-answer", "answer_not_null"),
    ("train", "blank-problem", "problem_not_empty"),
    ("train", "blank-answer", "answer_not_empty"),
    ("train", "short-problem", "problem_length"),
    ("train", "long-problem", "problem_length"),
    ("train", "long-answer", "answer_length"),
    ("train", "bad-answer", "answer_parses"),
    ("train", "leaked", "no_eval_overlap"),
    ("eval/toy", "e2", "unique_id"),
}


def _params(tmp_path: Path, **data) -> object:
    return params_from_dict({"seed": data.pop("seed", 0), "out_root": str(tmp_path), "data": data})


def _bad_params(tmp_path: Path, **extra) -> object:
    return _params(tmp_path, source="jsonl", train_file=str(FIXTURES / "bad_train.jsonl"),
                   eval_files={"toy": str(FIXTURES / "eval.jsonl")}, n_train=0, n_val=0, n_eval=0,
                   max_problem_chars=300, max_answer_chars=20, **extra)


def _run(params):
    inputs, outputs = prepare.default_io(params)
    return prepare.run(params, inputs, outputs), outputs


def _files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory):
    """The acceptance case, run once: (out_root, raised error, captured stderr)."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("bad")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(DataValidationError) as exc:
        _run(_bad_params(root))
    return root, exc.value, err.getvalue()


@pytest.fixture(scope="module")
def small_synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn")
    metrics, outputs = _run(_params(root, n_train=300, n_val=40, n_eval=25))
    return root, metrics, outputs


# --------------------------------------------------------------------------------------------------
# Acceptance: bad rows
# --------------------------------------------------------------------------------------------------

def test_bad_rows_are_all_reported(bad_run):
    _, err, _ = bad_run
    got = {(f.split, f.id, f.rule) for f in err.report.failures}
    assert got == BAD_ROWS


def test_bad_rows_report_is_printed_and_in_the_error(bad_run):
    _, err, stderr = bad_run
    for text in (stderr, str(err)):
        assert "data validation FAILED" in text
        for _, rid, rule in BAD_ROWS:
            assert any(rid in ln and rule in ln for ln in text.splitlines()), (rid, rule)


def test_bad_rows_write_no_outputs(bad_run):
    """No prepared split or metric is written; only the failed validation's Data Docs page (its report)."""
    root, _, _ = bad_run
    docs = root / "reports" / "data-docs"
    assert [p for p in _files_under(root) if docs not in p.parents] == []
    assert (docs / "index.html").is_file()


def test_drop_invalid_writes_only_the_good_rows(tmp_path):
    metrics, outputs = _run(_bad_params(tmp_path, drop_invalid=True))
    train_ids = [r["id"] for r in read_jsonl(outputs["train"])]
    assert train_ids == ["g1", "g2", "g3", "g4"]
    assert [r["id"] for r in read_jsonl(outputs["eval"] / "toy.jsonl")] == ["e1"]
    assert {(d["split"], d["id"], d["rule"]) for d in metrics["dropped"]} == BAD_ROWS
    assert read_json(outputs["metrics"])["counts"] == {"train": 4, "val": 0, "eval": {"toy": 1}}


def test_a_row_that_is_not_json_names_its_line(tmp_path):
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"id": "a", "problem": "A fine problem here.", "answer": "1"}\n{"id": "b", oops}\n')
    params = _params(tmp_path, source="jsonl", train_file=str(bad), n_val=0,
                     eval_files={"toy": str(FIXTURES / "eval.jsonl")})
    with pytest.raises(DataFileError, match=r"broken.jsonl:2: not valid JSON"):
        _run(params)
    missing = _params(tmp_path, source="jsonl", train_file=str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataFileError, match="nope.jsonl: does not exist"):
        _run(missing)


# --------------------------------------------------------------------------------------------------
# Synthetic source
# --------------------------------------------------------------------------------------------------

def test_synthetic_outputs_and_row_shape(small_synthetic):
    root, metrics, outputs = small_synthetic
    assert metrics["counts"] == {"train": 300, "val": 40,
                                 "eval": {"arith-short": 25, "arith-mid": 25, "arith-long": 25}}
    assert metrics["validation"]["passed"] is True
    assert read_metrics(outputs["metrics"]) == metrics  # the file itself holds no wall times
    assert "seconds" not in read_json(outputs["metrics"])
    assert sorted(p.name for p in outputs["eval"].iterdir()) == ["arith-long.jsonl", "arith-mid.jsonl",
                                                                 "arith-short.jsonl"]
    rows = read_jsonl(outputs["train"])
    assert list(rows[0]) == ["id", "problem", "answer", "prompt", "source", "n_steps", "solution"]
    for r in rows:
        assert r["prompt"] == user_message(r["problem"])
        assert 2 <= r["n_steps"] <= 8
        assert score(r["solution"], r["answer"]) == 1.0  # the reference solution earns the reward
    for name, (lo, hi) in {"arith-short": (2, 3), "arith-mid": (4, 5), "arith-long": (6, 8)}.items():
        steps = {r["n_steps"] for r in read_jsonl(outputs["eval"] / f"{name}.jsonl")}
        assert steps <= set(range(lo, hi + 1))


def test_synthetic_splits_never_share_a_problem(small_synthetic):
    _, _, outputs = small_synthetic
    files = [outputs["train"], outputs["val"], *sorted(outputs["eval"].iterdir())]
    seen: dict[str, str] = {}
    for f in files:
        for r in read_jsonl(f):
            key = normalise_problem(r["problem"])
            assert key not in seen, f"{r['id']} in {f.name} repeats a problem of {seen.get(key)}"
            seen[key] = f.name


def test_synthetic_is_deterministic_in_the_seed(small_synthetic, tmp_path):
    _, _, outputs = small_synthetic
    _, again = _run(_params(tmp_path / "a", n_train=300, n_val=40, n_eval=25))
    for key in ("train", "val"):
        assert again[key].read_bytes() == outputs[key].read_bytes()
    _, other = _run(_params(tmp_path / "b", n_train=300, n_val=40, n_eval=25, seed=1))
    assert other["train"].read_bytes() != outputs["train"].read_bytes()


def test_eval_sets_do_not_depend_on_the_training_size(small_synthetic, tmp_path):
    _, _, outputs = small_synthetic
    _, bigger = _run(_params(tmp_path, n_train=600, n_val=40, n_eval=25))
    for f in sorted(outputs["eval"].iterdir()):
        assert (bigger["eval"] / f.name).read_bytes() == f.read_bytes()
    assert (bigger["val"]).read_bytes() == outputs["val"].read_bytes()


def test_stale_eval_files_are_removed(tmp_path):
    stale = tmp_path / "data" / "prepared" / "eval" / "old-benchmark.jsonl"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}\n")
    _, outputs = _run(_params(tmp_path, n_train=30, n_val=5, n_eval=5, benchmarks={"only": [2, 3]}))
    assert sorted(p.name for p in outputs["eval"].iterdir()) == ["only.jsonl"]


@pytest.mark.slow
def test_default_params_run_under_30_seconds(tmp_path):
    params = params_from_dict({"out_root": str(tmp_path)})
    t0 = time.perf_counter()
    metrics, _ = _run(params)
    wall = time.perf_counter() - t0
    assert metrics["counts"]["train"] == 4000
    assert wall < 30, f"prepare took {wall:.1f} s on the default params"


# --------------------------------------------------------------------------------------------------
# jsonl source with the shipped sets
# --------------------------------------------------------------------------------------------------

def test_jsonl_source_with_math500(tmp_path):
    """Relative paths resolve to the repository's data/raw when out_root does not hold them."""
    params = _params(tmp_path, source="jsonl", n_train=40, n_val=10, n_eval=20,
                     train_file="data/raw/math_train/train.jsonl",
                     eval_files={"math500": "data/raw/math500/test.jsonl"})
    inputs, outputs = prepare.default_io(params)
    assert inputs == {"train_file": REPO / "data/raw/math_train/train.jsonl",
                      "eval/math500": REPO / "data/raw/math500/test.jsonl"}
    metrics = prepare.run(params, inputs, outputs)
    assert metrics["counts"] == {"train": 40, "val": 10, "eval": {"math500": 20}}
    source = {r["id"]: r for r in read_jsonl(REPO / "data/raw/math500/test.jsonl")}
    ev = read_jsonl(outputs["eval"] / "math500.jsonl")
    assert len({r["id"] for r in ev}) == 20
    for r in ev:
        assert list(r) == ["id", "problem", "answer", "prompt", "source"]
        assert (r["problem"], r["answer"], r["source"]) == (source[r["id"]]["problem"], source[r["id"]]["answer"],
                                                            "math500")
        assert r["prompt"] == user_message(r["problem"])
    train, val = read_jsonl(outputs["train"]), read_jsonl(outputs["val"])
    assert not {r["id"] for r in train} & {r["id"] for r in val}
    assert all(r["id"].startswith("math_train-") and r["source"] == "math_train" for r in train + val)
    # the same seed draws the same rows
    _, again = _run(params_from_dict({**params.to_dict(), "out_root": str(tmp_path / "again")}))
    assert again["val"].read_bytes() == outputs["val"].read_bytes()


def test_every_shipped_set_has_provenance():
    text = (REPO / "data" / "raw" / "PROVENANCE.md").read_text()
    for f in sorted((REPO / "data" / "raw").glob("*/*.jsonl")):
        assert f"{f.parent.name}/{f.name}" in text
        first = json.loads(f.open().readline())
        assert set(first) == {"id", "problem", "answer", "source"}


def test_the_benchmarks_stay_put_while_the_seed_varies_training(tmp_path):
    # data.eval_seed fixes the evaluation problems (a benchmark is a benchmark); the run's seed draws train and val
    shape = dict(n_train=40, n_val=10, n_eval=6, benchmarks={"short": [2, 3], "long": [5, 6]})
    splits = {(seed, es): prepare._synthetic_splits(_params(tmp_path, seed=seed, eval_seed=es, **shape))
              for seed, es in ((0, 0), (1, 0), (1, -1), (1, 1))}
    evals = {k: {n: rows for n, rows in s.items() if n.startswith(prepare.EVAL_PREFIX)} for k, s in splits.items()}
    assert evals[(1, 0)] == evals[(0, 0)]  # another seed, the same benchmarks
    assert evals[(1, -1)] == evals[(1, 1)] != evals[(0, 0)]  # -1: the run's seed draws them
    assert splits[(1, 0)]["train"] != splits[(0, 0)]["train"] and splits[(1, 0)]["val"] != splits[(0, 0)]["val"]
    for s in splits.values():  # no split shares a problem with another, whichever seed drew it
        problems = [r["problem"] for rows in s.values() for r in rows]
        assert len(problems) == len(set(problems))
