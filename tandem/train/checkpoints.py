"""Atomic checkpoints: trl writes `checkpoint-<N>/`, the main process publishes it as `step-<N>/` in one rename.

`checkpoint-<N>` is a staging name no reader trusts. After trl has written it (on every rank, each its own
RNG state), all ranks meet at a barrier, the main process adds `tandem_state.json`, fsyncs the tree and
renames it to `step-<N>` with one `os.replace`; the ranks meet again before training goes on. A crash leaves
at worst a staging directory, removed on the next start; `latest_checkpoint` only ever sees complete ones.
The layout and the one completeness rule live in `tandem.checkpoints`, shared with evaluation and analysis
(import them from there); this module adds what only training needs.
"""

from __future__ import annotations

import shutil
from pathlib import Path



def wipe_arm_dir(arm_dir: Path) -> list[str]:
    """Remove everything under `arm_dir` (`train.resume: never`); returns what was removed."""
    removed = [p.name for p in arm_dir.iterdir()] if arm_dir.is_dir() else []
    for p in arm_dir.iterdir() if arm_dir.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return removed
