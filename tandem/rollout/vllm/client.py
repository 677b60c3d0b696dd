"""The pipeline's side of the vLLM rollout service: start/attach/stop the service, and the `vllm` backend.

    service = VLLMService.start("models/base", "models/base", roots=["."])  # options=LaunchOptions(...)   # or VLLMService.attach(url, token)
    engine = TandemEngine(module, "models/base", tok, backend="vllm", vllm_options={"service": service, "live": True})
    batch = engine.generate(settings.request(prompt_ids, seed=3))                 # -> RolloutBatch
    engine.push_weights()                                     # after each optimizer step (VLLMWeightSync)

The service (`tandem/rollout/vllm/service.py`) runs in vLLM's own virtual environment (`.venv-vllm`, made by
`make vllm-env`); this module needs only the standard library, torch and safetensors, so the pipeline never
imports vLLM. `shared_service(rollout, start_dir, roots)` keeps one service per process (a Prefect run trains
every arm and evaluates every unit in one process): the first caller starts it (or attaches to
`rollout.vllm_url`), the rest reuse it, and it is stopped at exit.

Security. A started service gets a fresh per-run secret (`secrets.token_urlsafe`) in its environment (never on
its command line). It binds its port itself (`rollout.vllm_port`, or one of the system's choosing when 0) and
reports the port to this process over a pipe only the two share, so nothing else can be listening there; a
fixed port already taken is a one-line error before the service starts. Before sending anything secret, the
client asks `/health` to prove it holds the secret (an HMAC of a fresh challenge; a wrong or missing proof is a
one-line error, and nothing was sent), on every health check and so also for a service attached by URL. Every
request after that carries the secret (`Authorization: Bearer`), and an owned service is checked to be alive
before each one. Stopping or restarting a service ends its whole process group (its engines included, when the
service alone was killed), sparing the resource trackers that release vLLM's shared memory
(`tandem/rollout/vllm/lifecycle.py`). A service on another machine is started with
its own secret (`TANDEM_VLLM_TOKEN` there) and attached to with the same value in this process's
`TANDEM_VLLM_TOKEN` (see docs/rollout.md, "A service on another machine"). The service loads weight
directories only under the roots the stage names (the run's output root and the base model's directory),
files only from its own inbox, and it stops by itself when this process dies.

Weights. A senior given as a model directory (evaluation) is named by its directory; the service loads it
only when its engine holds something else. A live senior (a module trained in place, `live=True`) is pushed:
its state dict is written as safetensors into the service's inbox (`/dev/shm` when it exists: shared memory,
no disk I/O; the service deletes the file once loaded) and reloaded in place (`file` transport), or the bytes
are posted to the service (`http` transport, a service on another machine; one upload per role, replaced).

Failures. A request that finds the service gone restarts it when this process started it (then re-sends the
token tables and the weights it needs: the service answers 409 for state it does not hold), or waits for
it to come back when attached by URL; the request is then retried once.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import http.client
import json
import os
import re
import secrets
import select
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlparse

from tandem.errors import UserError
from tandem.rollout.core import RolloutBatch
from tandem.rollout.placement import Placement, placement_for
from tandem.rollout.vllm import lifecycle
from tandem.rollout.vllm.lifecycle import CHALLENGE_HEADER, health_proof
from tandem.rollout.vllm.knobs import EngineKnobs

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_PYTHON = ".venv-vllm/bin/python"
TOKEN_ENV = "TANDEM_VLLM_TOKEN"


class ServiceError(RuntimeError):
    """The rollout service failed a request (its one-line message is included; details are in its log)."""


class ServiceConflict(ServiceError):
    """The service lacks state this client sent before (it restarted): send it again."""


class ServiceStarting(ServiceError):
    """The service answers but its engines are still loading."""


class ServiceStartError(ServiceError, UserError):
    """The service could not be started or trusted: it exited while starting, its port is taken, or what answers
    cannot prove it holds the run's secret. One line; the service's log has the details."""


def port_taken(host: str, port: int) -> bool:
    """Whether `port` on `host` is bound by some process (then the service could not listen there)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the service's server binds (TIME_WAIT is free)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def last_error_line(log: str) -> str:
    """The line of a log that says what went wrong: the last exception line (`SomeError: ...`) or one-line
    message of the service (`tandem vllm service: ...`), else the last non-empty line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("tandem vllm service:") or re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b:?", ln):
            return ln[:300]
    return lines[-1][:300] if lines else "(its log is empty)"


def _is_local(url: str) -> bool:
    return (urlparse(url).hostname or "") in ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class LaunchOptions:
    """How `VLLMService.start` starts the rollout service: vLLM's Python (None = `.venv-vllm`), the address
    (port 0 = a free one), the engines' knobs (`knobs.EngineKnobs`: dtype, context length, GPU memory share,
    eager mode, KV blocks, rows per step; passed to the service as its flags), KV cache GiB on the CPU
    build, how long to wait for /health, the log file (None = in the service's run directory), the module
    that serves (`service`, run as `python -m`, with `service_args` after the flags: the benchmark runs its own
    subclass of the service, `benchmarks.vllm_ab_service`) and each engine's devices (`placement`, a
    `tandem.rollout.placement.Placement`; None = the engines inherit this process's devices)."""

    python: str | os.PathLike | None = None
    host: str = "127.0.0.1"
    port: int = 0
    knobs: EngineKnobs = EngineKnobs()
    cpu_kv_cache_gb: int = 1
    start_timeout: float = 600.0
    log_path: str | os.PathLike | None = None
    service: str = "tandem.rollout.vllm.service"
    service_args: tuple[str, ...] = ()
    placement: Placement | None = None

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", self.service):
            raise ValueError(f"service is a dotted module name run with `python -m`, got {self.service!r}")

    @classmethod
    def from_config(cls, rollout: Any, placement: Placement | None = None) -> "LaunchOptions":
        """The options the `rollout` params section states (`vllm_python`, `vllm_host`, ...), with the engines'
        `placement` (`tandem.rollout.placement.placement_for`)."""
        knobs = EngineKnobs(dtype=rollout.vllm_dtype, max_model_len=rollout.vllm_max_model_len,
                            gpu_memory=rollout.vllm_gpu_memory, enforce_eager=rollout.vllm_enforce_eager)
        return cls(python=rollout.vllm_python, host=rollout.vllm_host, port=rollout.vllm_port, knobs=knobs,
                   cpu_kv_cache_gb=rollout.vllm_cpu_kv_cache_gb, start_timeout=rollout.vllm_start_timeout,
                   placement=placement)

    def vllm_python(self) -> Path:
        """vLLM's Python (`python`, else `.venv-vllm`; relative paths from the repository root); a missing one
        is one line naming the setting (`missing_python`)."""
        py = Path(self.python or DEFAULT_PYTHON)
        py = py if py.is_absolute() else REPO_ROOT / py
        if not py.exists():
            raise ServiceStartError(missing_python(py))
        return py


def missing_python(py: Path) -> str:
    """The one line for a vLLM interpreter that is not there: it names the setting and what sets it."""
    return (f"vllm backend: no vLLM interpreter at {py} (rollout.vllm_python; $TANDEM_VLLM_PYTHON overrides it, "
            f"and the GPU image sets it to /opt/vllm/bin/python): create vLLM's environment with `make vllm-env` "
            f"or point rollout.vllm_python at vLLM's Python")


class VLLMService:
    """A running rollout service: its URL and token and, when this process started it, its process."""

    def __init__(self, url: str, token: str, proc: subprocess.Popen | None = None, cmd: list[str] | None = None,
                 env: dict | None = None, log_path: Path | None = None, start_timeout: float = 600.0):
        self.url = url.rstrip("/")
        self.token = token
        self.proc, self.cmd, self.env, self.log_path = proc, cmd, env, log_path
        self.start_timeout = start_timeout
        self.restarts = 0
        self.info: dict = {}
        self.architectures: dict | None = None  # {"senior": ..., "junior": ...} of a started service's engines
        self._lock = threading.Lock()

    # -- lifecycle -----------------------------------------------------------------------------------
    @classmethod
    def start(cls, senior_dir: str | os.PathLike, junior_dir: str | os.PathLike | None = None, *,
              roots: Sequence[str | os.PathLike] = (), options: "LaunchOptions | None" = None) -> "VLLMService":
        """Start the service from vLLM's environment and wait until its engines answer /health; it may load
        weights only under `roots`; `options` (a `LaunchOptions`) say how it is started."""
        o = options if options is not None else LaunchOptions()
        py = o.vllm_python()
        host, port = o.host, o.port
        if port and port_taken(host, port):
            raise ServiceStartError(f"rollout.vllm_port {port} on {host} is already in use by another process; "
                                    f"nothing was sent to it (set rollout.vllm_port: 0 and the service picks a "
                                    f"free port itself)")
        run_dir = Path(tempfile.mkdtemp(prefix="tandem-vllm-"))
        log = Path(o.log_path) if o.log_path else run_dir / "service.log"
        cmd = [str(py), "-m", o.service, "--senior", str(Path(senior_dir).resolve()),
               "--junior", str(Path(junior_dir or senior_dir).resolve()), "--host", host, "--port", str(port),
               "--parent-pid", str(os.getpid()), "--run-dir", str(run_dir), *o.knobs.to_argv(),
               *(o.placement.to_argv() if o.placement is not None else []), *o.service_args]
        for r in roots:
            cmd += ["--allow-root", str(Path(r).resolve())]
        token = secrets.token_urlsafe(32)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")}
        env["PYTHONPATH"] = str(REPO_ROOT)
        env[TOKEN_ENV] = token
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(o.cpu_kv_cache_gb))  # GiB per engine on the CPU build
        env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the service is threaded: never fork it
        # vLLM's CPU build binds each engine core's OpenMP threads to a core of its choosing: both engines on
        # the same core. Unbound, one thread each, the OS spreads the two engines over the machine's cores.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # AsyncLLM: each engine core in its own process
        svc = cls(f"http://{host}:{port}", token, None, cmd, env, log, o.start_timeout)
        svc.run_dir = run_dir
        try:
            svc._spawn()
        except BaseException:
            svc._stop_proc(timeout=10.0)  # nothing of a failed start is left running; its log is kept
            raise
        return svc

    @classmethod
    def attach(cls, url: str, token: str | None = None, timeout: float = 60.0) -> "VLLMService":
        """Use a service someone else started (another node); `token` defaults to $TANDEM_VLLM_TOKEN."""
        token = token or os.environ.get(TOKEN_ENV, "")
        if not token:
            raise ServiceError(f"attaching to the rollout service at {url} needs its secret: set {TOKEN_ENV} to "
                               f"the value the service was started with")
        svc = cls(url, token, start_timeout=timeout)
        svc.wait_healthy(timeout)
        return svc

    def _spawn(self) -> None:
        """Start the service process in a session of its own and learn its port from it: the service binds the
        port, then writes {"port", "pid"} to a pipe only this process reads; then wait for /health."""
        assert self.cmd is not None and self.log_path is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        rfd, wfd = os.pipe()
        try:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen([*self.cmd, "--ready-fd", str(wfd)], env=self.env, stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(REPO_ROOT),
                                             start_new_session=True, pass_fds=(wfd,))
            os.close(wfd)
            wfd = -1
            port = self._read_port(rfd, time.monotonic() + self.start_timeout)
        finally:
            os.close(rfd)
            if wfd >= 0:
                os.close(wfd)
        u = urlparse(self.url)
        self.url = f"http://{u.hostname if ':' not in (u.hostname or '') else f'[{u.hostname}]'}:{port}"
        self.wait_healthy(self.start_timeout)

    def _read_port(self, rfd: int, deadline: float) -> int:
        """The port the starting service reports on the pipe (one JSON line), or a one-line error when it exits
        first (the port taken, vLLM missing or refused) or stays silent past the deadline."""
        buf = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([rfd], [], [], 0.5)
            chunk = os.read(rfd, 4096) if ready else b""
            buf += chunk
            if b"\n" in buf:
                try:
                    msg = json.loads(buf.split(b"\n", 1)[0])
                    port, pid = int(msg["port"]), int(msg["pid"])
                except (ValueError, KeyError, TypeError):
                    raise ServiceStartError(f"the vLLM rollout service reported no port ({buf[:80]!r}); "
                                            f"log: {self.log_path}") from None
                if pid != self.proc.pid or not 0 < port < 65536:
                    raise ServiceStartError(f"the vLLM rollout service reported pid {pid} port {port}, not its own "
                                            f"pid {self.proc.pid}; log: {self.log_path}")
                return port
            if (ready and not chunk) or self.proc.poll() is not None:  # the pipe closed: the service is gone
                self.proc.wait()
                self._exited_while_starting()
        raise ServiceStartError(f"the vLLM rollout service did not report its port within {self.start_timeout:.0f} s;"
                                f" log: {self.log_path}")

    def _exited_while_starting(self) -> None:
        raise ServiceStartError(f"the vLLM rollout service exited with code {self.proc.returncode} while starting: "
                                f"{last_error_line(self.log_tail(200))} (log: {self.log_path})")

    def wait_healthy(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.exited:
                self._exited_while_starting()
            try:
                self.info = self.health(timeout=5.0)
                if "inbox" in self.info:
                    return self.info
                raise ServiceStartError(f"the rollout service at {self.url} proved it holds the secret but did "
                                        f"not return its state")
            except (OSError, http.client.HTTPException, ServiceStarting) as e:
                last = e
                time.sleep(0.5)
        raise ServiceStartError(f"the vLLM rollout service at {self.url} did not answer /health within "
                                f"{timeout:.0f} s ({last}); log: {self.log_path}")

    def log_tail(self, n: int = 30) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    @property
    def owned(self) -> bool:
        return self.cmd is not None

    @property
    def exited(self) -> bool:
        """This process started the service and its process has exited."""
        return self.proc is not None and self.proc.poll() is not None

    def alive(self) -> bool:
        if self.exited:
            return False
        try:
            self.health(timeout=5.0, full=False)
            return True
        except (OSError, http.client.HTTPException, ServiceError):
            return False

    def restart(self) -> None:
        """Start the service again (same command); only for a service this process started."""
        if not self.owned:
            raise ServiceError(f"cannot restart a service this process did not start ({self.url})")
        self._stop_proc()  # a killed service's inbox (weights, counters) is removed there
        self.restarts += 1
        self._spawn()

    def _stop_proc(self, timeout: float = 60.0) -> None:
        """Stop the service (asked, then SIGTERM, then SIGKILL) and end what is left of its process group: engines
        orphaned by a service killed alone, sparing the resource trackers that unlink their shared memory."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                if self.alive():  # the process is ours and listening: the secret goes only to it
                    self._request("POST", "/shutdown", b"{}", timeout=5.0)
            except (OSError, http.client.HTTPException, ServiceError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        left = lifecycle.end_group(self.proc.pid)  # the session we started it in: its group id is its pid
        if left:
            warnings.warn(f"rollout service processes {left} outlived SIGKILL of their group", stacklevel=2)
        lifecycle.remove_inbox(self.inbox)  # what a killed service could not remove (only a dead owner's)
        self.proc = None

    def stop(self, timeout: float = 60.0) -> None:
        self._stop_proc(timeout)
        run_dir = getattr(self, "run_dir", None)
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)

    # -- requests ------------------------------------------------------------------------------------
    def _send(self, method: str, path: str, body: bytes | None, timeout: float | None, headers: dict
              ) -> tuple[int, dict]:
        u = urlparse(self.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        try:
            obj = json.loads(data or b"{}")
        except ValueError:
            obj = {"error": data[:200].decode(errors="replace")}
        return resp.status, obj if isinstance(obj, dict) else {"error": str(obj)[:200]}

    def _request(self, method: str, path: str, body: bytes | None = None, timeout: float | None = None,
                 content_type: str = "application/json") -> dict:
        status, obj = self._send(method, path, body, timeout,
                                 {"Content-Type": content_type, "Authorization": f"Bearer {self.token}"})
        return self._result(path, status, obj)

    def _result(self, path: str, status: int, obj: dict) -> dict:
        if status == 409:
            raise ServiceConflict(obj.get("error", "conflict"))
        if status == 503:
            raise ServiceStarting(obj.get("error", "starting"))
        if status != 200:
            raise ServiceError(f"rollout service {path}: HTTP {status}: {obj.get('error')}"
                               + (f" (details in {self.log_path})" if self.log_path else ""))
        return obj

    def health(self, timeout: float = 10.0, full: bool = True) -> dict:
        """The service's /health, once it has proved it holds the secret: a challenge goes out without the
        secret, and the answer's HMAC must match (`health_proof`); only then, with `full`, the secret is sent
        for the service's state (inbox, loaded weights). A wrong or missing proof is a `ServiceStartError`."""
        challenge = secrets.token_hex(16)
        status, obj = self._send("GET", "/health", None, timeout, {CHALLENGE_HEADER: challenge})
        if not hmac.compare_digest(str(obj.get("proof", "")), health_proof(self.token, challenge)):
            raise ServiceStartError(f"what answers at {self.url} is not the rollout service this run started or "
                                    f"named: it cannot prove it holds the run's secret (HTTP {status}); nothing "
                                    f"secret was sent to it")
        self._result("/health", status, obj)  # 503: still starting
        return self._request("GET", "/health", timeout=timeout) if full else {"ok": True}

    def post(self, path: str, obj: dict | bytes, timeout: float | None = None, recover: bool = True,
             content_type: str = "application/json") -> dict:
        """POST with one recovery: a lost connection restarts (owned) or waits for (attached) the service. An
        owned service found dead is recovered before the request, so its port never receives the secret after
        the service has let it go."""
        body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        if self.exited:
            if not recover:
                raise ServiceError(f"the rollout service (pid {self.proc.pid}) has exited "
                                   f"(code {self.proc.returncode}); log: {self.log_path}")
            self.recover()
        try:
            return self._request("POST", path, body, timeout, content_type)
        except (OSError, http.client.HTTPException):
            if not recover:
                raise
            self.recover()
            return self._request("POST", path, body, timeout, content_type)

    def recover(self) -> None:
        with self._lock:
            if self.alive():
                return
            if self.owned:
                self.restart()
            else:
                self.wait_healthy(self.start_timeout)

    @property
    def inbox(self) -> Path | None:
        box = self.info.get("inbox")
        return Path(box) if box else None


# ------------------------------------------------------------------------------------------------------
# One service per process
# ------------------------------------------------------------------------------------------------------

_SHARED: dict[str, VLLMService] = {}
_SHARED_LOCK = threading.Lock()


# The config.json fields that decide an engine's tensor shapes: a weight directory or pushed state dict loads
# into an engine only when these agree.
ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size", "tie_word_embeddings")


def architecture(model: Any) -> dict:
    """`ARCHITECTURE_KEYS` of a model directory's config.json, or of a module's (or config's) attributes."""
    if isinstance(model, (str, os.PathLike)):
        f = Path(model) / "config.json"
        if not f.is_file():
            raise ValueError(f"vllm backend: {model} has no config.json: not a model directory")
        cfg = json.loads(f.read_text())
        return {k: cfg.get(k) for k in ARCHITECTURE_KEYS}
    cfg = getattr(model, "config", model)
    if hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    get = cfg.get if isinstance(cfg, dict) else (lambda k: getattr(cfg, k, None))
    return {k: get(k) for k in ARCHITECTURE_KEYS}


def architecture_difference(a: dict, b: dict) -> str:
    """'' when the two architectures agree, else the fields that differ ('hidden_size 96 vs 2560, ...')."""
    return ", ".join(f"{k} {a.get(k)} vs {b.get(k)}" for k in ARCHITECTURE_KEYS if a.get(k) != b.get(k))


def senior_start_dir(senior_dir: str | os.PathLike | None, junior_dir: str | os.PathLike,
                     senior_arch: dict | None = None) -> Path:
    """The directory the service's senior engine starts from. Every request names the senior's weights (a
    checkpoint directory, or a push of the live module), so any directory of the senior's architecture serves:
    the junior's when the two share one (the paper: the junior is the senior's base), else the senior's own.
    A senior known only by its architecture (a live module without a directory) that differs from the junior's
    is refused: no directory could start its engine."""
    junior_dir = Path(junior_dir)
    want = architecture(senior_dir) if senior_dir is not None else senior_arch
    diff = architecture_difference(want, architecture(junior_dir)) if want is not None else ""
    if not diff:
        return junior_dir
    if senior_dir is None:
        raise ValueError(f"vllm backend: the senior's architecture differs from the junior's at {junior_dir} "
                         f"({diff}) and the senior has no "
                         "model directory to start its engine from: load it with from_pretrained(<directory>)")
    return Path(senior_dir)


def shared_service(rollout: Any, start_dir: str | os.PathLike, roots: Sequence[str | os.PathLike] = (),
                   trainer_processes: int = 1, senior_dir: str | os.PathLike | None = None,
                   senior_arch: dict | None = None) -> VLLMService:
    """The process's rollout service for the `rollout` config section: attached to `rollout.vllm_url` if set
    ($TANDEM_VLLM_URL overrides it when params are loaded: tandem.config.ENV_OVERRIDES), else started once
    from `start_dir` (the junior's directory; the senior's engine from `senior_dir` where its architecture
    differs, refused for a senior known only by `senior_arch` that differs, `senior_start_dir`; its weight roots: `start_dir` and `roots`), each engine on the devices the layout
    gives it (`placement_for`: this process's `LOCAL_RANK` GPU, or the dedicated GPUs outside the trainer's
    `trainer_processes`), and stopped at exit; reused by every caller whose models have the architectures
    of the engines it started (another pair is refused in one line)."""
    url = rollout.vllm_url
    key = url or f"{rollout.vllm_python}|{rollout.vllm_host}|{rollout.vllm_dtype}|{rollout.vllm_max_model_len}"
    senior_start = senior_start_dir(senior_dir, start_dir, senior_arch)
    want = None if url else {"senior": architecture(senior_start), "junior": architecture(start_dir)}
    with _SHARED_LOCK:
        svc = _SHARED.get(key)
        if svc is not None and (svc.proc is None or svc.proc.poll() is None or not svc.owned):
            held = getattr(svc, "architectures", None)
            for role in ("senior", "junior"):
                diff = architecture_difference(held[role], want[role]) if held and want else ""
                if diff:
                    raise ValueError(f"vllm backend: this process's rollout service runs a {role} engine of "
                                     f"another architecture ({diff}); one process serves one (senior, junior) "
                                     "pair of architectures: run the other pair in a process of its own")
            return svc
        if url:
            svc = VLLMService.attach(url, timeout=rollout.vllm_start_timeout)
        else:
            placement = placement_for(rollout, trainer_processes)
            svc = VLLMService.start(senior_start, start_dir, roots=[start_dir, *roots],
                                    options=LaunchOptions.from_config(rollout, placement))
            svc.architectures = want
            atexit.register(svc.stop)
        _SHARED[key] = svc
        return svc


def stop_shared_services() -> None:
    with _SHARED_LOCK:
        for svc in _SHARED.values():
            svc.stop()
        _SHARED.clear()


# ------------------------------------------------------------------------------------------------------
# The `vllm` backend
# ------------------------------------------------------------------------------------------------------

def _model_dir(model: Any) -> Path:
    if isinstance(model, (str, os.PathLike)):
        return Path(model).resolve()
    path = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not path or not os.path.isdir(path):
        raise ValueError("vllm backend: cannot find the model's directory; pass a saved model directory, or "
                         "live=True for a module whose weights are pushed to the service")
    return Path(path).resolve()


def _dir_spec(path: Path) -> dict:
    return {"tag": f"dir:{path}", "dir": str(path)}


class VLLMEngine:
    """The `vllm` backend: tandem rollouts through the rollout service, `generate(request) -> RolloutBatch`.

    `pair` (a `tandem.rollout.request.ModelPair`, its vocabulary checked): the senior and junior as model
    directories, or modules (a module's `name_or_path` directory is used unless `live=True`, in which case its
    current weights are pushed now and by every `push_weights()`), their tokenizer, token tables and EOS ids.
    `transport`: `file` (the service's inbox), `http` (bytes posted to the service), `auto` (file for a service
    on this machine, http otherwise). Built by `TandemEngine(backend="vllm")`.
    """

    name = "vllm"

    def __init__(self, pair: Any, service: VLLMService, *, live: bool = False, transport: str = "auto",
                 request_timeout: float | None = None):
        if transport not in ("auto", "file", "http"):
            raise ValueError(f"transport must be auto, file or http, got {transport!r}")
        senior, junior = pair.senior, pair.junior
        self.service, self.senior, self.junior, self.tokenizer = service, senior, junior, pair.tokenizer
        self.vocab_size, self.tables, self.eos_ids = pair.vocab_size, pair.tables, list(pair.eos_ids)
        self.transport = ("file" if _is_local(service.url) else "http") if transport == "auto" else transport
        self.request_timeout = request_timeout
        self.live = bool(live)
        self._tables_msg = self._tables_payload()
        self.junior_spec = _dir_spec(_model_dir(junior)) if junior is not None else None
        self.senior_spec: dict | None = None
        self.version = 0
        self.last_stats: dict = {}
        self.last_calls: list[int] = []  # the rows of each service call of the last `generate`
        self.totals = {"decoded": 0, "kept": 0, "chunks": 0, "seconds": 0.0}
        if self.live:
            if not hasattr(senior, "state_dict"):
                raise TypeError("live=True needs the senior as a torch module")
            self._tag_base = f"live:{uuid.uuid4().hex[:12]}"
            self.push_weights()
        else:
            self.senior_spec = _dir_spec(_model_dir(senior))

    # -- state the service must hold -------------------------------------------------------------------
    def _tables_payload(self) -> dict:
        t = self.tables

        def ids(x) -> list[int]:
            return x.nonzero().flatten().tolist()

        msg = {"vocab_size": self.vocab_size, "word_start": ids(t.word_start_V), "step_end": ids(t.step_end_V),
               "starts_newline": ids(t.starts_newline_V), "ends_newline": ids(t.ends_newline_V),
               "empty": ids(t.empty_V)}
        msg["key"] = hashlib.sha256(json.dumps(msg, sort_keys=True).encode()).hexdigest()[:16]
        return msg

    def _send_tables(self) -> None:
        self.service.post("/tables", self._tables_msg)

    def push_weights(self, module: Any | None = None) -> dict:
        """Hand the live senior's current weights to the service (reloaded in place, prefix cache reset)."""
        import torch
        from safetensors.torch import save_file

        model = module if module is not None else self.senior
        t0 = time.perf_counter()
        self.version += 1
        tag = f"{self._tag_base}:{self.version}"
        with torch.no_grad():
            sd = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        # tied embeddings: one tensor under two names is refused by safetensors; the engine re-ties them
        if "lm_head.weight" in sd and "model.embed_tokens.weight" in sd and \
                sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr():
            del sd["lm_head.weight"]
        if self.transport == "file":
            box = self.service.inbox
            if box is None or not box.is_dir():
                raise ServiceError(f"the rollout service's inbox ({box}) is not on this machine: use "
                                   f"rollout.vllm_weight_transport http")
            path = box / f"senior-{os.getpid()}-{self.version}.safetensors"
            tmp = path.with_suffix(".part")
            save_file(sd, str(tmp))
            os.replace(tmp, path)
            self.senior_spec = {"tag": tag, "file": str(path)}
            self.service.post("/weights", {"role": "senior", **self.senior_spec})
        else:
            with tempfile.TemporaryDirectory(prefix="tandem-vllm-push-") as d:
                f = Path(d) / "senior.safetensors"
                save_file(sd, str(f))
                self.service.post(f"/upload?role=senior&tag={tag}", f.read_bytes(),
                                  content_type="application/octet-stream")
            self.senior_spec = {"tag": tag}
            self.service.post("/weights", {"role": "senior", **self.senior_spec})
        self._live_module = model
        return {"tag": tag, "seconds": time.perf_counter() - t0}

    def _call(self, path: str, payload: dict) -> dict:
        """POST, re-sending tables/weights once when the service says it lacks them (it restarted)."""
        for attempt in range(3):
            try:
                return self.service.post(path, payload, timeout=self.request_timeout)
            except ServiceConflict:
                if attempt == 2:
                    raise
                self._send_tables()
                if self.live:
                    self.version -= 1  # the same weights again, under the same tag
                    self.push_weights(getattr(self, "_live_module", None))
                    payload = {**payload, "senior": self.senior_spec} if "senior" in payload else payload
        raise AssertionError("unreachable")

    # -- the backend API -----------------------------------------------------------------------------
    def generate(self, request: Any) -> RolloutBatch:
        """Roll out every prompt of `request` once (see `tandem.rollout.request.RolloutRequest`): one service
        call per group of `settings.batch_size` rows (all rows at once when 0); `last_calls` keeps the rows of
        each call."""
        B = len(request)
        if B == 0:
            self.last_calls = []
            return RolloutBatch([], [], [], [], [])
        t0 = time.perf_counter()
        groups = request.groups()
        self.last_calls = [len(g) for g in groups]
        parts = [(g, self._generate(request.subset(g))) for g in groups]
        out = RolloutBatch.scatter(B, parts)
        service_s = sum(part.timings["service_seconds"] for _, part in parts)
        out.timings = {"seconds": time.perf_counter() - t0, "service_seconds": service_s}
        return out

    def _generate(self, request: Any, extra: dict | None = None) -> RolloutBatch:
        """One group's rollout; `extra`: further request fields for a service that reads them (the
        benchmark's service: "sessions", "replay")."""
        s = request.settings
        sp = s.sampling
        payload = {"tables": self._tables_msg["key"], "senior": self.senior_spec, "junior": self.junior_spec,
                   "prompts": [list(p) for p in request.prompts], "rows": list(request.row_ids),
                   "schedule": s.schedule.as_dict(),
                   "sampling": {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
                                "max_new_tokens": sp.max_new_tokens},
                   "seed": int(request.seed), "eos": request.eos(self.eos_ids)}
        if extra:
            payload.update(extra)
        out = self._call("/generate", payload)
        batch = RolloutBatch(out["completion_ids"], out["owner"], out["senior_logprobs"], out["handoffs"],
                             out["finish_reason"])
        batch.timings = {"service_seconds": out["stats"]["seconds"]}
        self.last_stats = out["stats"]
        for k in self.totals:
            self.totals[k] += out["stats"].get(k, 0)
        return batch

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int], role: str = "senior"
              ) -> list[list[float]]:
        """Teacher-forced log-probs (temperature 1) from the service's engine of `role`, positions >= start."""
        weights = self.senior_spec if role == "senior" else self.junior_spec
        return self._call("/score", {"role": role, "weights": weights, "sequences": [list(map(int, s)) for s in
                                                                                       sequences],
                                     "starts": [int(s) for s in starts]})["logprobs"]


