"""Trust between the pipeline and its rollout service, and the service's edges, without vLLM: the service's own
HTTP server (tandem/rollout/vllm/httpd.py) in this process with no engines behind it (it answers "starting"),
an impostor on a port, a fake vLLM Python for start failures, and a process group with a real resource tracker
(tandem/rollout/vllm/lifecycle.py).

- The client sends its secret only to a process that proves it holds it (an HMAC of a fresh challenge), also
  while the service is starting; an impostor gets no secret and the client fails with one line.
- A fixed port already taken is one line before anything starts; a service that fails to start is one line
  quoting the error line of its log; the service reports the port it bound on the client's private pipe.
- The server holds at most MAX_CONNECTIONS connections, closes silent ones, and logs a bounded number of lines
  for failed connections.
- Ending a service's process group spares the resource tracker, which then unlinks the shared memory its
  processes created: nothing is left in /dev/shm, no process is left in the group.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tandem.errors import UserError
from tandem.rollout.vllm import httpd, lifecycle
from tandem.rollout.vllm.client import LaunchOptions, ServiceStartError, ServiceStarting, VLLMService, port_taken

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s" * 40


@pytest.fixture
def starting_service():
    """The service's server as `main` runs it while the engines load (no Service yet: /health answers 503)."""
    ref: list = []
    srv = httpd.Server(("127.0.0.1", 0), httpd.make_handler(None, ref, TOKEN, set(), 0, 0))
    port = srv.server_address[1]
    srv.RequestHandlerClass = httpd.make_handler(None, ref, TOKEN, {f"127.0.0.1:{port}", "127.0.0.1"}, 0, 0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, f"http://127.0.0.1:{port}"
    srv.shutdown()
    srv.server_close()


class Impostor(http.server.BaseHTTPRequestHandler):
    """Answers every request as a healthy service would have before the proof existed, and keeps what it got."""

    seen: list = []

    def log_message(self, *a):
        pass

    def _ok(self):
        Impostor.seen.append(dict(self.headers))
        data = json.dumps({"ok": True, "inbox": "/tmp/x"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _ok


@pytest.fixture
def impostor():
    Impostor.seen = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_the_service_proves_it_holds_the_secret_even_while_starting(starting_service):
    _, url = starting_service
    with pytest.raises(ServiceStarting):  # the proof checked out; the engines are still loading
        VLLMService(url, TOKEN).health(timeout=5)
    with pytest.raises(ServiceStartError) as e:  # a client with another secret does not trust it
        VLLMService(url, "t" * 40).health(timeout=5)
    assert "\n" not in str(e.value) and "cannot prove" in str(e.value)


def test_an_impostor_gets_no_secret_and_the_client_fails_in_one_line(impostor):
    url = f"http://127.0.0.1:{impostor.server_address[1]}"
    with pytest.raises(ServiceStartError) as e:
        VLLMService.attach(url, TOKEN, timeout=5)
    assert isinstance(e.value, UserError) and "\n" not in str(e.value) and "nothing secret was sent" in str(e.value)
    svc = VLLMService(url, TOKEN)
    assert not svc.alive()
    assert Impostor.seen and all(TOKEN not in json.dumps(h) for h in Impostor.seen)
    assert all("Authorization" not in h for h in Impostor.seen)


def test_a_fixed_port_already_taken_is_one_line_before_anything_starts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_taken("127.0.0.1", port)
        with pytest.raises(ServiceStartError) as e:
            VLLMService.start(tmp_path, tmp_path, options=LaunchOptions(python=sys.executable, port=port))
    msg = str(e.value)
    assert "\n" not in msg and f"rollout.vllm_port {port}" in msg and "nothing was sent" in msg


def _fake_python(tmp_path: Path, version: str) -> Path:
    """A 'vLLM Python' whose vllm is a stub of `version` with no engine: the real service entry then fails."""
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\nPYTHONPATH={pkg.parent}:$PYTHONPATH exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    return py


def test_a_service_that_fails_to_start_is_one_line_quoting_its_log(tmp_path):
    log = tmp_path / "service.log"
    opts = LaunchOptions(python=_fake_python(tmp_path, "0.40.1"), log_path=log, start_timeout=120)
    with pytest.raises(ServiceStartError) as e:
        VLLMService.start(tmp_path, tmp_path, options=opts)
    msg = str(e.value)
    assert "\n" not in msg and "exited with code 2" in msg and "vLLM 0.40.1 is installed" in msg and str(log) in msg


def test_the_service_reports_the_port_it_bound_and_fails_on_a_taken_one(tmp_path):
    """The service entry itself (a stub vLLM inside the fence, so it gets as far as listening): it reports its
    port and pid on the pipe it is given; on a port another process holds it exits 2 with one line."""
    py = _fake_python(tmp_path, "0.32.0")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TANDEM_VLLM_TOKEN": TOKEN}
    base = [str(py), "-m", "tandem.rollout.vllm.service", "--senior", str(tmp_path), "--junior", str(tmp_path)]
    r, w = os.pipe()
    p = subprocess.Popen([*base, "--port", "0", "--ready-fd", str(w)], env=env, pass_fds=(w,),
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            msg = json.loads(f.readline())
        assert msg["pid"] == p.pid and port_taken("127.0.0.1", msg["port"])
    finally:
        p.wait(60)  # the stub has no engines: the service fails after listening
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        q = subprocess.run([*base, "--port", str(s.getsockname()[1])], env=env, capture_output=True, text=True,
                           timeout=60)
    errors = [ln for ln in q.stderr.splitlines() if ln.startswith("tandem vllm service:")]
    assert q.returncode == 2 and "Traceback" not in q.stderr, q.stderr
    assert len(errors) == 1 and "cannot listen on" in errors[0] and "already in use" in errors[0]


def test_connections_are_bounded_timed_out_and_their_failures_logged_briefly(starting_service, monkeypatch, caplog):
    srv, url = starting_service
    port = srv.server_address[1]
    monkeypatch.setattr(srv, "MAX_CONNECTIONS", 4)
    srv._slots = threading.BoundedSemaphore(4)
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
    try:
        time.sleep(1.0)
        assert threading.active_count() - before <= 4  # one thread per held connection, no more
        assert srv._refused >= 8  # the rest were closed at once
    finally:
        for s in idle:
            s.close()
    # a silent connection is closed by the server after the socket timeout
    srv.RequestHandlerClass.timeout = 0.5
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(10)
        t0 = time.monotonic()
        assert s.recv(1) == b"" and time.monotonic() - t0 < 5
    # failed connections: one warning line each, at most ERROR_LINES
    caplog.set_level(logging.WARNING, logger=httpd.LOG.name)
    srv._errors = 0
    for _ in range(srv.ERROR_LINES + 10):
        try:
            raise ConnectionResetError("reset by peer")
        except ConnectionResetError:
            srv.handle_error(None, ("127.0.0.1", 1))
    lines = [r for r in caplog.records if "connection from" in r.getMessage()]
    assert len(lines) == srv.ERROR_LINES and all("\n" not in r.getMessage() for r in lines)


LEADER = r"""
import os, sys, time
from multiprocessing import shared_memory
shm = shared_memory.SharedMemory(create=True, size=1 << 20)   # registered with this process's resource tracker
child = os.fork()                                            # an 'engine': holds the tracker's pipe too
if child == 0:
    time.sleep(600)
    os._exit(0)
print(shm.name, child, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not Path("/proc").is_dir() or not Path("/dev/shm").is_dir(), reason="needs /proc and /dev/shm")
def test_ending_an_orphaned_group_releases_its_shared_memory():
    leader = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    name, child = leader.stdout.readline().split()
    pgid = leader.pid
    try:
        assert Path("/dev/shm", name).exists()
        os.kill(pgid, signal.SIGKILL)  # the service alone is killed: its 'engine' and tracker live on
        leader.wait()
        time.sleep(0.5)
        left = lifecycle.group_members(pgid)
        assert int(child) in left and any(lifecycle.is_tracker(p) for p in left)
        assert Path("/dev/shm", name).exists()
        assert lifecycle.end_group(pgid, grace=5, tracker_wait=10) == []
        assert not Path("/dev/shm", name).exists()  # the spared tracker unlinked it
    finally:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            Path("/dev/shm", name).unlink()
        except FileNotFoundError:
            pass


def test_end_group_refuses_a_group_the_caller_does_not_lead():
    with pytest.raises(ValueError):
        lifecycle.end_group(os.getpgid(0)) if os.getpgid(0) != os.getpid() else lifecycle.end_group(1)


def test_inboxes_of_services_that_are_gone_are_swept_and_only_those(tmp_path, monkeypatch):
    monkeypatch.setattr(lifecycle, "inbox_bases", lambda: [tmp_path])
    mine = lifecycle.make_inbox()  # this process: alive
    dead = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]);"
                           "from tandem.rollout.vllm import lifecycle as L; import pathlib;"
                           "L.inbox_bases = lambda: [pathlib.Path(sys.argv[2])]; print(L.make_inbox())",
                           str(ROOT), str(tmp_path)], capture_output=True, text=True, check=True).stdout.strip()
    foreign = tmp_path / "tandem-vllm-noowner"  # no owner file (not ours to judge): kept
    foreign.mkdir()
    other = tmp_path / "elsewhere"
    other.mkdir()
    link = tmp_path / "tandem-vllm-link"
    link.symlink_to(other)
    assert lifecycle.sweep_stale_inboxes() == [Path(dead)]
    assert mine.is_dir() and foreign.is_dir() and other.is_dir() and not Path(dead).exists()
    assert not lifecycle.remove_inbox(mine) and not lifecycle.remove_inbox("/etc")


CHILD = r"""
import multiprocessing as mp, os, sys, time
sys.path.insert(0, sys.argv[1])

def engine(q):
    from tandem.rollout.vllm import lifecycle
    q.put((os.getpid(), lifecycle.die_with_parent()))
    time.sleep(600)

if __name__ == "__main__":
    from tandem.rollout.vllm import lifecycle
    assert lifecycle.die_with_parent() is False  # not a multiprocessing child: the service is never made to
    q = mp.get_context("spawn").Queue()
    mp.get_context("spawn").Process(target=engine, args=(q,)).start()
    print(*q.get(), flush=True)
    time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_engine_process_dies_with_its_parent(tmp_path):
    script = tmp_path / "svc.py"
    script.write_text(CHILD)
    svc = subprocess.Popen([sys.executable, str(script), str(ROOT)], stdout=subprocess.PIPE, text=True,
                           start_new_session=True)
    pid, armed = svc.stdout.readline().split()
    try:
        assert armed == "True"
        os.kill(svc.pid, signal.SIGKILL)  # the 'service' alone
        svc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and lifecycle.process_start(int(pid)) is not None:
            time.sleep(0.1)
        assert lifecycle.process_start(int(pid)) is None
    finally:
        try:
            os.killpg(svc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
