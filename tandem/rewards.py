"""Verifiable math reward: the last `\\boxed{}` answer of a completion checked against gold with math-verify.

`score` is the plain in-process check (no time limit). `score_many` and `parses_many` are the safe forms for
pipelines: callable from any thread, every sample bounded by a time limit. math-verify's own timeouts rely on
`signal.alarm`, which fails outside the main thread, so they are switched off (`parsing_timeout=None`,
`timeout_seconds=None`) and the limit is enforced here by running math-verify in worker processes that are
killed and replaced when a sample overruns or crashes. Plain integers (the common case on synthetic data)
skip math-verify altogether; that fast path gives exactly math-verify's verdict (tested).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import subprocess
import sys
import threading
import time
from functools import lru_cache
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as _wait_any
from pathlib import Path
from typing import Any, Sequence

__all__ = ["extract_boxed", "score", "parses", "score_many", "parses_many", "shutdown_pool", "pool_restarts"]

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# Plain integers are compared exactly by math-verify (sympy Integers), so int() equality is its verdict.
_INT_RE = re.compile(r"-?[0-9]{1,18}")
_PKG_ROOT = str(Path(__file__).resolve().parents[1])  # so a worker imports this very copy of tandem


# --------------------------------------------------------------------------------------------------
# Extraction and the in-process check
# --------------------------------------------------------------------------------------------------

def _box_end(text: str, start: int, stop: int) -> int | None:
    """Index of the `}` closing the brace opened just before `start` (searching up to `stop`), or None.

    A backslash escapes the next character, so `\\{` and `\\}` (literal braces in sets) do not count.
    """
    depth, i = 1, start
    while i < stop:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """Contents of the last closed `\\boxed{...}` (or `\\fbox{...}`) in `text`, stripped; None if there is none.

    Braces are matched, so nested braces stay inside. A box left open (a completion cut at the token
    budget) is not an answer and is skipped; with nested boxes the innermost, which starts last, wins.
    """
    if not isinstance(text, str):
        return None
    stop = len(text)
    for m in reversed(list(_BOX_RE.finditer(text))):
        end = _box_end(text, m.end(), stop)
        if end is not None:
            return text[m.end():end].strip()
        # a box that never closes keeps every earlier box open past its start, so earlier boxes can only
        # close before it: bounding their scans there keeps extraction linear in the text length
        stop = m.start()
    return None


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its timeouts are off; here they are off on purpose (see module doc)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_MV: Any = None


def _math_verify() -> Any:
    """Import math-verify on first use (it pulls in sympy) and silence its timeouts-off warning."""
    global _MV
    if _MV is None:
        import math_verify

        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
        _MV = math_verify
    return _MV


def _as_int(text: str) -> int | None:
    text = text.strip()
    return int(text) if _INT_RE.fullmatch(text) else None


@lru_cache(maxsize=4096)
def _parse(answer: str) -> tuple:
    """math-verify's parse of a bare answer (as inline math), cached: golds repeat across a group."""
    mv = _math_verify()
    try:
        return tuple(mv.parse(f"${answer}$", parsing_timeout=None))
    except Exception:
        return ()


def _verify(answer: str, gold: str) -> float:
    gold_p, pred_p = _parse(gold), _parse(answer)
    if not gold_p or not pred_p:
        return 0.0
    try:
        return float(bool(_math_verify().verify(list(gold_p), list(pred_p), timeout_seconds=None)))
    except Exception:
        return 0.0


def _fast_score(answer: str, gold: str) -> float | None:
    a, g = _as_int(answer), _as_int(gold)
    if a is None or g is None:
        return None
    return float(a == g)


def score(completion: str, gold: str) -> float:
    """1.0 if the completion's last boxed answer equals `gold` under math-verify, else 0.0. No time limit."""
    answer = extract_boxed(completion)
    if answer is None or not isinstance(gold, str):
        return 0.0
    fast = _fast_score(answer, gold)
    return fast if fast is not None else _verify(answer, gold)


def _parses_to_math(answer: str) -> bool:
    # math-verify falls back to the raw string when it cannot build an expression (`\frac{` -> ['\frac{']);
    # only a sympy object means it understood the answer
    from sympy import Basic, MatrixBase

    return any(isinstance(x, (Basic, MatrixBase)) for x in _parse(answer))


