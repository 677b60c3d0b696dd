"""Malformed data files, each used as the training file (`data.train_file`) and as a benchmark (`data.eval_files`).

Every case goes through `tasks.prepare.run` on tiny files in a temporary output root that already holds the
outputs of an earlier good run. The case must be refused with an error naming the file, the line or row id and
the rule, and the earlier outputs must stay byte for byte as they were (no new files either). Validation fails
closed: an expectation that raises inside Great Expectations is a failure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem.config import params_from_dict
from tandem.data.reader import DataFileError
from tasks import prepare, validation
from tasks.validation import DataValidationError


def _row(i: int | str, problem: str | None = None, answer: str = "7") -> dict:
    return {"id": f"r{i}", "problem": problem or f"What is {i} plus seven, counted twice?", "answer": answer}


GOOD_TRAIN = [_row(i) for i in range(6)]
GOOD_EVAL = [{"id": f"e{i}", "problem": f"Benchmark question number {i}: what is {i} times two?",
              "answer": str(2 * i)} for i in range(3)]


def _lines(rows: list) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


@dataclass(frozen=True)
class Case:
    name: str
    content: bytes | None  # None: the file does not exist
    kind: str  # "file": DataFileError; "row": DataValidationError
    rule: str
    where: str  # the line ("file.jsonl:3") or row id the error must name
    bad_row: dict | None = None  # row cases: appended to the role's good rows


BAD_ROW_CASES = [  # (name, bad row, rule, id shown in the report)
    ("missing id", {"problem": "A problem without any id at all.", "answer": "1"}, "id_not_null", "(no id: "),
    ("missing problem", {"id": "x1", "answer": "1"}, "problem_not_null", "x1"),
    ("missing answer", {"id": "x1", "problem": "A problem without an answer."}, "answer_not_null", "x1"),
    ("extra column", {"id": "x1", "problem": "A problem with an extra field.", "answer": "1", "difficulty": 3},
     "known_fields", "x1"),
    ("answer not a string", {"id": "x1", "problem": "A numeric answer is the wrong type.", "answer": 42},
     "answer_not_null", "x1"),
    ("problem not a string", {"id": "x1", "problem": ["a", "list"], "answer": "1"}, "problem_not_null", "x1"),
    ("id not a string", {"id": 1.5, "problem": "A float id is the wrong type.", "answer": "1"}, "id_not_null",
     "(no id: "),
    ("null answer", {"id": "x1", "problem": "An answer that is null.", "answer": None}, "answer_not_null", "x1"),
    ("blank problem", {"id": "x1", "problem": "   \t ", "answer": "1"}, "problem_not_empty", "x1"),
    ("empty answer", {"id": "x1", "problem": "An answer that is empty.", "answer": ""}, "answer_not_empty", "x1"),
    ("unparseable answer", {"id": "x1", "problem": "This answer does not parse.", "answer": "\\frac{"},
     "answer_parses", "x1"),
    ("oversized problem", {"id": "x1", "problem": "Long " * 100, "answer": "1"}, "problem_length", "x1"),
    ("oversized answer", {"id": "x1", "problem": "An answer far too long.", "answer": "1" * 50}, "answer_length",
     "x1"),
]


def _cases() -> list[Case]:
    out = [Case(name, b"", "row", rule, rid, bad_row=bad) for name, bad, rule, rid in BAD_ROW_CASES]
    good = json.dumps(_row(0)).encode()
    out += [
        Case("duplicate id in one file", _lines([_row(1), {**_row(2), "id": "r1"}, _row(3), _row(4)]), "row",
             "unique_id", "r1"),
        Case("invalid UTF-8", good + b"\n" + b'{"id": "u1", "problem": "caf\xe9 au lait problem", "answer": "1"}\n',
             "file", "utf8", ":2"),
        Case("empty file", b"", "file", "not_empty", "bad.jsonl"),
        Case("blank lines only", b"\n  \n\n", "file", "not_empty", "bad.jsonl"),
        Case("a JSON array, not JSON Lines", b'[\n  {"id": "a", "problem": "p", "answer": "1"}\n]\n', "file",
             "json_lines", ":1"),
        Case("CSV, not JSON Lines", b"id,problem,answer\na,What is one?,1\n", "file", "json_lines", ":1"),
        Case("a line that is not an object", good + b"\n[1, 2, 3]\n", "file", "json_object", ":2"),
        Case("truncated last line", good + b'\n{"id": "t1", "problem": "This line was cut of', "file",
             "truncated", ":2"),
        Case("garbage mid-file", good + b"\n{oops}\n" + good + b"\n", "file", "json_lines", ":2"),
        Case("oversized line", good + b"\n" + json.dumps({"id": "big", "problem": "x" * 3000, "answer": "1"}).encode()
             + b"\n", "file", "row_size", ":2"),
        Case("missing file", None, "file", "file_exists", "bad.jsonl"),
    ]
    return out


CASES = _cases()


def _files(case: Case, role: str, tmp: Path) -> tuple[Path, Path]:
    """(training file, benchmark file) for one case in one role; the bad file is always called bad.jsonl."""
    src = tmp / "src"
    src.mkdir(exist_ok=True)
    bad = src / "bad.jsonl"
    if case.content is not None:
        if case.bad_row is not None:
            bad.write_bytes(_lines((GOOD_TRAIN if role == "train" else GOOD_EVAL) + [case.bad_row]))
        else:
            bad.write_bytes(case.content)
    if role == "train":
        good = src / "eval.jsonl"
        good.write_bytes(_lines(GOOD_EVAL))
        return bad, good
    good = src / "train.jsonl"
    good.write_bytes(_lines(GOOD_TRAIN))
    return good, bad


def _params(root: Path, train: Path, bench: Path, bench_name: str, **data):
    cfg = {"source": "jsonl", "train_file": str(train), "eval_files": {bench_name: str(bench)}, "n_train": 0,
           "n_val": 1, "n_eval": 0, "min_problem_chars": 10, "max_problem_chars": 300, "max_answer_chars": 20,
           "max_row_bytes": 2000, **data}
    return params_from_dict({"seed": 0, "out_root": str(root), "data": cfg})


def _earlier_outputs(root: Path) -> dict[Path, bytes]:
    """Outputs of an earlier good run (stand-ins) that a refused run must leave untouched."""
    files = {root / "data" / "prepared" / "train.jsonl": b'{"id": "old"}\n',
             root / "data" / "prepared" / "val.jsonl": b'{"id": "old-val"}\n',
             root / "data" / "prepared" / "eval" / "old.jsonl": b'{"id": "old-eval"}\n',
             root / "metrics" / "data.json": b'{"old": true}\n'}
    for p, b in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b)
    return files


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` but the Data Docs (a refused validation's own report page is written there)."""
    docs = root / "reports" / "data-docs"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and docs not in p.parents}