def engine_from_config(senior: Any, junior: Any | None, tokenizer: Any, rollout: Any, *, live: bool,
                       roots: Sequence[str | os.PathLike] = (), eos_token_ids: Sequence[int] | None = None,
                       trainer_processes: int = 1):
    """The `rollout.backend: vllm` engine: a `TandemEngine` over the process's shared service (started from
    the junior's directory with weight roots `roots`, or attached to `rollout.vllm_url`). `live=True` in
    training (the senior module is trained in place and pushed after each optimizer step, see
    `sync.VLLMWeightSync`), False in evaluation (the senior is a saved checkpoint directory)."""
    from tandem.rollout.engine import TandemEngine

    junior_dir = _model_dir(junior if junior is not None else senior)
    try:
        senior_dir, senior_arch = _model_dir(senior), None
    except ValueError:  # a live module without a directory: known by its architecture alone
        senior_dir, senior_arch = None, architecture(senior)
    service = shared_service(rollout, junior_dir, roots, trainer_processes, senior_dir=senior_dir,
                             senior_arch=senior_arch)
    return TandemEngine(senior, junior, tokenizer, backend="vllm", eos_token_ids=eos_token_ids,
                        vllm_options={"service": service, "live": live,
                                      "transport": rollout.vllm_weight_transport})
