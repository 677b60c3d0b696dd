"""What the pipeline's client and the rollout service share about the service's life: its port report, the proof
that answers a health challenge, and its process group.

- Port: the service binds its port itself (a fixed one, or 0 for one of the system's choosing) and writes
  `port_report(port)` as one line to a pipe the client passed it (`--ready-fd`); nothing else can be listening
  on a port the service holds.
- Proof: the client sends `/health` a fresh challenge without the secret; the service answers
  `health_proof(token, challenge)`. Only a process holding the run's secret can, so the client sends the secret
  only after checking it.
- Group: the client starts the service in a session of its own, so the service, its two engine cores and their
  helpers share one process group whose id is the service's pid; the group outlives the service when the
  service alone is killed (`kill -9 <pid>`), and its engines then run on as orphans. `end_group` ends every
  member but Python's resource trackers: a tracker unlinks the shared-memory segments its processes created
  (vLLM's message queues, 160-240 MiB each in /dev/shm) once they are gone, then exits. Killing the trackers
  with the rest is what leaks those segments.

- Engines: each engine process (vLLM's engine core, and its workers where they are processes of their own)
  asks the kernel to kill it when its parent dies (`die_with_parent`: PR_SET_PDEATHSIG), so the engines die
  with the service however it dies, `kill -9` included; `end_group` is the safety net where that is
  unavailable.
- Inbox: the service's private folder (`/dev/shm/tandem-vllm-*`: pushed weights, counters, sockets) names its
  owner (`owner.json`: pid and process start time). A service killed with `kill -9` cannot remove it; the
  client removes it after the stop, and every service start removes the folders of owners that are gone
  (`sweep_stale_inboxes`).

Standard library only (the client and the service, in vLLM's environment, both import it); the group functions
read `/proc` (Linux) and elsewhere find no members and do nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

CHALLENGE_HEADER = "X-Tandem-Challenge"
PROC = Path("/proc")
TRACKER = "multiprocessing.resource_tracker"  # on the command line of Python's resource tracker processes


def die_with_parent() -> bool:
    """In a multiprocessing child (a vLLM engine core or worker): have the kernel SIGKILL this process when its
    parent dies, and exit now if the parent is already gone. True when set. Does nothing (False) in a process
    that is not a multiprocessing child, such as the service itself, whose lifetime its watchdog governs, or
    off Linux."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG = 1
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent.pid:  # the parent died before the request took effect
        os._exit(1)
    return True


def health_proof(token: str, challenge: str) -> str:
    """What a service holding `token` answers to a /health `challenge`."""
    return hmac.new(token.encode(), b"tandem-vllm-health:" + challenge.encode(), hashlib.sha256).hexdigest()


def port_report(port: int) -> bytes:
    """The one line a started service writes to the client's pipe once it listens."""
    return (json.dumps({"port": port, "pid": os.getpid()}) + "\n").encode()


INBOX_PREFIX = "tandem-vllm-"
OWNER_FILE = "owner.json"


def inbox_bases() -> list[Path]:
    """Where inboxes are made: /dev/shm when writable, else the temporary directory."""
    shm = Path("/dev/shm")
    return [shm] if shm.is_dir() and os.access(shm, os.W_OK) else [Path(tempfile.gettempdir())]


def process_start(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks since boot, /proc/<pid>/stat), None when it has exited
    (a zombie included): with the pid it names one process, whatever pid reuse does later."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]  # a zombie has exited too


def make_inbox() -> Path:
    """A new private inbox (mode 0700) naming this process as its owner."""
    inbox = Path(tempfile.mkdtemp(prefix=INBOX_PREFIX, dir=inbox_bases()[0]))
    (inbox / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "start": process_start(os.getpid())}))
    return inbox


def is_inbox(path: str | os.PathLike) -> bool:
    """Whether `path` is a service inbox this user may remove: a real folder named tandem-vllm-* directly in an
    inbox base, owned by this user (a path a service reports is never trusted further than that)."""
    p = Path(path)
    try:
        st = p.lstat()
    except OSError:
        return False
    return (p.name.startswith(INBOX_PREFIX) and p.parent in inbox_bases() and not p.is_symlink() and p.is_dir()
            and st.st_uid == os.getuid())


def owner_gone(inbox: Path) -> bool:
    """Whether the process named in the inbox's owner file has exited (False when the file is missing)."""
    try:
        owner = json.loads((inbox / OWNER_FILE).read_text())
        pid, start = int(owner["pid"]), owner.get("start")
    except (OSError, ValueError, KeyError, TypeError):
        return False
    now = process_start(pid)
    return now is None or (start is not None and now != start)


def remove_inbox(path: str | os.PathLike | None) -> bool:
    """Remove a dead service's inbox (`is_inbox` and `owner_gone`); True when removed."""
    if path is None or not is_inbox(path) or not owner_gone(Path(path)):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def sweep_stale_inboxes() -> list[Path]:
    """Remove every inbox of this user whose service is gone (killed with -9 before it could); returns them."""
    removed = []
    for base in inbox_bases():
        for d in base.glob(INBOX_PREFIX + "*"):
            if remove_inbox(d):
                removed.append(d)
    return removed


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes whose process group is `pgid`."""
    out = []
    if not PROC.is_dir():
        return out
    for d in PROC.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(d.name))
    return out


def is_tracker(pid: int) -> bool:
    """Whether `pid` is a Python resource tracker (which unlinks its processes' leaked segments, then exits)."""
    try:
        return TRACKER in (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def end_group(pgid: int, grace: float = 10.0, tracker_wait: float = 10.0) -> list[int]:
    """End the process group `pgid` but its resource trackers (and the caller, when it leads the group): SIGTERM (vLLM's engines shut down and release
    their segments), after `grace` seconds SIGKILL, then up to `tracker_wait` seconds for the trackers to
    finish their cleanup and exit. Returns the pids still alive at the end (normally none)."""
    me = os.getpid()
    if pgid <= 1 or (pgid == os.getpgid(0) and pgid != me):
        raise ValueError(f"refusing to end process group {pgid}: the caller's own group, which it does not lead")

    def others() -> list[int]:  # a leader ending its own group (the service) spares itself
        return [p for p in group_members(pgid) if p != me and not is_tracker(p)]

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        pids = others()
        if not pids:
            break
        for p in pids:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while others() and time.monotonic() < deadline:
            time.sleep(0.1)
    deadline = time.monotonic() + tracker_wait
    while [p for p in group_members(pgid) if p != me] and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in group_members(pgid) if p != me]
