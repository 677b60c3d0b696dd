"""The time-limited worker pool behind `tandem.rewards.score_many` / `parses_many`: math-verify in worker processes.

math-verify's own timeouts rely on `signal.alarm`, which fails outside the main thread, so the limit is enforced
here instead: every job runs in a worker process that is killed and replaced when it overruns or crashes
(`pool_restarts` counts them). One shared pool per process (`pool_run`), serialised by a lock, stopped at
interpreter exit or by `shutdown_pool`. The jobs are a module's `run_job(kind, args)` and `warm_up()`, named by
the caller (`tandem.rewards` names itself), so this module imports none of its callers.
"""

from __future__ import annotations

import atexit
import importlib
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as _wait_any
from pathlib import Path
from typing import Any, Sequence

_PKG_ROOT = str(Path(__file__).resolve().parents[1])  # so a worker imports this very copy of tandem


def _worker_main(read_fd: int, write_fd: int, jobs: str) -> None:
    """Worker loop: warm up the `jobs` module, say ready, then answer (index, kind, args) jobs until None."""
    conn_in, conn_out = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    mod = importlib.import_module(jobs)
    run_job, warm_up = mod.run_job, mod.warm_up

    try:
        warm_up()
        conn_out.send("ready")
        while True:
            msg = conn_in.recv()
            if msg is None:
                break
            idx, kind, args = msg
            try:
                out = run_job(kind, args)
            except Exception:
                out = None
            conn_out.send((idx, out))
    except (EOFError, OSError, KeyboardInterrupt):
        pass


class _Worker:
    """One worker: a fresh interpreter running `_worker_main`, talking over two pipes.

    A plain subprocess rather than multiprocessing's spawn/forkserver: those re-import the parent's
    `__main__`, which breaks (or recurses) when the caller is a script without a main guard. Forking a
    process that holds threads (torch, Prefect) is unsafe, so fork is out too.
    """

    def __init__(self, jobs: str) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_ROOT, env.get("PYTHONPATH", "")) if p)
        code = f"from tandem.score_pool import _worker_main; _worker_main({to_child_r}, {from_child_w}, {jobs!r})"
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code], pass_fds=(to_child_r, from_child_w), env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.send_conn = Connection(to_child_w, readable=False)
        self.conn = Connection(from_child_r, writable=False)
        self.ready = False
        self.job: int | None = None
        self.deadline = 0.0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _close_pipes(self) -> None:
        for c in (self.send_conn, self.conn):
            try:
                c.close()
            except OSError:
                pass

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._close_pipes()

    def stop(self) -> None:
        try:
            self.send_conn.send(None)
            self.proc.wait(timeout=2)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        self.kill()


class ScorePool:
    """Worker processes running math-verify; `run` bounds every job by a timeout (then it gets the default).

    Not thread-safe by itself: the module-level functions serialise calls through a lock.
    """

    def __init__(self, jobs: str, workers: int = 2, startup_timeout: float = 120.0):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.jobs = jobs  # the module whose run_job / warm_up the workers call
        self.n_workers = workers
        self.startup_timeout = startup_timeout
        self._workers: list[_Worker] = []
        self.restarts = 0  # workers replaced after a timeout or a crash

    def _ensure_workers(self) -> None:
        for w in [w for w in self._workers if not w.alive()]:
            w.kill()
            self._workers.remove(w)
        while len(self._workers) < self.n_workers:
            self._workers.append(_Worker(self.jobs))

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers.remove(w)
        self._workers.append(_Worker(self.jobs))
        self.restarts += 1

    def run(self, jobs: Sequence[tuple[str, tuple]], timeout: float, default: Any) -> list[Any]:
        """Results of `jobs` ((kind, args) pairs) in order; a job past `timeout` s or crashing gives `default`."""
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        results: list[Any] = [default] * len(jobs)
        if not jobs:
            return results
        self._ensure_workers()
        todo = list(range(len(jobs)))[::-1]
        done = 0
        started = time.monotonic()
        while done < len(jobs):
            now = time.monotonic()
            for w in list(self._workers):
                if w.ready and w.job is None and todo:
                    idx = todo.pop()
                    try:
                        w.send_conn.send((idx, *jobs[idx]))
                    except (OSError, ValueError):
                        todo.append(idx)  # the worker died while idle: retry the job on its replacement
                        self._replace(w)
                        continue
                    w.job, w.deadline = idx, now + timeout
            busy = [w for w in self._workers if w.job is not None]
            starting = [w for w in self._workers if not w.ready]
            if not busy and now - started > self.startup_timeout:
                raise RuntimeError(f"reward workers did not start within {self.startup_timeout:.0f} s")
            wait_s = min((w.deadline for w in busy), default=now + 0.5) - now
            ready = set(_wait_any([w.conn for w in busy + starting], timeout=max(0.0, wait_s)))
            now = time.monotonic()
            for w in list(self._workers):
                if w.conn in ready:
                    try:
                        msg, died = w.conn.recv(), False
                    except (EOFError, OSError):
                        msg, died = None, True
                    if died and not w.ready:
                        self.close()
                        raise RuntimeError("a reward worker exited during startup (its error is on stderr): "
                                           f"exit code {w.proc.wait()}")
                    if died:  # segfault, OOM kill: its job keeps the default
                        if w.job is not None:
                            w.job = None
                            done += 1
                        self._replace(w)
                    elif msg == "ready":
                        w.ready = True
                    else:
                        idx, out = msg
                        if out is not None:
                            results[idx] = out
                        w.job = None
                        done += 1
                elif w.job is not None and now >= w.deadline:
                    w.job = None
                    done += 1
                    self._replace(w)
        return results

    def close(self) -> None:
        for w in self._workers:
            if w.job is None and w.ready:
                w.stop()
            else:
                w.kill()
        self._workers = []


_POOL: ScorePool | None = None
_POOL_LOCK = threading.Lock()


def pool_run(module: str, jobs: list[tuple[str, tuple]], timeout: float, workers: int, default: Any) -> list[Any]:
    """`ScorePool.run` on the shared pool of `workers` processes running `module`'s jobs."""
    global _POOL
    if not jobs:
        return []
    with _POOL_LOCK:
        if _POOL is None or (_POOL.n_workers, _POOL.jobs) != (workers, module):
            if _POOL is not None:
                _POOL.close()
            _POOL = ScorePool(module, workers)
        return _POOL.run(jobs, timeout, default)


def shutdown_pool() -> None:
    """Stop the shared worker processes (they restart on the next call). Also run at interpreter exit."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close()
            _POOL = None


atexit.register(shutdown_pool)


def pool_restarts() -> int:
    """Workers replaced so far in the shared pool after a timeout or crash (0 when no pool runs)."""
    return _POOL.restarts if _POOL is not None else 0
