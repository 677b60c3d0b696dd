"""Strict reading of a problem file (JSON Lines): every line one JSON object, UTF-8, bounded in size.

Problems that make a file unusable as a whole (missing, empty, undecodable bytes, a line that is not a JSON
object, a truncated last line, an oversized line) are collected for every line of every file and raised
together as one `DataFileError` naming file, line and rule, before anything is written. Row-level rules
(fields, types, lengths, duplicates, answers, overlaps) are checked afterwards by tasks/validation.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tandem.errors import UserError

# rule -> what it means (the README's "Failure behaviour" section lists the same)
FILE_RULES: dict[str, str] = {
    "file_exists": "the file does not exist",
    "not_empty": "the file holds no rows",
    "utf8": "the line is not valid UTF-8 text",
    "json_lines": "the line is not valid JSON (a JSON Lines file holds one JSON object per line)",
    "json_object": "the line is JSON but not an object ({...})",
    "truncated": "the last line breaks off mid-object (the file was cut short)",
    "row_size": "the line is longer than data.max_row_bytes",
    "enough_rows": "the file has too few rows for the requested split",
}


@dataclass(frozen=True)
class FileProblem:
    where: str  # "path" or "path:line"
    rule: str
    detail: str


class DataFileError(UserError):
    """One or more data files cannot be read as problem rows; `problems` names each file, line and rule."""

    def __init__(self, problems: Sequence[FileProblem], max_lines: int = 20):
        self.problems = list(problems)
        shown = self.problems[:max_lines]
        lines = [f"data input refused ({len(self.problems)} problem{'s' * (len(self.problems) != 1)}; "
                 "nothing was written):"]
        lines += [f"  {p.where}: {p.detail} [rule: {p.rule}]" for p in shown]
        if len(shown) < len(self.problems):
            lines.append(f"  ... and {len(self.problems) - len(shown)} more")
        super().__init__("\n".join(lines))


def read_problem_file(path: str | Path, what: str, max_row_bytes: int,
                      max_problems: int = 50) -> tuple[list[dict], list[FileProblem]]:
    """(rows, problems) of one jsonl file; each row gets `_where` = "<file name>:<line>" for reports.

    `what` names the file's role (e.g. "data.train_file") in messages. Blank lines are skipped. At most
    `max_problems` problems are collected per file (a file that is not JSON Lines fails on every line).
    """
    path = Path(path)
    label = f"{what} {path}"
    if not path.is_file():
        return [], [FileProblem(label, "file_exists", "does not exist" if not path.exists() else "is not a file")]
    data = path.read_bytes()
    rows: list[dict] = []
    problems: list[FileProblem] = []
    lines = data.split(b"\n")
    ends_cleanly = data.endswith(b"\n")
    for n, raw in enumerate(lines, 1):
        if len(problems) >= max_problems:
            break
        where = f"{label}:{n}"
        if len(raw) > max_row_bytes:
            problems.append(FileProblem(where, "row_size", f"{len(raw)} bytes, allowed <= {max_row_bytes} "
                                                           "(data.max_row_bytes)"))
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            problems.append(FileProblem(where, "utf8", f"byte {e.start} (0x{raw[e.start]:02x}) is not valid UTF-8"))
            continue
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            last = n == len(lines) and not ends_cleanly
            if last and text.lstrip().startswith("{") and not text.rstrip().endswith("}"):
                problems.append(FileProblem(where, "truncated", f"the line ends mid-object ({e.msg})"))
            else:
                problems.append(FileProblem(where, "json_lines", f"not valid JSON ({e.msg} at column {e.colno})"))
            continue
        if not isinstance(row, dict):
            problems.append(FileProblem(where, "json_object", f"a JSON {type(row).__name__}, expected an object"))
            continue
        row["_where"] = f"{path.name}:{n}"
        rows.append(row)
    if not rows and not problems:
        problems.append(FileProblem(label, "not_empty", "holds no rows (empty or blank lines only)"))
    return rows, problems
