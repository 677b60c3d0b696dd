"""A git repository whose committed dvc.lock pins the checkpoints a promotion names (tasks/promotion.py refuses
to tag a commit that does not): shared by the promotion registry and report tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

# dvc.lock as DVC writes it for one trained arm (hashes are placeholders: promotion reads the outputs' paths)
PINNED_LOCK = """\
schema: '2.0'
stages:
  train@tandem:
    cmd: tandem stage train --arm tandem
    outs:
    - path: models/checkpoints/tandem
      hash: md5
      md5: 0123456789abcdef0123456789abcdef.dir
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout


def commit_pinned_lock(repo: Path, text: str = PINNED_LOCK) -> Path:
    """Write and commit dvc.lock (a git repository is created first when `repo` is none yet)."""
    repo.mkdir(parents=True, exist_ok=True)
    if not (repo / ".git").exists():
        git(repo, "init", "-q")
    (repo / "dvc.lock").write_text(text)
    git(repo, "add", "dvc.lock")
    git(repo, "commit", "-q", "-m", "results")
    return repo
