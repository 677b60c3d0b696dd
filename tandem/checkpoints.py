"""The checkpoint layout: where training puts `step-<N>` folders, what makes one complete, and who reads them.

    models/checkpoints/<arm>/step-<N>/      a complete checkpoint (N >= 1): config.json, weights, tandem_state.json
    models/checkpoints/<arm>/checkpoint-<N>/ trl's staging name while it writes; never read
    models/checkpoints/<arm>/.old-step-<N>-<pid>/ a replaced checkpoint on its way out; never read
    results/generations/<arm>/step-<N>/<mode>/<benchmark>.jsonl   the evaluate stage's saved samples

Training writes into the staging name, adds `tandem_state.json` (the run's fingerprint and step) and renames
the folder to `step-<N>` in one `os.replace` (`commit_dir`). One rule (`is_complete`) decides what every
reader trusts: training resuming a run, evaluation listing an arm's checkpoints, the analysis and the report.
Step 0 is the base model itself (`list_checkpoints`, which lists every step or only the base and the last).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

STATE_FILE = "tandem_state.json"
STAGING_PREFIX = "checkpoint-"  # what trl/transformers writes; renamed to step-<N> once complete
STEP_PREFIX = "step-"
OLD_PREFIX = ".old-"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_name(step: int) -> str:
    """The folder name of step `step` (`step-<N>`)."""
    return f"{STEP_PREFIX}{int(step)}"


def parse_step(name: str) -> int | None:
    """N for a folder named exactly `step-<N>`, else None (`step-x`, `.step-3.tmp`, `checkpoint-3`)."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The files whose bytes define the model: `*.safetensors`, else `*.bin` (sorted by name)."""
    d = Path(model_dir)
    return sorted(d.glob("*.safetensors")) or sorted(d.glob("*.bin"))


def is_complete(path: str | os.PathLike) -> bool:
    """True when `path` is a finished checkpoint: a `step-<N>` folder (N >= 1) with the training marker
    (`tandem_state.json`, written just before the rename), `config.json` and weight files."""
    p = Path(path)
    step = parse_step(p.name)
    return (step is not None and step > 0 and p.is_dir() and (p / STATE_FILE).is_file()
            and (p / "config.json").is_file() and bool(weight_files(p)))


def complete_checkpoints(arm_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete `step-<N>` checkpoint under `arm_dir`, by step."""
    arm_dir = Path(arm_dir)
    if not arm_dir.is_dir():
        return []
    return sorted((parse_step(p.name), p) for p in arm_dir.iterdir() if is_complete(p))  # type: ignore[misc]


def read_state(path: str | os.PathLike) -> dict:
    """The `tandem_state.json` of a checkpoint folder (arm, fingerprint, step, ...)."""
    return json.loads((Path(path) / STATE_FILE).read_text())


def write_state(path: str | os.PathLike, state: dict) -> None:
    """Write the marker that, once the folder carries its `step-<N>` name, makes it a complete checkpoint."""
    (Path(path) / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


def latest_checkpoint(arm_dir: str | os.PathLike, fingerprint: str | None = None) -> Path | None:
    """The last complete checkpoint (of the run with `fingerprint`, when given), or None."""
    for _, p in reversed(complete_checkpoints(arm_dir)):
        if fingerprint is None or read_state(p).get("fingerprint") == fingerprint:
            return p
    return None


def clean_arm_dir(arm_dir: str | os.PathLike, fingerprint: str) -> list[str]:
    """Remove staging leftovers of a crash and checkpoints of a different run; returns what was removed."""
    arm_dir = Path(arm_dir)
    removed: list[str] = []
    if not arm_dir.is_dir():
        return removed
    for p in arm_dir.iterdir():
        stale = p.name.startswith((STAGING_PREFIX, OLD_PREFIX))
        if p.is_dir() and p.name.startswith(STEP_PREFIX):
            stale = not (p / STATE_FILE).exists() or read_state(p).get("fingerprint") != fingerprint
        if stale:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    # Data on disk before the rename publishes it: a power cut must not leave a named but empty checkpoint.
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def commit_dir(staging: str | os.PathLike, final: str | os.PathLike) -> None:
    """Make `staging` appear as `final` in one rename (replacing an older `final` if any)."""
    staging, final = Path(staging), Path(final)
    _fsync_tree(staging)
    old = None
    if final.exists():
        old = final.with_name(f"{OLD_PREFIX}{final.name}-{os.getpid()}")
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True)
class Checkpoint:
    """One model to evaluate: an arm's step (0 = the base model) and its directory."""

    arm: str
    step: int
    path: Path

    @property
    def name(self) -> str:
        return step_name(self.step)


# `evaluate.checkpoints`: every saved step; the base and the last; or the base, the best by validation and the last
CHECKPOINT_SELECTIONS = ("all", "final", "final_and_best")
VAL_KEY, LOG_STEP_KEY = "val/accuracy", "tandem/step"  # the trainer's validation and training-step log keys


def best_by_validation(found: list[tuple[int, Path]]) -> int | None:
    """The saved step with the highest in-training validation accuracy (ties: the later step), read from the
    last checkpoint's log history (`trainer_state.json`); None when no saved step was validated."""
    if not found:
        return None
    state = found[-1][1] / "trainer_state.json"
    if not state.is_file():
        return None
    history = json.loads(state.read_text()).get("log_history", [])
    saved = {s for s, _ in found}
    scored = [(float(h[VAL_KEY]), int(h.get(LOG_STEP_KEY, h.get("step", -1)))) for h in history
              if h.get(VAL_KEY) is not None]
    scored = [(acc, s) for acc, s in scored if s in saved]
    return max(scored)[1] if scored else None


def list_checkpoints(checkpoints_dir: str | os.PathLike, arm: str, base_dir: str | os.PathLike,
                     which: str = "all") -> list[Checkpoint]:
    """The base as step 0, then every complete `<checkpoints_dir>/<arm>/step-<N>/` in increasing N
    (`which="all"`), only the last of them (`which="final"`), or the best by in-training validation and the
    last (`which="final_and_best"`, one entry when they coincide or no step was validated).

    An arm never trained has only step 0.
    """
    if which not in CHECKPOINT_SELECTIONS:
        raise ValueError(f"list_checkpoints: which={which!r} must be one of {list(CHECKPOINT_SELECTIONS)}")
    found = complete_checkpoints(Path(checkpoints_dir) / arm)
    if which == "final":
        found = found[-1:]
    elif which == "final_and_best":
        best = best_by_validation(found)
        found = [(s, p) for s, p in found if s == best or (s, p) == found[-1]] if found else []
    return [Checkpoint(arm, 0, Path(base_dir))] + [Checkpoint(arm, s, p) for s, p in found]


def generations_file(generations_dir: str | os.PathLike, arm: str, step: int, mode: str, benchmark: str) -> Path:
    """Where the evaluate stage saves the samples of (arm, step, mode, benchmark)."""
    return Path(generations_dir) / arm / step_name(step) / mode / f"{benchmark}.jsonl"
