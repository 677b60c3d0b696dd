"""Per-problem measures of one pipeline run, the values the claims bootstrap over (tandem.metrics.claims).

For every arm's final evaluated checkpoint, and for the base (step 0, as the pseudo-arm "base"), one value per
benchmark problem: pass@k in each evaluated mode (from the saved generations of the evaluate stage, grouped by
problem id) and junior cross-entropy, distribution overlap and per-token KL to the base (from the analyze
stage's `per_problem.csv`). Problems are ordered by id, so two runs on the same prepared data (the seeds of a
study) line up problem by problem.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from tandem.checkpoints import generations_file
from tandem.errors import BadInputError
from tandem.metrics.passk import pass_at_k_P
from tasks.common import read_json, read_jsonl

ANALYSIS_METRICS = ("junior_ce", "overlap", "kl_mean")
BASE = "base"


def final_steps(eval_doc: dict, arms: list[str]) -> dict[str, int]:
    """Each arm's last evaluated step (0 when the arm was never trained) and the base's step 0."""
    out = {BASE: 0}
    for arm in arms:
        if arm in eval_doc["arms"]:
            out[arm] = int(eval_doc["arms"][arm]["checkpoints"][-1]["step"])
    return out


def _gen_arm(eval_doc: dict, arm: str) -> str:
    """Which arm's directory holds `arm`'s generations (the base's are under every arm's step-0)."""
    return next(iter(eval_doc["arms"])) if arm == BASE else arm


def passk_by_problem(rows: list[dict], ks: list[int]) -> dict[int, dict[str, float]]:
    """{k: {problem id: pass@k}} from one benchmark's generation rows (each with `id` and a 0/1 `score`)."""
    by_id: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        by_id[str(r["id"])].append(float(r["score"]))
    ids = sorted(by_id)
    n_P = [len(by_id[i]) for i in ids]
    c_P = [sum(1 for s in by_id[i] if s >= 0.5) for i in ids]
    return {k: dict(zip(ids, pass_at_k_P(c_P, n_P, k).tolist())) for k in ks if all(k <= n for n in n_P)}


def _per_problem_csv(path: Path) -> dict[tuple[str, int, str], dict[str, dict[str, float]]]:
    """(arm, step, benchmark) -> metric -> {problem id: value} from the analyze stage's per-problem table."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    with open(path, newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            key = (r["arm"], int(r["step"]), r["benchmark"])
            for m in ANALYSIS_METRICS:
                v = r.get(m, "")
                out[key][m][str(r["id"])] = float(v) if v not in ("", None) else math.nan
    return out


def run_measures(root: str | Path, arms: list[str], steps: dict[str, int] | None = None
                 ) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """arm (and "base") -> metric -> benchmark -> {problem id: value} for one run under `root`.

    Metrics: `<mode>/pass@<k>` for each evaluated mode and k, and the analysis metrics when
    metrics/plots/analysis/per_problem.csv exists. `steps` ({arm: step}, "base" at 0) picks the checkpoints;
    by default each arm's last evaluated one and the base.
    """
    root = Path(root)
    eval_path = root / "metrics" / "eval.json"
    if not eval_path.exists():
        raise BadInputError(f"measures: {eval_path} does not exist; run the evaluate stage for this run first")
    ev = read_json(eval_path)
    ks, modes, benches = list(ev["settings"]["ks"]), list(ev["settings"]["modes"]), sorted(ev["settings"]["benchmarks"])
    steps = final_steps(ev, arms) if steps is None else dict(steps)
    out: dict = {}
    for arm, step in steps.items():
        out[arm] = {}
        for mode in modes:
            for b in benches:
                f = generations_file(root / "results" / "generations", _gen_arm(ev, arm), step, mode, b)
                if not f.exists():
                    raise BadInputError(f"measures: missing generations {f}; rerun the evaluate stage")
                for k, vals in passk_by_problem(read_jsonl(f), ks).items():
                    out[arm].setdefault(f"{mode}/pass@{k}", {})[b] = vals
    table = root / "metrics" / "plots" / "analysis" / "per_problem.csv"
    if table.exists():
        pp = _per_problem_csv(table)
        for arm, step in steps.items():
            src = next((a for (a, s, _) in pp if s == step and (a == arm or (arm == BASE and s == 0))), None)
            if src is None:
                continue
            for m in ANALYSIS_METRICS:
                out[arm][m] = {b: dict(pp[(src, step, b)][m]) for b in benches if (src, step, b) in pp}
    return out


def stack_seeds(per_seed: list[dict]) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    """Stack the `run_measures` of several seeds into arm -> metric -> benchmark -> values_MP (NaN where a seed
    lacks a problem). Only arms, metrics and benchmarks present in every seed are kept."""
    if not per_seed:
        return {}
    common_arms = set.intersection(*(set(s) for s in per_seed))
    out: dict = {}
    for arm in sorted(common_arms):
        metrics = set.intersection(*(set(s[arm]) for s in per_seed))
        for m in sorted(metrics):
            benches = set.intersection(*(set(s[arm][m]) for s in per_seed))
            for b in sorted(benches):
                ids = sorted(set().union(*(s[arm][m][b].keys() for s in per_seed)))
                arr = np.array([[s[arm][m][b].get(i, math.nan) for i in ids] for s in per_seed], dtype=np.float64)
                out.setdefault(arm, {}).setdefault(m, {})[b] = arr
    return out
