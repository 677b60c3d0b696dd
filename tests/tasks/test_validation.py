"""Tests for tasks/validation.py: every rule reported through one GX run, with row ids, and a readable report."""

from __future__ import annotations

import pytest

import json

from tandem.config import DataConfig
from tasks.validation import RULES, DataValidationError, normalise_problem, validate_splits

CFG = DataConfig(min_problem_chars=10, max_problem_chars=120, max_answer_chars=20)

GOOD_TRAIN = [
    {"id": "t1", "problem": "What is the sum of 12 and 30?", "answer": "42"},
    {"id": "t2", "problem": "Compute one half of one.", "answer": r"\frac{1}{2}"},
    {"id": 3, "problem": "Which direction does the sun rise in?", "answer": r"\text{east}"},  # int ids are fine
]
BAD_TRAIN = [
    {"id": "dup", "problem": "First row with a repeated id.", "answer": "1"},
    {"id": "dup", "problem": "Second row with a repeated id.", "answer": "2"},
    {"problem": "This row has no id field at all.", "answer": "4", "_where": "f.jsonl:6"},
    {"id": ["not", "an", "id"], "problem": "This row has a list for an id.", "answer": "4"},
    {"id": "null-problem", "problem": None, "answer": "5"},
    {"id": "num-problem", "problem": 12345678901, "answer": "5"},
    {"id": "no-answer", "problem": "This row has no answer field."},
    {"id": "blank-problem", "problem": "            ", "answer": "6"},
    {"id": "blank-answer", "problem": "This row has a blank answer.", "answer": "   "},
    {"id": "short-problem", "problem": "1+1=?", "answer": "2"},
    {"id": "long-problem", "problem": "word " * 30, "answer": "81"},
    {"id": "long-answer", "problem": "Write a very long number.", "answer": "1234567890123456789012345"},
    {"id": "bad-answer", "problem": "This answer does not parse.", "answer": r"\frac{"},
    {"id": "leaked", "problem": "What   is 7 TIMES 6?", "answer": "42"},
    {"id": "in-val", "problem": "A problem that is also held out.", "answer": "1"},
]
VAL = [
    {"id": "v1", "problem": "a problem that is ALSO held out.", "answer": "1"},
    {"id": "v-leaked", "problem": "What is 9 minus 4?", "answer": "5"},
]
EVAL = [
    {"id": "e1", "problem": "What is 7 times 6?", "answer": "42"},
    {"id": "e2", "problem": "What is 9 minus 4?", "answer": "5"},
    {"id": "e2", "problem": "What is 9 plus 4?", "answer": "13"},
]

EXPECTED = {
    ("train", "dup", "unique_id"),
    ("train", "(no id: f.jsonl:6)", "id_not_null"),
    ("train", "(no id: row 7)", "id_not_null"),
    ("train", "null-problem", "problem_not_null"),
    ("train", "num-problem", "problem_not_null"),
    ("train", "no-answer", "answer_not_null"),
    ("train", "blank-problem", "problem_not_empty"),
    ("train", "blank-answer", "answer_not_empty"),
    ("train", "short-problem", "problem_length"),
    ("train", "long-problem", "problem_length"),
    ("train", "long-answer", "answer_length"),
    ("train", "bad-answer", "answer_parses"),
    ("train", "leaked", "no_eval_overlap"),
    ("train", "in-val", "no_train_val_overlap"),
    ("val", "v-leaked", "no_eval_overlap"),
    ("eval/toy", "e2", "unique_id"),
}


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data-docs")


@pytest.fixture(scope="module")
def bad_report(docs_dir):
    """One validation run over every kind of bad row (GX imports once per module), with its Data Docs."""
    splits = {"train": GOOD_TRAIN + BAD_TRAIN, "val": VAL, "eval/toy": EVAL}
    return validate_splits(splits, CFG, eval_splits=["eval/toy"], docs_dir=docs_dir)


def test_every_bad_row_and_rule_is_reported(bad_report):
    got = {(f.split, f.id, f.rule) for f in bad_report.failures}
    assert got == EXPECTED
    assert not bad_report.passed
    assert bad_report.n_rows == len(GOOD_TRAIN) + len(BAD_TRAIN) + len(VAL) + len(EVAL)
    # the duplicate ids are reported on both rows
    assert sum(1 for f in bad_report.failures if f.id == "dup") == 2


def test_report_format_names_every_row_and_rule(bad_report):
    text = bad_report.format()
    assert text.startswith("data validation FAILED")
    for split, rid, rule in EXPECTED:
        line = next(ln for ln in text.splitlines() if f" {rid} " in ln and f" {rule} " in ln)
        assert split in line
    assert "answer = '\\\\frac{'" in text  # the detail shows the offending value
    assert "also in eval/toy" in text
    for rule in {r for _, _, r in EXPECTED}:
        assert f"{rule} (" in text and RULES[rule] in text
    short = bad_report.format(max_rows=3)
    assert f"... and {len(bad_report.failures) - 3} more" in short


