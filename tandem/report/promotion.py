"""Scheduled-retraining promotion: pick the run's best checkpoint and gate it on no regression.

Pure functions over the `metrics/eval.json` dict (docs/metrics.md) and the record of the last promoted
checkpoint. A candidate is promoted only when neither its solo nor its tandem macro pass@k drops by more
than `tolerance` below the last promoted one, measured under the same evaluation settings; the gate fails
closed (no promotion) whenever the two cannot be compared.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem.run_keys import eval_estimate_fields

# Evaluation settings that change what a pass@k estimates (`tandem.run_keys`); two runs are comparable only when
# all agree. The seed and batch size change the random stream, not the quantity, so they are left out.
_FINGERPRINT_KEYS = eval_estimate_fields()


@dataclass(frozen=True)
class Candidate:
    """One trained checkpoint with the two scores the gate compares (macro pass@k)."""

    arm: str
    step: int
    path: str
    hash: str
    k: int
    solo: float | None
    tandem: float | None
    tandem_mode: str | None
    fingerprint: str

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Candidate":
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    candidate: Candidate | None
    previous: Candidate | None
    tolerance: float
    deltas: dict[str, float | None] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"promote": self.promote, "reason": self.reason, "tolerance": self.tolerance,
                "deltas": dict(self.deltas),
                "candidate": self.candidate.to_dict() if self.candidate else None,
                "previous": self.previous.to_dict() if self.previous else None}


def settings_fingerprint(eval_data: dict) -> str:
    """SHA-256 (first 16 hex) of the decoding settings and each benchmark's rows hash."""
    s = eval_data.get("settings", {})
    core = {k: s.get(k) for k in _FINGERPRINT_KEYS}
    core["benchmarks"] = {b: (v or {}).get("rows_hash") for b, v in sorted((s.get("benchmarks") or {}).items())}
    return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:16]


def tandem_mode(eval_data: dict) -> str | None:
    """The handoff-robustness mode when evaluated (`step`, the paper's figure 3), else `word`, else None."""
    modes = eval_data.get("settings", {}).get("modes", [])
    return next((m for m in ("step", "word") if m in modes), None)


def _score(ckpt: dict, mode: str | None, k: int) -> float | None:
    if mode is None:
        return None
    return ((ckpt.get("modes", {}).get(mode) or {}).get("macro") or {}).get(f"pass@{k}")


def candidates(eval_data: dict, arm: str = "", k: int = 1) -> list[Candidate]:
    """Every trained checkpoint (step > 0) of `arm` (all arms when empty) with its solo and tandem pass@k."""
    ks = eval_data.get("settings", {}).get("ks", [])
    if ks and k not in ks:
        raise ValueError(f"promotion compares pass@{k}, but the evaluation computed only pass@k for k in {ks}")
    fp, tm = settings_fingerprint(eval_data), tandem_mode(eval_data)
    out = []
    for arm_name, arm_data in sorted(eval_data.get("arms", {}).items()):
        if arm and arm_name != arm:
            continue
        for c in arm_data.get("checkpoints", []):
            if int(c.get("step", 0)) <= 0:  # step 0 is the base model, never a promotion
                continue
            out.append(Candidate(arm=arm_name, step=int(c["step"]), path=str(c.get("path", "")),
                                 hash=str(c.get("hash", "")), k=k, solo=_score(c, "solo", k),
                                 tandem=_score(c, tm, k), tandem_mode=tm, fingerprint=fp))
    return out


def selection_score(c: Candidate) -> float | None:
    """Mean of the solo and tandem scores (solo alone when no tandem mode ran); None when unscored."""
    vals = [v for v in (c.solo, c.tandem if c.tandem_mode else None) if v is not None]
    if c.solo is None or (c.tandem_mode and c.tandem is None):
        return None
    return sum(vals) / len(vals)


def best_checkpoint(eval_data: dict, arm: str = "", k: int = 1) -> Candidate | None:
    """The highest `selection_score`; ties go to the later step (more training at equal score)."""
    scored = [(selection_score(c), c) for c in candidates(eval_data, arm, k)]
    scored = [(s, c) for s, c in scored if s is not None]
    if not scored:
        return None
    return max(scored, key=lambda sc: (sc[0], sc[1].step, sc[1].arm))[1]


def decide(candidate: Candidate | None, previous: Candidate | None, tolerance: float) -> Decision:
    """Promote `candidate` unless its solo or tandem pass@k regresses by more than `tolerance`."""
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")

    def no(reason: str, deltas: dict | None = None) -> Decision:
        return Decision(False, reason, candidate, previous, tolerance, deltas or {})

    if candidate is None:
        return no("no scored trained checkpoint to promote")
    if previous is None:
        return Decision(True, "first promotion: nothing promoted before", candidate, None, tolerance,
                        {"solo": None, "tandem": None})
    if candidate.hash and candidate.hash == previous.hash:
        return no("already promoted: the best checkpoint has the same weights as the promoted one")
    if candidate.fingerprint != previous.fingerprint or candidate.k != previous.k \
            or candidate.tandem_mode != previous.tandem_mode:
        return no("not comparable: evaluation settings or benchmarks changed since the last promotion "
                  "(promote by hand after checking)")
    deltas = {"solo": _delta(candidate.solo, previous.solo), "tandem": _delta(candidate.tandem, previous.tandem)}
    for name in ("solo", "tandem"):
        d = deltas[name]
        if d is None:
            if getattr(previous, name) is not None:
                return no(f"{name} pass@{candidate.k} missing for the candidate", deltas)
            continue
        if d < -tolerance - 1e-12:
            return no(f"{name} pass@{candidate.k} regressed by {-d:.4f} (> tolerance {tolerance:.4f})", deltas)
    return Decision(True, f"no regression beyond {tolerance:.4f} in solo or tandem pass@{candidate.k}",
                    candidate, previous, tolerance, deltas)


def _delta(new: float | None, old: float | None) -> float | None:
    return None if new is None or old is None else new - old


def comparison_rows(decision: Decision) -> list[list[Any]]:
    """Rows (metric, last promoted, this run's best, change) for the report's promotion table."""
    c, p = decision.candidate, decision.previous
    k = (c or p).k if (c or p) else 1

    def row(label: str, get) -> list[Any]:
        new = get(c) if c else None
        old = get(p) if p else None
        return [label, old, new, _delta(new, old)]

    return [
        ["checkpoint", f"{p.arm}/step-{p.step}" if p else None, f"{c.arm}/step-{c.step}" if c else None, None],
        row(f"solo pass@{k}", lambda x: x.solo),
        row(f"tandem ({(c or p).tandem_mode if (c or p) else '-'}) pass@{k}", lambda x: x.tandem),
    ]
