"""A write that fails midway (disk full, an exception, a killed process) never replaces the previous good file.

Covers the atomic writers of tasks/common.py (JSON, JSON Lines, whole directories) and the checkpoint commit of
the train stage (trl writes `checkpoint-<N>/`, renamed to `step-<N>/` only once complete).
"""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.common import atomic_path, read_json, read_jsonl, write_json, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def _disk_full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def test_write_json_that_fails_midway_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "metrics" / "data.json"
    write_json(path, {"good": 1})
    real_write = Path.write_text

    def half_then_full(self, text, *a, **k):
        real_write(self, text[: len(text) // 2], *a, **k)  # part of the new content reaches the disk
        _disk_full()

    monkeypatch.setattr(Path, "write_text", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        write_json(path, {"good": 2, "more": list(range(100))})
    monkeypatch.undo()
    assert read_json(path) == {"good": 1}
    assert _leftovers(path.parent) == []  # the temporary sibling is gone too


def test_write_jsonl_that_raises_midway_keeps_the_old_file(tmp_path):
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [{"id": "old"}])

    def rows():
        yield {"id": "new-1"}
        yield {"id": "new-2"}
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        write_jsonl(path, rows())
    assert read_jsonl(path) == [{"id": "old"}]
    assert _leftovers(tmp_path) == []


def test_a_directory_write_that_fails_keeps_the_old_directory(tmp_path):
    target = tmp_path / "eval"
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "a.jsonl").write_text("old a\n")
    with pytest.raises(RuntimeError, match="midway"):
        with atomic_path(target) as tmp:
            tmp.mkdir()
            (tmp / "b.jsonl").write_text("new b\n")
            raise RuntimeError("failed midway")
    assert sorted(p.name for p in target.iterdir()) == ["a.jsonl"]
    assert (target / "a.jsonl").read_text() == "old a\n"
    # and a successful replacement swaps the whole directory
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "c.jsonl").write_text("c\n")
    assert sorted(p.name for p in target.iterdir()) == ["c.jsonl"]
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", ["jsonl", "dir"])
def test_a_process_killed_midway_leaves_the_old_content(tmp_path, kind):
    """SIGKILL in the middle of a write (after part of the new data hit the disk): the old content survives."""
    target = tmp_path / ("data.jsonl" if kind == "jsonl" else "eval")
    if kind == "jsonl":
        write_jsonl(target, [{"id": "old"}])
    else:
        with atomic_path(target) as tmp:
            tmp.mkdir()
            (tmp / "old.jsonl").write_text("old\n")
    code = f"""
import os, signal, sys
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from tasks.common import atomic_path, write_jsonl
target = Path({str(target)!r})
def rows():
    for i in range(1000):
        yield {{"id": f"new-{{i}}", "pad": "x" * 100}}
        if i == 500:
            os.kill(os.getpid(), signal.SIGKILL)
if {kind == "jsonl"!r}:
    write_jsonl(target, rows())
else:
    with atomic_path(target) as tmp:
        tmp.mkdir()
        write_jsonl(tmp / "new.jsonl", rows())
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == -signal.SIGKILL, res.stderr
    if kind == "jsonl":
        assert read_jsonl(target) == [{"id": "old"}]
    else:
        assert [p.name for p in target.iterdir()] == ["old.jsonl"]


def test_a_checkpoint_save_that_fails_midway_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    """trl's save raising halfway through `checkpoint-<N>/` leaves `step-<previous>/` intact and no `step-<N>`."""
    pytest.importorskip("trl")
    from types import SimpleNamespace

    from trl import GRPOTrainer

    from tandem.checkpoints import STAGING_PREFIX, complete_checkpoints, latest_checkpoint
    from tandem.checkpoints import STATE_FILE as TANDEM_STATE
    from tandem.train.trainer import _make_trainer_class

    arm = tmp_path / "tandem"
    good = arm / "step-2"
    good.mkdir(parents=True)
    (good / "model.safetensors").write_bytes(b"good weights")
    (good / "config.json").write_text("{}")
    (good / "trainer_state.json").write_text('{"log_history": []}')
    (good / TANDEM_STATE).write_text(json.dumps({"step": 2, "complete": True, "fingerprint": "fp"}))
    before = {p.name: p.read_bytes() for p in good.iterdir()}

    def partial_save(self, model, trial):
        staging = arm / f"{STAGING_PREFIX}{self.state.global_step}"
        staging.mkdir()
        (staging / "model.safetensors").write_bytes(b"half of the new wei")
        _disk_full()

    monkeypatch.setattr(GRPOTrainer, "_save_checkpoint", partial_save)
    trainer_cls = _make_trainer_class()
    trainer = trainer_cls.__new__(trainer_cls)  # only the save path is exercised: no model, no data
    trainer.state = SimpleNamespace(global_step=4)
    trainer.tandem_state = {"prompts_per_step": 2, "fingerprint": "fp"}
    trainer._get_output_dir = lambda trial: str(arm)
    with pytest.raises(OSError, match="No space left"):
        trainer._save_checkpoint(None, None)

    assert [p.name for _, p in complete_checkpoints(arm)] == ["step-2"]
    assert latest_checkpoint(arm, "fp") == good
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert not (arm / "step-4").exists()
    from tandem.checkpoints import clean_arm_dir

    assert clean_arm_dir(arm, "fp") == [f"{STAGING_PREFIX}4"]  # the rerun removes the half-written staging dir
    assert latest_checkpoint(arm, "fp") == good
