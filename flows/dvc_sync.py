"""Keep DVC and git in step with a Prefect run, and read the pipeline's stage graph from dvc.yaml.

`pipeline_stages` turns dvc.yaml into the flow's stages (foreach stages expanded, topological order from
outs -> deps), so the flow composes exactly the stages `dvc repro` runs. After each stage, `dvc commit`
records what the flow produced.

A stage run by the flow produces exactly what `dvc repro` would (same `tasks/<stage>.run`, same paths), so
committing it makes `dvc.lock` describe the outputs and `dvc status` report the pipeline up to date, with
the outputs in the DVC cache (ready for `dvc push`). This only makes sense when the run *is* the DVC
project's run: the params file is the project's `params.yaml` and `out_root` is the project root.
Otherwise (a tiny config in a temporary folder, a test) syncing is off and `reason` says why. Mode
`adopt` is for a worker's own fresh clone: it copies the run's params file onto the project's params.yaml
first, so any params file (params.paper.yaml on the GPU deployment) can be the DVC project's run.

`push` uploads the committed outputs to the DVC remote; `git_commit` + `git_push` commit dvc.lock, params.yaml
and the metrics to git and push them with the promotion tags, so a later worker's clone + `dvc pull` sees
this run's results.

DVC is quiet here (`quiet_dvc`): in a terminal, DVC's in-process API draws a progress bar for every hash, cache
check and checkout, and its repo lock draws "Waiting to acquire lock. If DVC froze, ..." on every acquisition,
free or not (a "friendly" bar, drawn before the first try). Hundreds of such lines buried the flow's own live
view; the flow's task runs and its view report the same progress. The subprocess calls (push, pull) capture
their output, which is no terminal, so DVC draws nothing there.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

from tandem.config import apply_tool_env, tool_env

_LOCK = threading.Lock()  # dvc takes a repo lock; commits from concurrent task threads would collide

# DVC's loggers while the flow calls it. DVC decides whether to draw a bar from the level of the bar's own logger
# (`dvc.progress` for DVC's bars and its lock's "Waiting to acquire lock", `dvc_data.callbacks` for dvc-data's):
# a bar is drawn unless that logger is above ERROR. `dvc -q` gets there by raising every DVC logger to CRITICAL,
# which would drop DVC's warnings too; raising only the bars' loggers keeps them. DVC's own notes ("Updating
# lock file" per stage) are INFO: noise here.
_QUIET_LEVELS = {"dvc": logging.WARNING, "dvc_data": logging.WARNING, "dvc_objects": logging.WARNING,
                 "dvc.progress": logging.CRITICAL, "dvc_data.callbacks": logging.CRITICAL}


@contextmanager
def quiet_dvc() -> Iterator[None]:
    """Within the block, DVC's in-process API draws no progress bar or lock message and logs warnings and errors
    only; the loggers' levels are restored after it. Callers hold `_LOCK` (the levels are process-wide)."""
    apply_tool_env()
    saved = {name: logging.getLogger(name).level for name in _QUIET_LEVELS}
    for name, level in _QUIET_LEVELS.items():
        logging.getLogger(name).setLevel(level)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def find_project(start: Path) -> Path | None:
    """The nearest directory at or above `start` holding both `dvc.yaml` and `.dvc/`."""
    for d in [start, *start.parents]:
        if (d / "dvc.yaml").is_file() and (d / ".dvc").is_dir():
            return d
    return None


