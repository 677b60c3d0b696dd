"""The rollout service's HTTP layer: the bounded server, the request handler (authentication, Host and Origin
checks, body limits, routes; one short line per error) and `main`, which binds the port, reports it to the
client, starts the `Service` behind it (`serve`, which `service.main` calls) and cleans up on every exit. `service.py`'s docstring lists the
endpoints and the security rules.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from tandem.rollout.placement import Placement, PlacementError
from tandem.rollout.vllm.compat import ENGINE_ENV, ENGINE_FIXED, UnsupportedVLLMError, supported_text
from tandem.rollout.vllm.engines import ROLES, EngineSpec, check_vllm
from tandem.rollout.vllm.knobs import EngineKnobs
from tandem.rollout.vllm.lifecycle import (CHALLENGE_HEADER, end_group, health_proof, make_inbox, port_report,
                                          sweep_stale_inboxes)

LOG = logging.getLogger("tandem.vllm.service")


class Conflict(Exception):
    """The request names state the service does not hold (a restarted service): the client re-sends it."""


class Refused(Exception):
    """A request the service will not serve (HTTP status, one-line reason)."""

    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


def _inbox_root() -> Path:
    """This service's inbox (`lifecycle.make_inbox`), after removing those of services killed before they could."""
    stale = sweep_stale_inboxes()
    if stale:
        LOG.info("removed %d inbox(es) of services that are gone: %s", len(stale), ", ".join(map(str, stale)))
    return make_inbox()



class Server(ThreadingHTTPServer):
    """The HTTP server, bounded: at most `MAX_CONNECTIONS` connections at a time (more are closed at once, one
    warning), and a failed connection (reset, timed out) is one log line, at most `ERROR_LINES` of them; each
    connection's socket times out after `SOCKET_TIMEOUT_S` of silence (`Handler.timeout`)."""

    daemon_threads = True
    MAX_CONNECTIONS = 64
    ERROR_LINES = 20

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(self.MAX_CONNECTIONS)
        self._refused = self._errors = 0
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self._refused += 1
            if self._refused in (1, 10, 100, 1000):
                LOG.warning("over %d open connections: closed %d so far", self.MAX_CONNECTIONS, self._refused)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address):
        self._errors += 1
        if self._errors <= self.ERROR_LINES:
            e = sys.exc_info()[1]
            LOG.warning("connection from %s failed: %s: %s%s", client_address[0], type(e).__name__, e,
                        " (further failures are not logged)" if self._errors == self.ERROR_LINES else "")


SOCKET_TIMEOUT_S = 60.0  # a connection silent this long (an idle or stalled client) is closed


