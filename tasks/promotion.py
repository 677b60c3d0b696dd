"""Promotion registry for scheduled retraining, kept in git: GTO-style tags on the commit whose dvc.lock
holds the promoted checkpoint.

The comparison itself is pure (`tandem.report.promotion`); this module holds the I/O around it. A promotion
is two annotated git tags at HEAD, in the naming GTO reads for the `tandem-model` artifact that dvc.yaml's
`artifacts:` section declares: the version `tandem-model@v<N>.0.0` (its message holds the record as JSON:
candidate, scores, previous, deltas, run id) and the stage assignment `tandem-model#prod#<N>`. The tagged
commit's dvc.lock pins the checkpoint's content, so `git checkout tandem-model@v3.0.0 && dvc pull
models/checkpoints` restores it on any machine, and `gto show tandem-model` lists the history. Nothing is
kept on a worker's disk: a fresh clone (with its tags) sees every promotion. A run outside a git work tree
with a commit cannot promote (the registry would have nowhere to live); `decision_for` still reports.

A tag is only true when the commit it lands on pins what it promotes: `record` refuses (BadInputError naming
the fix) unless the output root's dvc.lock is committed, unmodified against HEAD, and names the promoted
checkpoint's directory among its outputs (`pin_problem`). The flow commits dvc.lock first when it publishes.
"""

from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from tandem.config import Params
import yaml

from tandem.errors import BadInputError
from tandem.report.promotion import Candidate, Decision, best_checkpoint, decide
from tasks.common import Layout

ARTIFACT = "tandem-model"
TAG_PREFIX = f"{ARTIFACT}@v"
STAGE = "prod"


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)


def git_root(params: Params) -> Path | None:
    """The git work tree holding `out_root`, when it has a commit (tags need one)."""
    root = Layout.of(params).root
    if not root.exists():
        return None
    top = _git(root, "rev-parse", "--show-toplevel")
    if top.returncode != 0 or _git(root, "rev-parse", "--verify", "-q", "HEAD").returncode != 0:
        return None
    return Path(top.stdout.strip())


def _version(tag: str) -> int | None:
    head = tag[len(TAG_PREFIX):].split(".")[0] if tag.startswith(TAG_PREFIX) else ""
    return int(head) if head.isdigit() else None


def history(params: Params) -> list[dict]:
    """Every promotion record, oldest first (from the version tags' messages)."""
    repo = git_root(params)
    if repo is None:
        return []
    out = _git(repo, "tag", "--list", f"{TAG_PREFIX}*")
    tags = sorted((v, t) for t in out.stdout.split() if (v := _version(t)) is not None)
    records = []
    for _, tag in tags:
        msg = _git(repo, "tag", "--list", "--format=%(contents)", tag).stdout
        body = msg[msg.find("{"):] if "{" in msg else ""
        try:
            rec = json.loads(body[: body.rfind("}") + 1])
        except ValueError as e:
            raise ValueError(f"promotion tag {tag} holds no readable record ({e}); delete the tag "
                             f"(git tag -d {tag}; git push origin :refs/tags/{tag}) to start over") from e
        records.append({**rec, "git_tag": tag})
    return records


def load_promoted(params: Params) -> Candidate | None:
    """The last promoted checkpoint, or None before the first promotion."""
    recs = history(params)
    if not recs:
        return None
    try:
        return Candidate.from_dict(recs[-1]["candidate"])
    except (KeyError, TypeError, ValueError) as e:
        raise BadInputError(f"promotion tag {recs[-1]['git_tag']} is unreadable ({e})") from e


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


def next_tag(repo: Path) -> str:
    """`tandem-model@v<N>.0.0` with N one above the highest existing such tag."""
    out = _git(repo, "tag", "--list", f"{TAG_PREFIX}*")
    nums = [v for t in out.stdout.split() if (v := _version(t)) is not None]
    return f"{TAG_PREFIX}{max(nums, default=0) + 1}.0.0"


