"""Outputs that change all at once: swaps without a missing moment, one staging directory per stage, recovery.

`swap_in(new, final)` puts `new` where `final` is in one step: a file by `os.replace`, a directory (or a file
replacing one) by Linux's `renameat2(RENAME_EXCHANGE)`, which exchanges the two names atomically; the old
content, now at the staging name, is removed afterwards. Only on a file system without that call does it fall
back to two renames (and then a reader could find `final` missing for a moment).

`StageOutputs` is one stage's transaction. Every output is written into one staging directory,
`<out_root>/scratch/staging/<stage>-<pid>-<random>/` (no DVC stage declares scratch/, so staging leftovers are
never inside a tracked output). Commit flushes everything, writes `commit.json` (the commit point: the list of
moves and the inode of each staged output) and swaps each output in. A process killed before the commit point
leaves every output as it was; one killed after it leaves a commit that the next run finishes (`recover`, run
by every transaction and whenever a run takes the output root's lock): a move is done when `final` carries the
staged inode, so finishing is idempotent. The owner holds `flock` on the staging directory's `lock` file, so
recovery never touches a transaction whose process is alive (two arms of the train stage publish side by side).

Optional outputs (declared with the others, or added while the block runs: `add_optional`) belong to the same
commit but may be left unwritten: a written one is swapped in with the rest, an unwritten one's final path is
removed. A metrics file's timing sidecar is one (`tasks.common.write_metrics`): it changes with its summary,
so a run killed midway never leaves one run's summary beside another run's timings. `StageOutputs.of_staged`
finds the open transaction of this process that staged a path.

`temp_sibling(path)` is the temporary directory next to one file that `tasks.common.atomic_path` writes into
(`.<name>.tandem-<pid>-<random>/`, with the same held lock); `sweep_temp_siblings(dir)` removes those of dead
processes.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

log = logging.getLogger("tandem.transactions")

STAGING = Path("scratch") / "staging"  # under out_root
LOCK = "lock"
TEMP_LOCK = ".tandem-lock"  # inside a temporary sibling, beside the file being written
PLAN, COMMIT = "plan.json", "commit.json"
TEMP_MARK = ".tandem-"  # in `.<name>.tandem-<pid>-<random>`: atomic_path's temporary siblings
STALE_UNLOCKED_SECONDS = 60  # a temporary directory whose lock file is missing: created this long ago at least

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2 = None
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM}


def _libc_renameat2():
    global _renameat2
    if _renameat2 is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (AttributeError, OSError):  # not Linux, or a libc older than glibc 2.28
            _renameat2 = False
    return _renameat2


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> None:
    """Swap the names `a` and `b` atomically (both must exist, on one file system); OSError where unsupported."""
    fn = _libc_renameat2()
    if not fn:
        raise OSError(errno.ENOSYS, "renameat2 is not available", str(a))
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(a), None, str(b))


def _is_dir(p: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(p).st_mode)
    except FileNotFoundError:
        return False


def remove(p: str | os.PathLike) -> None:
    """Remove a file, symlink (never its target) or directory tree; nothing if absent."""
    p = Path(p)
    if _is_dir(p):
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file, or every file and directory of a tree, to disk (symlinks are skipped)."""
    path = Path(path)
    if path.is_symlink() or not path.exists():
        return
    if path.is_dir():
        for p in sorted(path.rglob("*")):
            if p.is_file() and not p.is_symlink():
                _fsync_one(p)
        for p in sorted(path.rglob("*"), reverse=True):
            if p.is_dir() and not p.is_symlink():
                _fsync_one(p)
    _fsync_one(path)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename inside it) to disk."""
    _fsync_one(Path(path))


def _fsync_one(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_in(new: str | os.PathLike, final: str | os.PathLike) -> None:
    """Put `new` at `final`, with `final` present at every moment, then remove the old content."""
    new, final = Path(new), Path(final)
    if not os.path.lexists(final):
        os.rename(new, final)
        return
    if not _is_dir(new) and not _is_dir(final):
        os.replace(new, final)
        return
    try:
        exchange(new, final)
    except OSError as e:
        if e.errno not in _UNSUPPORTED:
            raise
        aside = new.with_name(new.name + ".old")  # no RENAME_EXCHANGE here: two renames, a moment without final
        os.rename(final, aside)
        os.rename(new, final)
        new = aside
    remove(new)  # the old content, now under the staging name


def _ino(p: Path) -> int | None:
    try:
        return os.lstat(p).st_ino
    except FileNotFoundError:
        return None


def _write_json_durably(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_one(path.parent)


def _apply(moves: list[list]) -> None:
    """Swap every staged output in; idempotent (a move whose target carries the staged inode is done). A move
    without a staged path (an optional output left unwritten) removes its target."""
    parents = set()
    for staged, final, ino in moves:
        if staged is None:
            final = Path(final)
            remove(final)
            parents.add(final.parent)
            continue
        staged, final = Path(staged), Path(final)
        if _ino(final) != ino and os.path.lexists(staged):
            swap_in(staged, final)
        for leftover in (staged, staged.with_name(staged.name + ".old")):  # old content of a finished move
            remove(leftover)
        parents.add(final.parent)
    for p in parents:
        if p.is_dir():
            _fsync_one(p)


def _try_lock(path: Path) -> int | None:
    """An fd holding `path`'s exclusive flock, or None when a live process holds it."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _age_seconds(p: Path) -> float:
    try:
        return time.time() - os.lstat(p).st_mtime
    except OSError:
        return 0.0


