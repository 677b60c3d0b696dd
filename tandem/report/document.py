"""The report as data: sections holding paragraphs, figures, tables and verbatim text blocks.

Builders fill these plain containers; `tandem.report.render` turns them into HTML or Markdown. Every string
here is treated as untrusted text by the renderers (escaped), except `Figure.png`, which is raw PNG bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Figure:
    """One PNG figure; `name` is a file-safe slug used for the Markdown copy and the W&B key."""

    name: str
    caption: str
    png: bytes


@dataclass(frozen=True)
class Estimate:
    """A table cell: a value with its 95% interval, shown '<value> [<low>, <high>]' ('[<low>, <high>]' without a
    value) in the number format of its column; `signed` shows a sign on every number (a difference)."""

    value: float | None
    low: float | None = None
    high: float | None = None
    signed: bool = False


@dataclass(frozen=True)
class Table:
    """A table of cells (numbers and `Estimate`s are formatted by the renderer, None shows as an en dash).

    The renderer gives each column one number format. `row_groups` lists groups of column indices whose cells
    share one format per row instead (a table whose rows are different measures, each in its own unit)."""

    caption: str
    headers: list[str]
    rows: list[list[Any]]
    note: str = ""
    row_groups: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class TextBlock:
    """Verbatim text (e.g. one model generation) shown preformatted under a label."""

    label: str
    text: str


@dataclass(frozen=True)
class Link:
    """A link to a page next to the report (a relative path the report's own code chose, e.g. the Data Docs)."""

    label: str
    href: str


@dataclass
class Section:
    title: str
    paragraphs: list[str] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    texts: list[TextBlock] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)


@dataclass
class Report:
    title: str
    subtitle: str = ""
    sections: list[Section] = field(default_factory=list)

    def figures(self) -> list[Figure]:
        return [f for s in self.sections for f in s.figures]
