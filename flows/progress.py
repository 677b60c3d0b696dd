"""A live terminal view of a pipeline run: one row per task run (state, wall time) under an overall bar.

Used by `flows.pipeline` when the run is attached to a terminal (`tandem run`); off under a worker or in
tests, where Prefect's logs and UI are the view. Task bodies call `track(name)`, which is thread-safe
(mapped evaluation units run in worker threads). While the view is live, Prefect's console log handlers
print through the view's console, so log lines scroll above the table instead of tearing it.
"""

from __future__ import annotations

import io
import logging
import re
import sys
import threading
import time
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

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
        for r in rows:
            s = r.seconds()
            table.add_row(_ICONS.get(r.state, r.state), r.stage, r.name, "" if s is None else f"{s:.1f}s")
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

def _saved_steps(arm_dir: Path) -> int:
    """The highest `step-<N>` checkpoint directory under `arm_dir` (0 when none)."""
    steps = [int(p.name[5:]) for p in arm_dir.glob("step-*") if p.name[5:].isdigit()] if arm_dir.is_dir() else []
    return max(steps, default=0)


@contextmanager
def artifact(key: str, description: str, watch_dir: Path | None = None, total: int | None = None,
             every: float = 5.0) -> Iterator[None]:
    """A Prefect progress artifact for the enclosed work: 0 % at the start, 100 % at the end, and in between
    (when `watch_dir` and `total` are given) the share of `total` steps already saved as `step-<N>` checkpoints,
    polled every `every` seconds, so a long training arm shows how far it is without hooks in its loop."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    log = logging.getLogger("flows.progress")
    try:
        art_id = create_progress_artifact(progress=0.0, key=key, description=description)
    except Exception as e:  # the UI is a view: never fail the work for it
        log.warning("progress artifact %s not created: %s", key, e)
        yield
        return
    stop = threading.Event()

    def poll() -> None:
        last = -1.0
        while not stop.wait(every):
            pct = min(100.0, 100.0 * _saved_steps(watch_dir) / total)
            if pct != last:
                try:
                    update_progress_artifact(artifact_id=art_id, progress=pct)
                    last = pct
                except Exception as e:  # noqa: BLE001 - transient API trouble: try again next tick
                    log.debug("progress update failed: %s", e)

    watcher = None
    if watch_dir is not None and total:
        watcher = threading.Thread(target=poll, name=f"progress-{key}", daemon=True)
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
