"""The promotion registry lives in git tags (GTO naming): record and reload a promotion from a clone, refuse
rejected ones, count versions up, refuse to promote outside a git work tree, and refuse to tag a commit whose
dvc.lock does not pin the promoted checkpoint (dirty, uncommitted, or naming other outputs)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tandem.config import params_from_dict
from tandem.errors import BadInputError
from tasks import promotion

from tests.promotion_fixtures import PINNED_LOCK, commit_pinned_lock
from tests.report.fake_metrics import fake_eval

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _params(root):
    return params_from_dict({"out_root": str(root)})


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout


def _repo(path: Path) -> Path:
    return commit_pinned_lock(path)


def test_record_then_reload_from_a_fresh_clone(tmp_path):
    repo = _repo(tmp_path / "repo")
    params, ev = _params(repo), fake_eval()
    first = promotion.decision_for(params, ev)
    assert first.promote and first.previous is None
    rec = promotion.record(params, first, run_id="run-1")
    assert rec["git_tag"] == "tandem-model@v1.0.0"
    assert "tandem-model#prod#1" in _git(repo, "tag", "--list").split()
    assert not (repo / "registry").exists()  # nothing on disk: the tags are the registry
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    assert promotion.load_promoted(_params(clone)) == first.candidate
    again = promotion.decision_for(_params(clone), ev)
    assert not again.promote and "already promoted" in again.reason
    assert [r["run_id"] for r in promotion.history(_params(clone))] == ["run-1"]


def test_refuses_to_record_a_rejected_decision(tmp_path):
    params = _params(_repo(tmp_path / "repo"))
    promotion.record(params, promotion.decision_for(params, fake_eval()))
    rejected = promotion.decision_for(params, fake_eval())
    with pytest.raises(ValueError, match="refusing"):
        promotion.record(params, rejected)


def test_unknown_promote_arm_is_explained(tmp_path):
    params = params_from_dict({"out_root": str(tmp_path), "report": {"promote_arm": "grpo_g16"}})
    d = promotion.decision_for(params, fake_eval())
    assert not d.promote and "grpo_g16" in d.reason and "not evaluated" in d.reason


def test_no_git_no_promotion(tmp_path):
    params = _params(tmp_path)
    d = promotion.decision_for(params, fake_eval())
    assert d.promote and promotion.load_promoted(params) is None
    with pytest.raises(BadInputError, match="git work tree"):
        promotion.record(params, d)


def test_corrupt_tag_is_named(tmp_path):
    repo = _repo(tmp_path / "repo")
    _git(repo, "tag", "-a", "tandem-model@v1.0.0", "-m", "promote x\n\n{not json}")
    with pytest.raises(ValueError, match="tandem-model@v1.0.0"):
        promotion.load_promoted(_params(repo))


def test_versions_count_up_and_hold_the_record(tmp_path):
    repo = _repo(tmp_path / "repo")
    params = _params(repo)
    d = promotion.decision_for(params, fake_eval())
    rec1 = promotion.record(params, d)
    rec2 = promotion.record(params, d)
    assert (rec1["git_tag"], rec2["git_tag"]) == ("tandem-model@v1.0.0", "tandem-model@v2.0.0")
    msg = _git(repo, "tag", "-l", "--format=%(contents)", "tandem-model@v1.0.0")
    assert "promote tandem/step-20" in msg and json.loads(msg[msg.index("{"):])["candidate"]["arm"] == "tandem"


def test_refuses_to_tag_a_commit_whose_dvc_lock_does_not_pin_the_checkpoint(tmp_path):
    repo = _repo(tmp_path / "repo")
    params = _params(repo)
    d = promotion.decision_for(params, fake_eval())
    assert d.promote and d.candidate.path.startswith("models/checkpoints/tandem/")
    # the run changed dvc.lock (a retrained checkpoint) and nobody committed it: HEAD pins the old model
    (repo / "dvc.lock").write_text(PINNED_LOCK.replace("0123456789abcdef", "fedcba9876543210"))
    with pytest.raises(BadInputError, match="dvc.lock has uncommitted changes") as e:
        promotion.record(params, d)
    assert "commit dvc.lock" in str(e.value) and "publish" in str(e.value)
    assert not _git(repo, "tag", "--list").strip()  # nothing tagged
    # dvc.lock never committed
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    _git(fresh, "init", "-q")
    _git(fresh, "commit", "-q", "--allow-empty", "-m", "c")
    (fresh / "dvc.lock").write_text(PINNED_LOCK)
    with pytest.raises(BadInputError, match="dvc.lock is not committed"):
        promotion.record(_params(fresh), promotion.decision_for(_params(fresh), fake_eval()))
    # committed, but pinning other outputs than the promoted arm's checkpoints
    other = commit_pinned_lock(tmp_path / "other", PINNED_LOCK.replace("tandem", "grpo"))
    with pytest.raises(BadInputError, match="lists no output holding models/checkpoints/tandem"):
        promotion.record(_params(other), promotion.decision_for(_params(other), fake_eval()))
    # once committed, the same decision is recorded
    _git(repo, "commit", "-q", "-am", "the retrained run")
    assert promotion.record(params, d)["git_tag"] == "tandem-model@v1.0.0"


@pytest.mark.integration
def test_gto_reads_the_registry(tmp_path):
    """GTO (the DVC model registry tool) sees the artifact dvc.yaml declares and the promoted version."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(Path(__file__).resolve().parents[2] / "dvc.yaml", repo / "dvc.yaml")
    _git(repo, "init", "-q")
    _git(repo, "add", "dvc.yaml")
    commit_pinned_lock(repo)
    params = _params(repo)
    promotion.record(params, promotion.decision_for(params, fake_eval()))
    from gto.api import show

    rows = show(str(repo), promotion.ARTIFACT)
    assert [(r["version"], [st["stage"] for st in r["stages"]]) for r in rows] == [("v1.0.0", ["prod"])]
    assert json.loads(rows[0]["message"][rows[0]["message"].index("{"):])["candidate"]["arm"] == "tandem"
