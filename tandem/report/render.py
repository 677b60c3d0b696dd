"""Render a `Report` as one self-contained HTML page (base64 PNGs, inline CSS) or as Markdown.

Generated text is untrusted: a model can emit `<script>`, `<img onerror=...>`, Markdown links or fences.
HTML output escapes every string with `html.escape` (quotes included) and loads nothing from outside the
page; Markdown output escapes inline text and puts verbatim text in a fence longer than any backtick run
inside it, so nothing a model writes can become markup.
"""

from __future__ import annotations

import base64
import html
import math
import re
from typing import Any

from tandem.report.document import Estimate, Report, Table

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#1d1d1f;line-height:1.45}
h1{margin-bottom:.2em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}
.subtitle{color:#555;margin-top:0}
figure{margin:1.2em 0}figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{color:#444;font-size:.92em;margin-top:.3em}
table{border-collapse:collapse;margin:1em 0;font-size:.92em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th:first-child,td:first-child{text-align:left}th{background:#f4f4f6}
caption{caption-side:top;text-align:left;font-weight:600;padding-bottom:.3em}
.note{color:#555;font-size:.88em}
pre{background:#f6f8fa;border:1px solid #e1e4e8;padding:.6em;white-space:pre-wrap;word-break:break-word;
font-size:.85em;max-height:24em;overflow:auto}
.label{font-weight:600;margin-bottom:.2em}
"""


def format_cell(value: Any) -> str:
    """Numbers to short strings; None and NaN to an en dash (undefined is never shown as 0)."""
    if value is None:
        return "\u2013"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "\u2013"
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3g}"
        return f"{value:.3f}"
    return str(value)


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not (
        isinstance(value, float) and math.isnan(value))


def _floats(cell: Any) -> list[float]:
    """The non-integer numbers of a cell (an Estimate's value and bounds included)."""
    parts = [cell.value, cell.low, cell.high] if isinstance(cell, Estimate) else [cell]
    return [float(v) for v in parts if _is_num(v) and (isinstance(v, float) or isinstance(cell, Estimate))]


def decimals_for(values: list[float]) -> int | None:
    """One number format for a group of values: 3 decimals, or 3 significant digits of the largest when every
    value is below 0.1 (a KL of 0.00087 keeps its digits and 0.001 shows as 0.00100 beside it); None
    (scientific notation) from 1e5 up."""
    mags = [abs(v) for v in values if v != 0]
    if not mags:
        return 3
    top = max(mags)
    if top >= 1e5:
        return None
    if top >= 0.1:
        return 3
    return min(8, 2 - math.floor(math.log10(top)))


def _fmt(value: Any, decimals: int | None, signed: bool = False) -> str:
    if not _is_num(value):
        return format_cell(value)
    if isinstance(value, int) and not signed:
        return str(value)
    sign = "+" if signed else ""
    return f"{value:{sign}.3g}" if decimals is None else f"{value:{sign}.{decimals}f}"


def format_with(cell: Any, decimals: int | None) -> str:
    """One cell in its group's number format (`decimals_for`)."""
    if isinstance(cell, Estimate):
        ci = (f"[{_fmt(cell.low, decimals, cell.signed)}, {_fmt(cell.high, decimals, cell.signed)}]"
              if _is_num(cell.low) and _is_num(cell.high) else "")
        if cell.value is None or (isinstance(cell.value, float) and math.isnan(cell.value)):
            return ci or "\u2013"
        return f"{_fmt(cell.value, decimals, cell.signed)} {ci}".rstrip()
    return _fmt(cell, decimals) if isinstance(cell, float) else format_cell(cell)


def formatted_rows(t: Table) -> list[list[str]]:
    """The table's cells as text: one number format per column (per row within each of `t.row_groups`)."""
    grouped = {i for g in t.row_groups for i in g}
    ncols = max([len(t.headers)] + [len(r) for r in t.rows])
    col_dec = {j: decimals_for([v for r in t.rows if j < len(r) for v in _floats(r[j])])
               for j in range(ncols) if j not in grouped}
    out = []
    for r in t.rows:
        dec = dict(col_dec)
        for g in t.row_groups:
            d = decimals_for([v for j in g if j < len(r) for v in _floats(r[j])])
            dec.update({j: d for j in g})
        out.append([format_with(c, dec.get(j, 3)) for j, c in enumerate(r)])
    return out


def proportion_decimals(n: int) -> int:
    """Decimals worth showing for a proportion (pass@k) averaged over `n` problems: its 95% interval is about
    +-1/sqrt(n) wide at worst, so one decimal past that width's first digit (n = 8: 2, n = 500: 3)."""
    return 1 + math.ceil(math.log10(math.sqrt(max(int(n), 1))))


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _safe_href(href: str) -> str:
    """Only a relative path to a file next to the report is linked (no scheme, no markup characters)."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", href) or re.search(r"[<>\s\"'`()]", href):
        raise ValueError(f"report links are relative file paths, got {href!r}")
    return href


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "section"


def _html_table(t: Table) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in t.headers)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row) + "</tr>" for row in formatted_rows(t))
    note = f'<p class="note">{_esc(t.note)}</p>' if t.note else ""
    return (f"<table><caption>{_esc(t.caption)}</caption><thead><tr>{head}</tr></thead>"
            f"<tbody>{body}</tbody></table>{note}")


def render_html(report: Report) -> str:
    """One HTML page with every figure embedded as a data URI; no external resource, no script."""
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           # The page needs nothing from elsewhere: forbid scripts and remote loads outright.
           "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; "
           "style-src 'unsafe-inline'\">",
           f"<title>{_esc(report.title)}</title><style>{_CSS}</style></head><body>",
           f"<h1>{_esc(report.title)}</h1>"]
    if report.subtitle:
        out.append(f'<p class="subtitle">{_esc(report.subtitle)}</p>')
    if len(report.sections) > 1:
        out.append("<nav><ul>" + "".join(f'<li><a href="#{_slug(s.title)}">{_esc(s.title)}</a></li>'
                                         for s in report.sections) + "</ul></nav>")
    for s in report.sections:
        out.append(f'<section id="{_slug(s.title)}"><h2>{_esc(s.title)}</h2>')
        out.extend(f"<p>{_esc(p)}</p>" for p in s.paragraphs)
        out.extend(f'<p><a href="{_esc(_safe_href(ln.href))}">{_esc(ln.label)}</a></p>' for ln in s.links)
        for f in s.figures:
            b64 = base64.b64encode(f.png).decode("ascii")
            out.append(f'<figure><img src="data:image/png;base64,{b64}" alt="{_esc(f.caption)}">'
                       f"<figcaption>{_esc(f.caption)}</figcaption></figure>")
        out.extend(_html_table(t) for t in s.tables)
        for tb in s.texts:
            out.append(f'<div class="label">{_esc(tb.label)}</div><pre>{_esc(tb.text)}</pre>')
        out.append("</section>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]#!|~>])")
_MD_LINE_START = re.compile(r"^(\s*)([-+=]|\d+)([.)]?)(?=\s|$)")  # a list marker needs a space after


def md_escape(text: Any) -> str:
    """Inline Markdown text: escape markup characters, raw HTML, entities, and list markers at the start.

    Newlines become spaces, so the only line start is the beginning of the string.
    """
    s = str(text).replace("\r", " ").replace("\n", " ").replace("&", "&amp;").replace("<", "&lt;")
    s = _MD_SPECIAL.sub(r"\\\1", s)
    def _lead(m: re.Match) -> str:  # "- x" / "+ x" lose the marker's meaning; so does "1." as "1\\."
        if m.group(2)[0].isdigit():
            return m.group(1) + m.group(2) + ("\\" + m.group(3) if m.group(3) else "")
        return m.group(1) + "\\" + m.group(2) + m.group(3)

    return _MD_LINE_START.sub(_lead, s, count=1)


def md_fence(text: str) -> str:
    """A fenced block that `text` cannot close: the fence is longer than its longest backtick run."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def _md_table(t: Table) -> str:
    lines = [f"**{md_escape(t.caption)}**", "",
             "| " + " | ".join(md_escape(h) for h in t.headers) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(t.headers) - 1)) + "|"]
    lines += ["| " + " | ".join(md_escape(c) for c in row) + " |" for row in formatted_rows(t)]
    if t.note:
        lines += ["", f"_{md_escape(t.note)}_"]
    return "\n".join(lines)


def render_markdown(report: Report, figure_dir: str = "figures") -> str:
    """Markdown with figures linked as `<figure_dir>/<name>.png` (the caller writes those files)."""
    out = [f"# {md_escape(report.title)}", ""]
    if report.subtitle:
        out += [md_escape(report.subtitle), ""]
    for s in report.sections:
        out += [f"## {md_escape(s.title)}", ""]
        for p in s.paragraphs:
            out += [md_escape(p), ""]
        for ln in s.links:
            out += [f"[{md_escape(ln.label)}](<{_safe_href(ln.href)}>)", ""]
        for f in s.figures:
            out += [f"![{md_escape(f.caption)}]({figure_dir}/{_slug(f.name)}.png)", "",
                    f"_{md_escape(f.caption)}_", ""]
        for t in s.tables:
            out += [_md_table(t), ""]
        for tb in s.texts:
            out += [f"**{md_escape(tb.label)}**", "", md_fence(tb.text), ""]
    return "\n".join(out).rstrip() + "\n"


def figure_filename(name: str) -> str:
    """The file name `render_markdown` links for a figure called `name`."""
    return f"{_slug(name)}.png"