@dataclass(frozen=True)
class DvcSync:
    root: Path | None
    reason: str

    @property
    def enabled(self) -> bool:
        return self.root is not None

    @classmethod
    def detect(cls, params_path: str | os.PathLike, out_root: str | os.PathLike, mode: str = "auto") -> "DvcSync":
        """`mode`: 'auto' (sync when this run is the project's run), 'off', or 'on' (raise if it cannot)."""
        if mode not in ("auto", "on", "off", "adopt"):
            raise ValueError(f"dvc sync mode must be auto, on, off or adopt, got {mode!r}")
        if mode == "off":
            return cls(None, "turned off")
        root = find_project(Path.cwd().resolve())
        adopted = ""
        if mode == "adopt" and root is not None and Path(params_path).resolve() != (root / "params.yaml").resolve():
            # the workspace is this run's own clone: its params.yaml may become the run's params file
            shutil.copyfile(params_path, root / "params.yaml")
            adopted = f" (params.yaml adopted from {params_path})"
            params_path = root / "params.yaml"
        why = None
        if root is None:
            why = f"no DVC project (dvc.yaml + .dvc/) at or above {Path.cwd()}"
        elif Path(params_path).resolve() != (root / "params.yaml").resolve():
            why = f"params file {params_path} is not the project's params.yaml, which dvc.lock records"
        elif Path(out_root).resolve() != root:
            why = f"out_root {out_root} is not the DVC project root {root}"
        if why is None:
            return cls(root, f"committing stages to {root / 'dvc.lock'}{adopted}")
        if mode in ("on", "adopt"):
            raise RuntimeError(f"DVC sync requested but impossible: {why}")
        return cls(None, why)

    def commit(self, stage: str) -> bool:
        """`dvc commit --force <stage>`: record the stage's current deps, params and outputs in dvc.lock.

        Through DVC's Python API: ~0.25 s a stage, against ~2 s for a `dvc` subprocess (its import).
        """
        if self.root is None:
            return False
        from dvc.exceptions import DvcException
        from dvc.repo import Repo

        with _LOCK, quiet_dvc():
            try:
                with Repo(str(self.root)) as repo:
                    repo.commit(stage, force=True)
            except DvcException as e:
                raise RuntimeError(f"`dvc commit {stage}` failed: {e}") from e
        return True

    def up_to_date(self, stage: str) -> bool:
        """True when dvc.lock already records this stage with its current deps, params and outputs."""
        if self.root is None:
            return False
        from dvc.repo import Repo

        with _LOCK, quiet_dvc():
            with Repo(str(self.root)) as repo:
                return not repo.status(targets=[stage])

    def push(self, remote: str | None = None, timeout: float = 3600, stage: str | None = None) -> None:
        """`dvc push` of everything committed, or of one stage's outputs (`stage`), to the default remote unless
        `remote` is given."""
        if self.root is None:
            raise RuntimeError("DVC push needs a DVC project run (see DvcSync.reason)")
        cmd = ([sys.executable, "-m", "dvc", "push", "--quiet"] + (["--remote", remote] if remote else [])
               + ([stage] if stage else []))
        with _LOCK:
            res = subprocess.run(cmd, cwd=self.root, capture_output=True, text=True, timeout=timeout,
                                 env=_subprocess_env())
        if res.returncode != 0:
            raise RuntimeError(f"`dvc push` failed (exit {res.returncode}): {(res.stderr or res.stdout).strip()[-2000:]}")

    def pull(self, timeout: float = 3600) -> str:
        """`dvc pull --allow-missing`: fetch what dvc.lock references and the remote holds (a fresh clone's
        inputs and the outputs of earlier runs); outputs never pushed stay missing and their stages rerun."""
        if self.root is None:
            raise RuntimeError("DVC pull needs a DVC project run (see DvcSync.reason)")
        return _dvc(self.root, ["pull", "--allow-missing"], timeout)

    def git_commit(self, message: str) -> str | None:
        """Commit dvc.lock, params.yaml and the metrics (small, `cache: false`, kept in git) to the current
        branch; returns the new commit, or None when nothing changed."""
        if self.root is None:
            raise RuntimeError("publishing results needs a DVC project run (see DvcSync.reason)")
        files = [f for f in ("dvc.lock", "params.yaml", "dvc.yaml", "metrics") if (self.root / f).exists()]
        git(self.root, "add", "--", *files)
        if git(self.root, "diff", "--cached", "--quiet", check=False).returncode == 0:
            return None
        git(self.root, "-c", "user.name=tandem-pipeline", "-c", "user.email=tandem@localhost",
            "commit", "-q", "-m", message)
        return git(self.root, "rev-parse", "HEAD").stdout.strip()

    def git_push(self, timeout: float = 600) -> str:
        """Push the branch and the promotion tags to `origin`. A branch that moved meanwhile is rebased once
        (a dvc.lock conflict is a real conflict: the push then fails and says so)."""
        if self.root is None:
            raise RuntimeError("publishing results needs a DVC project run (see DvcSync.reason)")
        branch = git(self.root, "rev-parse", "--abbrev-ref", "HEAD").stdout.strip()
        if git(self.root, "push", "-q", "origin", f"HEAD:{branch}", check=False, timeout=timeout).returncode:
            git(self.root, "-c", "user.name=tandem-pipeline", "-c", "user.email=tandem@localhost",
                "pull", "-q", "--rebase", "origin", branch, timeout=timeout)
            git(self.root, "push", "-q", "origin", f"HEAD:{branch}", timeout=timeout)
        git(self.root, "push", "-q", "origin", "--tags", timeout=timeout)
        return branch


