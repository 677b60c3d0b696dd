"""The promotion registry: record and reload a promotion, refuse rejected ones, git-tag in a scratch repo."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tandem.config import params_from_dict
from tasks import promotion

from tests.report.fake_metrics import fake_eval


def _params(root):
    return params_from_dict({"out_root": str(root)})


def test_record_then_reload_then_already_promoted(tmp_path):
    params, ev = _params(tmp_path), fake_eval()
    first = promotion.decision_for(params, ev)
    assert first.promote and first.previous is None
    rec = promotion.record(params, first, run_id="run-1")
    assert rec["candidate"]["arm"] == "tandem" and "git_tag" not in rec
    assert promotion.load_promoted(params) == first.candidate
    again = promotion.decision_for(params, ev)
    assert not again.promote and "already promoted" in again.reason
    history = (tmp_path / "registry" / "history.jsonl").read_text().splitlines()
    assert [json.loads(line)["run_id"] for line in history] == ["run-1"]


def test_refuses_to_record_a_rejected_decision(tmp_path):
    params = _params(tmp_path)
    promotion.record(params, promotion.decision_for(params, fake_eval()))
    rejected = promotion.decision_for(params, fake_eval())
    with pytest.raises(ValueError, match="refusing"):
        promotion.record(params, rejected)


def test_unknown_promote_arm_is_explained(tmp_path):
    params = params_from_dict({"out_root": str(tmp_path), "report": {"promote_arm": "grpo_g16"}})
    d = promotion.decision_for(params, fake_eval())
    assert not d.promote and "grpo_g16" in d.reason and "not evaluated" in d.reason


def test_corrupt_registry_names_the_file(tmp_path):
    (tmp_path / "registry").mkdir()
    (tmp_path / "registry" / "promoted.json").write_text('{"nope": 1}')
    with pytest.raises(ValueError, match="promoted.json"):
        promotion.load_promoted(_params(tmp_path))


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_tags_count_up(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    params = _params(repo)
    d = promotion.decision_for(params, fake_eval())
    # no commit yet: nothing to tag, the registry is still written
    assert promotion.record(params, d, tag_repo=repo)["git_tag"] is None
    (repo / "f").write_text("x")
    subprocess.run(git + ["add", "f"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "c"], check=True)
    rec1 = promotion.record(params, d, tag_repo=repo)
    rec2 = promotion.record(params, d, tag_repo=repo)
    assert (rec1["git_tag"], rec2["git_tag"]) == ("tandem-model@v1.0.0", "tandem-model@v2.0.0")
    msg = subprocess.run(git + ["tag", "-l", "--format=%(contents)", "tandem-model@v1.0.0"], capture_output=True,
                         text=True, check=True).stdout
    assert "promote tandem/step-20" in msg and '"arm": "tandem"' in msg