def _tag(repo: Path, name: str, message: str) -> None:
    res = _git(repo, "-c", "user.name=tandem-pipeline", "-c", "user.email=tandem@localhost",
               "tag", "-a", name, "-m", message)
    if res.returncode != 0:
        raise RuntimeError(f"git tag {name} failed: {res.stderr.strip()}")


def _inside(path: str, out: str) -> bool:
    path, out = os.path.normpath(path), os.path.normpath(out)
    return path == out or path.startswith(out.rstrip("/") + "/")


def pin_problem(params: Params, candidate: Candidate) -> str | None:
    """Why HEAD does not pin `candidate` (None when it does): the output root's dvc.lock must be committed,
    unmodified, and list the checkpoint's directory (e.g. models/checkpoints/tandem) among its outputs, so
    that `git checkout <tag> && dvc pull` restores exactly the promoted weights."""
    repo = git_root(params)
    if repo is None:
        return f"{Layout.of(params).root} is no git work tree with a commit"
    lock = Layout.of(params).root.resolve() / "dvc.lock"
    rel = os.path.relpath(lock, repo.resolve())
    fix = ("commit dvc.lock (and metrics/) first, as the flow's `publish` does, or run without promote")
    if not lock.exists():
        return f"there is no {rel}: the promoted checkpoint would be pinned nowhere; run the pipeline through DVC"
    if _git(repo, "ls-files", "--error-unmatch", "--", rel).returncode != 0:
        return f"{rel} is not committed, so HEAD does not pin the promoted checkpoint: {fix}"
    if _git(repo, "diff", "--quiet", "HEAD", "--", rel).returncode != 0:
        return (f"{rel} has uncommitted changes, so HEAD pins other outputs than the ones evaluated: {fix}")
    try:
        stages = (yaml.safe_load(_git(repo, "show", f"HEAD:{rel}").stdout) or {}).get("stages") or {}
    except yaml.YAMLError as e:
        return f"{rel} at HEAD is not readable YAML ({e})"
    outs = [o.get("path", "") for st in stages.values() for o in (st.get("outs") or []) if isinstance(o, dict)]
    if not any(_inside(candidate.path, o) for o in outs):
        return (f"{rel} at HEAD lists no output holding {candidate.path} (outputs: {', '.join(outs) or 'none'}): "
                f"{fix}")
    return None


def record(params: Params, decision: Decision, *, run_id: str = "", provenance: dict | None = None) -> dict:
    """Tag HEAD as the new promoted version (and assign it the `prod` stage); returns the record.

    Requires a passing decision, a git work tree with a commit, and a HEAD whose dvc.lock pins the candidate
    (`pin_problem`). Pushing the tags (with the commit of the run's dvc.lock) is the caller's job:
    `flows.dvc_sync.DvcSync.git_push`."""
    if not decision.promote or decision.candidate is None:
        raise BadInputError(f"refusing to record a promotion the gate rejected: {decision.reason}")
    repo = git_root(params)
    if repo is None:
        raise BadInputError(f"promotion needs a git work tree with a commit at {Layout.of(params).root}: "
                            "the registry is its tags")
    if (problem := pin_problem(params, decision.candidate)) is not None:
        raise BadInputError(f"refusing to promote {decision.candidate.arm}/step-{decision.candidate.step}: "
                            f"{problem}")
    rec = {"promoted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "run_id": run_id,
           "reason": decision.reason, "candidate": decision.candidate.to_dict(),
           "previous": decision.previous.to_dict() if decision.previous else None,
           "deltas": decision.deltas, "provenance": provenance or {}}
    name = next_tag(repo)
    n = _version(name)
    cand = rec["candidate"]
    _tag(repo, name, f"promote {cand['arm']}/step-{cand['step']}\n\n" + json.dumps(rec, indent=2, sort_keys=True))
    _tag(repo, f"{ARTIFACT}#{STAGE}#{n}", f"assign {STAGE} to {name}")
    return {**rec, "git_tag": name}
