"""Great Expectations checks on prepared problem tables: one suite, one run, one report naming every bad row.

All splits (train, val and each evaluation benchmark) are stacked into one table with a `split` column and
validated by one GX 1.x suite in an ephemeral context, through a checkpoint run that can store and render the
result as GX's Data Docs (the prepare stage keeps them in `reports/data-docs/`, linked from the report). Rules GX
cannot compute itself (does math-verify parse the answer? does a training problem also appear in an evaluation
set?) are computed first as boolean helper columns, then expected to be True through GX, so every rule reports
through the same result. GX is imported inside `validate_splits` because its import costs seconds.

The Data Docs are a DVC output of `prepare`, so they depend on the validated data alone, like every other
output: GX would give every run random ids (expectations, suite, validation definition, checkpoint, the HTML's
collapsible blocks) and wall-clock names (the run's folder and time, the batch's load time, a date parameter on
the logo's URL). Here the ids are fixed (`_fixed_id`), the run's name is the data's fingerprint
(`data-<sha256 prefix>`) and its time a fixed epoch (`DOCS_RUN_TIME`), and what GX's renderer still stamps is
rewritten after rendering (`_settle_docs`), so two runs on the same data write the same bytes.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from tandem.config import DataConfig, apply_tool_env
from tandem.errors import DiskFullError, UserError
from tandem.rewards import parses_many

REQUIRED = ("id", "problem", "answer")
# fields a problem row may carry besides the required ones; anything else is refused (`known_fields`)
OPTIONAL = ("source", "solution", "n_steps")
TRAINING_SPLITS = ("train", "val")

# rule name -> what a failing row broke (shown under the report)
RULES: dict[str, str] = {
    "required_columns": "the table has no such column at all",
    "id_not_null": "id is missing, null, or not a string/integer",
    "problem_not_null": "problem is missing, null, or not a string",
    "answer_not_null": "answer is missing, null, or not a string",
    "problem_not_empty": "problem is blank",
    "answer_not_empty": "answer is blank",
    "known_fields": "the row has a field other than id, problem, answer, source, solution, n_steps",
    "unique_id": "id repeats within its source file (train + val come from one file) or benchmark",
    "problem_length": "problem length outside [data.min_problem_chars, data.max_problem_chars]",
    "answer_length": "answer longer than data.max_answer_chars",
    "answer_parses": "math-verify builds no math expression from the answer (read as $answer$)",
    "no_eval_overlap": "a training/validation problem also appears in an evaluation benchmark",
    "no_train_val_overlap": "a training problem also appears in the validation split",
    "expectation_error": "a validation check itself raised an error, so its rows count as failed (fail closed)",
}


class DataValidationError(UserError):
    """Prepared data broke validation rules; `report` names each failing row and rule."""

    def __init__(self, report: "ValidationReport"):
        self.report = report
        super().__init__(report.format())

    def summary(self) -> str:
        """The one line the CLI prints after the stage has printed the whole report."""
        bad = len({(f.split, f.id) for f in self.report.failures})
        return (f"data validation found {len(self.report.failures)} failures in {bad} rows (report above); "
                "nothing was written: fix the rows named there (or set data.drop_invalid: true to drop them)")


@dataclass(frozen=True)
class Failure:
    split: str
    id: str  # the row's id, "(no id: <file:line or row N>)" when it has none, "*" for a whole-table failure
    rule: str
    detail: str = ""
    row: int = -1  # position in the stacked table (splits in the order given), for sorting


@dataclass
class ValidationReport:
    n_rows: int
    rows_per_split: dict[str, int]
    n_expectations: int
    failures: list[Failure] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures

    def counts_by_rule(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.failures:
            out[f.rule] = out.get(f.rule, 0) + 1
        return out

    def summary(self) -> dict:
        """JSON-ready summary for metrics files."""
        return {
            "passed": self.passed,
            "rows_checked": self.n_rows,
            "expectations": self.n_expectations,
            "failures": len(self.failures),
            "failures_by_rule": self.counts_by_rule(),
            "rules": sorted(RULES),
            "seconds": round(self.seconds, 3),
        }

    def format(self, max_rows: int | None = 200) -> str:
        """Readable report: a verdict line, then one line per failing (split, id, rule) with a detail."""
        head = (f"data validation {'passed' if self.passed else 'FAILED'}: {self.n_rows} rows in "
                f"{len(self.rows_per_split)} splits, {self.n_expectations} expectations")
        if self.passed:
            return head
        bad_rows = len({(f.split, f.id) for f in self.failures})
        lines = [f"{head}; {len(self.failures)} failures in {bad_rows} rows"]
        shown = self.failures if max_rows is None else self.failures[:max_rows]
        w_split = max(len("split"), *(len(f.split) for f in shown))
        w_id = max(len("id"), *(len(f.id) for f in shown))
        w_rule = max(len("rule"), *(len(f.rule) for f in shown))
        lines.append(f"  {'split':<{w_split}}  {'id':<{w_id}}  {'rule':<{w_rule}}  detail")
        for f in shown:
            lines.append(f"  {f.split:<{w_split}}  {f.id:<{w_id}}  {f.rule:<{w_rule}}  {f.detail}")
        if len(shown) < len(self.failures):
            lines.append(f"  ... and {len(self.failures) - len(shown)} more")
        lines.append("rules broken:")
        for rule, n in sorted(self.counts_by_rule().items()):
            lines.append(f"  {rule} ({n}): {RULES.get(rule, '')}")
        return "\n".join(lines)


def normalise_problem(text: str) -> str:
    """Text used for overlap checks: lower case, whitespace runs collapsed."""
    return " ".join(text.lower().split())


def _clip(value: Any, n: int = 60) -> str:
    s = repr(value)
    return s if len(s) <= n else s[: n - 3] + "..."


def _as_text(value: Any, allow_int: bool = False) -> str | None:
    if isinstance(value, str):
        return value
    if allow_int and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def _import_gx_quietly() -> None:
    try:
        import great_expectations.expectations  # noqa: F401
    except Exception:
        pass  # the import in the caller's thread raises it again, with its traceback


DOCS_SITE = "tandem"  # the Data Docs site's name in the GX context
# Fixed identity of the Data Docs (module docstring): uuid5 ids in a namespace of their own, and one run time for
# every run, so the run's folder and the pages name the data's fingerprint, never the moment they were made.
DOCS_NAMESPACE = uuid.UUID("6f1c2a52-3a7e-5d0b-9c41-7d2f0e5b8a13")
DOCS_RUN_TIME = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_GX_STAMP = DOCS_RUN_TIME.strftime("%Y%m%dT%H%M%S.%fZ")  # GX's own format for load times and URL dates
_URL_DATE = re.compile(r"\?d=\d{8}T\d{6}\.\d{6}Z(&?)")
_COLLAPSE_ID = re.compile(r"(collapse-body-)([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")


def _fixed_id(*parts: object) -> str:
    """A stable id for a GX object (`expectation`, 3, `unique_id`): the same on every run."""
    return str(uuid.uuid5(DOCS_NAMESPACE, "/".join(map(str, parts))))


def data_fingerprint(records: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """SHA-256 of the validated table (its columns and every row): the Data Docs' run name."""
    text = json.dumps({"columns": list(columns), "rows": list(records)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _fixed_ids(obj: Any, kind: str) -> Any:
    """`obj` (a suite, validation definition or checkpoint just added to its store) with fixed ids in place of
    the random ones the store gave it, saved (an update keeps an id that is set); each object is settled before
    the next one refers to it, so GX's freshness checks see saved objects."""
    obj.id = _fixed_id(kind, obj.name)
    for i, exp in enumerate(getattr(obj, "expectations", None) or []):
        exp.id = _fixed_id(kind, obj.name, "expectation", i, exp.meta.get("rule", ""), exp.expectation_type)
    obj.save()
    return obj


def _settle_docs(docs_dir: Path, load_time: str | None) -> None:
    """Rewrite what GX's renderer stamps on every page although no option turns it off: the batch's load time
    (wall clock) becomes DOCS_RUN_TIME, the logo URL's date parameter goes, and each page's random ids of
    collapsible blocks become ids numbered in page order (a link and its block keep sharing one)."""
    for f in sorted(Path(docs_dir).rglob("*")):
        if f.suffix not in (".html", ".json") or not f.is_file():
            continue
        text = f.read_text(encoding="utf-8")
        new = text.replace(load_time, _GX_STAMP) if load_time else text
        new = _URL_DATE.sub(lambda m: "?" if m.group(1) else "", new)
        seen: dict[str, str] = {}
        rel = f.relative_to(docs_dir).as_posix()
        new = _COLLAPSE_ID.sub(lambda m: m.group(1) + seen.setdefault(m.group(2), _fixed_id(rel, "collapse",
                                                                                          len(seen))), new)
        if new != text:
            f.write_text(new, encoding="utf-8")


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _docs_errors:
    """GX logs a failed Data Docs write (a page-long traceback) and goes on: keep it off the terminal, turn a
    full disk into `DiskFullError` naming the Data Docs folder, and say any other failure in one line."""

    LOGGER = "great_expectations.render.renderer.site_builder"

    def __init__(self, docs_dir: Path | None):
        self.docs_dir, self.handler = docs_dir, _Captured()

    def __enter__(self) -> None:
        log = logging.getLogger(self.LOGGER)
        self.propagate, log.propagate = log.propagate, False
        log.addHandler(self.handler)

    def __exit__(self, *exc: Any) -> None:
        log = logging.getLogger(self.LOGGER)
        log.removeHandler(self.handler)
        log.propagate = self.propagate
        if exc[0] is not None or not self.handler.messages:
            return
        text = "\n".join(self.handler.messages)
        if "No space left on device" in text or f"Errno {errno.ENOSPC}" in text:
            raise DiskFullError(self.docs_dir if self.docs_dir is not None else "Data Docs")
        last = [ln for ln in text.splitlines() if ln.strip()][-1][:300]
        logging.getLogger(__name__).warning("Data Docs were not fully rendered in %s: %s", self.docs_dir, last)


def _gx_context(docs_dir: Path | None = None) -> Any:
    """A fresh ephemeral GX context with analytics and progress bars off; with `docs_dir`, one local Data Docs
    site rendered there (GX's own HTML: an index, the suite, one page per validation run)."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    sites = {} if docs_dir is None else {DOCS_SITE: {
        "class_name": "SiteBuilder", "show_how_to_buttons": False, "show_cta_footer": False,
        "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(Path(docs_dir).resolve())},
        "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"}}}
    config = DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
        analytics_enabled=False,
        progress_bars=ProgressBarsConfig(globally=False, metric_calculations=False),
        data_docs_sites=sites,
    )
    return gx.get_context(project_config=config, mode="ephemeral")


def validate_splits(splits: Mapping[str, Sequence[Mapping[str, Any]]], cfg: DataConfig,
                    eval_splits: Sequence[str] | None = None, parse_timeout: float | None = None,
                    parse_workers: int = 2, docs_dir: Path | None = None) -> ValidationReport:
    """Validate every split's rows against the data rules; never raises on bad data (see `.passed`).

    `splits` maps split name -> rows (dicts with at least id, problem, answer; an optional `_where` such as
    "file.jsonl:12" names a row that has no id). Splits named "train" and "val" are training splits;
    `eval_splits` (default: every other split) are evaluation benchmarks. With `docs_dir`, the run is also
    stored and rendered there as Great Expectations' Data Docs (`index.html`), passing or not, with the
    validation result as `validation_result.json`.
    """
    t0 = time.perf_counter()
    import pandas as pd

    names = list(splits)
    evals = [s for s in (eval_splits if eval_splits is not None else names) if s not in TRAINING_SPLITS]
    unknown = [s for s in evals if s not in splits]
    if unknown:
        raise ValueError(f"eval_splits names splits that are not given: {unknown}")
    timeout = parse_timeout if parse_timeout is not None else cfg.parse_timeout
    # GX takes seconds to import and math-verify runs in worker processes: overlap the two
    apply_tool_env()  # GX's analytics off before it is imported
    gx_import = threading.Thread(target=_import_gx_quietly, name="gx-import", daemon=True)
    gx_import.start()

    # one record per row; helper columns hold the rules GX cannot compute
    records: list[dict] = []
    raw_rows: list[Mapping[str, Any]] = []
    present: set[str] = set()
    for split in names:
        first = len(raw_rows)
        for row in splits[split]:
            present.update(k for k in REQUIRED if k in row)
            where = row.get("_where") or f"row {len(raw_rows) - first + 1}"
            extra = sorted(k for k in row if k not in REQUIRED and k not in OPTIONAL and k != "_where")
            rec = {"_row": len(records), "split": split, "_where": where,
                   # train and val are one source file: an id repeated across them is a duplicate too
                   "_id_group": "train+val" if split in TRAINING_SPLITS else split,
                   "_extra": extra, "_known_fields": not extra,
                   "id": _as_text(row.get("id"), allow_int=True),
                   "problem": _as_text(row.get("problem")), "answer": _as_text(row.get("answer"))}
            records.append(rec)
            raw_rows.append(row)

    answers = [r["answer"] if r["answer"] is not None and r["answer"].strip() else None for r in records]
    todo = [i for i, a in enumerate(answers) if a is not None]
    ok = parses_many([answers[i] for i in todo], timeout=timeout, workers=parse_workers)
    for r in records:
        r["_answer_parses"] = None
    for i, good in zip(todo, ok):
        records[i]["_answer_parses"] = bool(good)

    eval_texts: dict[str, list[str]] = {}
    for r in records:
        if r["split"] in evals and r["problem"] is not None and r["problem"].strip():
            eval_texts.setdefault(normalise_problem(r["problem"]), []).append(r["split"])
    val_texts = {normalise_problem(r["problem"]) for r in records
                 if r["split"] == "val" and r["problem"] is not None and r["problem"].strip()}
    for r in records:
        r["_no_eval_overlap"] = r["_no_train_val_overlap"] = None
        if r["problem"] is None or not r["problem"].strip() or r["split"] not in TRAINING_SPLITS:
            continue
        key = normalise_problem(r["problem"])
        r["_no_eval_overlap"] = key not in eval_texts
        if r["split"] == "train":
            r["_no_train_val_overlap"] = key not in val_texts

    columns = ["_row", "split", "_id_group", *[c for c in REQUIRED if c in present], "_known_fields",
               "_answer_parses", "_no_eval_overlap", "_no_train_val_overlap"]
    df = pd.DataFrame.from_records(records, columns=columns) if records else pd.DataFrame(columns=columns)
    # object dtype keeps None as None (pandas' string dtype would turn it into NaN, which GX also treats as null)
    df = df.astype({c: object for c in columns if c != "_row"})

    gx_import.join()
    import great_expectations as gx

    expectations = build_expectations(cfg, present)
    ctx = _gx_context(docs_dir)
    batch_def = ctx.data_sources.add_pandas("prepared").add_dataframe_asset("rows") \
        .add_batch_definition_whole_dataframe("all")
    suite = _fixed_ids(ctx.suites.add(gx.ExpectationSuite(name="prepared_data", expectations=expectations)),
                       "suite")
    # a checkpoint run (GX's way to validate and keep the result): its UpdateDataDocsAction renders the Data Docs
    validation = _fixed_ids(ctx.validation_definitions.add(gx.ValidationDefinition(
        name="prepared_data", data=batch_def, suite=suite)), "validation")
    actions = [gx.checkpoint.UpdateDataDocsAction(name="data_docs", site_names=[DOCS_SITE])] if docs_dir else []
    checkpoint = _fixed_ids(ctx.checkpoints.add(gx.Checkpoint(
        name="prepare", validation_definitions=[validation], actions=actions,
        result_format={"result_format": "COMPLETE", "unexpected_index_column_names": ["_row"]})), "checkpoint")
    from great_expectations.core.run_identifier import RunIdentifier

    # the run is named after the data, at a fixed time: its Data Docs folder is the same for the same data
    run_id = RunIdentifier(run_name=f"data-{data_fingerprint(records, columns)[:16]}", run_time=DOCS_RUN_TIME)
    with _docs_errors(docs_dir):
        run = checkpoint.run(batch_parameters={"dataframe": df}, run_id=run_id)
    (result,) = run.run_results.values()
    if docs_dir is not None:
        (Path(docs_dir) / "validation_result.json").write_text(json.dumps(result.to_json_dict(), indent=1,
                                                                          default=str) + "\n")
        _settle_docs(Path(docs_dir), (result.meta.get("batch_markers") or {}).get("ge_load_time"))

    failures: list[Failure] = []
    for res in result.results:
        name = res.expectation_config.meta["rule"]
        error = expectation_error(res.exception_info)
        if error is not None:
            # GX reports a metric that raised as an exception_info and an empty result: no unexpected rows.
            # Read that as "every row unchecked", i.e. failed, never as clean.
            failures.append(Failure("*", "*", "expectation_error", f"{name}: {error}"))
            continue
        if res.success:
            continue
        if name == "required_columns":
            col = res.expectation_config.kwargs["column"]
            failures.append(Failure("*", "*", name, f"no row has a {col!r} field"))
            continue
        for hit in res.result.get("unexpected_index_list") or []:
            i = int(hit["_row"])
            failures.append(_row_failure(records[i], raw_rows[i], name, cfg, eval_texts))
    rule_order = {r: k for k, r in enumerate(RULES)}
    failures.sort(key=lambda f: (f.row, rule_order.get(f.rule, 99)))
    return ValidationReport(n_rows=len(records), rows_per_split={s: len(splits[s]) for s in names},
                            n_expectations=len(expectations), failures=failures,
                            seconds=time.perf_counter() - t0)


def build_expectations(cfg: DataConfig, present: set[str]) -> list[Any]:
    """The GX expectations of the suite, each tagged with its rule name in `meta`."""
    import great_expectations.expectations as gxe

    def rule(exp_cls: type, name: str, **kw: Any) -> Any:
        return exp_cls(meta={"rule": name}, **kw)

    expectations = [rule(gxe.ExpectColumnToExist, "required_columns", column=c) for c in REQUIRED]
    for c in REQUIRED:
        if c in present:
            expectations.append(rule(gxe.ExpectColumnValuesToNotBeNull, f"{c}_not_null", column=c))
    if "problem" in present:
        expectations += [
            rule(gxe.ExpectColumnValuesToMatchRegex, "problem_not_empty", column="problem", regex=r"\S"),
            rule(gxe.ExpectColumnValueLengthsToBeBetween, "problem_length", column="problem",
                 min_value=cfg.min_problem_chars, max_value=cfg.max_problem_chars),
        ]
    if "answer" in present:
        expectations += [
            rule(gxe.ExpectColumnValuesToMatchRegex, "answer_not_empty", column="answer", regex=r"\S"),
            rule(gxe.ExpectColumnValueLengthsToBeBetween, "answer_length", column="answer",
                 max_value=cfg.max_answer_chars),
        ]
    if "id" in present:
        expectations.append(rule(gxe.ExpectCompoundColumnsToBeUnique, "unique_id", column_list=["_id_group", "id"],
                                 ignore_row_if="any_value_is_missing"))
    for col, name in (("_known_fields", "known_fields"), ("_answer_parses", "answer_parses"),
                      ("_no_eval_overlap", "no_eval_overlap"), ("_no_train_val_overlap", "no_train_val_overlap")):
        expectations.append(rule(gxe.ExpectColumnValuesToBeInSet, name, column=col, value_set=[True]))
    return expectations


def expectation_error(exception_info: Any) -> str | None:
    """The message of an expectation that raised, else None.

    GX 1.x gives either one dict (`raised_exception`, `exception_message`) or, when a metric raised, a dict
    keyed by metric id holding such dicts; both shapes are read.
    """
    if not exception_info:
        return None
    infos = [exception_info] if "raised_exception" in exception_info else list(exception_info.values())
    for info in infos:
        if isinstance(info, dict) and info.get("raised_exception"):
            return str(info.get("exception_message") or "raised an exception")
    return None


def _label(rec: dict) -> str:
    return rec["id"] if rec["id"] is not None else f"(no id: {rec['_where']})"


def _row_failure(rec: dict, raw: Mapping[str, Any], rule: str, cfg: DataConfig,
                 eval_texts: dict[str, list[str]]) -> Failure:
    """One failing row with a detail that says what was wrong with it."""
    if rule.endswith("_not_null"):
        col = rule[: -len("_not_null")]
        if col not in raw:
            detail = f"no {col!r} field"
        elif raw[col] is None:
            detail = f"{col} is null"
        else:
            detail = f"{col} = {_clip(raw[col])} is a {type(raw[col]).__name__}, expected a string"
    elif rule == "problem_length":
        detail = (f"{len(rec['problem'])} chars, allowed [{cfg.min_problem_chars}, {cfg.max_problem_chars}]: "
                  f"{_clip(rec['problem'], 40)}")
    elif rule == "answer_length":
        detail = f"{len(rec['answer'])} chars, allowed <= {cfg.max_answer_chars}"
    elif rule in ("problem_not_empty", "answer_not_empty", "answer_parses"):
        col = "answer" if rule.startswith("answer") else "problem"
        detail = f"{col} = {_clip(rec[col])}"
    elif rule == "unique_id":
        detail = f"id {rec['id']!r} appears more than once in {rec['_id_group']}"
    elif rule == "known_fields":
        detail = f"unknown field(s) {', '.join(map(repr, rec['_extra']))}"
    elif rule == "no_eval_overlap":
        where = sorted(set(eval_texts.get(normalise_problem(rec["problem"]), [])))
        detail = f"problem also in {', '.join(where)}: {_clip(rec['problem'], 40)}"
    elif rule == "no_train_val_overlap":
        detail = f"problem also in val: {_clip(rec['problem'], 40)}"
    else:
        detail = ""
    return Failure(rec["split"], _label(rec), rule, detail, rec["_row"])
