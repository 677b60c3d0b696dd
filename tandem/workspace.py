"""One run per output root at a time: an advisory lock file (`<out_root>/.tandem.lock`, fcntl.flock).

`tandem run` and `tandem stage` take the lock before any work. A second run on the same root waits
(`wait=True`) or is refused with a message naming the holder; it never interleaves its writes with the first.
The lock is re-entrant within one process (the Prefect flow calls the stages in-process, from worker threads),
and the operating system drops it when the holding process dies, so a killed run leaves no stale lock behind.
Runs in different output roots lock different directories and never wait for each other.

What the lock guarantees:

- The gate is the out_root directory's own inode, locked exclusively by a whole-root run and shared by a run
  that writes only its part of the root (`scope`, e.g. one arm of the train stage, which is what `dvc.yaml`'s
  `train@<arm>` and tandem study run side by side). A scoped run also locks its scope's directory
  `<out_root>/.tandem.<scope>.lock/` exclusively: two different arms run together, the same arm twice does not,
  and neither runs next to a whole-root run. Deleting lock files under a running job (`rm -f .tandem*.lock`)
  therefore admits nobody: neither directory is a file that `rm -f` removes. After taking a lock the run checks
  that the path still names the inode it locked and starts over if not, so a directory removed and created
  again while a run waited for it is not locked in vain (removing a scope's directory with `rm -r` under its
  running holder is not detected).
- `<out_root>/.tandem.lock` (a plain file) is flocked too, in the same mode, so a run of an older version, which
  locked only that file, and a run of this one still exclude each other; a scope lock file an older version left
  behind is replaced by the scope's directory once no process holds it. The file also carries the whole-root
  holder's pid, command and start time (a scoped holder's are in `holder` inside its scope's directory), only
  as information for the 'in use by ...' message. On a file system that cannot flock a directory (NFS, say) the
  files are the gate, as they were before, and a warning says that deleted lock files go unnoticed there.
- Nothing is opened through a symbolic link: every lock and holder path is opened with O_NOFOLLOW, and a link
  (or a device, a FIFO, a file with other hard links or of another user) at a lock path is refused with one
  line naming it, so a planted link never makes a run create, truncate or write its target.
- The output root must belong to the user running tandem (created if missing); one of another user is refused.

Whoever takes the lock first finishes what a killed run left half done: a stage's outputs committed but not
all swapped in are swapped in, uncommitted ones discarded (`tandem.transactions.recover`), before any stage
reads them.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tandem.errors import BadInputError, WorkspaceBusyError

LOCK_NAME = ".tandem.lock"
HOLDER_NAME = "holder"  # inside a scope's lock directory: that holder's pid, command, start time

log = logging.getLogger("tandem.workspace")

_held: dict[str, int] = {}  # resolved root lock path -> nesting depth in this process
_guard = threading.Lock()
_warned_no_dir_lock: set[str] = set()

# never through a link; never block on a FIFO; never become a controlling terminal; never inherited by exec
_SAFE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
# what flock on a directory says where the file system cannot lock one (NFS emulates flock with byte-range locks)
_NO_DIR_LOCK = {errno.EBADF, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP,
                getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


def lock_path(out_root: str | os.PathLike, scope: str | None = None) -> Path:
    """The root's lock file, or a scope's lock directory (`.tandem.<scope>.lock`)."""
    name = LOCK_NAME if scope is None else f".tandem.{scope}.lock"
    return Path(out_root).resolve() / name


class _Retry(Exception):
    """The path no longer names the inode just locked (removed or replaced meanwhile): start over."""


def _link_refusal(path: Path | str) -> BadInputError:
    return BadInputError(f"{path} is a symbolic link where tandem keeps its lock: a lock is never opened through a "
                         f"link (that could overwrite the link's target); remove the link and rerun.")


def _check_entry(dir_fd: int, name: str, display: Path, want_dir: bool) -> os.stat_result | None:
    """lstat of a lock path before opening it: None if absent; refuses a link or a thing of the wrong kind."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise _link_refusal(display)
    if want_dir and not stat.S_ISDIR(st.st_mode) and not stat.S_ISREG(st.st_mode):
        raise BadInputError(f"{display} is neither tandem's lock directory nor a lock file of an older version; "
                            f"remove it and rerun.")
    if not want_dir and not stat.S_ISREG(st.st_mode):
        raise BadInputError(f"{display} is not a plain file where tandem keeps its lock; remove it and rerun.")
    return st


def _check_own(fd: int, display: Path, regular: bool) -> os.stat_result:
    st = os.fstat(fd)
    problem = None
    if regular and not stat.S_ISREG(st.st_mode):
        problem = "is not a plain file"
    elif regular and st.st_nlink != 1:
        problem = f"has {st.st_nlink} hard links (tandem writes its lock only into a file of its own)"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if problem:
        os.close(fd)
        raise BadInputError(f"{display} {problem}: tandem keeps its lock there; remove it and rerun.")
    return st


