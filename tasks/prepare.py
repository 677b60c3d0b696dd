"""Stage `prepare`: build train / val / evaluation problem sets, validate them with GX, then write them.

Two sources (`data.source`):
- `synthetic`: seeded arithmetic word problems (`tandem.data.synthetic.generate`). Evaluation benchmarks are
  generated first (in name order, from `data.eval_seed`: the same benchmarks whatever the run's seed, unless it
  is -1), then val, then train (from the run's seed), each excluding every problem drawn before it, so the
  evaluation sets do not change when the training size or the seed does and no two splits share a problem.
- `jsonl`: `data.train_file` split into a seeded held-out val slice of `n_val` rows and up to `n_train`
  training rows; one benchmark per `data.eval_files` entry, capped at `n_eval` rows (a subset seeded by
  `data.eval_seed`).

No split is written unless every file reads as JSON Lines (else `DataFileError` names file, line and rule)
and validation passes (or `data.drop_invalid` removes the bad rows): a failed validation prints the report
and raises `DataValidationError`. The validation itself, passing or not, is stored and rendered as Great
Expectations' Data Docs in `reports/data-docs/` (`index.html`; the result as `validation_result.json`). Both are `tandem.errors.UserError`s: the CLI prints them without a
traceback and exits with code 1; earlier outputs stay as they were. The Data Docs, a DVC output like the data,
are the same bytes for the same data (fixed ids, the run named after the data's fingerprint and dated at a
fixed epoch: `tasks.validation`), so a rerun of the stage reproduces all of its outputs.

The outputs change together, in one transaction (`tasks.common.stage_outputs`): `data/prepared/` is written
as a whole new folder beside `metrics/data.json` in one staging directory and both are swapped in at once, so
training data of one run never sits next to benchmarks of another, and nothing but the prepared files (no
leftover of an interrupted write) is ever inside `data/prepared/`.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any

from tandem.config import Params
from tandem.data.prompts import user_message
from tandem.data.reader import DataFileError, FileProblem, read_problem_file
from tandem.data.synthetic import ProblemShape, generate
from tasks import headline
from tasks.common import Layout, atomic_path, stage_outputs, timing_path, write_json, write_jsonl, write_metrics
from tasks.validation import DataValidationError, ValidationReport, validate_splits

__all__ = ["default_io", "run", "resolve_data_path", "DataValidationError", "DataFileError"]

REPO_ROOT = Path(__file__).resolve().parents[1]
EVAL_PREFIX = "eval/"


def resolve_data_path(params: Params, path: str) -> Path:
    """A data path from params: absolute as given; else under out_root if it exists there, else in the repo.

    Shipped sets live in the repository's data/raw; a run with its own out_root still finds them.
    """
    p = Path(path)
    if p.is_absolute():
        return p
    under_root = Path(params.out_root) / p
    if under_root.exists():
        return under_root
    in_repo = REPO_ROOT / p
    return in_repo if in_repo.exists() else under_root


def default_io(params: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    lay = Layout.of(params)
    inputs: dict[str, Path] = {}
    if params.data.source == "jsonl":
        inputs["train_file"] = resolve_data_path(params, params.data.train_file)
        for name, path in params.data.eval_files.items():
            inputs[EVAL_PREFIX + name] = resolve_data_path(params, path)
    outputs = {
        "train": lay.prepared / "train.jsonl",
        "val": lay.prepared / "val.jsonl",
        "eval": lay.prepared / "eval",
        "metrics": lay.metrics / "data.json",
        "headline": lay.metrics / "headline" / "data.json",
        "data_docs": lay.data_docs,
    }
    return inputs, outputs


# --------------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------------

def eval_seed(params: Params) -> int:
    """The evaluation benchmarks' seed: `data.eval_seed`, or the run's seed where that is -1."""
    return params.seed if params.data.eval_seed < 0 else params.data.eval_seed


def _synthetic_splits(params: Params) -> dict[str, list[dict]]:
    cfg = params.data
    seen: set[str] = set()
    splits: dict[str, list[dict]] = {}

    def draw(n: int, lo: int, hi: int, prefix: str, seed: int) -> list[dict]:
        probs = generate(n, lo, hi, seed, ProblemShape.of(cfg), exclude=seen, prefix=prefix)
        seen.update(p.problem for p in probs)
        return [p.to_dict() for p in probs]

    for name in sorted(cfg.benchmarks):
        lo, hi = cfg.benchmarks[name]
        splits[EVAL_PREFIX + name] = draw(cfg.n_eval, lo, hi, f"eval-{name}", eval_seed(params))
    splits["val"] = draw(cfg.n_val, cfg.min_steps, cfg.max_steps, "val", params.seed)
    splits["train"] = draw(cfg.n_train, cfg.min_steps, cfg.max_steps, "train", params.seed)
    return splits


def _seeded_subset(n_rows: int, k: int, rng: random.Random) -> list[int]:
    """k row indices drawn without replacement, returned in file order (k = 0 or >= n_rows: all rows)."""
    if k <= 0 or k >= n_rows:
        return list(range(n_rows))
    return sorted(rng.sample(range(n_rows), k))


def _jsonl_splits(params: Params, inputs: dict[str, Path]) -> dict[str, list[dict]]:
    """Read every file first and refuse them all at once (file, line, rule) before splitting anything."""
    cfg = params.data
    train_path = Path(inputs.get("train_file") or resolve_data_path(params, cfg.train_file))
    rows, problems = read_problem_file(train_path, "data.train_file", cfg.max_row_bytes)
    if rows and cfg.n_val >= len(rows):
        problems.append(FileProblem(f"data.train_file {train_path}", "enough_rows",
                                    f"{len(rows)} rows, but data.n_val={cfg.n_val} leaves none for training "
                                    f"(lower data.n_val below {len(rows)} or add rows)"))
    evals: dict[str, list[dict]] = {}
    for name, path in sorted(cfg.eval_files.items()):
        path = Path(inputs.get(EVAL_PREFIX + name) or resolve_data_path(params, path))
        evals[name], bad = read_problem_file(path, f"data.eval_files.{name}", cfg.max_row_bytes)
        problems += bad
    if problems:
        raise DataFileError(problems)
    order = random.Random(f"{params.seed}-prepare-split").sample(range(len(rows)), len(rows))
    val_idx = sorted(order[: cfg.n_val])
    rest = order[cfg.n_val:]
    train_idx = sorted(rest[: cfg.n_train] if cfg.n_train > 0 else rest)
    default_source = train_path.parent.name
    splits: dict[str, list[dict]] = {}
    for name, ev in evals.items():
        pick = _seeded_subset(len(ev), cfg.n_eval, random.Random(f"{eval_seed(params)}-prepare-eval-{name}"))
        splits[EVAL_PREFIX + name] = [_with_source(ev[i], name) for i in pick]
    splits["val"] = [_with_source(rows[i], default_source) for i in val_idx]
    splits["train"] = [_with_source(rows[i], default_source) for i in train_idx]
    return splits


def _with_source(row: dict, default: str) -> dict:
    return row if row.get("source") else {**row, "source": default}


# --------------------------------------------------------------------------------------------------
# Output rows and metrics
# --------------------------------------------------------------------------------------------------

def _output_row(row: dict) -> dict:
    """The prepared row shape: id, problem, answer, prompt, source (+ n_steps, solution when synthetic)."""
    out = {"id": str(row["id"]), "problem": row["problem"], "answer": row["answer"],
           "prompt": user_message(row["problem"]), "source": row.get("source", "")}
    for k in ("n_steps", "solution"):
        if k in row:
            out[k] = row[k]
    return out


def _drop_failing(splits: dict[str, list[dict]], report: ValidationReport) -> tuple[dict[str, list[dict]], list[dict]]:
    """Remove every row named by a row-level failure; returns the kept splits and what was dropped."""
    offsets, k = {}, 0
    for name, rows in splits.items():
        offsets[name] = k
        k += len(rows)
    bad: dict[str, set[int]] = {}
    dropped = []
    for f in report.failures:
        bad.setdefault(f.split, set()).add(f.row - offsets[f.split])
        dropped.append({"split": f.split, "id": f.id, "rule": f.rule, "detail": f.detail})
    kept = {name: [r for i, r in enumerate(rows) if i not in bad.get(name, ())] for name, rows in splits.items()}
    return kept, dropped


def _split_stats(rows: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": len(rows)}
    if rows:
        out["problem_chars_mean"] = round(mean(len(r["problem"]) for r in rows), 1)
        steps = [r["n_steps"] for r in rows if isinstance(r.get("n_steps"), int)]
        if steps:
            out["n_steps"] = {"min": min(steps), "max": max(steps), "mean": round(mean(steps), 3)}
    return out


def run(params: Params, inputs: dict[str, Path], outputs: dict[str, Path]) -> dict:
    """Build, validate and write the prepared splits; returns the metrics written to metrics/data.json."""
    t0 = time.perf_counter()
    cfg = params.data
    splits = _synthetic_splits(params) if cfg.source == "synthetic" else _jsonl_splits(params, inputs)
    evals = [s for s in splits if s.startswith(EVAL_PREFIX)]
    # math-verify parses ~200 LaTeX answers a second per process: use the cores there are (synthetic
    # integer answers skip it entirely)
    # the validation is stored and rendered as GX Data Docs whether it passes or not (a failure's page names
    # every failing row)
    with atomic_path(outputs["data_docs"]) as docs:
        docs.mkdir()
        report = validate_splits(splits, cfg, eval_splits=evals, parse_workers=max(1, min(8, os.cpu_count() or 1)),
                                 docs_dir=docs)
    print(f"prepare: {report.format().splitlines()[0]}; Data Docs: {Path(outputs['data_docs']) / 'index.html'}",
          file=sys.stderr, flush=True)

    dropped: list[dict] = []
    if not report.passed:
        table_level = [f for f in report.failures if f.split == "*"]
        if not cfg.drop_invalid or table_level:
            print(report.format(max_rows=None), file=sys.stderr, flush=True)
            raise DataValidationError(report)
        splits, dropped = _drop_failing(splits, report)
        print(f"prepare: data.drop_invalid removed {len({(f.split, f.row) for f in report.failures})} rows:\n"
              + report.format(max_rows=50), file=sys.stderr, flush=True)

    prepared = {name: [_output_row(r) for r in rows] for name, rows in splits.items()}
    targets, paths_in = _output_plan(outputs)
    with stage_outputs(params, "prepare", targets) as staged:
        paths = paths_in(staged)
        if "prepared" in staged:
            staged["prepared"].mkdir()
        write_jsonl(paths["train"], prepared["train"])
        write_jsonl(paths["val"], prepared["val"])
        # the whole eval folder is new, so benchmarks dropped from params leave no stale files
        paths["eval"].mkdir()
        for name in evals:
            write_jsonl(paths["eval"] / f"{name[len(EVAL_PREFIX):]}.jsonl", prepared[name])

        metrics = {
            "source": cfg.source,
            "seed": params.seed,
            "counts": {"train": len(prepared["train"]), "val": len(prepared["val"]),
                       "eval": {n[len(EVAL_PREFIX):]: len(prepared[n]) for n in evals}},
            "splits": {name: _split_stats(splits[name]) for name in splits},
            "validation": report.summary(),
            "dropped": dropped,
            "seconds": round(time.perf_counter() - t0, 3),
        }
        write_metrics(paths["metrics"], metrics, timing_to=timing_path(outputs["metrics"]))
        write_json(paths["headline"], headline.data(metrics))
    return metrics


def _output_plan(outputs: dict[str, Path]):
    """(targets of the transaction, staged targets -> where each output is written).

    The declared layout keeps train, val and eval in one folder (`data/prepared/`, one DVC output): that folder
    is the target, written whole. Outputs placed elsewhere by a caller are targets one by one."""
    files = {k: Path(outputs[k]) for k in ("train", "val", "eval")}
    folder = files["train"].parent
    if all(p.parent == folder for p in files.values()) and len({p.name for p in files.values()}) == 3:
        return ({"prepared": folder, "metrics": Path(outputs["metrics"]), "headline": Path(outputs["headline"])},
                lambda staged: {**{k: staged["prepared"] / p.name for k, p in files.items()},
                                "metrics": staged["metrics"], "headline": staged["headline"]})
    return {**files, "metrics": Path(outputs["metrics"]), "headline": Path(outputs["headline"])}, dict