def make_handler(service: Any, server_ref: list, token: str, hosts: set[str], max_json: int,
                 max_upload: int):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = SOCKET_TIMEOUT_S

        def log_message(self, fmt, *args):  # one line per request on stderr is noise at a step a second
            pass

        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self) -> bool:
            got = self.headers.get("Authorization", "")
            return bool(token) and hmac.compare_digest(got.encode(), f"Bearer {token}".encode())

        def _check(self, write: bool) -> None:
            if (self.headers.get("Host") or "").lower() not in hosts:
                raise Refused(421, "unexpected Host header")
            if self.headers.get("Origin") is not None:
                raise Refused(403, "requests from web pages are refused")
            if write and not self._authorised():
                raise Refused(401, "missing or wrong token")

        def _length(self, limit: int) -> int:
            raw = self.headers.get("Content-Length")
            if raw is None or not raw.isdigit():
                raise Refused(411, "a numeric Content-Length is required")
            n = int(raw)
            if n > limit:
                raise Refused(413, f"body too large ({n} bytes; limit {limit})")
            return n

        def _fail(self, e: Exception) -> None:
            if isinstance(e, Refused):
                code, msg = e.status, str(e)
            elif isinstance(e, Conflict):
                code, msg = 409, str(e)
            else:
                code, msg = 500, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                LOG.error("request %s failed:\n%s", self.path, traceback.format_exc())
            self.close_connection = True
            try:
                self._send(code, {"error": msg})
            except OSError:
                pass

        def do_GET(self):
            try:
                self._check(write=False)
                if urlparse(self.path).path != "/health":
                    raise Refused(404, "no such route")
                # a client proves this is its service before it sends the secret: answer its challenge
                challenge = self.headers.get(CHALLENGE_HEADER)
                proof = {"proof": health_proof(token, challenge[:128])} if challenge and token else {}
                if service is None:
                    return self._send(503, {"error": "starting", **proof})
                return self._send(200, {**service.health(full=self._authorised()), **proof})
            except Exception as e:  # noqa: BLE001 - one short line to the client, details to the log
                return self._fail(e)

        def do_POST(self):
            url = urlparse(self.path)
            try:
                self._check(write=True)
                if service is None:
                    raise Refused(503, "starting")
                if url.path == "/upload":
                    if self.headers.get("Content-Type") != "application/octet-stream":
                        raise Refused(415, "uploads are application/octet-stream")
                    n = self._length(max_upload)
                    q = parse_qs(url.query)
                    role, tag = ROLES.get(q.get("role", [""])[0]), q.get("tag", [""])[0]
                    if role is None or not tag:
                        raise Refused(400, "upload needs ?role=senior|junior&tag=")
                    with service.lock:
                        return self._send(200, service.upload(role, tag, self.rfile, n))
                if (self.headers.get("Content-Type") or "").split(";")[0].strip() != "application/json":
                    raise Refused(415, "bodies are application/json")
                n = self._length(max_json)
                body = self.rfile.read(n) if n else b""
                if url.path == "/shutdown":
                    self._send(200, {"ok": True})
                    threading.Thread(target=server_ref[0].shutdown, daemon=True).start()
                    return
                try:
                    req = json.loads(body or b"{}")
                except ValueError:
                    raise Refused(400, "the body is not JSON") from None
                if not isinstance(req, dict):
                    raise Refused(400, "the body must be a JSON object")
                routes = {"/tables": service.set_tables, "/generate": service.generate, "/score": service.score,
                          "/weights": lambda r: {"ok": True, "reloaded": service.ensure(_role(r), r)}}
                if url.path not in routes:
                    raise Refused(404, "no such route")
                with service.lock:
                    out = routes[url.path](req)
                return self._send(200, out)
            except Exception as e:  # noqa: BLE001 - one short line to the client, details to the log
                return self._fail(e)

    return Handler


def _role(r: dict) -> int:
    role = ROLES.get(r.get("role", ""))
    if role is None:
        raise Refused(400, "role must be senior or junior")
    return role


