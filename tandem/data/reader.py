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
from typing import BinaryIO, Iterator, Sequence

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


_SKIP_CHUNK = 1 << 20


def _lines(f: BinaryIO, max_row_bytes: int) -> Iterator[tuple[bytes | None, int, bool]]:
    """(line without its newline, its length in bytes, whether a newline ended it) for each line of a binary
    file, streamed: at most `max_row_bytes` + 1 bytes of one line are held in memory. A longer line is
    skipped in chunks and comes as (None, its length, ...)."""
    while True:
        line = f.readline(max_row_bytes + 1)
        if not line:
            return
        if line.endswith(b"\n"):
            yield line[:-1], len(line) - 1, True
            continue
        if len(line) <= max_row_bytes:  # the last line, without a newline
            yield line, len(line), False
            return
        size, ended = len(line), False
        while chunk := f.readline(_SKIP_CHUNK):
            if chunk.endswith(b"\n"):
                size, ended = size + len(chunk) - 1, True
                break
            size += len(chunk)
        yield None, size, ended
        if not ended:
            return


def read_problem_file(path: str | Path, what: str, max_row_bytes: int,
                      max_problems: int = 50) -> tuple[list[dict], list[FileProblem]]:
    """(rows, problems) of one jsonl file; each row gets `_where` = "<file name>:<line>" for reports.

    `what` names the file's role (e.g. "data.train_file") in messages. Blank lines are skipped. At most
    `max_problems` problems are collected per file (a file that is not JSON Lines fails on every line). The
    file is streamed line by line: a line longer than `max_row_bytes` is refused without being held in memory.
    """
    path = Path(path)
    label = f"{what} {path}"
    if not path.is_file():
        return [], [FileProblem(label, "file_exists", "does not exist" if not path.exists() else "is not a file")]
    rows: list[dict] = []
    problems: list[FileProblem] = []
    with open(path, "rb") as f:
        for n, (raw, size, ended) in enumerate(_lines(f, max_row_bytes), 1):
            if len(problems) >= max_problems:
                break
            where = f"{label}:{n}"
            if raw is None:
                problems.append(FileProblem(where, "row_size", f"{size} bytes, allowed <= {max_row_bytes} "
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
                if not ended and text.lstrip().startswith("{") and not text.rstrip().endswith("}"):
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