def parses(answer: str) -> bool:
    """Whether math-verify turns `answer` (read as `$answer$`) into a math object, not just a string. No time limit."""
    if not isinstance(answer, str) or not answer.strip():
        return False
    return _as_int(answer) is not None or _parses_to_math(answer)


# --------------------------------------------------------------------------------------------------
# Time-limited worker pool
# --------------------------------------------------------------------------------------------------

def _run_job(kind: str, args: tuple) -> Any:
    if kind == "score":
        return _verify(*args)
    if kind == "parse":
        return _parses_to_math(args[0])
    raise ValueError(f"unknown job kind {kind!r}")


def _worker_main(read_fd: int, write_fd: int) -> None:
    """Worker loop: warm up math-verify, say ready, then answer (index, kind, args) jobs until None."""
    conn_in, conn_out = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    try:
        _verify("1", "1")
        conn_out.send("ready")
        while True:
            msg = conn_in.recv()
            if msg is None:
                break
            idx, kind, args = msg
            try:
                out = _run_job(kind, args)
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

    def __init__(self) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_ROOT, env.get("PYTHONPATH", "")) if p)
        code = f"from tandem.rewards import _worker_main; _worker_main({to_child_r}, {from_child_w})"
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

    def __init__(self, workers: int = 2, startup_timeout: float = 120.0):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.n_workers = workers
        self.startup_timeout = startup_timeout
        self._workers: list[_Worker] = []
        self.restarts = 0  # workers replaced after a timeout or a crash

    def _ensure_workers(self) -> None:
        for w in [w for w in self._workers if not w.alive()]:
            w.kill()
            self._workers.remove(w)
        while len(self._workers) < self.n_workers:
            self._workers.append(_Worker())

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers.remove(w)
        self._workers.append(_Worker())
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


def _pool_run(jobs: list[tuple[str, tuple]], timeout: float, workers: int, default: Any) -> list[Any]:
    global _POOL
    if not jobs:
        return []
    with _POOL_LOCK:
        if _POOL is None or _POOL.n_workers != workers:
            if _POOL is not None:
                _POOL.close()
            _POOL = ScorePool(workers)
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


def _check_limits(timeout: float, workers: int) -> None:
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")


def score_many(completions: Sequence[str], golds: Sequence[str], timeout: float = 5.0,
               workers: int = 2) -> list[float]:
    """`score` for each (completion, gold) pair, safe from any thread; a sample past `timeout` s scores 0.

    Extraction and plain-integer answers are handled in-process; only the rest reach the worker pool.
    """
    if len(completions) != len(golds):
        raise ValueError(f"score_many: {len(completions)} completions but {len(golds)} golds")
    _check_limits(timeout, workers)
    out: list[float] = [0.0] * len(completions)
    jobs: list[tuple[str, tuple]] = []
    where: list[int] = []
    for i, (comp, gold) in enumerate(zip(completions, golds)):
        answer = extract_boxed(comp)
        if answer is None or not isinstance(gold, str):
            continue
        fast = _fast_score(answer, gold)
        if fast is not None:
            out[i] = fast
        else:
            jobs.append(("score", (answer, gold)))
            where.append(i)
    for i, r in zip(where, _pool_run(jobs, timeout, workers, 0.0)):
        out[i] = float(r)
    return out


def parses_many(answers: Sequence[Any], timeout: float = 5.0, workers: int = 2) -> list[bool]:
    """`parses` for each answer, safe from any thread; an answer past `timeout` s counts as unparseable."""
    _check_limits(timeout, workers)
    out = [False] * len(answers)
    jobs: list[tuple[str, tuple]] = []
    where: list[int] = []
    for i, a in enumerate(answers):
        if not isinstance(a, str) or not a.strip():
            continue
        if _as_int(a) is not None:
            out[i] = True
        else:
            jobs.append(("parse", (a,)))
            where.append(i)
    for i, r in zip(where, _pool_run(jobs, timeout, workers, False)):
        out[i] = bool(r)
    return out