def _open_root(root: Path) -> int:
    """out_root's directory (created if missing), opened without following a link, owned by this user."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise BadInputError(f"out_root {root} exists and is not a directory: point out_root at a directory "
                            f"(or remove the file) and rerun.") from None
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _SAFE)
    except OSError as e:
        if e.errno == errno.ELOOP:  # replaced by a link since it was resolved
            raise _link_refusal(root) from None
        if e.errno == errno.ENOTDIR:
            raise BadInputError(f"out_root {root} is not a directory: point out_root at a directory and "
                                f"rerun.") from None
        if e.errno == errno.ENOENT:
            raise _Retry() from None  # removed since it was created: create it again
        raise
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise BadInputError(f"out_root {root} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
                            f"tandem writes only into an output root of its own; point out_root at a directory "
                            f"you own (or chown it) and rerun.")
    return fd


def _open_file(dir_fd: int, name: str, display: Path) -> int:
    """A plain single-link file of this user's in `dir_fd`, created if missing, never through a link."""
    _check_entry(dir_fd, name, display, want_dir=False)
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | _SAFE, 0o644, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link_refusal(display) from None
        if e.errno in (errno.EISDIR, errno.ENXIO):
            raise BadInputError(f"{display} is not a plain file where tandem keeps its lock; remove it and "
                                f"rerun.") from None
        raise
    _check_own(fd, display, regular=True)
    return fd


