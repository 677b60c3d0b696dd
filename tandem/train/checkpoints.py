"""Atomic checkpoints: trl writes `checkpoint-<N>/`, the main process publishes it as `step-<N>/` in one rename.

`checkpoint-<N>` is a staging name no reader trusts. After trl has written it (on every rank, each its own
RNG state), all ranks meet at a barrier, the main process adds `tandem_state.json`, fsyncs the tree and
renames it to `step-<N>` with one `os.replace`; the ranks meet again before training goes on. A crash leaves
at worst a staging directory, removed on the next start; `latest_checkpoint` only ever sees complete ones,
and `resume_checkpoint` verifies the one a rerun continues from against the checksums recorded at save time.
The layout and the one completeness rule live in `tandem.checkpoints`, shared with evaluation and analysis;
this module adds what only training needs.
"""

from __future__ import annotations

from pathlib import Path

from tandem.transactions import remove


def wipe_arm_dir(arm_dir: Path) -> list[str]:
    """Remove everything under `arm_dir` (`train.resume: never`); returns what was removed."""
    removed = [p.name for p in arm_dir.iterdir()] if arm_dir.is_dir() else []
    for p in arm_dir.iterdir() if arm_dir.is_dir() else []:
        remove(p)
    return removed