def git(repo: Path, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    res = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise RuntimeError(f"`git {' '.join(args)}` failed (exit {res.returncode}): {res.stderr.strip()[-2000:]}")
    return res


def _subprocess_env() -> dict[str, str]:
    """A `dvc` subprocess's environment: the tools' defaults, without DVC_IGNORE_ISATTY (which would make DVC
    draw its bars into the captured output, and from there into the run's logs)."""
    return {k: v for k, v in tool_env().items() if k != "DVC_IGNORE_ISATTY"}


def _dvc(root: Path, args: list[str], timeout: float) -> str:
    res = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, capture_output=True, text=True,
                         timeout=timeout, env=_subprocess_env())
    if res.returncode != 0:
        raise RuntimeError(f"`dvc {' '.join(args)}` failed (exit {res.returncode}): "
                           f"{(res.stderr or res.stdout).strip()[-2000:]}")
    return (res.stdout or "") + (res.stderr or "")


# --------------------------------------------------------------------------------------------------
# The stage graph of dvc.yaml
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageSpec:
    """One DVC stage as the flow runs it: `name` as DVC calls it (train@tandem), `group` = the tasks/ module,
    `item` = the foreach item (None for a plain stage), `after` = the stages whose outputs it reads."""

    name: str
    group: str
    item: Any = None
    deps: tuple[str, ...] = ()
    outs: tuple[str, ...] = ()
    after: tuple[str, ...] = field(default=())


def _paths(entries: list) -> list[str]:
    return [str(Path(e if isinstance(e, str) else next(iter(e)))) for e in entries or []]


def _lookup(ref: str, params: dict) -> Any:
    value: Any = params
    for part in ref.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(f"dvc.yaml: ${{{ref}}} is not a params key")
        value = value[part]
    return value


def _inside(a: str, b: str) -> bool:
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def pipeline_stages(dvc_yaml: str | os.PathLike, params: dict) -> list[StageSpec]:
    """dvc.yaml's stages in an order `dvc repro` could run them: `foreach` over a params list expanded into
    `group@item` stages (what `dvc stage list` shows), then sorted so every stage comes after the stages whose
    outputs it depends on (file order among independent ones)."""
    doc = yaml.safe_load(Path(dvc_yaml).read_text()) or {}
    specs: list[StageSpec] = []
    for group, st in (doc.get("stages") or {}).items():
        if "foreach" in st:
            m = re.fullmatch(r"\$\{\s*([\w.]+)\s*\}", str(st["foreach"]).strip())
            items = _lookup(m.group(1), params) if m else st["foreach"]
            for item in items:
                body = yaml.safe_load(yaml.safe_dump(st["do"]).replace("${item}", str(item)))
                specs.append(StageSpec(f"{group}@{item}", group, item, tuple(_paths(body.get("deps"))),
                                       tuple(_paths(body.get("outs")) + _paths(body.get("metrics"))
                                             + _paths(body.get("plots")))))
        else:
            specs.append(StageSpec(group, group, None, tuple(_paths(st.get("deps"))),
                                   tuple(_paths(st.get("outs")) + _paths(st.get("metrics")) + _paths(st.get("plots")))))
    after = {s.name: tuple(o.name for o in specs if o.name != s.name
                           and any(_inside(d, out) for d in s.deps for out in o.outs)) for s in specs}
    ordered: list[StageSpec] = []
    done: set[str] = set()
    while len(ordered) < len(specs):
        ready = [s for s in specs if s.name not in done and set(after[s.name]) <= done]
        if not ready:
            raise ValueError(f"dvc.yaml: cycle among stages {sorted(set(after) - done)}")
        s = ready[0]
        ordered.append(StageSpec(s.name, s.group, s.item, s.deps, s.outs, after[s.name]))
        done.add(s.name)
    return ordered
