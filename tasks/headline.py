"""The headline numbers of each stage: the DVC metrics files (`dvc metrics show`, `dvc exp show`, `dvc exp diff`).

DVC shows every leaf of a metrics file as a column, and strings or lists as columns it cannot diff. So the
stages' own documents (`metrics/<stage>.json`: settings, hashes, fingerprints, per-benchmark blocks; schemas in
docs/metrics.md) are plain outputs, read by the report, the promotion gate and the study, and each stage also
writes `metrics/headline/<stage>.json`: a few numbers taken from its document, nothing else. Keys repeat across
files of the same kind (every arm's training file has the same keys), so `dvc metrics show` stays within a few
dozen columns: 4 (data) + 2 (base) + 5 (training) + 3 x (arms + 1) (evaluation) + 3 x arms (analysis).
"""

from __future__ import annotations

from typing import Any

TRAIN_KEYS = ("reward_first", "reward_last", "reward_mean", "kl_to_base_last", "senior_fraction")
ANALYSIS_KEYS = ("kl_mean", "junior_ce", "overlap")


def _num(value: Any) -> float | int | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def data(doc: dict) -> dict:
    """metrics/data.json -> row counts and validation failures."""
    counts = doc.get("counts") or {}
    return {"train_rows": counts.get("train"), "val_rows": counts.get("val"),
            "eval_problems": sum((counts.get("eval") or {}).values()),
            "validation_failures": (doc.get("validation") or {}).get("failures")}


def base(doc: dict) -> dict:
    """metrics/base.json -> the base model's greedy and sampled accuracy (macro over benchmarks)."""
    acc = doc.get("accuracy") or {}
    return {"greedy_accuracy": _num((acc.get("greedy") or {}).get("macro")),
            "sampled_accuracy": _num((acc.get("sampled") or {}).get("macro"))}


def junior(doc: dict) -> dict:
    """metrics/junior.json -> whether the junior is the base, and a built junior's greedy and sampled accuracy."""
    acc = doc.get("accuracy") or {}
    return {"is_base": 1 if doc.get("is_base") else 0,
            "greedy_accuracy": _num((acc.get("greedy") or {}).get("macro")),
            "sampled_accuracy": _num((acc.get("sampled") or {}).get("macro"))}


def train(doc: dict) -> dict:
    """metrics/train_<arm>.json -> reward at the first and last step, its mean, drift and senior share."""
    return {k: _num(doc.get(k)) for k in TRAIN_KEYS}


def evaluation(doc: dict) -> dict:
    """metrics/eval.json -> macro pass@<first k> per mode of the base (step 0) and of each arm's last checkpoint:
    {"pass@1": {"base": {"solo": ..}, "<arm>": {"solo": .., "step": ..}}}."""
    s = doc.get("settings") or {}
    k = f"pass@{(s.get('ks') or [1])[0]}"
    out: dict[str, dict] = {}

    def modes(ckpt: dict) -> dict:
        return {m: _num(((ckpt.get("modes") or {}).get(m, {}).get("macro") or {}).get(k)) for m in s.get("modes", [])}

    for arm, a in (doc.get("arms") or {}).items():
        cks = sorted(a.get("checkpoints") or [], key=lambda c: c.get("step", 0))
        if cks and cks[0].get("step", 0) == 0 and "base" not in out:
            out["base"] = modes(cks[0])
        if cks and cks[-1].get("step", 0) > 0:
            out[arm] = modes(cks[-1])
    return {k: out}


def analysis(doc: dict) -> dict:
    """metrics/analysis.json -> each arm's drift (mean per-token KL), junior cross-entropy and overlap at its
    last checkpoint."""
    return {arm: {k: _num(s.get(k)) for k in ANALYSIS_KEYS} for arm, s in (doc.get("summary") or {}).items()}
