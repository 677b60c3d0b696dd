"""A params file must be a regular file: a named pipe (FIFO) is refused in one line, exit code 2, at once.

Opening a FIFO for reading blocks until some process opens it for writing, so a params reader that only
refused devices and directories hung `tandem check-params` (and every command that reads params) forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes (POSIX)")


def _tandem(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TANDEM_DEBUG": ""}
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=30)


@pytest.fixture
def deadline():
    """Fail an in-process read that blocks (the old reader waited in open() for a writer) instead of hanging."""
    def _expired(signum, frame):
        raise TimeoutError("the read blocked for 20 s")

    old = signal.signal(signal.SIGALRM, _expired)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("command", [("check-params",), ("stage", "prepare", "--params")])
def test_a_fifo_as_the_params_file_is_refused_in_one_line(tmp_path, command):
    fifo = tmp_path / "params.yaml"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    res = _tandem(*command, str(fifo))  # the old reader blocked in open() until the timeout
    assert time.monotonic() - t0 < 20
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and len(lines) == 1, res.stderr[-2000:]
    assert "params file" in lines[0] and "params.yaml" in lines[0] and "named pipe" in lines[0], lines[0]


def test_load_params_refuses_a_fifo_without_opening_it(tmp_path, deadline):
    from tandem.config import ParamsError
    from tasks.common import load_params

    fifo = tmp_path / "p.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ParamsError, match="not a regular file"):
        load_params(fifo)


def test_a_path_swapped_for_a_fifo_after_the_check_is_refused_too(tmp_path, monkeypatch, deadline):
    """The descriptor is opened non-blocking and checked again: a FIFO put in place after `stat` is refused."""
    from tandem.config import ParamsError
    from tasks import common

    fifo = tmp_path / "p.yaml"
    os.mkfifo(fifo)
    regular = os.stat(REPO / "params.yaml")
    monkeypatch.setattr(Path, "stat", lambda self, **kw: regular if self == fifo else os.stat(self))
    with pytest.raises(ParamsError, match="named pipe"):
        common._params_bytes(fifo)
