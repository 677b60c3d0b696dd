"""Verifiable math reward: the last `\\boxed{}` answer of a completion checked against gold with math-verify.

`score` is the plain in-process check (no time limit). `score_many` and `parses_many` are the safe forms for
pipelines: callable from any thread, every sample bounded by a time limit. math-verify's own timeouts rely on
`signal.alarm`, which fails outside the main thread, so they are switched off (`parsing_timeout=None`,
`timeout_seconds=None`) and the limit is enforced by running math-verify in worker processes that are
killed and replaced when a sample overruns or crashes (the pool is `tandem/score_pool.py`; its jobs are
defined here). Plain integers (the common case on synthetic data) skip math-verify altogether; that fast path
gives exactly math-verify's verdict (tested).
"""

from __future__ import annotations

import logging
import re
from functools import lru_cache
from typing import Any, Sequence

from tandem.score_pool import pool_run

__all__ = ["extract_boxed", "score", "parses", "score_many", "parses_many"]

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# Plain integers are compared exactly by math-verify (sympy Integers), so int() equality is its verdict.
_INT_RE = re.compile(r"-?[0-9]{1,18}")


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
# Jobs of the worker pool (tandem/score_pool.py runs them in its processes)
# --------------------------------------------------------------------------------------------------

def run_job(kind: str, args: tuple) -> Any:
    if kind == "score":
        return _verify(*args)
    if kind == "parse":
        return _parses_to_math(args[0])
    raise ValueError(f"unknown job kind {kind!r}")


def warm_up() -> None:
    """Load math-verify once, so that a worker's first job does not pay the import inside its time limit."""
    _verify("1", "1")


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
    for i, r in zip(where, pool_run(__name__, jobs, timeout, workers, 0.0)):
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
    for i, r in zip(where, pool_run(__name__, jobs, timeout, workers, False)):
        out[i] = bool(r)
    return out
