"""The evaluation's reuse of work: a result cache on disk, the unit planner and a per-process model cache.

- `ResultCache`: one entry per result key (`tandem.evaluation.result_key`: checkpoint weights, mode, benchmark
  rows, result settings) in a directory, `<key>.jsonl` (one record per sample) and `<key>.json` (the summary,
  written last: its presence marks the entry complete), so a rerun, or a rerun after a crash, computes only
  what is missing. The stage gives it its durable writers (`tasks.common.write_json` / `write_jsonl`).
- `plan_units`: the (arm, checkpoint, mode) units of an evaluation, one per distinct (weights, mode), so the
  base every arm starts from runs once.
- `ModelCache`: models by content hash, keeping resident only those a unit asks for (the base and the current
  senior); a lock makes it safe for the flow's task-runner threads. `MODELS` is the process's cache.

`tasks/evaluate.py` composes them into the stage.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from tandem.evaluation import content_hash

JUNIOR = "junior"  # pseudo-arm name of the junior floor (the junior model alone)


# --------------------------------------------------------------------------------------------------
# Result cache
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ResultCache:
    """Evaluation results by key under `root`; `write_json(path, obj)` / `write_jsonl(path, rows)` write files
    atomically (a killed writer leaves no half entry)."""

    root: Path
    write_json: Callable[[Path, Any], None]
    write_jsonl: Callable[[Path, Iterable[dict]], None]

    def paths(self, key: str) -> tuple[Path, Path]:
        """The entry's summary file and records file."""
        return self.root / f"{key}.json", self.root / f"{key}.jsonl"

    def summary(self, key: str) -> dict | None:
        """The stored summary of a complete entry, else None."""
        meta_p, _ = self.paths(key)
        return json.loads(meta_p.read_text())["summary"] if meta_p.exists() else None

    def require(self, key: str, what: str) -> tuple[dict, Path]:
        """The summary and records file of a complete entry; raises naming `what` when it is missing."""
        summary = self.summary(key)
        if summary is None:
            raise RuntimeError(f"evaluate: result {key[:12]} ({what}) is missing from {self.root}; "
                               f"run every unit of `plan` before `collect`")
        return summary, self.paths(key)[1]

    def store(self, key: str, records: Sequence[dict], meta: dict) -> None:
        """Write an entry: the records first, then `meta` (with its `summary`), which marks it complete."""
        meta_p, gen_p = self.paths(key)
        self.write_jsonl(gen_p, records)
        self.write_json(meta_p, meta)


# --------------------------------------------------------------------------------------------------
# Units
# --------------------------------------------------------------------------------------------------

def plan_units(checkpoints: dict[str, Sequence[Any]], modes: Sequence[str], junior: Path) -> list[dict]:
    """Units to compute, as plain dicts {arm, step, path, mode}; one per distinct (weights, mode).

    `checkpoints` maps each arm to its checkpoints (objects with `step` and `path`). The junior floor is the
    junior in solo mode: when the junior is the base it shares step 0's unit (if solo is evaluated), otherwise
    it is a unit of its own; identical weights under two names (every arm's step 0) are listed once.
    """
    seen: set[tuple[str, str]] = set()
    units = []
    for arm, ckpts in checkpoints.items():
        for c in ckpts:
            h = content_hash(c.path)
            for mode in modes:
                if (h, mode) not in seen:
                    seen.add((h, mode))
                    units.append({"arm": arm, "step": c.step, "path": str(c.path), "mode": mode})
    if (content_hash(junior), "solo") not in seen:
        units.append({"arm": JUNIOR, "step": 0, "path": str(junior), "mode": "solo"})
    return units


# --------------------------------------------------------------------------------------------------
# Model cache
# --------------------------------------------------------------------------------------------------

class ModelCache:
    """Loaded models by content hash, with only the requested ones kept resident (thread-safe)."""

    def __init__(self) -> None:
        self._models: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, path: str | os.PathLike, dtype: str, trust_remote_code: bool, keep: set[str]):
        """The model at `path` in eval mode on the device, loaded once; every other model whose hash is not in
        `keep` is dropped first (the base and the current senior stay resident, never a third)."""
        import torch

        from tandem.models import load_model

        h = content_hash(path)
        with self._lock:
            for k in [k for k in self._models if k not in keep | {h}]:
                del self._models[k]
            if h not in self._models:
                m = load_model(path, dtype, trust_remote_code=trust_remote_code)
                m.to("cuda" if torch.cuda.is_available() else "cpu").eval()
                self._models[h] = m
            return self._models[h]


MODELS = ModelCache()
