"""Expected failures: errors a user causes and fixes (bad input, missing file or model, a busy workspace).

Every such error derives from `UserError`. The command line prints its message as one short block and exits
with code 1, without a traceback (`--debug` or `TANDEM_DEBUG=1` shows it); any other exception is a bug and
keeps its traceback. Params errors (`tandem.config.ParamsError`, exit code 2) stay separate because they are
found before any work starts.

A full disk is expected too, however it surfaces: an `OSError` with errno ENOSPC/EDQUOT, a Rust or C++ writer
that only says "No space left on device" or "os error 28", or torch's stream writer (`basic_ios::clear:
iostream error`), which says nothing at all, on a file system with no space left. `disk_full` recognises
them and `DiskFullError` names the path.
"""

from __future__ import annotations

import errno
import os
import shutil

__all__ = ["UserError", "BadInputError", "WorkspaceBusyError", "NonFiniteLossError", "MissingInputError",
           "ModelUnavailableError", "ModelFileError", "CheckpointError", "DiskFullError", "WorkerFailedError",
           "disk_full", "disk_full_error", "is_expected", "as_user_error"]


class UserError(Exception):
    """A failure the user can fix; its message says what is wrong and what to do next."""

    exit_code = 1


class BadInputError(UserError, ValueError):
    """An input or request the pipeline refuses (inconsistent artifacts, a refused plan); says what to rerun."""


class ModelUnavailableError(UserError, RuntimeError):
    """A model cannot be obtained (not in the local cache while offline, no weights where params point)."""


class MissingInputError(UserError, FileNotFoundError):
    """A stage input (file, model directory, checkpoint) does not exist; usually an earlier stage is missing."""


class ModelFileError(BadInputError):
    """A file of a model directory is missing, unreadable, truncated or malformed (weights, config, tokenizer)."""


class CheckpointError(BadInputError):
    """A checkpoint is incomplete or its files differ from the checksums recorded when it was saved."""


class WorkspaceBusyError(UserError):
    """Another tandem run holds the output root's lock."""


class NonFiniteLossError(UserError):
    """Training produced a NaN or infinite loss and `train.nonfinite_loss: stop` asked to stop."""


class WorkerFailedError(UserError, RuntimeError):
    """A process of a multi-process training run died (killed, out of memory) or failed with an expected error."""


class DiskFullError(UserError, OSError):
    """A write failed because its file system is full (or over quota)."""

    def __init__(self, path: str | os.PathLike, free_bytes: int | None = None):
        self.path, self.free = str(path), free_bytes
        free = "" if free_bytes is None else f" ({free_bytes / 2**20:.1f} MiB free there)"
        super().__init__(errno.ENOSPC, f"No space left on device while writing {self.path}{free}: free space on "
                                       f"that file system (or point out_root at a larger one) and rerun; earlier "
                                       f"outputs are unchanged and the rerun continues from completed work "
                                       f"(training from its last complete checkpoint)")

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):  # picklable across processes (evaluation workers)
        return (type(self), (self.path, self.free))


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXT = ("no space left on device", "os error 28", "disk quota exceeded", "storagefull")
# torch's C++ stream writer reports a failed write without its cause; counted only where space has run out
_SILENT_WRITE_FAILURES = ("basic_ios::clear", "iostream error", "file write failed", "unexpected pos")
LOW_SPACE_BYTES = 64 * 2**20


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the file system of `path` (its nearest existing parent), or None if unknown."""
    p = os.path.abspath(path)
    while p and not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def disk_full(exc: BaseException, path: str | os.PathLike | None = None) -> bool:
    """Whether `exc` (or an exception it was raised from) is a write that failed for want of space.

    `path`, where given, lets a write error without a cause (torch's stream writer) count when the file system
    of `path` has under 64 MiB left.
    """
    for e in _chain(exc):
        if isinstance(e, DiskFullError) or (isinstance(e, OSError) and e.errno in _FULL_ERRNOS):
            return True
        text = str(e).lower()
        if any(t in text for t in _FULL_TEXT):
            return True
        if path is not None and any(t in text for t in _SILENT_WRITE_FAILURES):
            free = free_bytes(path)
            if free is not None and free < LOW_SPACE_BYTES:
                return True
    return False


def disk_full_error(exc: BaseException, path: str | os.PathLike | None = None) -> DiskFullError | None:
    """A `DiskFullError` naming the file being written (from the exception where it says, else `path`), or None
    when `exc` is no disk-full failure."""
    if not disk_full(exc, path):
        return None
    for e in _chain(exc):
        if isinstance(e, DiskFullError):
            return e
    named = next((e.filename for e in _chain(exc) if isinstance(e, OSError) and e.filename), None)
    where = named or path or "(unknown path)"
    return DiskFullError(where, free_bytes(where) if where != "(unknown path)" else None)


def is_expected(exc: BaseException) -> bool:
    """An expected failure: a UserError, a missing file (an input an earlier stage did not make), a full disk."""
    return isinstance(exc, (UserError, FileNotFoundError)) or (isinstance(exc, Exception) and disk_full(exc))


def as_user_error(exc: BaseException, path: str | os.PathLike | None = None) -> BaseException:
    """`exc` as the error to report: a disk-full failure of any shape becomes a `DiskFullError` naming the file
    (or `path`, where the exception names none); anything else is returned as it is."""
    if isinstance(exc, DiskFullError) or not isinstance(exc, Exception):
        return exc
    return disk_full_error(exc, path) or exc
