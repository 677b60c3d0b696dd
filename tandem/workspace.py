"""One run per output root at a time: an advisory lock file (`<out_root>/.tandem.lock`, fcntl.flock).

`tandem run` and `tandem stage` take it before any work. A second run on the same root waits (`wait=True`) or
is refused with a message naming the holder; it never interleaves its writes with the first. The lock is
re-entrant within one process (the Prefect flow calls the stages in-process, from worker threads), and the
operating system drops it when the holding process dies, so a killed run leaves no stale lock behind; the
holder's pid and command stay in the file only as information. Runs in different output roots use different
lock files and never wait for each other.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tandem.errors import WorkspaceBusyError

LOCK_NAME = ".tandem.lock"

_held: dict[str, list] = {}  # resolved lock path -> [fd, depth] held by this process
_guard = threading.Lock()


def lock_path(out_root: str | os.PathLike) -> Path:
    return Path(out_root).resolve() / LOCK_NAME


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return "another tandem process"
    if not info:
        return "another tandem process"
    return f"pid {info.get('pid')} ({info.get('command', '?')}, since {info.get('since', '?')})"


@contextmanager
def workspace_lock(out_root: str | os.PathLike, wait: bool = False, command: str | None = None,
                   poll_seconds: float = 0.5) -> Iterator[Path]:
    """Hold the output root's lock for the block; raise WorkspaceBusyError if another process holds it.

    With `wait=True` block until the other run ends instead. Nested use in one process only counts depth.
    """
    path = lock_path(out_root)
    key = str(path)
    with _guard:
        if key in _held:
            _held[key][1] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield path
        finally:
            with _guard:
                _held[key][1] -= 1
        return

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not wait:
                    raise WorkspaceBusyError(
                        f"output root {path.parent} is in use by {_holder(path)}: two runs on one output root "
                        f"would overwrite each other's files. Wait for it to finish (or pass --wait), or give "
                        f"this run its own out_root.") from None
                time.sleep(poll_seconds)
        info = {"pid": os.getpid(), "command": command or " ".join(sys.argv[:3]),
                "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        with _guard:
            _held[key] = [fd, 1]
        try:
            yield path
        finally:
            with _guard:
                _held[key][1] -= 1
                last = _held[key][1] == 0
                if last:
                    del _held[key]
            if last:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        with _guard:
            still_held = key in _held and _held[key][0] == fd
        if not still_held:
            os.close(fd)