def recover(out_root: str | os.PathLike) -> list[str]:
    """Finish the committed transactions of dead processes under `out_root`, discard their uncommitted ones.

    Returns one line per transaction handled (also logged as a warning)."""
    base = Path(out_root) / STAGING
    if not base.is_dir():
        return []
    done = []
    for d in sorted(base.iterdir()):
        if not _is_dir(d):
            continue
        lock = d / LOCK
        fd = _try_lock(lock) if lock.exists() else None
        if fd is None and (lock.exists() or _age_seconds(d) < STALE_UNLOCKED_SECONDS):
            continue  # its process is alive (or is just creating it)
        try:
            plan, commit = _read_json(d / PLAN) or {}, _read_json(d / COMMIT)
            if commit:
                _apply(commit["moves"])
                what = f"finished the interrupted commit of {plan.get('name', d.name)} ({len(commit['moves'])} outputs)"
            else:
                what = f"discarded the uncommitted outputs of {plan.get('name', d.name)} (the old ones stay)"
            for place in plan.get("places", []):
                remove(place)
            remove(d)
        finally:
            if fd is not None:
                os.close(fd)
        log.warning("%s: %s", d, what)
        done.append(f"{d.name}: {what}")
    return done


_OPEN: list["StageOutputs"] = []  # the transactions of this process whose block is running


