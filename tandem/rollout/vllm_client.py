"""The pipeline's side of the vLLM rollout service: start/attach/stop the service, and an engine-shaped client.

    service = VLLMService.start("models/base", "models/base")          # or VLLMService.attach("http://node:8471")
    engine = VLLMEngine(senior, junior, tokenizer, service, live=True)  # same generate() as TandemEngine
    batch = engine.generate(prompt_ids, "word", SamplingParams(max_new_tokens=160), seed=3)
    engine.push_weights()                                               # after each optimizer step (VLLMWeightSync)

The service (`tandem/rollout/vllm_service.py`) runs in vLLM's own virtual environment (`.venv-vllm`, made by
`make vllm-env`); this module needs only the standard library, torch and safetensors, so the pipeline never
imports vLLM. `shared_service(rollout)` keeps one service per process (a Prefect run trains every arm and
evaluates every unit in one process): the first caller starts it (or attaches to `rollout.vllm_url`), the
rest reuse it, and it is stopped at exit.

Weights. A senior given as a model directory (evaluation) is named by its directory; the service loads it
only when its engine holds something else. A live senior (a module trained in place, `live=True`) is pushed:
its state dict is written as safetensors to a transfer directory (`/dev/shm` when it exists: shared memory,
no disk I/O) and the service reloads it in place and resets the prefix cache (`file` transport), or the bytes
are posted to the service (`http` transport, a service on another machine). On GPUs the same hand-over can
go through NCCL (see docs/rollout.md, "Weight sync on GPUs").

Failures. A request that finds the service gone restarts it when this process started it (then re-sends the
token tables and the weights it needs: the service answers 409 for state it does not hold), or waits for
it to come back when attached by URL; the request is then retried once.
"""

from __future__ import annotations

import atexit
import hashlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlparse

from tandem.rollout.core import RolloutBatch, SamplingParams, check_request

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = ".venv-vllm/bin/python"


class ServiceError(RuntimeError):
    """The rollout service failed a request (its message and traceback are included)."""


