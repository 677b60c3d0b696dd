"""How a pipeline run shows its progress: a live terminal view, Prefect progress artifacts, the stages' output.

The terminal view is one row per task run (state, wall time, work done) under an overall bar, used by
`flows.pipeline` when the run is attached to a terminal (`tandem run`); off under a worker or in tests, where
Prefect's logs and UI are the view. Task bodies call `track(name)`, which is thread-safe (mapped evaluation
units run in worker threads). While the view is live, Prefect's console log handlers print through the view's
console, so log lines scroll above the table instead of tearing it. `artifact` keeps a Prefect progress
artifact moving from a value the work updates (`Counter`) or from saved checkpoints: keyless unless the caller
names a key, so it lives in its task run and leaves the global artifact catalog to what is tracked across runs.
`Milestones` turns the same updates into one log line per finished part (an evaluation unit's benchmarks), so
a long unit's logs fill in while it runs. `stage_output` routes a stage's stdout and stderr into the run's logs;
`quiet_tools` keeps tool progress bars out of them.
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import threading
import time
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from itertools import accumulate, combinations
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

_ICONS = {"pending": "[dim]·[/dim]", "running": "[yellow]…[/yellow]", "done": "[green]✓[/green]",
          "failed": "[red]✗[/red]", "skipped": "[dim]-[/dim]"}


@dataclass
class _Row:
    stage: str
    name: str
    state: str = "pending"
    started: float | None = None
    ended: float | None = None
    peak_rss_mb: float | None = None  # this process's peak resident memory while the task ran (Linux VmHWM)
    percent: float | None = None  # work done while running (evaluation units: generations), when known

    def seconds(self) -> float | None:
        if self.started is None:
            return None
        return (self.ended or time.perf_counter()) - self.started


class ProgressView:
    """Thread-safe registry of task rows; renders with rich when `live` is on, otherwise records only."""

    def __init__(self, title: str, live: bool):
        self.title = title
        self.live_requested = live
        self._rows: dict[str, _Row] = {}
        self._lock = threading.Lock()
        self._live = None
        self._t0 = time.perf_counter()
        self._swapped: list[tuple[logging.Handler, object]] = []

    # -- bookkeeping -----------------------------------------------------------------------------
    def expect(self, stage: str, name: str) -> None:
        with self._lock:
            self._rows.setdefault(name, _Row(stage, name))

    def set_state(self, stage: str, name: str, state: str) -> None:
        with self._lock:
            row = self._rows.setdefault(name, _Row(stage, name))
            now = time.perf_counter()
            if state == "running" and row.started is None:
                row.started = now
            if state in ("done", "failed", "skipped"):
                row.ended = now
            row.state = state
        self.refresh()

    def set_progress(self, name: str, percent: float | None) -> None:
        with self._lock:
            row = self._rows.get(name)
            if row is not None:
                row.percent = percent
        self.refresh()

    @contextmanager
    def track(self, stage: str, name: str) -> Iterator[None]:
        from tasks.common import peak_rss, reset_peak_rss

        # Per-task peak memory: the mark is process-wide, so this is exact when tasks run one at a time (the
        # default, evaluate.workers: 1) and an upper bound for overlapping tasks.
        reset_peak_rss()
        self.set_state(stage, name, "running")
        try:
            yield
        except BaseException:
            self.set_state(stage, name, "failed")
            raise
        finally:
            with self._lock:
                row = self._rows.get(name)
                if row is not None:
                    row.peak_rss_mb = peak_rss()["peak_rss_mb"]
        self.set_state(stage, name, "done")

    def rows(self) -> list[_Row]:
        with self._lock:
            return list(self._rows.values())

    def timings(self) -> dict[str, float]:
        """Task name -> wall seconds, for the run summary."""
        return {r.name: round(r.seconds(), 3) for r in self.rows() if r.seconds() is not None}

    def peak_memory(self) -> dict[str, float]:
        """Task name -> peak resident memory in MB while it ran, for the run summary."""
        return {r.name: r.peak_rss_mb for r in self.rows() if r.peak_rss_mb is not None}

    # -- rendering -------------------------------------------------------------------------------
    def _render(self):
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        rows = self.rows()
        done = sum(r.state in ("done", "skipped") for r in rows)
        table = Table(title=f"{self.title}  ({time.perf_counter() - self._t0:.0f}s)", title_justify="left",
                      show_edge=False, pad_edge=False, expand=False)
        table.add_column("")
        table.add_column("stage")
        table.add_column("task")
        table.add_column("time", justify="right")
        table.add_column("done", justify="right")
        for r in rows:
            s = r.seconds()
            pct = f"{r.percent:.0f}%" if r.state == "running" and r.percent is not None else ""
            table.add_row(_ICONS.get(r.state, r.state), r.stage, r.name, "" if s is None else f"{s:.1f}s", pct)
        bar = ProgressBar(total=max(len(rows), 1), completed=done, width=40)
        return Group(table, bar)

    def refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._render())

    def __enter__(self) -> "ProgressView":
        if self.live_requested:
            from rich.console import Console
            from rich.live import Live

            console = Console(file=sys.stderr)
            self._live = Live(self._render(), console=console, refresh_per_second=2, transient=False,
                              get_renderable=self._render)
            self._live.start()
            # Prefect's console handlers hold their own rich Console; print through the live one instead.
            loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                               if isinstance(lg, logging.Logger)]
            for h in {h for lg in loggers for h in lg.handlers}:
                if hasattr(h, "console"):
                    self._swapped.append((h, h.console))
                    h.console = console
        return self

    def __exit__(self, *exc) -> None:
        for h, old in self._swapped:
            h.console = old
        self._swapped.clear()
        if self._live is not None:
            self._live.update(self._render())
            self._live.stop()
            self._live = None


_CURRENT: ProgressView | None = None


def current() -> ProgressView:
    """The view of the running pipeline (a silent one outside a run, so task bodies never need a check)."""
    return _CURRENT if _CURRENT is not None else ProgressView("tandem", live=False)


@contextmanager
def activate(view: ProgressView) -> Iterator[ProgressView]:
    global _CURRENT
    prev, _CURRENT = _CURRENT, view
    try:
        with view:
            yield view
    finally:
        _CURRENT = prev


# --------------------------------------------------------------------------------------------------
# Progress artifacts in the Prefect UI
# --------------------------------------------------------------------------------------------------

POLL_SECONDS = 5.0  # how often a progress artifact reads its value (the API sees at most one update per tick)


def _saved_steps(arm_dir: Path) -> int:
    """The highest `step-<N>` checkpoint directory under `arm_dir` (0 when none)."""
    steps = [int(p.name[5:]) for p in arm_dir.glob("step-*") if p.name[5:].isdigit()] if arm_dir.is_dir() else []
    return max(steps, default=0)


def checkpoint_share(watch_dir: Path, total: int) -> Callable[[], float]:
    """Percent of `total` steps already saved as `step-<N>` checkpoints under `watch_dir`: a long training arm
    shows how far it is without hooks in its loop."""
    return lambda: min(100.0, 100.0 * _saved_steps(watch_dir) / total)


class Counter:
    """Work done out of a total, fed from a worker (`update(done, total)`), read by a progress artifact and the
    terminal view (`percent()`)."""

    def __init__(self, view: "ProgressView | None" = None, name: str = ""):
        self.done, self.total = 0, 0
        self._view, self._name = view, name

    def update(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        if self._view is not None:
            self._view.set_progress(self._name, self.percent())

    def percent(self) -> float | None:
        return 100.0 * self.done / self.total if self.total else None


class Passed(NamedTuple):
    """A part of the work that has just finished: its name (None when the sizes cannot tell which part it is),
    its place among the parts this run computes, its size, the seconds since the previous part (or the start),
    and how many parts were done before the work started (found in a cache)."""

    name: str | None
    index: int
    count: int
    size: int
    seconds: float
    done_before: int


class Milestones:
    """Announces each part of a piece of work as it finishes, from the `update(done, total)` calls a `Counter`
    hears (so the work needs no hook of its own): `sizes` are the parts in the order the work does them (an
    evaluation unit's benchmarks, rows x samples generations each).

    The first update tells how much was done before any work (parts found in a cache): the parts left are those
    whose sizes add up to the rest. When more than one set of parts adds up to it (equal sizes), a part is
    announced by its place only; when the sizes do not add up to the total, or the sets disagree on where the
    parts end, nothing is announced: a wrong name is worse than none."""

    MAX_PARTS = 16  # beyond this, a partly cached piece of work is not searched for its parts (2^16 sets)

    def __init__(self, sizes: dict[str, int], announce: Callable[[Passed], None]):
        self._sizes = [(str(n), int(s)) for n, s in sizes.items() if s and s > 0]
        self._announce = announce
        self._parts: list[tuple[str | None, int, int]] | None = None  # (name, size, done count at its end)
        self._next = 0
        self._t = 0.0
        self._lock = threading.Lock()

    def _plan(self, start: int, total: int) -> list[tuple[str | None, int, int]]:
        sizes = [s for _, s in self._sizes]
        if not sizes or sum(sizes) != total or start >= total:
            return []
        if start <= 0:
            choices = [tuple(range(len(sizes)))]
        elif len(sizes) > self.MAX_PARTS:
            return []
        else:
            choices = [c for r in range(1, len(sizes) + 1) for c in combinations(range(len(sizes)), r)
                       if sum(sizes[i] for i in c) == total - start]
        ends = {tuple(accumulate(sizes[i] for i in c)) for c in choices}
        if len(ends) != 1:
            return []
        named = len(choices) == 1
        return [(self._sizes[i][0] if named else None, sizes[i], start + end)
                for i, end in zip(choices[0], next(iter(ends)))]

    def update(self, done: int, total: int) -> None:
        passed = []
        with self._lock:
            now = time.perf_counter()
            if self._parts is None:
                self._parts, self._t = self._plan(done, total), now
            before = len(self._sizes) - len(self._parts)
            while self._next < len(self._parts) and done >= self._parts[self._next][2]:
                name, size, _ = self._parts[self._next]
                self._next += 1
                passed.append(Passed(name, self._next, len(self._parts), size, now - self._t, before))
                self._t = now
        for p in passed:
            try:
                self._announce(p)
            except Exception as e:  # noqa: BLE001 - a log line is a view: never fail the work for it
                logging.getLogger("flows.progress").debug("milestone not announced: %s", e)


@contextmanager
def artifact(key: str | None, description: str, value: Callable[[], float | None] | None = None,
             every: float | None = None) -> Iterator[None]:
    """A Prefect progress artifact for the enclosed work: 0 % at the start, 100 % at the end, and in between
    `value()` (a percentage, None = unknown yet), read every `every` seconds (POLL_SECONDS) by a watcher thread,
    so the work itself never waits on the API. `key` None (the pipeline's choice) makes it keyless: it belongs
    to the task run that created it and stays out of the global artifact catalog, which keeps one entry per key
    across all runs."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    log = logging.getLogger("flows.progress")
    try:
        art_id = create_progress_artifact(progress=0.0, key=key, description=description)
    except Exception as e:  # the UI is a view: never fail the work for it
        log.warning("progress artifact %s not created: %s", key or description, e)
        yield
        return
    stop = threading.Event()

    def poll() -> None:
        last = 0.0
        while not stop.wait(POLL_SECONDS if every is None else every):
            pct = value()
            if pct is None or pct == last:
                continue
            try:
                update_progress_artifact(artifact_id=art_id, progress=round(min(100.0, pct), 1))
                last = pct
            except Exception as e:  # noqa: BLE001 - transient API trouble: try again next tick
                log.debug("progress update failed: %s", e)

    watcher = None
    if value is not None:
        watcher = threading.Thread(target=poll, name=f"progress-{key or art_id}", daemon=True)
        watcher.start()
    try:
        yield
    finally:
        stop.set()
        if watcher is not None:
            watcher.join(timeout=30)
    update_progress_artifact(artifact_id=art_id, progress=100.0)


# --------------------------------------------------------------------------------------------------
# Stage output into the run's logs
# --------------------------------------------------------------------------------------------------

class _LogStream(io.TextIOBase):
    """A text stream that sends each complete line to `logger` (a carriage-return progress bar as its final
    state only). Writes made while it is already logging go to `fallback`, so a log handler that writes to
    the current sys.stderr cannot loop back into it."""

    def __init__(self, logger: logging.Logger, level: int | Callable[[str], int], fallback):
        self._logger, self._fallback = logger, fallback
        self._level = level if callable(level) else (lambda _line, lv=level: lv)
        self._buf = ""
        self._busy = threading.local()

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if getattr(self._busy, "on", False):
            return self._fallback.write(s)
        self._buf += s
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            self._emit(line.rsplit("\r", 1)[-1])
        return len(s)

    def flush(self) -> None:
        pass

    def close_line(self) -> None:
        if self._buf.strip():
            self._emit(self._buf.rsplit("\r", 1)[-1])
        self._buf = ""

    def _emit(self, line: str) -> None:
        if not line.strip():
            return
        self._busy.on = True
        try:
            self._logger.log(self._level(line), line.rstrip())
        finally:
            self._busy.on = False


def quiet_tools() -> None:
    """Tool chatter stays out of the run's logs: transformers' and the Hub's progress bars ("Loading weights
    100%" per model load) are off for the run (HF_HUB_DISABLE_PROGRESS_BARS, read when transformers is imported,
    and transformers' own switch when it already is). The stages report their own progress."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


_ALARM = re.compile(r"warn|error\b|exception|traceback|\bfailed\b|fatal", re.IGNORECASE)


def stderr_level(line: str) -> int:
    """A stage's stderr carries progress bars and notes as well as warnings: WARNING only for a line that says
    it is one (warning, error, traceback, failed, ...), INFO otherwise, so the UI's warnings mean something."""
    return logging.WARNING if _ALARM.search(line) else logging.INFO


@contextmanager
def stage_output(logger) -> Iterator[None]:
    """Route what a stage writes to stdout and stderr (its summaries, validation reports, warnings) into the
    run's logs for the duration of the stage.

    Used instead of Prefect's `log_prints` for whole stages: `log_prints` patches `print` itself, so a print
    to a redirected `sys.stdout` (dill's globals detection captures `dis` output that way while `datasets`
    hashes a training set) is logged instead of reaching the redirect. Redirecting the streams leaves
    `print` alone. Stages run one at a time, so swapping the process-wide streams is safe here."""
    out = _LogStream(logger, logging.INFO, sys.__stdout__ or sys.stdout)
    err = _LogStream(logger, stderr_level, sys.__stderr__ or sys.stderr)
    with redirect_stdout(out), redirect_stderr(err):
        try:
            yield
        finally:
            out.close_line()
            err.close_line()
