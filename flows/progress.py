"""A live terminal view of a pipeline run: one row per task run (state, wall time) under an overall bar.

Used by `flows.pipeline` when the run is attached to a terminal (`tandem run`); off under a worker or in
tests, where Prefect's logs and UI are the view. Task bodies call `track(name)`, which is thread-safe
(mapped evaluation units run in worker threads). While the view is live, Prefect's console log handlers
print through the view's console, so log lines scroll above the table instead of tearing it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

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
        # default, TANDEM_EVAL_WORKERS=1) and an upper bound for overlapping tasks.
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
