"""Project text: the file map (docs/file-map.md) matches the files, no control characters, no build-history wording."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Prose that tells when or how the project was built ("session 2", "this session") instead of what it is.
HISTORY = re.compile(r"\bsessions?\s+\d|\b(this|last|previous|next|earlier|later|one)\s+sessions?\b", re.I)
TEXT_SUFFIXES = {".md", ".py", ".yaml", ".yml", ".toml", ".sh", ".json", ".txt", ".cfg", ".ini", ""}


def _file_map():
    spec = importlib.util.spec_from_file_location("file_map", ROOT / "scripts" / "file_map.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / f for f in out.splitlines()
            # dvc-remote/ is DVC's content-addressed store of the record's outputs (model weights among them)
            if not f.startswith(("data/raw/", "dvc-remote/")) and Path(f).suffix in TEXT_SUFFIXES
            and (ROOT / f).is_file()]


def test_docs_file_map_is_generated_from_the_files():
    fm = _file_map()
    table, problems = fm.build()
    assert not problems, "\n".join(problems)
    path = ROOT / fm.MAP
    assert path.is_file(), f"{fm.MAP.as_posix()} is missing: run `python scripts/file_map.py --write`"
    assert fm.current(path.read_text(encoding="utf-8")) == table, \
        f"{fm.MAP.as_posix()} is out of date: run `python scripts/file_map.py --write`"


def test_readme_is_a_front_door():
    # Read in five minutes: the details live in docs/ (operations, results, measurements, the file map).
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move details to docs/ and link them"
    opening = (lines[2], lines[3].split()[:2], lines[4].split()[:2], lines[5])
    assert opening == ("```bash", ["make", "run"], ["make", "test"], "```"), \
        "README.md opens with its two commands, `make run` and `make test`"


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    out = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^#{1,6}\s+(.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("path", ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                       for p in (ROOT / "docs").glob("*.md"))])
def test_markdown_links_point_to_files_and_headings(path):
    f = ROOT / path
    text = re.sub(r"```.*?```", "", f.read_text(encoding="utf-8"), flags=re.S)  # code blocks hold no links
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file, _, anchor = target.partition("#")
        dest = (f.parent / file).resolve() if file else f
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with that anchor")
    assert not bad, f"{path}: " + "; ".join(bad)


def test_file_map_describes_python_files_by_their_whole_first_paragraph(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('r"""First line of a summary\nthat goes on, with `\\boxed{}`.\n\nDetails."""\n')
    assert _file_map().docstring_summary(f) == "First line of a summary that goes on, with `\\boxed{}`."


@pytest.mark.parametrize("path", [p.relative_to(ROOT).as_posix() for p in _text_files()])
def test_no_control_characters(path):
    text = (ROOT / path).read_text(encoding="utf-8", errors="replace")
    bad = [(i + 1, repr(ch)) for i, line in enumerate(text.splitlines()) for ch in line
           if ord(ch) < 32 and ch not in "\t"]
    assert not bad, f"{path}: control characters at lines {bad[:5]}"


def test_no_control_characters_in_docstrings():
    # A non-raw docstring turns `\boxed` into a backspace byte and the file map would carry it into docs/file-map.md.
    import ast

    bad = []
    for p in _text_files():
        if p.suffix == ".py":
            doc = ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or ""
            if any(ord(c) < 32 and c not in "\n\t" for c in doc):
                bad.append(p.relative_to(ROOT).as_posix())
    assert not bad, f"docstrings with control characters (use r\"\"\"...): {bad}"


def test_project_text_speaks_of_the_project_only():
    hits = [f"{p.relative_to(ROOT)}:{i + 1}: {line.strip()[:100]}"
            for p in _text_files() if p.name != "test_docs.py"
            for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines())
            if HISTORY.search(line)]
    assert not hits, "\n".join(hits)


def test_history_rule_can_fail():
    assert HISTORY.search("measured in session 2") and HISTORY.search("found this session")
    assert not HISTORY.search('@pytest.fixture(scope="session")')