def _run(params):
    inputs, outputs = prepare.default_io(params)
    return prepare.run(params, inputs, outputs)


@pytest.mark.parametrize("role", ["train", "benchmark"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_malformed_input_is_refused_before_anything_is_written(case: Case, role: str, tmp_path, capsys):
    train, bench = _files(case, role, tmp_path)
    root = tmp_path / "out"
    _earlier_outputs(root)
    before = _snapshot(root)
    params = _params(root, train, bench, "bad" if role == "benchmark" else "toy")

    err_type = DataFileError if case.kind == "file" else DataValidationError
    with pytest.raises(err_type) as exc:
        _run(params)
    err = exc.value
    if case.kind == "file":
        hits = [p for p in err.problems if p.rule == case.rule]
        assert hits, str(err)
        assert any("bad.jsonl" in p.where and case.where in p.where for p in hits), str(err)
        which = "data.train_file" if role == "train" else "data.eval_files.bad"
        assert all(p.where.startswith(which) for p in err.problems), str(err)
        text = str(err)
        assert f"[rule: {case.rule}]" in text and len(text.splitlines()) <= 22
    else:
        splits = {"train", "val"} if role == "train" else {"eval/bad"}
        hits = [f for f in err.report.failures if f.rule == case.rule and f.split in splits]
        assert hits, err.report.format()
        assert any(case.where in f.id for f in hits), err.report.format()
        assert case.rule in str(err)
    assert _snapshot(root) == before  # earlier outputs untouched, nothing new


def test_duplicate_ids_across_train_and_val_are_refused(tmp_path):
    """Two rows with one id, split apart by n_val=1: uniqueness holds per source file, not per split."""
    src = tmp_path / "train.jsonl"
    src.write_bytes(_lines([_row(1), {**_row(2), "id": "r1"}]))
    ev = tmp_path / "eval.jsonl"
    ev.write_bytes(_lines(GOOD_EVAL))
    with pytest.raises(DataValidationError) as exc:
        _run(_params(tmp_path / "out", src, ev, "toy", n_val=1))
    hits = [f for f in exc.value.report.failures if f.rule == "unique_id"]
    assert {f.split for f in hits} == {"train", "val"} and {f.id for f in hits} == {"r1"}


@pytest.mark.parametrize("role", ["train", "benchmark"])
def test_train_benchmark_overlap_is_refused(role, tmp_path):
    """The same problem (case and spacing aside) in the training file and a benchmark, planted from either side."""
    shared = "What is 11 plus seven, counted twice?"
    train_rows, eval_rows = list(GOOD_TRAIN), list(GOOD_EVAL)
    if role == "train":
        train_rows.append(_row("leak", problem="  what IS 11 plus   seven, counted twice? "))
        eval_rows.append({"id": "e-shared", "problem": shared, "answer": "36"})
    else:
        train_rows.append(_row("shared", problem=shared))
        eval_rows.append({"id": "e-leak", "problem": shared.upper(), "answer": "36"})
    (tmp_path / "t.jsonl").write_bytes(_lines(train_rows))
    (tmp_path / "e.jsonl").write_bytes(_lines(eval_rows))
    root = tmp_path / "out"
    _earlier_outputs(root)
    before = _snapshot(root)
    with pytest.raises(DataValidationError) as exc:
        _run(_params(root, tmp_path / "t.jsonl", tmp_path / "e.jsonl", "bench", n_val=0))
    assert any(f.rule == "no_eval_overlap" for f in exc.value.report.failures)
    assert _snapshot(root) == before


def test_too_few_rows_for_the_validation_split(tmp_path):
    src = tmp_path / "train.jsonl"
    src.write_bytes(_lines(GOOD_TRAIN[:3]))
    ev = tmp_path / "eval.jsonl"
    ev.write_bytes(_lines(GOOD_EVAL))
    root = tmp_path / "out"
    _earlier_outputs(root)
    before = _snapshot(root)
    with pytest.raises(DataFileError) as exc:
        _run(_params(root, src, ev, "toy", n_val=3))
    (p,) = exc.value.problems
    assert p.rule == "enough_rows" and "train.jsonl" in p.where and "data.n_val=3" in p.detail
    assert _snapshot(root) == before


def test_every_bad_file_is_named_in_one_report(tmp_path):
    """Problems in the training file and in two benchmarks come back together, each with its file and line."""
    (tmp_path / "t.jsonl").write_bytes(b'{"id": "a"')  # cut short: no closing brace, no newline
    (tmp_path / "e1.jsonl").write_bytes(b"")
    (tmp_path / "e2.jsonl").write_bytes(b"\xff\xfe\n")
    params = params_from_dict({"seed": 0, "out_root": str(tmp_path / "out"), "data": {
        "source": "jsonl", "train_file": str(tmp_path / "t.jsonl"),
        "eval_files": {"one": str(tmp_path / "e1.jsonl"), "two": str(tmp_path / "e2.jsonl")}}})
    with pytest.raises(DataFileError) as exc:
        _run(params)
    got = {(p.rule, re.search(r"([\w.]+\.jsonl)", p.where).group(1)) for p in exc.value.problems}
    assert got == {("truncated", "t.jsonl"), ("not_empty", "e1.jsonl"), ("utf8", "e2.jsonl")}


# --------------------------------------------------------------------------------------------------
# Great Expectations fails closed
# --------------------------------------------------------------------------------------------------

def _with_erroring_expectation(monkeypatch):
    """Add an expectation whose metric raises inside GX (an invalid regular expression)."""
    real = validation.build_expectations

    def build(cfg, present):
        import great_expectations.expectations as gxe

        return real(cfg, present) + [gxe.ExpectColumnValuesToMatchRegex(column="problem", regex="(",
                                                                        meta={"rule": "problem_not_empty"})]

    monkeypatch.setattr(validation, "build_expectations", build)


def test_an_expectation_that_errors_is_a_failure(monkeypatch):
    from tandem.config import DataConfig

    _with_erroring_expectation(monkeypatch)
    report = validation.validate_splits({"train": GOOD_TRAIN, "eval/x": GOOD_EVAL}, DataConfig(), parse_workers=1)
    assert not report.passed
    (f,) = report.failures
    assert f.rule == "expectation_error" and f.split == "*" and "problem_not_empty" in f.detail
    assert "expectation_error" in report.format()


def test_clean_data_passes_without_the_erroring_expectation():
    """The control for the test above: the same rows pass when every expectation computes."""
    from tandem.config import DataConfig

    assert validation.validate_splits({"train": GOOD_TRAIN, "eval/x": GOOD_EVAL}, DataConfig(),
                                      parse_workers=1).passed


@pytest.mark.parametrize("drop_invalid", [False, True])
def test_prepare_refuses_when_an_expectation_errors(monkeypatch, tmp_path, drop_invalid):
    _with_erroring_expectation(monkeypatch)
    (tmp_path / "t.jsonl").write_bytes(_lines(GOOD_TRAIN))
    (tmp_path / "e.jsonl").write_bytes(_lines(GOOD_EVAL))
    root = tmp_path / "out"
    _earlier_outputs(root)
    before = _snapshot(root)
    with pytest.raises(DataValidationError, match="expectation_error"):
        _run(_params(root, tmp_path / "t.jsonl", tmp_path / "e.jsonl", "toy", drop_invalid=drop_invalid))
    assert _snapshot(root) == before


def test_the_expectation_error_reader_knows_both_gx_shapes():
    assert validation.expectation_error(None) is None
    assert validation.expectation_error({"raised_exception": False, "exception_message": None}) is None
    assert validation.expectation_error({"raised_exception": True, "exception_message": "boom"}) == "boom"
    keyed = {"MetricConfigurationID(metric_name='x')": {"raised_exception": True, "exception_message": "bad"}}
    assert validation.expectation_error(keyed) == "bad"
