"""Shared plumbing for stages: params loading, the standard path layout, JSON/JSONL I/O, atomic writes.

Every stage module exposes `run(params, inputs, outputs) -> dict` plus `default_io(params)` returning the
`inputs` and `outputs` dicts of paths that `dvc.yaml` declares for it. The CLI, DVC, Prefect and the tests
all go through those two functions.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import yaml

from tandem.config import Params, ParamsError, params_from_dict

DEFAULT_PARAMS = "params.yaml"


def load_params(path: str | os.PathLike = DEFAULT_PARAMS) -> Params:
    """Parse and validate a params file; raises ParamsError (the CLI turns it into exit code 2).

    Strict: the file must state every setting (a missing key is an error naming the key and the rule), so
    the file is the complete record of what a stage runs with. The one way to change a setting for a run is
    another file (`--params FILE`) or DVC editing this one (`dvc exp run -S key=value`).
    """
    p = Path(path)
    if not p.exists():
        raise ParamsError([f"params file: {str(p)!r} -> does not exist"])
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ParamsError([f"params file: {str(p)!r} -> is not valid YAML ({e})"]) from None
    if not isinstance(raw, dict):
        raise ParamsError([f"params file: {str(p)!r} -> must hold a mapping of sections"])
    return params_from_dict(raw, strict=True)


@dataclass(frozen=True)
class Layout:
    """Where every artifact lives, relative to `params.out_root` (mirrors dvc.yaml)."""

    root: Path

    @classmethod
    def of(cls, params: Params) -> "Layout":
        return cls(Path(params.out_root))

    # data
    @property
    def raw(self) -> Path: return self.root / "data" / "raw"
    @property
    def prepared(self) -> Path: return self.root / "data" / "prepared"
    # models
    @property
    def base_model(self) -> Path: return self.root / "models" / "base"
    @property
    def checkpoints(self) -> Path: return self.root / "models" / "checkpoints"
    # results
    @property
    def metrics(self) -> Path: return self.root / "metrics"
    @property
    def plots(self) -> Path: return self.root / "metrics" / "plots"
    @property
    def generations(self) -> Path: return self.root / "results" / "generations"
    @property
    def reports(self) -> Path: return self.root / "reports"
    @property
    def runs(self) -> Path: return self.root / "runs"
    # crash-resume state that no DVC stage declares (training checkpoints in progress, the evaluation result
    # cache): outputs stay plain DVC outs, so every stage is in DVC's run-cache
    @property
    def scratch(self) -> Path: return self.root / "scratch"


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling path; rename it onto `path` only if the block succeeds (file or dir)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)) / path.name
    try:
        yield tmp
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)
