"""Flow tests share one temporary Prefect API (a local server on a throwaway SQLite database), started on
first use and stopped when the session ends, while output streams are still open."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=None):  # None: PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
        yield