def test_summary_counts_failures_by_rule(bad_report):
    s = bad_report.summary()
    assert s["passed"] is False
    assert s["failures"] == len(bad_report.failures) == len(EXPECTED) + 2  # dup x2, e2 x2
    assert s["failures_by_rule"]["unique_id"] == 4
    assert s["failures_by_rule"]["id_not_null"] == 2
    assert set(s["rules"]) == set(RULES)


def test_clean_splits_pass(bad_report):
    report = validate_splits({"train": GOOD_TRAIN, "val": VAL[:1], "eval/toy": EVAL[:2]}, CFG)
    assert report.passed, report.format()
    assert report.failures == []
    assert report.format().startswith("data validation passed")
    assert report.n_expectations == bad_report.n_expectations


def test_a_missing_column_is_a_table_failure(bad_report):
    rows = [{"id": "a", "problem": "A problem without an answer column."}]
    report = validate_splits({"train": rows}, CFG)
    assert [(f.split, f.id, f.rule) for f in report.failures] == [("*", "*", "required_columns")]
    assert "'answer'" in report.failures[0].detail


def test_limits_come_from_the_config(bad_report):
    rows = [{"id": "a", "problem": "x" * 50, "answer": "12345"}]
    assert validate_splits({"train": rows}, DataConfig()).passed
    strict = DataConfig(max_problem_chars=40, max_answer_chars=4)
    got = {f.rule for f in validate_splits({"train": rows}, strict).failures}
    assert got == {"problem_length", "answer_length"}


def test_error_carries_the_report(bad_report):
    err = DataValidationError(bad_report)
    assert err.report is bad_report
    assert "bad-answer" in str(err)


def test_normalise_problem():
    assert normalise_problem("  What IS\n 7\ttimes 6? ") == "what is 7 times 6?"


def test_a_failing_validation_is_stored_and_rendered_as_data_docs(bad_report, docs_dir):
    result = json.loads((docs_dir / "validation_result.json").read_text())
    assert result["success"] is False and len(result["results"]) == bad_report.n_expectations
    failed = {r["expectation_config"]["meta"]["rule"] for r in result["results"] if not r["success"]}
    assert failed == {rule for _, _, rule in EXPECTED}
    assert (docs_dir / "index.html").is_file()
    (page,) = (docs_dir / "validations" / "prepared_data").rglob("*.html")  # this run's validation page
    assert "Failed" in page.read_text() or "failed" in page.read_text()


@pytest.mark.integration
@pytest.mark.slow
def test_data_docs_open_in_headless_chromium(bad_report, docs_dir):
    """The Data Docs index and the validation page load in a browser; the validation page shows the suite and its
    rules. GX's styles and scripts come from CDNs, which an offline machine cannot reach: the index draws its list
    of validations with them (so offline its source holds the list, not its text), the validation page is HTML."""
    from tests.report.chromium import ensure_chromium, load_page

    chromium, why = ensure_chromium()
    if chromium is None:
        pytest.skip(f"browser test skipped: {why}")
    index = load_page(chromium, docs_dir / "index.html")
    assert "Data Docs" in index.text
    (page,) = (docs_dir / "validations" / "prepared_data").rglob("*.html")
    assert page.relative_to(docs_dir).as_posix() in (docs_dir / "index.html").read_text()  # the index lists it
    shown = load_page(chromium, page)
    assert "prepared_data" in shown.text and "_answer_parses" in shown.text


def test_data_docs_carry_no_random_id_and_no_wall_clock(bad_report, docs_dir):
    """The Data Docs are a DVC output: their ids are fixed (uuid5), the run is named after the data and dated at
    a fixed epoch, and nothing the renderer stamps (load time, URL dates, random block ids) is left."""
    import re
    import uuid

    from tasks.validation import DOCS_RUN_TIME

    result = json.loads((docs_dir / "validation_result.json").read_text())
    meta = result["meta"]
    ids = [r["expectation_config"]["id"] for r in result["results"]] + [meta["validation_id"], meta["checkpoint_id"]]
    assert len(set(ids)) == len(ids) and all(uuid.UUID(i).version == 5 for i in ids)
    assert re.fullmatch(r"data-[0-9a-f]{16}", meta["run_id"]["run_name"])
    assert meta["validation_time"] == meta["run_id"]["run_time"] == DOCS_RUN_TIME.isoformat()
    assert meta["batch_markers"]["ge_load_time"] == "19700101T000000.000000Z"
    (page,) = (docs_dir / "validations" / "prepared_data").rglob("*.html")
    assert page.parent.relative_to(docs_dir).as_posix() == \
        f"validations/prepared_data/{meta['run_id']['run_name']}/19700101T000000.000000Z"
    this_year = str(__import__("datetime").date.today().year)
    for f in [*docs_dir.rglob("*.html"), docs_dir / "validation_result.json"]:
        text = f.read_text()
        assert this_year not in text and "?d=" not in text, f
        found = re.findall(r"collapse-body-([0-9a-f-]{36})", text)
        assert all(uuid.UUID(u).version == 5 for u in found), f
