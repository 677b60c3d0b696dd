"""Test-wide settings: offline, quiet tools, temporary homes; shared fixtures."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# Set before any test module imports transformers, wandb or prefect.
_HOME = tempfile.mkdtemp(prefix="tandem-test-home-")
for _k, _v in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "DVC_NO_ANALYTICS": "1",
    "GX_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",  # Prefect's SDK telemetry and its first-run notice
    "TRL_EXPERIMENTAL_SILENCE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ[_k] = _v
# a loaded machine may need longer for the test server to start: a larger value in the environment wins
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = str(max(
    120, int(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "0") or 0)))
os.environ.setdefault("PREFECT_HOME", str(Path(_HOME) / "prefect"))

REPO = Path(__file__).resolve().parents[1]
# importlib import mode (pyproject) keeps same-named test files apart; shared test helpers live in tests/.
for _p in (REPO, REPO / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
