"""Contracts between the stages and dvc.yaml: DVC must see every input, or `dvc status` lies.

- Code: each stage's declared code deps equal its import closure (scripts/dvc_deps.py, static).
- Params: every params key a stage reads while it runs is declared in its dvc.yaml `params` (or, for
  `train@<arm>`, stated in tandem/run_keys.py `RUNTIME_KEYS` to shape no output of an arm). Reads are
  recorded on the real config objects (a `__getattribute__` hook on `Params` and the section classes, so
  `dataclasses.asdict` and helpers that take a section are seen too) while every stage runs on the tiny
  pipeline (tests/flows/tiny_params.yaml) in process.
- Settings: every shipped params file states every setting (tests/test_config.py; here: the run read none
  that params.yaml lacks).
- Acceptance: in a copy of the project, a comment appended to tandem/config.py makes every stage stale.

Each checker is also run on a deliberately broken mini-case, so each is shown able to fail.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from tandem import run_keys
from tandem.config import SECTIONS, Params, setting_keys

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from dvc_project import committed_project, stale  # noqa: E402
from params_files import complete_params  # noqa: E402


def _dvc_deps():
    spec = importlib.util.spec_from_file_location("dvc_deps", REPO / "scripts" / "dvc_deps.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------------------------------
# Recording params reads
# --------------------------------------------------------------------------------------------------

@contextmanager
def recorded_reads() -> Iterator[set[str]]:
    """Collect the dotted key (`seed`, `train.steps`) of every settings field read inside the block."""
    reads: set[str] = set()
    owners = {Params: ""} | {cls: f"{name}." for name, cls in SECTIONS.items()}
    fields = {cls: {f.name for f in dataclasses.fields(cls)} - set(SECTIONS) for cls in owners}
    saved = {cls: cls.__dict__.get("__getattribute__") for cls in owners}

    def hook(self, name, _get=object.__getattribute__):
        cls = type(self)
        if name in fields.get(cls, ()):
            reads.add(owners[cls] + name)
        return _get(self, name)

    for cls in owners:
        cls.__getattribute__ = hook
    try:
        yield reads
    finally:
        for cls, old in saved.items():
            if old is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = old


def declared_params(stage: dict) -> list[str]:
    """The params keys a dvc.yaml stage declares (plain keys; `{file: [keys]}` entries flattened)."""
    out = []
    for p in stage.get("params", []):
        if isinstance(p, dict):
            out += [k for keys in p.values() for k in (keys or [])]
        else:
            out.append(p)
    return out


def undeclared(reads: set[str], declared: list[str]) -> list[str]:
    """Keys read but not covered by a declared key (a declared section covers every key under it)."""
    return sorted(r for r in reads if not any(r == d or r.startswith(d + ".") for d in declared))


def _stages() -> dict[str, dict]:
    return _dvc_deps().stages_of(yaml.safe_load((REPO / "dvc.yaml").read_text()))


# --------------------------------------------------------------------------------------------------
# The checkers fail on broken mini-cases
# --------------------------------------------------------------------------------------------------

def test_recorder_and_checker_catch_an_undeclared_read():
    from tandem.config import params_from_dict

    p = params_from_dict({})

    def fake_stage(params):  # reads one declared key, one undeclared, and a whole section through asdict
        return params.model.dtype, params.model.vocab_size, dataclasses.asdict(params.report)

    with recorded_reads() as reads:
        fake_stage(p)
    assert {"model.dtype", "model.vocab_size", "report.title", "report.promote_k"} <= reads
    assert undeclared(reads, ["model.dtype", "report"]) == ["model.vocab_size"]
    assert undeclared(reads, ["model", "report"]) == []
    assert all("__getattribute__" not in cls.__dict__ for cls in (Params, *SECTIONS.values()))  # hook removed


def test_closure_checker_catches_an_undeclared_import(tmp_path):
    dd = _dvc_deps()
    for pkg in ("tasks", "tandem", "tandem/sub"):
        (tmp_path / pkg).mkdir(parents=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "tandem" / "sub" / "a.py").write_text("X = 1\n")
    (tmp_path / "tandem" / "sub" / "b.py").write_text("Y = 2\n")
    (tmp_path / "tandem" / "lib.py").write_text("def f():\n    from .sub import a  # lazy and relative\n")
    (tmp_path / "tasks" / "one.py").write_text("import json\nfrom tandem import lib\n")
    closure = dd.import_closure([("tasks.one", True)], tmp_path)
    assert closure == {"tasks/__init__.py", "tasks/one.py", "tandem/__init__.py", "tandem/lib.py",
                       "tandem/sub/__init__.py", "tandem/sub/a.py"}
    # tandem/sub/b.py is not imported: the directory is listed file by file, never whole
    assert "tandem/sub" not in dd.stage_code_deps("one", tmp_path)
    stage = "stages:\n  one:\n    cmd: x\n    deps:\n      - tasks/one.py\n      - tandem/lib.py\n      - data/in\n"
    (tmp_path / "dvc.yaml").write_text(stage)
    problems = dd.check(tmp_path)
    assert "one: imports tandem/sub/a.py, which dvc.yaml does not declare" in problems
    assert "one: imports tandem/__init__.py, which dvc.yaml does not declare" in problems
    (tmp_path / "dvc.yaml").write_text(dd.rewrite(stage, tmp_path))
    assert dd.check(tmp_path) == []
    assert "- data/in" in (tmp_path / "dvc.yaml").read_text()  # non-code deps kept
    (tmp_path / "tandem" / "sub" / "b.py").unlink()  # now all of tandem/sub is imported: declared whole
    assert "tandem/sub" in dd.stage_code_deps("one", tmp_path)


# --------------------------------------------------------------------------------------------------
# The contracts on the real pipeline
# --------------------------------------------------------------------------------------------------

def test_every_stage_declares_its_import_closure():
    problems = _dvc_deps().check(REPO)
    assert not problems, "\n".join(problems) + "\nfix: python scripts/dvc_deps.py --write"


def test_tandem_config_is_a_dep_of_every_stage():
    for name, st in _stages().items():
        assert "tandem/config.py" in st["deps"], name


@pytest.mark.slow
def test_every_stage_declares_the_params_it_reads(tmp_path):
    """Run every stage on the tiny pipeline in process, recording the params keys each one reads."""
    from cli.main import run_stage
    from tasks.common import load_params

    raw = complete_params({"out_root": str(tmp_path),
                           "train": {"arms": ["tandem"], "report_to": "none"},
                           "evaluate": {"modes": ["solo", "word"]}, "analyze": {"reference_arm": "tandem"}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    params = load_params(tmp_path / "params.yaml")
    stages = _stages()
    # read but stated to shape no output (tandem/run_keys.py): the arm list names the other arms' outputs
    not_shaping = {"train": run_keys.dotted(run_keys.RUNTIME_KEYS)}
    problems, all_reads = [], set()
    for name in stages:
        arms = params.train.arms if name == "train" else [None]
        for arm in arms:
            with recorded_reads() as reads:
                run_stage(name, params, arm)
            all_reads |= reads
            problems += [f"{name}: reads {k}, which its dvc.yaml params do not declare"
                         for k in undeclared(reads, declared_params(stages[name]) + not_shaping.get(name, []))]
            assert reads, f"{name}: no params read recorded (the recorder is broken)"
    assert not problems, "\n".join(problems)
    assert all_reads <= set(setting_keys())  # and params.yaml states each of them (tests/test_config.py)


@pytest.mark.integration
def test_a_comment_in_tandem_config_makes_every_stage_stale(tmp_path):
    """In a copy of the project with every stage committed (placeholder outputs), `dvc status` is clean;
    after a comment is appended to tandem/config.py it lists every stage as changed."""
    proj = tmp_path / "proj"
    dvc = committed_project(proj)
    arms = yaml.safe_load((REPO / "params.yaml").read_text())["train"]["arms"]
    assert stale(dvc) == set()
    with open(proj / "tandem" / "config.py", "a") as f:
        f.write("# a comment\n")
    want = {n for n in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"] if n != "train"}
    assert stale(dvc) == want | {f"train@{a}" for a in arms}
