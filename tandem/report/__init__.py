"""The results report: figures (matplotlib, Agg), tables, HTML and Markdown rendering, promotion comparison.

Inputs are the plain dicts of `metrics/eval.json` and `metrics/analysis.json` (schemas in docs/metrics.md),
so everything here can be called from a notebook on saved metrics. All text that can come from a model
(generations, token strings) is escaped by the renderers; HTML output is self-contained (base64 PNGs).
"""

from tandem.report.document import Estimate, Figure, Link, Report, Section, Table, TextBlock
from tandem.report.promotion import Candidate, Decision, best_checkpoint, decide
from tandem.report.render import render_html, render_markdown

__all__ = [
    "Estimate", "Figure", "Link", "Report", "Section", "Table", "TextBlock",
    "Candidate", "Decision", "best_checkpoint", "decide",
    "render_html", "render_markdown",
]
