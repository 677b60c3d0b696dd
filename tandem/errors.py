"""Expected failures: errors a user causes and fixes (bad input, missing file or model, a busy workspace).

Every such error derives from `UserError`. The command line prints its message as one short block and exits
with code 1, without a traceback (`--debug` or `TANDEM_DEBUG=1` shows it); any other exception is a bug and
keeps its traceback. Params errors (`tandem.config.ParamsError`, exit code 2) stay separate because they are
found before any work starts.
"""

from __future__ import annotations

__all__ = ["UserError", "BadInputError", "WorkspaceBusyError", "NonFiniteLossError", "MissingInputError",
           "ModelUnavailableError"]


class UserError(Exception):
    """A failure the user can fix; its message says what is wrong and what to do next."""

    exit_code = 1


class BadInputError(UserError, ValueError):
    """An input or request the pipeline refuses (inconsistent artifacts, a refused plan); says what to rerun."""


class ModelUnavailableError(UserError, RuntimeError):
    """A model cannot be obtained (not in the local cache while offline, no weights where params point)."""


class MissingInputError(UserError, FileNotFoundError):
    """A stage input (file, model directory, checkpoint) does not exist; usually an earlier stage is missing."""


class WorkspaceBusyError(UserError):
    """Another tandem run holds the output root's lock."""


class NonFiniteLossError(UserError):
    """Training produced a NaN or infinite loss and `train.nonfinite_loss: stop` asked to stop."""
