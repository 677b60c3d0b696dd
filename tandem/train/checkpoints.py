"""Atomic checkpoints: trl writes `checkpoint-<N>/`, the main process publishes it as `step-<N>/` in one rename.

`checkpoint-<N>` is a staging name no reader trusts. After trl has written it (on every rank, each its own
RNG state), all ranks meet at a barrier, the main process adds `tandem_state.json`, fsyncs the tree and
renames it to `step-<N>` with one `os.replace`; the ranks meet again before training goes on. A crash leaves
at worst a staging directory, removed on the next start; `latest_checkpoint` only ever sees complete ones.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

TANDEM_STATE = "tandem_state.json"
STAGING_PREFIX = "checkpoint-"  # what trl/transformers writes; renamed to step-<N> once complete
STEP_PREFIX = "step-"


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


def commit_dir(staging: Path, final: Path) -> None:
    """Make `staging` appear as `final` in one rename (replacing an older `final` if any)."""
    _fsync_tree(staging)
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def complete_checkpoints(arm_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete `step-<N>` checkpoint under `arm_dir`, by step."""
    arm_dir = Path(arm_dir)
    out = []
    if not arm_dir.is_dir():
        return out
    for p in arm_dir.iterdir():
        if not (p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX):].isdigit()):
            continue
        needed = (TANDEM_STATE, "trainer_state.json", "config.json")
        if all((p / f).exists() for f in needed) and list(p.glob("*.safetensors")):
            out.append((int(p.name[len(STEP_PREFIX):]), p))
    return sorted(out)


def latest_checkpoint(arm_dir: str | os.PathLike, fingerprint: str | None = None) -> Path | None:
    """The last complete checkpoint (of the run with `fingerprint`, when given), or None."""
    for _, p in reversed(complete_checkpoints(arm_dir)):
        if fingerprint is None or json.loads((p / TANDEM_STATE).read_text()).get("fingerprint") == fingerprint:
            return p
    return None


def clean_arm_dir(arm_dir: Path, fingerprint: str) -> list[str]:
    """Remove staging leftovers of a crash and checkpoints of a different run; returns what was removed."""
    removed = []
    if not arm_dir.is_dir():
        return removed
    for p in arm_dir.iterdir():
        stale = p.name.startswith((STAGING_PREFIX, ".old-"))
        if p.is_dir() and p.name.startswith(STEP_PREFIX):
            st = p / TANDEM_STATE
            stale = not st.exists() or json.loads(st.read_text()).get("fingerprint") != fingerprint
        if stale:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def wipe_arm_dir(arm_dir: Path) -> list[str]:
    """Remove everything under `arm_dir` (`train.resume: never`); returns what was removed."""
    removed = [p.name for p in arm_dir.iterdir()] if arm_dir.is_dir() else []
    for p in arm_dir.iterdir() if arm_dir.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return removed