class ServiceConflict(ServiceError):
    """The service lacks state this client sent before (it restarted): send it again."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _is_local(url: str) -> bool:
    return (urlparse(url).hostname or "") in ("127.0.0.1", "localhost", "::1")


class VLLMService:
    """A running rollout service: its URL and, when this process started it, its process and command."""

    def __init__(self, url: str, proc: subprocess.Popen | None = None, cmd: list[str] | None = None,
                 env: dict | None = None, log_path: Path | None = None, start_timeout: float = 600.0):
        self.url = url.rstrip("/")
        self.proc, self.cmd, self.env, self.log_path = proc, cmd, env, log_path
        self.start_timeout = start_timeout
        self.restarts = 0
        self._lock = threading.Lock()

    # -- lifecycle -----------------------------------------------------------------------------------
    @classmethod
    def start(cls, senior_dir: str | os.PathLike, junior_dir: str | os.PathLike | None = None, *,
              python: str | os.PathLike | None = None, host: str = "127.0.0.1", port: int = 0,
              dtype: str = "auto", max_model_len: int = 0, gpu_memory: float = 0.35, enforce_eager: bool = True,
              cpu_kv_cache_gb: int = 1, start_timeout: float = 600.0, log_path: str | os.PathLike | None = None
              ) -> "VLLMService":
        """Start the service from vLLM's environment and wait until it answers /health."""
        py = Path(python or DEFAULT_PYTHON)
        py = py if py.is_absolute() else REPO_ROOT / py
        if not py.exists():
            raise FileNotFoundError(f"vllm backend: no Python at {py}; create vLLM's environment with "
                                    f"`make vllm-env` (or set rollout.vllm_python)")
        port = port or free_port(host)
        cmd = [str(py), "-m", "tandem.rollout.vllm_service", "--senior", str(Path(senior_dir).resolve()),
               "--junior", str(Path(junior_dir or senior_dir).resolve()), "--host", host, "--port", str(port),
               "--dtype", dtype, "--max-model-len", str(max_model_len), "--gpu-memory-utilization", str(gpu_memory)]
        if not enforce_eager:
            cmd.append("--no-enforce-eager")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")}
        env["PYTHONPATH"] = str(REPO_ROOT)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gb))  # GiB per engine on the CPU build
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        log = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="tandem-vllm-")) / "service.log"
        svc = cls(f"http://{host}:{port}", None, cmd, env, log, start_timeout)
        svc._spawn()
        return svc

    @classmethod
    def attach(cls, url: str, timeout: float = 60.0) -> "VLLMService":
        """Use a service someone else started (another node, a Kubernetes service)."""
        svc = cls(url, start_timeout=timeout)
        svc.wait_healthy(timeout)
        return svc

    def _spawn(self) -> None:
        assert self.cmd is not None and self.log_path is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=str(REPO_ROOT), start_new_session=True)
        self.wait_healthy(self.start_timeout)

    def wait_healthy(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServiceError(f"the vLLM rollout service exited with code {self.proc.returncode} while "
                                   f"starting; its log ({self.log_path}) ends with:\n{self.log_tail()}")
            try:
                return self.health(timeout=5.0)
            except (OSError, http.client.HTTPException) as e:
                last = e
                time.sleep(0.5)
        raise ServiceError(f"the vLLM rollout service at {self.url} did not answer /health within {timeout:.0f} s "
                           f"({last}); log: {self.log_path}\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    @property
    def owned(self) -> bool:
        return self.cmd is not None

    def alive(self) -> bool:
        try:
            self.health(timeout=5.0)
            return True
        except (OSError, http.client.HTTPException):
            return False

    def restart(self) -> None:
        """Start the service again (same command); only for a service this process started."""
        if not self.owned:
            raise ServiceError(f"cannot restart a service this process did not start ({self.url})")
        self.stop()
        self.restarts += 1
        self._spawn()

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self._request("POST", "/shutdown", b"{}", timeout=5.0)
            except (OSError, http.client.HTTPException, ServiceError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self.proc = None

    # -- requests ------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: bytes | None = None, timeout: float | None = None,
                 content_type: str = "application/json") -> dict:
        u = urlparse(self.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": content_type})
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        obj = json.loads(data or b"{}")
        if resp.status == 409:
            raise ServiceConflict(obj.get("error", "conflict"))
        if resp.status != 200:
            raise ServiceError(f"{path}: HTTP {resp.status}: {obj.get('error')}\n{obj.get('traceback', '')}")
        return obj

    def health(self, timeout: float = 10.0) -> dict:
        return self._request("GET", "/health", timeout=timeout)

    def post(self, path: str, obj: dict | bytes, timeout: float | None = None, recover: bool = True,
             content_type: str = "application/json") -> dict:
        """POST with one recovery: a lost connection restarts (owned) or waits for (attached) the service."""
        body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
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


# ------------------------------------------------------------------------------------------------------
# One service per process
# ------------------------------------------------------------------------------------------------------

_SHARED: dict[str, VLLMService] = {}
_SHARED_LOCK = threading.Lock()


def shared_service(rollout: Any, start_dir: str | os.PathLike) -> VLLMService:
    """The process's rollout service for the `rollout` config section: attached to `rollout.vllm_url` if set
    ($TANDEM_VLLM_URL overrides it when params are loaded: tandem.config.ENV_OVERRIDES), else started once
    from `start_dir` and stopped at exit; reused by every caller."""
    url = rollout.vllm_url
    key = url or f"{rollout.vllm_python}|{rollout.vllm_host}|{rollout.vllm_dtype}|{rollout.vllm_max_model_len}"
    with _SHARED_LOCK:
        svc = _SHARED.get(key)
        if svc is not None and (svc.proc is None or svc.proc.poll() is None or not svc.owned):
            return svc
        if url:
            svc = VLLMService.attach(url, timeout=rollout.vllm_start_timeout)
        else:
            svc = VLLMService.start(start_dir, start_dir, python=rollout.vllm_python, host=rollout.vllm_host,
                                    port=rollout.vllm_port, dtype=rollout.vllm_dtype,
                                    max_model_len=rollout.vllm_max_model_len, gpu_memory=rollout.vllm_gpu_memory,
                                    enforce_eager=rollout.vllm_enforce_eager,
                                    cpu_kv_cache_gb=rollout.vllm_cpu_kv_cache_gb,
                                    start_timeout=rollout.vllm_start_timeout)
            atexit.register(svc.stop)
        _SHARED[key] = svc
        return svc


def stop_shared_services() -> None:
    with _SHARED_LOCK:
        for svc in _SHARED.values():
            svc.stop()
        _SHARED.clear()


# ------------------------------------------------------------------------------------------------------
# The engine-shaped client
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


def _transfer_root() -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="tandem-vllm-sync-", dir=base))


class VLLMEngine:
    """Tandem rollouts through the vLLM rollout service, with `TandemEngine.generate`'s signature and output.

    `senior`/`junior`: model directories, or modules (a module's `name_or_path` directory is used unless
    `live=True`, in which case its current weights are pushed now and by every `push_weights()`).
    `transport`: `file` (a shared transfer directory), `http` (bytes posted to the service), `auto` (file for
    a service on this machine, http otherwise).
    """

    def __init__(self, senior: Any, junior: Any | None, tokenizer: Any, service: VLLMService, *,
                 junior_tokenizer: Any | None = None, eos_token_ids: Sequence[int] | None = None,
                 live: bool = False, transport: str = "auto", request_timeout: float | None = None):
        from tandem.rollout.engine import collect_eos_ids
        from tandem.rollout.vocab import build_tables, check_vocab_compatible

        if transport not in ("auto", "file", "http"):
            raise ValueError(f"transport must be auto, file or http, got {transport!r}")
        if isinstance(tokenizer, (tuple, list)):
            tokenizer, junior_tokenizer = tokenizer
        self.service, self.senior, self.junior, self.tokenizer = service, senior, junior, tokenizer
        self.backend = "vllm"
        self.vocab_size = check_vocab_compatible(senior, junior, tokenizer, junior_tokenizer)
        self.tables = build_tables(tokenizer, self.vocab_size)
        self.eos_ids = list(eos_token_ids) if eos_token_ids is not None else collect_eos_ids(tokenizer, senior,
                                                                                              junior)
        self.transport = ("file" if _is_local(service.url) else "http") if transport == "auto" else transport
        self.request_timeout = request_timeout
        self.live = bool(live)
        self._tables_msg = self._tables_payload()
        self.junior_spec = _dir_spec(_model_dir(junior)) if junior is not None else None
        self.senior_spec: dict | None = None
        self._transfer: Path | None = None
        self.version = 0
        self.last_stats: dict = {}
        self.totals = {"decoded": 0, "kept": 0, "turns": 0, "rounds": 0, "seconds": 0.0}
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

    def _send_weights(self) -> None:
        """Make the service hold the current live weights (re-upload for the http transport)."""
        spec = self.senior_spec
        assert spec is not None
        if self.transport == "http":
            self.service.post(f"/upload?tag={spec['tag']}", Path(spec["path"]).read_bytes(),
                              content_type="application/octet-stream")
            self.service.post("/weights", {"role": "senior", "tag": spec["tag"]})
        else:
            self.service.post("/weights", {"role": "senior", **spec})

    def push_weights(self, module: Any | None = None) -> dict:
        """Hand the live senior's current weights to the service (reloaded in place, prefix cache reset)."""
        import torch
        from safetensors.torch import save_file

        model = module if module is not None else self.senior
        if self._transfer is None:
            self._transfer = _transfer_root()
            atexit.register(shutil.rmtree, self._transfer, True)
        t0 = time.perf_counter()
        self.version += 1
        path = self._transfer / f"senior-{self.version}.safetensors"
        with torch.no_grad():
            sd = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        # tied embeddings: one tensor under two names is refused by safetensors; the engine re-ties them
        if "lm_head.weight" in sd and "model.embed_tokens.weight" in sd and \
                sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr():
            del sd["lm_head.weight"]
        save_file(sd, str(path))
        old = self.senior_spec
        tag = f"{self._tag_base}:{self.version}"
        self.senior_spec = {"tag": tag, "file": str(path)} if self.transport == "file" else {"tag": tag,
                                                                                                "path": str(path)}
        self._send_weights()
        if old and old.get("file", old.get("path")) and old.get("file", old.get("path")) != str(path):
            Path(old.get("file", old.get("path"))).unlink(missing_ok=True)
        return {"tag": tag, "seconds": time.perf_counter() - t0}

    def _senior_request_spec(self) -> dict | None:
        spec = self.senior_spec
        if spec is None:
            return None
        return {"tag": spec["tag"]} if self.transport == "http" else spec

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
                    self._send_weights()
        raise AssertionError("unreachable")

    # -- the engine API ------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], schedule: str, sampling: SamplingParams, seed: int,
                 p_senior: float = 0.5, max_gap_tokens: int = 32, max_rounds: int = 150,
                 row_ids: Sequence[int] | None = None, batch_size: int | None = None,
                 progress: bool = False) -> RolloutBatch:
        """Roll out every prompt once (see `TandemEngine.generate`); `batch_size`/`progress` are accepted for
        the same signature: the service batches all rows of a call itself."""
        check_request(schedule, sampling, seed, p_senior, max_gap_tokens, max_rounds, self.junior is not None)
        prompts = [list(map(int, p)) for p in prompt_ids]
        B = len(prompts)
        if B == 0:
            return RolloutBatch([], [], [], [], [])
        rows = list(range(B)) if row_ids is None else [int(r) for r in row_ids]
        if len(rows) != B or min(rows) < 0:
            raise ValueError(f"row_ids must hold {B} ids >= 0")
        for b, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {b} is empty: every prompt needs at least one token")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ValueError(f"prompt {b} holds token ids outside [0, {self.vocab_size})")
        eos = sorted(set(self.eos_ids) | set(sampling.stop_token_ids))
        payload = {"tables": self._tables_msg["key"], "senior": self._senior_request_spec(),
                   "junior": self.junior_spec, "prompts": prompts, "rows": rows, "schedule": schedule,
                   "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                                "max_new_tokens": sampling.max_new_tokens},
                   "seed": int(seed), "eos": eos, "p_senior": p_senior, "max_gap_tokens": max_gap_tokens,
                   "max_rounds": max_rounds}
        t0 = time.perf_counter()
        out = self._call("/generate", payload)
        batch = RolloutBatch(out["completion_ids"], out["owner"], out["senior_logprobs"], out["handoffs"],
                             out["finish_reason"])
        batch.timings = {"seconds": time.perf_counter() - t0, "service_seconds": out["stats"]["seconds"]}
        self.last_stats = out["stats"]
        for k in self.totals:
            self.totals[k] += out["stats"].get(k, 0)
        return batch

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int], role: str = "senior"
              ) -> list[list[float]]:
        """Teacher-forced log-probs (temperature 1) from the service's engine of `role`, positions >= start."""
        weights = self._senior_request_spec() if role == "senior" else self.junior_spec
        return self._call("/score", {"role": role, "weights": weights, "sequences": [list(map(int, s)) for s in
                                                                                       sequences],
                                     "starts": [int(s) for s in starts]})["logprobs"]



def engine_from_config(senior: Any, junior: Any | None, tokenizer: Any, rollout: Any, *, live: bool,
                       eos_token_ids: Sequence[int] | None = None) -> VLLMEngine:
    """The `rollout.backend: vllm` engine: the process's shared service (started from the junior's directory,
    or attached to `rollout.vllm_url`) and a client for these models. `live=True` in training (the senior
    module is trained in place and pushed after each optimizer step, see `vllm_sync.VLLMWeightSync`),
    False in evaluation (the senior is a saved checkpoint directory)."""
    service = shared_service(rollout, _model_dir(junior if junior is not None else senior))
    return VLLMEngine(senior, junior, tokenizer, service, eos_token_ids=eos_token_ids, live=live,
                      transport=rollout.vllm_weight_transport)
