"""HTML/Markdown rendering: untrusted text is escaped, the HTML is self-contained, cells format honestly."""

from __future__ import annotations

import base64
import math
import re
from html.parser import HTMLParser

import pytest

from tandem.report.document import Figure, Report, Section, Table, TextBlock
from tandem.report.render import figure_filename, format_cell, md_escape, md_fence, render_html, render_markdown

from tests.report.fake_metrics import HOSTILE

PNG_1x1 = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8/5+hHgAHggJ/PchI7wAAAABJRU5ErkJggg==")


def _report(text: str = HOSTILE) -> Report:
    return Report(title=f"T {text}", subtitle=text, sections=[
        Section(f"S {text}", paragraphs=[text],
                figures=[Figure("fig one", f'cap " onload="x {text}', PNG_1x1)],
                tables=[Table(text, ["model", text], [[text, 0.5], ["b", None]], note=text)],
                texts=[TextBlock(text, text)]),
        Section("second")])


class _Tags(HTMLParser):
    """Every start tag with its attributes, as a browser's tokenizer would see them."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _tags(page: str) -> list[tuple[str, dict]]:
    p = _Tags()
    p.feed(page)
    return p.tags


def test_html_escapes_every_untrusted_string():
    out = render_html(_report())
    tags = _tags(out)
    # Only the renderer's own markup exists: no script, no injected element, no event-handler attribute.
    assert {t for t, _ in tags} <= {"html", "head", "meta", "title", "style", "body", "h1", "p", "nav", "ul", "li",
                                    "a", "section", "h2", "figure", "img", "figcaption", "table", "caption",
                                    "thead", "tbody", "tr", "th", "td", "div", "pre"}
    assert not any(k.startswith("on") for _, attrs in tags for k in attrs)
    imgs = [a for t, a in tags if t == "img"]
    assert len(imgs) == 1 and imgs[0]["src"].startswith("data:image/png;base64,")
    assert imgs[0]["alt"].startswith('cap " onload="x <script>')  # the quote stayed inside the attribute
    assert "&lt;script&gt;console.error(&quot;xss&quot;)&lt;/script&gt;" in out


def test_tag_check_catches_raw_markup():
    # guard: the parser-based check above does see an injected tag when escaping is skipped
    tags = _tags("<p>" + HOSTILE + "</p>")
    assert ("script", {}) in tags and any("onerror" in a for t, a in tags if t == "img")


def test_html_is_self_contained():
    out = render_html(_report("plain"))
    srcs = re.findall(r'src="([^"]*)"', out)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert base64.b64decode(srcs[0].split(",", 1)[1]) == PNG_1x1
    assert "http://" not in out and "https://" not in out and "<link" not in out
    assert "default-src 'none'" in out  # the CSP forbids anything the page does not carry itself


def test_markdown_escapes_inline_text_and_fences_verbatim_text():
    out = render_markdown(_report())
    assert "<script" not in out.split("````text")[0]  # inline parts: HTML neutralised
    assert "&lt;script\\>" in out
    assert "\\[link\\](javascript:alert(1))" in out
    assert f"](figures/{figure_filename('fig one')})" in out
    # the verbatim block survives byte for byte inside a fence longer than its backtick runs
    assert md_fence(HOSTILE) in out


@pytest.mark.parametrize("text", ["plain", "``` inside", "a ```` b ````` c", "`", ""])
def test_fence_cannot_be_closed_from_inside(text):
    block = md_fence(text)
    fence = block.splitlines()[0][: len(block.splitlines()[0]) - len("text")]
    assert set(fence) == {"`"} and len(fence) >= 3
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    assert len(fence) > longest
    assert block == f"{fence}text\n{text}\n{fence}"


@pytest.mark.parametrize("raw, expected", [
    ("1. item", "1\\. item"), ("- item", "\\- item"), ("0.25", "0.25"), ("-0.25", "-0.25"),
    ("a|b", "a\\|b"), ("**b**", "\\*\\*b\\*\\*"), ("x & <y>", "x &amp; &lt;y\\>"), ("# h", "\\# h"),
    ("line\nbreak", "line break"), ("[a](b)", "\\[a\\](b)"),
])
def test_md_escape(raw, expected):
    assert md_escape(raw) == expected


def test_format_cell_never_shows_missing_as_zero():
    assert format_cell(None) == "\u2013"
    assert format_cell(math.nan) == "\u2013"
    assert format_cell(0.0) == "0.000"
    assert format_cell(0.12345) == "0.123"
    assert format_cell(1e-5) == "1e-05"
    assert format_cell(3) == "3"
    assert format_cell(True) == "yes"