class StageOutputs:
    """One stage's outputs as one transaction: `with StageOutputs(root, "prepare", targets) as staged: ...`.

    `targets` maps a key to each final path; `staged[key]` is where the block writes that output (a file or a
    directory, not yet existing). Leaving the block normally commits every output together (each must have
    been written); an exception discards them all and the old outputs stay. `optional` (key -> final path)
    are staged the same way but may stay unwritten: the commit then removes their final path (a timing
    sidecar of a run that has no timings). `dir` is the transaction's own directory, removed with it, for files
    a stage needs only while it runs (a worker spec, error records).
    """

    def __init__(self, out_root: str | os.PathLike, name: str, targets: dict[str, str | os.PathLike],
                 optional: dict[str, str | os.PathLike] | None = None):
        self.root, self.name = Path(out_root), name
        self.targets = {k: Path(v) for k, v in targets.items()}
        self.optional = {k: Path(v) for k, v in (optional or {}).items()}
        clash = set(self.targets) & set(self.optional)
        if clash:
            raise ValueError(f"{name}: outputs {sorted(clash)} are both required and optional")
        self.dir: Path | None = None
        self.staged: dict[str, Path] = {}
        self._fd: int | None = None
        self._dev: int | None = None
        self._places: list[Path] = []
        self._keep = False  # a commit that failed after its commit point stays for `recover` to finish

    def __enter__(self) -> dict[str, Path]:
        recover(self.root)
        base = self.root / STAGING
        base.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in self.name)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{safe}-{os.getpid()}-", dir=base))
        self._fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        (self.dir / "out").mkdir()
        self._dev = os.stat(self.dir).st_dev
        for key, final in [*self.targets.items(), *self.optional.items()]:
            self._stage(key, final)
        self._write_plan()
        _OPEN.append(self)
        return dict(self.staged)

    def _stage(self, key: str, final: Path) -> Path:
        """Where output `key` (final path `final`) is written: in the staging directory, or beside the output
        when that is on another file system (so the swap stays a rename); the place is created."""
        final.parent.mkdir(parents=True, exist_ok=True)
        if os.stat(final.parent).st_dev == self._dev:
            place = self.dir / "out"
        else:
            place = final.parent / f".tandem-staging-{self.dir.name}"
            if place not in self._places:
                self._places.append(place)
                self._write_plan()  # recorded before it exists, so recovery removes it after a kill
                place.mkdir()
        self.staged[key] = place / f"{len(self.staged)}-{final.name}"
        return self.staged[key]

    def _write_plan(self) -> None:
        _write_json_durably(self.dir / PLAN, {"name": self.name, "pid": os.getpid(),
                                              "targets": {k: str(v) for k, v in self.targets.items()},
                                              "optional": {k: str(v) for k, v in self.optional.items()},
                                              "places": [str(p) for p in self._places]})

    def add_optional(self, key: str, final: str | os.PathLike) -> Path:
        """Declare one more optional output while the block runs; returns where to write it (the staged path
        it already has when `final` was declared before)."""
        final = Path(final)
        for k, f in self.optional.items():
            if f == final:
                return self.staged[k]
        if self.dir is None or self not in _OPEN:
            raise RuntimeError(f"{self.name}: add_optional({final}) outside the transaction's block")
        if key in self.targets or key in self.optional or final in self.targets.values():
            raise ValueError(f"{self.name}: {key!r} ({final}) is already an output of this transaction")
        self.optional[key] = final
        staged = self._stage(key, final)
        self._write_plan()
        return staged

    def staged_for(self, final: str | os.PathLike) -> Path | None:
        """The staged path of the output whose final path is `final` (None when it is no output of this one)."""
        final = Path(final)
        for k, f in [*self.targets.items(), *self.optional.items()]:
            if f == final:
                return self.staged.get(k)
        return None

    @staticmethod
    def of_staged(path: str | os.PathLike) -> "StageOutputs | None":
        """The open transaction of this process whose block writes `path` (one of its staged outputs)."""
        path = Path(path)
        for txn in reversed(_OPEN):
            if path in txn.staged.values():
                return txn
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is None:
                self.commit()
            elif isinstance(exc, Exception):
                full = self._disk_full(exc)
                if full is not None:
                    raise full from exc
        finally:
            self._close()
        return False

    def _disk_full(self, exc: BaseException):
        """A disk-full error of the block that names the output being written, not its staging copy."""
        from tandem.errors import DiskFullError, disk_full, free_bytes

        if not disk_full(exc, self.dir):
            return None
        named = exc.path if isinstance(exc, DiskFullError) else getattr(exc, "filename", None)
        named = str(named) if named else None
        finals = {**self.targets, **self.optional}
        for key, staged in self.staged.items():
            if named and (named == str(staged) or named.startswith(str(staged) + os.sep)):
                final = finals[key] / os.path.relpath(named, staged) if named != str(staged) else finals[key]
                return DiskFullError(final, free_bytes(final))
        if isinstance(exc, DiskFullError):
            return None  # it names its path already
        where = named or next(iter(self.targets.values()), self.root)
        return DiskFullError(where, free_bytes(where))

    def commit(self) -> None:
        missing = [str(self.targets[k]) for k in self.targets if not os.path.lexists(self.staged[k])]
        if missing:
            raise RuntimeError(f"{self.name}: outputs {missing} were not written; nothing was replaced")
        for p in self.staged.values():
            fsync_path(p)
        moves = [[str(self.staged[k]), str(self.targets[k]), _ino(self.staged[k])] for k in self.targets]
        # optional outputs after the required ones: an unwritten one removes its final path (no stale sidecar)
        moves += [[str(self.staged[k]), str(f), _ino(self.staged[k])] if os.path.lexists(self.staged[k])
                  else [None, str(f), None] for k, f in self.optional.items()]
        _write_json_durably(self.dir / COMMIT, {"moves": moves})  # the commit point
        try:
            _apply(moves)
        except BaseException:
            self._keep = True
            raise

    def _close(self) -> None:
        if self in _OPEN:
            _OPEN.remove(self)
        if not self._keep:
            for place in self._places:
                remove(place)
            if self.dir is not None:
                remove(self.dir)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# --------------------------------------------------------------------------------------------------
# Temporary siblings of single files (tasks.common.atomic_path)
# --------------------------------------------------------------------------------------------------

_swept: set[str] = set()


def sweep_temp_siblings(directory: str | os.PathLike, force: bool = False) -> list[str]:
    """Remove the temporary directories (`.<name>.tandem-<pid>-<random>/`) that dead processes left in
    `directory`; once per directory and process unless `force`. Returns the names removed."""
    d = Path(directory)
    key = str(d.resolve()) if d.exists() else str(d)
    if (key in _swept and not force) or not d.is_dir():
        return []
    _swept.add(key)
    removed = []
    for p in d.iterdir():
        if not (p.name.startswith(".") and TEMP_MARK in p.name and _is_dir(p)):
            continue
        lock = p / TEMP_LOCK
        fd = _try_lock(lock) if lock.exists() else None
        if fd is None and (lock.exists() or _age_seconds(p) < STALE_UNLOCKED_SECONDS):
            continue
        try:
            remove(p)
        finally:
            if fd is not None:
                os.close(fd)
        removed.append(p.name)
    if removed:
        log.warning("%s: removed temporary files of interrupted writes: %s", d, ", ".join(sorted(removed)))
    return removed


@contextmanager
def temp_sibling(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary directory next to `path` (same file system), locked while the block runs, then removed."""
    path = Path(path)
    work = Path(tempfile.mkdtemp(prefix=f".{path.name}{TEMP_MARK}{os.getpid()}-", dir=path.parent))
    fd = os.open(work / TEMP_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield work
    finally:
        remove(work)
        os.close(fd)
