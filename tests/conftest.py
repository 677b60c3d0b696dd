"""Test-wide settings: offline, quiet tools, temporary homes; shared fixtures."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# importlib import mode (pyproject) keeps same-named test files apart; shared test helpers live in tests/.
for _p in (REPO, REPO / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from tandem.config import TOOL_ENV  # noqa: E402  (stdlib only: imports nothing that reads these)

# Set before any test module imports transformers, wandb or prefect: the project's tool defaults (forced, so
# the suite does not depend on the caller's environment) plus offline hubs and W&B off.
_HOME = tempfile.mkdtemp(prefix="tandem-test-home-")
for _k, _v in {
    **TOOL_ENV,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
}.items():
    os.environ[_k] = _v
os.environ.setdefault("PREFECT_HOME", str(Path(_HOME) / "prefect"))
