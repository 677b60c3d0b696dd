"""One run per output root at a time: an advisory lock file (`<out_root>/.tandem.lock`, fcntl.flock).

`tandem run` and `tandem stage` take it before any work. A second run on the same root waits (`wait=True`) or
is refused with a message naming the holder; it never interleaves its writes with the first. The lock is
re-entrant within one process (the Prefect flow calls the stages in-process, from worker threads), and the
operating system drops it when the holding process dies, so a killed run leaves no stale lock behind; the
holder's pid and command stay in the file only as information. Runs in different output roots use different
lock files and never wait for each other.

A run that writes only its own part of the root (`scope`, e.g. one arm of the train stage, which is what
`dvc.yaml`'s `train@<arm>` and tandem study run side by side) takes the root's lock shared and an exclusive
lock of its own (`.tandem.<scope>.lock`): two different arms run together, the same arm twice does not, and
neither runs next to a whole-root run.

Whoever takes the lock first finishes what a killed run left half done: a stage's outputs committed but not
all swapped in are swapped in, uncommitted ones discarded (`tandem.transactions.recover`), before any stage
reads them.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

from tandem.errors import WorkspaceBusyError

LOCK_NAME = ".tandem.lock"

_held: dict[str, int] = {}  # resolved root lock path -> nesting depth in this process
_guard = threading.Lock()


def lock_path(out_root: str | os.PathLike, scope: str | None = None) -> Path:
    name = LOCK_NAME if scope is None else f".tandem.{scope}.lock"
    return Path(out_root).resolve() / name


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "another tandem process"
    return f"pid {info.get('pid')} ({info.get('command', '?')}, since {info.get('since', '?')})"


def _describe(path: Path) -> str:
    """The holder named in the root's lock file or in any scoped lock file next to it."""
    names = [_holder(path)] + [_holder(p) for p in sorted(path.parent.glob(".tandem.*.lock")) if p != path]
    known = [n for n in names if n != "another tandem process"]
    return ", ".join(dict.fromkeys(known)) or "another tandem process"


@contextmanager
def _flock(path: Path, shared: bool, wait: bool, poll_seconds: float, command: str) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not wait:
                    raise WorkspaceBusyError(
                        f"output root {path.parent} is in use by {_describe(path)}: two runs on one output root "
                        f"would overwrite each other's files. Wait for it to finish (or pass --wait), or give "
                        f"this run its own out_root.") from None
                time.sleep(poll_seconds)
        if not shared:  # information for the message of a refused run; a shared holder leaves the file alone
            info = {"pid": os.getpid(), "command": command, "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        try:
            yield
        finally:
            if not shared:
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextmanager
def workspace_lock(out_root: str | os.PathLike, wait: bool = False, command: str | None = None,
                   scope: str | None = None, poll_seconds: float = 0.5) -> Iterator[Path]:
    """Hold the output root's lock for the block; raise WorkspaceBusyError if another process holds it.

    `wait=True` blocks until the other run ends instead. `scope` (e.g. "train-tandem") locks only that part of
    the root exclusively (see the module docstring). Nested use in one process only counts depth.
    """
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
    with ExitStack() as stack:
        stack.enter_context(_flock(path, scope is not None, wait, poll_seconds, command))
        if scope is not None:
            stack.enter_context(_flock(lock_path(out_root, scope), False, wait, poll_seconds, command))
        with _guard:
            _held[key] = 1
        try:
            from tandem.transactions import recover

            recover(out_root)
            yield path
        finally:
            with _guard:
                del _held[key]