def _watch_parent(pid: int, stop) -> None:
    """Stop the service when the process that started it is gone (killed with -9 included): `stop` sends this
    process SIGTERM, whose handler interrupts even an engine start in progress."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(pid, 0)
            alive = os.getppid() == pid or pid == 1
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        if not alive:
            LOG.warning("the process that started the service (pid %d) is gone: stopping", pid)
            stop()
            return


def serve(argv: list[str] | None, service_cls: type) -> int:
    """Serve until stopped (`service_cls`: `service.Service`, or the benchmark's subclass of it; `service.main`)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--senior", required=True, help="model directory the senior engine starts from")
    ap.add_argument("--junior", required=True, help="model directory of the frozen junior")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    ap.add_argument("--port", type=int, default=8471)
    EngineKnobs.add_arguments(ap)
    ap.add_argument("--allow-root", action="append", default=[], help="weights directories may lie under this")
    ap.add_argument("--allow-host", action="append", default=[], help="extra accepted Host header values")
    ap.add_argument("--token-file", default=None, help="file holding the secret (else $TANDEM_VLLM_TOKEN)")
    ap.add_argument("--parent-pid", type=int, default=0, help="stop when this process is gone")
    ap.add_argument("--ready-fd", type=int, default=-1,
                    help="a pipe to report {port, pid} on once listening (the client that started the service)")
    ap.add_argument("--run-dir", default=None, help="the starter's temporary directory, removed on a clean exit")
    ap.add_argument("--max-json-mb", type=float, default=256.0)
    ap.add_argument("--max-upload-gb", type=float, default=64.0)
    ap.add_argument("--layout", default="shared", choices=("shared", "dedicated"), help="rollout.vllm_layout")
    ap.add_argument("--senior-devices", default="", help="the senior engine's CUDA_VISIBLE_DEVICES (empty: inherit)")
    ap.add_argument("--junior-devices", default="", help="the junior engine's CUDA_VISIBLE_DEVICES (empty: inherit)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    token = (Path(a.token_file).read_text().strip() if a.token_file else os.environ.pop("TANDEM_VLLM_TOKEN", ""))
    if len(token) < 16:
        print("tandem vllm service: a secret of at least 16 characters is required ($TANDEM_VLLM_TOKEN or "
              "--token-file)", file=sys.stderr)
        return 2
    try:
        placement = Placement.from_argv(a.layout, a.senior_devices, a.junior_devices)
    except PlacementError as e:
        print(f"tandem vllm service: {e}", file=sys.stderr)
        return 2
    try:
        version = check_vllm()
    except UnsupportedVLLMError as e:
        print(f"tandem vllm service: {e}", file=sys.stderr)
        return 2
    LOG.info("vLLM %s (supported: %s); engine environment %s; fixed engine arguments %s", version,
             supported_text(), ENGINE_ENV, ENGINE_FIXED)
    ref: list = []
    try:
        server = Server((a.host, a.port), make_handler(None, ref, token, set(), 0, 0))
    except OSError as e:
        print(f"tandem vllm service: cannot listen on {a.host}:{a.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    port = server.server_address[1]
    if a.ready_fd >= 0:  # the port is ours now: tell the client that started us, over its private pipe
        try:
            os.write(a.ready_fd, port_report(port))
        finally:
            os.close(a.ready_fd)
    hosts = {f"{a.host}:{port}".lower(), a.host.lower()} | {h.lower() for h in a.allow_host}
    if a.host in ("127.0.0.1", "localhost", "::1"):
        hosts |= {f"127.0.0.1:{port}", f"localhost:{port}"}
    ref.append(server)
    stopping = threading.Event()
    clean = {"ok": True}

    def stop(*_):
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

    def on_signal(*_):
        stop()
        if service is None:  # still starting the engines: abort the start (the finally below cleans up)
            raise SystemExit(1)

    service = None
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if a.parent_pid:
        threading.Thread(target=_watch_parent, args=(a.parent_pid, lambda: os.kill(os.getpid(), signal.SIGTERM)),
                         daemon=True).start()
    inbox = _inbox_root()
    server_thread = threading.Thread(target=server.serve_forever, daemon=True)
    try:
        server.RequestHandlerClass = make_handler(None, ref, token, hosts, 0, 0)
        server_thread.start()  # /health answers "starting" (503) while the engines load
        LOG.info("layout %s: %s", placement.layout, placement.describe())
        spec = EngineSpec(a.senior, a.junior, EngineKnobs.from_args(a), placement=placement)
        service = service_cls(spec, roots=a.allow_root, inbox=inbox)
        server.RequestHandlerClass = make_handler(service, ref, token, hosts, int(a.max_json_mb * 2**20),
                                                  int(a.max_upload_gb * 2**30))
        print(json.dumps({"listening": f"http://{a.host}:{port}", "pid": os.getpid()}), flush=True)
        while server_thread.is_alive() and not stopping.is_set():
            server_thread.join(0.5)
    except BaseException:
        if not stopping.is_set():  # a failure, not a stop asked for: keep the log for diagnosis
            clean["ok"] = False
            LOG.error("the rollout service failed:\n%s", traceback.format_exc())
        raise
    finally:
        stop()
        server_thread.join(10)
        server.server_close()
        if service is not None:
            service.shutdown()
        shutil.rmtree(inbox, ignore_errors=True)  # pushed weights and counters never outlive the service
        if a.run_dir and clean["ok"]:
            shutil.rmtree(a.run_dir, ignore_errors=True)
        if service is None and stopping.is_set() and os.getpgid(0) == os.getpid():
            # stopped while the engines were starting: their processes (this process group, which the client
            # made ours) would otherwise finish starting and linger; the resource trackers are spared, so the
            # engines' shared memory is released (lifecycle.end_group)
            end_group(os.getpid(), grace=5.0, tracker_wait=0.0)
    return 0
