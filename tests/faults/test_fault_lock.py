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

from tandem.errors import BadInputError, UserError, WorkspaceBusyError
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


# --- fault probes: a link at a lock path, an output root of another user, lock files deleted under a run ---------


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg.strip(), msg
    return msg


def _plant_link(root: Path, where: str, target: Path) -> Path:
    link = root / where
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


@pytest.mark.parametrize("where, scope", [
    (LOCK_NAME, None),                      # the root's lock file, whole-root run (the old code truncated the target)
    (LOCK_NAME, "train-tandem"),            # the root's lock file, taken shared by an arm's run
    (".tandem.train-tandem.lock", "train-tandem"),         # an arm's lock
    (".tandem.train-tandem.lock/holder", "train-tandem"),  # the arm's holder information
])
def test_a_link_at_a_lock_path_is_refused_and_its_target_untouched(tmp_path, where, scope):
    root, target = tmp_path / "out", tmp_path / "precious.txt"
    target.write_text("keep me\n")
    before = os.stat(target)
    link = _plant_link(root, where, target)
    with pytest.raises(BadInputError) as exc:
        with workspace_lock(root, scope=scope):
            pytest.fail("the run started with a link at its lock path")
    msg = _one_line(exc.value)
    assert str(link) in msg and "link" in msg and "remove" in msg
    assert target.read_text() == "keep me\n" and os.stat(target).st_mtime_ns == before.st_mtime_ns
    assert link.is_symlink()
    link.unlink()  # once the link is gone the root works again
    with workspace_lock(root, scope=scope):
        pass
    assert target.read_text() == "keep me\n"


def test_a_dangling_link_at_the_lock_path_creates_nothing(tmp_path):
    root, target = tmp_path / "out", tmp_path / "elsewhere" / "created-by-the-lock"
    target.parent.mkdir()
    _plant_link(root, LOCK_NAME, target)
    with pytest.raises(BadInputError):
        with workspace_lock(root):
            pass
    assert not target.exists()


def test_a_hard_link_at_the_lock_path_is_not_written_through(tmp_path):
    root, target = tmp_path / "out", tmp_path / "precious.txt"
    root.mkdir()
    target.write_text("keep me\n")
    os.link(target, root / LOCK_NAME)
    with pytest.raises(BadInputError, match="hard links"):
        with workspace_lock(root):
            pass
    assert target.read_text() == "keep me\n"


def test_an_out_root_of_another_user_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "out"
    root.mkdir()
    owner = os.stat(root).st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)  # this run's user is not the root's owner
    with pytest.raises(BadInputError) as exc:
        with workspace_lock(root):
            pytest.fail("the run started in another user's output root")
    msg = _one_line(exc.value)
    assert f"uid {owner}" in msg and str(root) in msg
    assert list(root.iterdir()) == []  # nothing written there


@pytest.mark.parametrize("holder_scope", [None, "train-tandem"])
def test_deleted_lock_files_admit_no_second_run(tmp_path, holder_scope):
    """`rm -f <out_root>/.tandem*.lock` under a running job: neither the same arm nor a whole-root run starts."""
    holder = Holder(tmp_path, scope=holder_scope)
    try:
        removed = [p for p in tmp_path.glob(".tandem*.lock") if p.is_file() and not p.is_symlink()]
        assert removed  # the old code's lock files were all plain files, so this removed every one of them
        for p in removed:
            os.remove(p)
        for scope in (None, "train-tandem"):
            with pytest.raises(WorkspaceBusyError) as exc:
                with workspace_lock(tmp_path, scope=scope):
                    pytest.fail(f"scope {scope} started beside a running holder (scope {holder_scope})")
            _one_line(exc.value)
            if holder_scope is not None:  # the arm's holder information lives in its directory, which rm -f spares
                assert f"pid {holder.proc.pid}" in str(exc.value)
        if holder_scope is not None:  # another arm still runs beside it
            with workspace_lock(tmp_path, scope="train-grpo"):
                pass
    finally:
        holder.release()
    with workspace_lock(tmp_path, scope="train-tandem"):
        pass
    with workspace_lock(tmp_path):
        pass


