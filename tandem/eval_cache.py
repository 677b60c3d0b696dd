"""The evaluation's reuse of work: a result cache on disk, the unit planner and a per-process model cache.

- `ResultCache`: one entry per result key (`tandem.evaluation.result_key`: checkpoint weights, mode, benchmark
  rows, result settings) in a directory, `<key>.jsonl` (one record per sample) and `<key>.json` (the summary,
  written last: its presence marks the entry complete), so a rerun, or a rerun after a crash, computes only
  what is missing. The stage gives it its durable writers (`tasks.common.write_json` / `write_jsonl`).
- `StatsCache` / `stats_key`: the analysis's per-checkpoint teacher-forced statistics by key (the checkpoint,
  the base and junior it is compared with, the very completions and reference texts, the numerics settings), so
  an analysis resumes at the first checkpoint it had not finished and a checkpoint another run already scored
  (a study's step 0) is read back.
- `plan_units`: the (arm, checkpoint, mode) units of an evaluation, one per distinct (weights, mode), so the
  base every arm starts from runs once.
- `ModelCache`: models by content hash, keeping resident only those a unit asks for (the base and the current
  senior); a lock makes it safe for the flow's task-runner threads. `MODELS` is the process's cache.

`tasks/evaluate.py` composes them into the stage.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

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


STATS_FORMAT = 1


def stats_key(senior_hash: str, base_hash: str, junior_hash: str | None, texts: Any, refs: Any,
              numerics: dict) -> str:
    """SHA-256 naming one checkpoint's analysis statistics: the senior's weights, the base's, the junior's (None:
    the junior is the base), the teacher-forced texts and reference texts (any JSON-able value: the token ids
    themselves) and whatever else can change a float (`numerics`: batch size, dtype, device, threads, the hash of
    the computing code)."""
    payload = {"format": STATS_FORMAT, "senior": senior_hash, "base": base_hash, "junior": junior_hash,
               "texts": texts, "refs": refs, "numerics": numerics}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class StatsCache:
    """Per-checkpoint statistics by key under `root`: `<key>.npz` (per benchmark, each per-token array of every
    completion, concatenated, with the completions' lengths) and `<key>.json` (the benchmarks, the completions'
    problem ids and the per-problem values on the reference texts; written last, its presence marks the entry
    complete). `write_arrays(path, arrays)` / `write_json(path, obj)` write files atomically."""

    root: Path
    write_arrays: Callable[[Path, dict[str, np.ndarray]], None]
    write_json: Callable[[Path, Any], None]

    def paths(self, key: str) -> tuple[Path, Path]:
        """The entry's summary file and arrays file."""
        return self.root / f"{key}.json", self.root / f"{key}.npz"

    def store(self, key: str, stats: dict[str, list[dict[str, np.ndarray]]], ids: dict[str, list],
              common: dict) -> None:
        """Write one checkpoint's `stats` (benchmark -> one dict of per-token arrays per completion), the
        completions' problem `ids` (benchmark -> ids, same order) and its `common` values."""
        meta_p, arr_p = self.paths(key)
        arrays: dict[str, np.ndarray] = {}
        benches = list(stats)
        for j, b in enumerate(benches):
            rows = stats[b]
            arrays[f"b{j}.lengths"] = np.asarray([len(r["targets"]) for r in rows], dtype=np.int64)
            for name in (rows[0] if rows else {}):
                arrays[f"b{j}.{name}"] = np.concatenate([r[name] for r in rows])
        self.write_arrays(arr_p, arrays)
        self.write_json(meta_p, {"format": STATS_FORMAT, "key": key, "benchmarks": benches, "ids": ids,
                                 "common": common})

    def load(self, key: str) -> tuple[dict[str, list[dict[str, np.ndarray]]], dict[str, list], dict] | None:
        """(stats, ids, common) as `store` was given them, or None when the entry is not complete."""
        meta_p, arr_p = self.paths(key)
        if not meta_p.exists():
            return None
        meta = json.loads(meta_p.read_text())
        stats: dict[str, list[dict[str, np.ndarray]]] = {}
        with np.load(arr_p) as z:
            for j, b in enumerate(meta["benchmarks"]):
                bounds = np.cumsum(np.concatenate([[0], z[f"b{j}.lengths"]]))
                names = [k.split(".", 1)[1] for k in z.files if k.startswith(f"b{j}.") and k != f"b{j}.lengths"]
                cols = {n: z[f"b{j}.{n}"] for n in names}
                stats[b] = [{n: cols[n][lo:hi].copy() for n in names} for lo, hi in zip(bounds[:-1], bounds[1:])]
        return stats, meta["ids"], meta["common"]


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
