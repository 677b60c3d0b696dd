"""A quiet terminal: the flow's DVC calls draw nothing in a real terminal, where the flow's live view is the display.

In a terminal, DVC's in-process API draws a progress bar for every hash, cache check and checkout, and its repo
lock draws "Waiting to acquire lock. If DVC froze, ..." on every acquisition (before `tandem run`'s live view
was buried under hundreds of such lines). The test runs DVC in a child process on a pseudo-terminal of 120 x 40
(on a terminal without a size tqdm draws nothing, and the test would prove nothing): first DVC's API as it
stands, which must draw, then the flow's calls (`DvcSync.up_to_date`, `DvcSync.commit`), which must draw
nothing. On a pipe (a worker's or a CI log) neither draws, as before.
"""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration

# The child: a DVC project whose stage has a directory output (hashed, cached and checked out file by file),
# DVC's API as it is, then the flow's calls between two markers on stderr.
CHILD = r"""
import sys
from pathlib import Path
from dvc.repo import Repo

root = Path.cwd()  # DVC resolves stage names against the working directory, as in the flow
Repo.init(str(root), no_scm=True)
(root / "out").mkdir()
for i in range(40):
    (root / "out" / f"f{i}.txt").write_text(str(i))
(root / "dvc.yaml").write_text("stages:\n  make:\n    cmd: echo make\n    outs: [out]\n")
with Repo(str(root)) as repo:
    repo.status(targets=["make"])
sys.stderr.write("=== flow ===\n")
from flows.dvc_sync import DvcSync

sync = DvcSync(root, "test")
assert not sync.up_to_date("make")
sync.commit("make")
assert sync.up_to_date("make")
sys.stderr.write("=== end ===\n")
"""


def _env() -> dict[str, str]:
    """The tools' quiet defaults (tandem.config.TOOL_ENV), this checkout's code, and no DVC_IGNORE_ISATTY (which
    would make DVC draw on a pipe too)."""
    from tandem.config import tool_env

    env = {k: v for k, v in tool_env().items() if k != "DVC_IGNORE_ISATTY"}
    return {**env, "PYTHONPATH": str(REPO), "TERM": "xterm"}


def _on_a_terminal(args: list[str], cwd: Path, timeout: float = 180) -> tuple[int, str]:
    """Run `args` with stdin, stdout and stderr on a new pseudo-terminal of 120 x 40; its exit code and output."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=_env(), cwd=cwd, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1.0)[0]:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every holder of the terminal has closed it
                break
            if not data:
                break
            chunks.append(data)
    finally:
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
        code = proc.wait(timeout=30)
        os.close(master)
    return code, b"".join(chunks).decode("utf-8", "replace")


def _sections(out: str) -> tuple[str, str]:
    assert "=== flow ===" in out and "=== end ===" in out, out[-3000:]
    before, rest = out.split("=== flow ===", 1)
    return before, rest.split("=== end ===", 1)[0]


def test_the_flows_dvc_calls_draw_nothing_on_a_terminal(tmp_path):
    (tmp_path / "proj").mkdir()
    code, out = _on_a_terminal([sys.executable, "-c", CHILD], tmp_path / "proj")
    assert code == 0, out[-3000:]
    before, flow = _sections(out)
    # the control: on this terminal DVC's API as it stands draws its bars and its lock message
    assert "Waiting to acquire lock" in before and "computing hashes" in before, before[-3000:]
    # the flow's calls: no bar, no lock message, nothing at all
    assert not flow.strip(), repr(flow[:3000])


def test_on_a_pipe_dvc_draws_nothing_either_way(tmp_path):
    (tmp_path / "proj").mkdir()
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=_env(),
                         cwd=tmp_path / "proj", timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    before, flow = _sections(res.stdout + res.stderr)
    assert "Waiting" not in before and "%" not in before and "\r" not in before, before
    assert not flow.strip(), flow