def test_a_lock_directory_replaced_while_being_locked_is_locked_again(tmp_path, monkeypatch):
    """A run that opened the arm's directory just before another run removed and created it again would lock a
    directory nobody else sees: after locking, the path must still name the locked inode, else it starts over."""
    import tandem.workspace as ws

    real, replaced = ws._flock, []

    def flock(fd, shared):
        d = tmp_path / ".tandem.train-tandem.lock"
        if not replaced and d.is_dir() and os.path.samestat(os.fstat(fd), os.stat(d)):
            d.rename(tmp_path / "gone")  # meanwhile: removed and created again by another run
            d.mkdir()
            replaced.append(d)
        return real(fd, shared)

    monkeypatch.setattr(ws, "_flock", flock)
    lock = ws._acquire(tmp_path, "train-tandem", False, 0.05, "test")
    try:
        assert replaced
        assert os.path.samestat(os.fstat(lock.scope_fd), os.lstat(tmp_path / ".tandem.train-tandem.lock"))
    finally:
        lock.release()


class OldHolder:
    """A run of the previous version: flock on the plain files `.tandem.lock` (and `.tandem.<scope>.lock`)."""

    def __init__(self, root: Path, scope: str | None = None):
        code = ("import fcntl, os, sys\n"
                f"root, scope = {str(root)!r}, {scope!r}\n"
                "fd = os.open(os.path.join(root, '.tandem.lock'), os.O_RDWR | os.O_CREAT)\n"
                "fcntl.flock(fd, fcntl.LOCK_SH if scope else fcntl.LOCK_EX)\n"
                "if scope:\n"
                "    sfd = os.open(os.path.join(root, f'.tandem.{scope}.lock'), os.O_RDWR | os.O_CREAT)\n"
                "    fcntl.flock(sfd, fcntl.LOCK_EX)\n"
                "    os.write(sfd, b'{\"pid\": %d, \"command\": \"old holder\"}' % os.getpid())\n"
                "print('held', flush=True)\n"
                "sys.stdin.readline()\n")
        root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout.readline().strip() == "held"

    release = Holder.release


def test_lock_files_left_by_an_older_version_break_nothing(tmp_path):
    (tmp_path / LOCK_NAME).write_text('{"pid": 1, "command": "old run"}\n')
    (tmp_path / ".tandem.train-tandem.lock").write_text("")
    with workspace_lock(tmp_path):
        pass
    with workspace_lock(tmp_path, scope="train-tandem"):
        pass
    assert (tmp_path / ".tandem.train-tandem.lock").is_dir()  # the old arm file became the arm's directory
    assert list((tmp_path / ".tandem.train-tandem.lock").iterdir()) == []  # empty between runs (git ignores it)


def test_a_run_of_an_older_version_still_excludes_and_is_excluded(tmp_path):
    old = OldHolder(tmp_path)
    try:
        for scope in (None, "train-tandem"):
            with pytest.raises(WorkspaceBusyError):
                with workspace_lock(tmp_path, scope=scope):
                    pass
    finally:
        old.release()
    old = OldHolder(tmp_path, scope="train-tandem")
    try:
        with pytest.raises(WorkspaceBusyError, match="old holder"):
            with workspace_lock(tmp_path, scope="train-tandem"):
                pass
        with workspace_lock(tmp_path, scope="train-grpo"):
            pass
    finally:
        old.release()


def test_where_a_directory_cannot_be_locked_the_files_keep_runs_apart(tmp_path, monkeypatch, caplog):
    """NFS emulates flock with byte-range locks, which refuse a directory: the lock files are the gate there."""
    import fcntl
    import stat

    import tandem.workspace as ws

    real = fcntl.flock

    def flock(fd, op):
        if stat.S_ISDIR(os.fstat(fd).st_mode) and not op & fcntl.LOCK_UN:
            raise OSError(9, "Bad file descriptor")
        return real(fd, op)

    monkeypatch.setattr(ws.fcntl, "flock", flock)
    monkeypatch.setattr(ws, "_warned_no_dir_lock", set())
    arm = ws._acquire(tmp_path, "train-tandem", False, 0.05, "first arm")
    try:
        assert "cannot lock a directory" in caplog.text
        for scope in ("train-tandem", None):
            with pytest.raises(WorkspaceBusyError, match="first arm"):
                ws._acquire(tmp_path, scope, False, 0.05, "second")
        ws._acquire(tmp_path, "train-grpo", False, 0.05, "other arm").release()
    finally:
        arm.release()
    ws._acquire(tmp_path, None, False, 0.05, "whole").release()