def _flock(fd: int, shared: bool) -> bool:
    """Take the lock without blocking: False when another open file holds it."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _same(fd: int, dir_fd: int | None, name: str | os.PathLike) -> None:
    """Raise _Retry unless `name` (relative to dir_fd) still names the open inode `fd`."""
    a = os.fstat(fd)
    try:
        b = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise _Retry() from None
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        raise _Retry()


def _open_scope(root_fd: int, name: str, display: Path) -> int:
    """The scope's lock directory, created if missing; an older version's lock file there is replaced by it."""
    st = _check_entry(root_fd, name, display, want_dir=True)
    if st is not None and stat.S_ISREG(st.st_mode):  # left by an older version: replace it once nobody holds it
        try:
            fd = os.open(name, os.O_RDONLY | _SAFE, dir_fd=root_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _link_refusal(display) from None
            if e.errno == errno.ENOENT:
                raise _Retry() from None
            raise
        try:
            if not _flock(fd, shared=False):
                return -1  # a run of an older version holds this scope
            _same(fd, root_fd, name)
            os.unlink(name, dir_fd=root_fd)
        finally:
            os.close(fd)
        st = None
    if st is None:
        try:
            os.mkdir(name, 0o755, dir_fd=root_fd)
        except FileExistsError:
            raise _Retry() from None  # another run created it meanwhile: look again
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _SAFE, dir_fd=root_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link_refusal(display) from None
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise _Retry() from None
        raise
    _check_own(fd, display, regular=False)
    return fd


def _write_info(fd: int, command: str) -> None:
    """Holder information into a file checked by _open_file (this user's, plain, one link, opened without links)."""
    info = {"pid": os.getpid(), "command": command, "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)


def _read_info(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | _SAFE)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        info = json.loads(os.pread(fd, 65536, 0).decode() or "{}")
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(info, dict) or not info:
        return None
    return f"pid {info.get('pid')} ({info.get('command', '?')}, since {info.get('since', '?')})"


def _describe(root: Path) -> str:
    """The holders named in the root's lock file and in every scope's lock directory (or older lock file)."""
    names = [_read_info(root / LOCK_NAME)]
    try:
        entries = sorted(e.name for e in os.scandir(root)
                         if e.name.startswith(".tandem.") and e.name.endswith(".lock"))
    except OSError:
        entries = []
    for name in entries:
        if name != LOCK_NAME:
            p = root / name
            names.append(_read_info(p / HOLDER_NAME) if p.is_dir() and not p.is_symlink() else _read_info(p))
    return ", ".join(dict.fromkeys(n for n in names if n)) or "another tandem process"


class _Lock:
    """The open files of one acquisition of a root's lock (and its scope's), in the order they were locked."""

    def __init__(self, root: Path, scope: str | None, command: str):
        self.root, self.scope, self.command = root, scope, command
        self.fds: list[int] = []
        self.scope_fd: int | None = None
        self.file_fd: int | None = None
        self.dir_locked = True

    def _open(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def try_acquire(self) -> bool:
        """One attempt without blocking: True when held; False when another run holds it (files closed)."""
        ok = False
        try:
            ok = self._attempt()
            return ok
        finally:
            if not ok:
                self.close()

    def _attempt(self) -> bool:
        root, shared = self.root, self.scope is not None
        root_fd = self._open(_open_root(root))
        try:
            got = _flock(root_fd, shared)
        except OSError as e:
            if e.errno not in _NO_DIR_LOCK:
                raise
            got, self.dir_locked = True, False  # this file system cannot flock a directory: the files are the gate
            if str(root) not in _warned_no_dir_lock:
                _warned_no_dir_lock.add(str(root))
                log.warning("%s: this file system cannot lock a directory (%s): the lock files alone keep runs "
                            "apart here, so do not delete .tandem*.lock while a run is using this output root",
                            root, os.strerror(e.errno))
        if not got:
            return False
        if self.dir_locked:
            _same(root_fd, None, root)
        self.file_fd = self._open(_open_file(root_fd, LOCK_NAME, root / LOCK_NAME))
        if not _flock(self.file_fd, shared):  # a run of an older version (or, without directory locks, any run)
            return False
        _same(self.file_fd, root_fd, LOCK_NAME)
        if self.scope is None:
            _write_info(self.file_fd, self.command)
            return True
        name = lock_path(root, self.scope).name
        scope_fd = _open_scope(root_fd, name, root / name)
        if scope_fd < 0:
            return False
        self.scope_fd = self._open(scope_fd)
        if self.dir_locked:
            if not _flock(scope_fd, shared=False):
                return False
            _same(scope_fd, root_fd, name)
        holder_fd = self._open(_open_file(scope_fd, HOLDER_NAME, root / name / HOLDER_NAME))
        if not self.dir_locked:
            if not _flock(holder_fd, shared=False):
                return False
            _same(holder_fd, scope_fd, HOLDER_NAME)
        _write_info(holder_fd, self.command)
        return True

    def release(self) -> None:
        try:
            if self.scope_fd is not None:
                try:  # leave the scope's directory empty (and so invisible to git) for the next run
                    os.unlink(HOLDER_NAME, dir_fd=self.scope_fd)
                except FileNotFoundError:
                    pass
            elif self.file_fd is not None:
                os.ftruncate(self.file_fd, 0)
        finally:
            self.close()

    def close(self) -> None:
        for fd in reversed(self.fds):
            try:  # explicitly: a forked child sharing the open file would otherwise keep the lock alive
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass
            os.close(fd)
        self.fds, self.scope_fd, self.file_fd = [], None, None


_MAX_RETRIES = 100


def _acquire(root: Path, scope: str | None, wait: bool, poll_seconds: float, command: str) -> _Lock:
    retries = 0
    while True:
        lock = _Lock(root, scope, command)
        try:
            if lock.try_acquire():
                return lock
        except _Retry:  # something moved under the attempt (all its files are closed): try again
            retries += 1
            if retries > _MAX_RETRIES:
                raise WorkspaceBusyError(
                    f"the lock paths of output root {root} keep being removed or replaced while this run takes "
                    f"the lock: stop whatever deletes them and rerun.") from None
            time.sleep(0.01)
            continue
        retries = 0
        if not wait:
            raise WorkspaceBusyError(
                f"output root {root} is in use by {_describe(root)}: two runs on one output root "
                f"would overwrite each other's files. Wait for it to finish (or pass --wait), or give "
                f"this run its own out_root.")
        time.sleep(poll_seconds)


def _check_scope(scope: str | None) -> None:
    if scope is not None and (not scope or scope in (".", "..") or "/" in scope or "\0" in scope):
        raise BadInputError(f"workspace lock scope {scope!r} is not a plain name; use a name like 'train-<arm>'.")


@contextmanager
def workspace_lock(out_root: str | os.PathLike, wait: bool = False, command: str | None = None,
                   scope: str | None = None, poll_seconds: float = 0.5) -> Iterator[Path]:
    """Hold the output root's lock for the block; raise WorkspaceBusyError if another process holds it.

    `wait=True` blocks until the other run ends instead. `scope` (e.g. "train-tandem") locks only that part of
    the root exclusively (see the module docstring). Nested use in one process only counts depth. A link at a
    lock path, or an out_root of another user, is refused with BadInputError.
    """
    _check_scope(scope)
    path = lock_path(out_root)
    key = str(path)
    with _guard:
        reentered = key in _held
        if reentered:
            _held[key] += 1
    if reentered:
        try:
            yield path
        finally:
            with _guard:
                _held[key] -= 1
        return

    command = command or " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv[:4]))
    lock = _acquire(path.parent, scope, wait, poll_seconds, command)
    try:
        with _guard:
            _held[key] = 1
        try:
            from tandem.transactions import recover

            recover(out_root)
            yield path
        finally:
            with _guard:
                del _held[key]
    finally:
        lock.release()
