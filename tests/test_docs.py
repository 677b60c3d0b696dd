"""Project text: the README's file map matches the files, no control characters, no build-history wording."""

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


def test_readme_file_map_is_generated_from_the_files():
    fm = _file_map()
    table, problems = fm.build()
    assert not problems, "\n".join(problems)
    assert fm.current((ROOT / "README.md").read_text(encoding="utf-8")) == table, \
        "README.md's file map is out of date: run `python scripts/file_map.py --write`"


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
    # A non-raw docstring turns `\boxed` into a backspace byte and the file map would carry it into the README.
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
