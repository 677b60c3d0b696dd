"""Promotion registry for scheduled retraining: read the last promoted checkpoint, record a new one, tag it.

The comparison itself is pure (`tandem.report.promotion`); this module holds the I/O around it:
`registry/promoted.json` under `out_root` (the current promoted checkpoint, with its scores and the
evaluation settings' fingerprint) and `registry/history.jsonl` (every promotion, append-only). The registry
is deliberately not a DVC output: it records decisions across runs, so no stage may depend on it for
reproducibility. Optionally the promotion is also a git tag `tandem-model@v<N>.0.0` (the GTO/DVC artifact
convention) whose message holds the record.
"""

from __future__ import annotations

import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from tandem.config import Params
from tandem.report.promotion import Candidate, Decision, best_checkpoint, decide
from tasks.common import Layout, read_json, write_json
from tandem.errors import BadInputError

TAG_PREFIX = "tandem-model@v"


def registry_dir(params: Params) -> Path:
    return Layout.of(params).root / "registry"


def load_promoted(params: Params) -> Candidate | None:
    """The last promoted checkpoint, or None before the first promotion."""
    p = registry_dir(params) / "promoted.json"
    if not p.exists():
        return None
    try:
        return Candidate.from_dict(read_json(p)["candidate"])
    except (KeyError, TypeError, ValueError) as e:
        raise BadInputError(f"promotion registry {p} is unreadable ({e}); fix or delete it to start over") from e


def decision_for(params: Params, eval_data: dict) -> Decision:
    """Compare this run's best checkpoint (of `report.promote_arm`) with the last promoted one."""
    cfg = params.report
    try:
        cand = best_checkpoint(eval_data, cfg.promote_arm, cfg.promote_k)
    except ValueError as e:  # k not evaluated: a settings problem the report should show, not crash on
        return Decision(False, str(e), None, load_promoted(params), cfg.regression_tolerance)
    d = decide(cand, load_promoted(params), cfg.regression_tolerance)
    if cand is None and cfg.promote_arm and cfg.promote_arm not in eval_data.get("arms", {}):
        return Decision(False, f"arm {cfg.promote_arm!r} (report.promote_arm) was not evaluated; evaluated arms: "
                               f"{sorted(eval_data.get('arms', {}))}", None, d.previous, d.tolerance)
    return d


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)


def next_tag(repo: Path) -> str:
    """`tandem-model@v<N>.0.0` with N one above the highest existing such tag."""
    out = _git(repo, "tag", "--list", f"{TAG_PREFIX}*")
    nums = []
    for t in out.stdout.split():
        head = t[len(TAG_PREFIX):].split(".")[0]
        if head.isdigit():
            nums.append(int(head))
    return f"{TAG_PREFIX}{max(nums, default=0) + 1}.0.0"


def git_tag(repo: Path, record: dict) -> str | None:
    """Create an annotated tag at HEAD holding `record`; None when `repo` is not a git work tree with a commit."""
    if _git(repo, "rev-parse", "--verify", "-q", "HEAD").returncode != 0:
        return None
    name = next_tag(repo)
    msg = f"promote {record['candidate']['arm']}/step-{record['candidate']['step']}\n\n" + \
        json.dumps(record, indent=2, sort_keys=True)
    res = _git(repo, "-c", "user.name=tandem-pipeline", "-c", "user.email=tandem@localhost",
               "tag", "-a", name, "-m", msg)
    if res.returncode != 0:
        raise RuntimeError(f"git tag {name} failed: {res.stderr.strip()}")
    return name


def record(params: Params, decision: Decision, *, run_id: str = "", tag_repo: Path | None = None,
           provenance: dict | None = None) -> dict:
    """Write the promotion (registry files, optional git tag) and return the record. Requires `promote`."""
    if not decision.promote or decision.candidate is None:
        raise BadInputError(f"refusing to record a promotion the gate rejected: {decision.reason}")
    rec = {"promoted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "run_id": run_id,
           "reason": decision.reason, "candidate": decision.candidate.to_dict(),
           "previous": decision.previous.to_dict() if decision.previous else None,
           "deltas": decision.deltas, "provenance": provenance or {}}
    if tag_repo is not None:
        rec["git_tag"] = git_tag(Path(tag_repo), rec)
    d = registry_dir(params)
    write_json(d / "promoted.json", rec)
    with open(d / "history.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
    return rec
