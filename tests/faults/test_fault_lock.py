"""Two runs on one output root: the second waits or is refused (tandem/workspace.py); different roots never meet.

Another process holds the lock in these tests (a child interpreter), because the lock is re-entrant within one
process on purpose: the Prefect flow holds it and calls the stages in-process, from worker threads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tandem.errors import UserError, WorkspaceBusyError
from tandem.workspace import LOCK_NAME, workspace_lock

REPO = Path(__file__).resolve().parents[2]


class Holder:
    """A child process that takes the lock on `root`, says so, and keeps it until told to stop (or killed)."""

    def __init__(self, root: Path, scope: str | None = None):
        code = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
                "from tandem.workspace import workspace_lock\n"
                f"with workspace_lock({str(root)!r}, command='holder', scope={scope!r}):\n"
                "    print('held', flush=True)\n"
                "    sys.stdin.readline()\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout.readline().strip() == "held"

    def release(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        assert self.proc.wait(timeout=60) == 0

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)


def test_a_second_run_is_refused_with_the_holder_named(tmp_path):
    holder = Holder(tmp_path)
    try:
        with pytest.raises(WorkspaceBusyError) as exc:
            with workspace_lock(tmp_path):
                pass
        assert isinstance(exc.value, UserError)
        msg = str(exc.value)
        assert f"pid {holder.proc.pid}" in msg and "holder" in msg and "--wait" in msg
    finally:
        holder.release()
    with workspace_lock(tmp_path):  # free again once the first run ends
        pass


def test_a_waiting_run_starts_when_the_first_ends(tmp_path):
    holder = Holder(tmp_path)
    got: list[str] = []

    def second():
        with workspace_lock(tmp_path, wait=True, poll_seconds=0.05):
            got.append("ran")

    t = threading.Thread(target=second)
    t.start()
    t.join(timeout=1.0)
    assert got == [] and t.is_alive()  # still waiting: the first run holds the root
    holder.release()
    t.join(timeout=60)
    assert got == ["ran"]


def test_a_killed_run_leaves_no_stale_lock(tmp_path):
    holder = Holder(tmp_path)
    holder.kill()
    with workspace_lock(tmp_path):
        pass


def test_different_output_roots_do_not_wait_for_each_other(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    holder = Holder(a)
    try:
        with workspace_lock(b):
            assert (b / LOCK_NAME).exists()
    finally:
        holder.release()
    assert sorted(p.name for p in b.iterdir()) == [LOCK_NAME]  # b's run touched nothing of a's and vice versa
    assert sorted(p.name for p in a.iterdir()) == [LOCK_NAME]


def test_two_arms_share_a_root_but_not_an_arm_or_a_whole_root_run(tmp_path):
    """`tandem stage train --arm A` writes only arm A's files: arms run side by side (dvc, tandem study)."""
    holder = Holder(tmp_path, scope="train-tandem")
    try:
        with workspace_lock(tmp_path, scope="train-grpo"):
            pass
        with pytest.raises(WorkspaceBusyError, match="holder"):
            with workspace_lock(tmp_path, scope="train-tandem"):
                pass
        with pytest.raises(WorkspaceBusyError, match="holder"):
            with workspace_lock(tmp_path):
                pass
    finally:
        holder.release()
    whole = Holder(tmp_path)
    try:
        with pytest.raises(WorkspaceBusyError):
            with workspace_lock(tmp_path, scope="train-grpo"):
                pass
    finally:
        whole.release()


def test_the_lock_is_reentrant_within_one_process(tmp_path):
    """The flow holds the root and calls stages in-process (and in threads): no self-deadlock."""
    with workspace_lock(tmp_path):
        with workspace_lock(tmp_path):
            pass
        errors = []

        def stage():
            try:
                with workspace_lock(tmp_path):
                    pass
            except Exception as e:  # pragma: no cover - the assertion below reports it
                errors.append(e)

        t = threading.Thread(target=stage)
        t.start()
        t.join(timeout=30)
        assert errors == []
        # still held by this process after the nested exits: another process is refused
        code = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
                "from tandem.workspace import workspace_lock\n"
                "from tandem.errors import WorkspaceBusyError\n"
                "try:\n"
                f"    with workspace_lock({str(tmp_path)!r}): sys.exit(0)\n"
                "except WorkspaceBusyError: sys.exit(3)\n")
        assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 3
    with workspace_lock(tmp_path):
        pass


def test_the_flow_takes_the_lock():
    """Every flow (pipeline, training, evaluation) holds the root's lock (a deployment run has no CLI around it):
    all three go through `_pipeline`, which takes it."""
    src = (REPO / "flows" / "pipeline.py").read_text()
    assert src.count("with workspace_lock(params.out_root") == 1
    body = src.split("def _pipeline(", 1)[1].split("\ndef ", 1)[0]
    assert "with workspace_lock(params.out_root" in body
    assert src.count("return _pipeline(") == 3
    assert os.path.exists(REPO / "cli" / "main.py")
    cli = (REPO / "cli" / "main.py").read_text()
    assert cli.count("workspace_lock(p.out_root") == 2  # tandem run and tandem stage
