"""The terminal progress view: task states and timings, thread safety, rendering, console hand-over."""

from __future__ import annotations

import io
import logging
import threading

import pytest
from rich.console import Console

from flows import progress


def _text(view: progress.ProgressView) -> str:
    buf = io.StringIO()
    Console(file=buf, width=120, force_terminal=False).print(view._render())
    return buf.getvalue()


def test_states_and_timings():
    view = progress.ProgressView("t", live=False)
    view.expect("evaluate", "unit-a")
    view.expect("evaluate", "unit-b")
    with view.track("evaluate", "unit-a"):
        pass
    with pytest.raises(RuntimeError):
        with view.track("evaluate", "unit-b"):
            raise RuntimeError("boom")
    view.set_state("train", "train-x", "skipped")
    states = {r.name: r.state for r in view.rows()}
    assert states == {"unit-a": "done", "unit-b": "failed", "train-x": "skipped"}
    assert set(view.timings()) == {"unit-a", "unit-b"} and all(v >= 0 for v in view.timings().values())
    text = _text(view)
    assert "unit-a" in text and "unit-b" in text and "train-x" in text


def test_concurrent_tracking_loses_nothing():
    view = progress.ProgressView("t", live=False)

    def work(i: int) -> None:
        with view.track("evaluate", f"u{i}"):
            pass

    threads = [threading.Thread(target=work, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.name for r in view.rows() if r.state == "done") == sorted(f"u{i}" for i in range(32))


def test_current_outside_a_run_is_a_silent_view():
    assert progress.current().live_requested is False
    view = progress.ProgressView("t", live=False)
    with progress.activate(view):
        assert progress.current() is view
    assert progress.current() is not view


class _ConsoleHandler(logging.Handler):
    def __init__(self):
        super().__init__()
        self.console = Console(file=io.StringIO())

    def emit(self, record):
        self.console.print(record.getMessage())


def test_live_view_borrows_and_returns_log_consoles():
    handler = _ConsoleHandler()
    original = handler.console
    logger = logging.getLogger("tandem-test-progress")
    logger.addHandler(handler)
    try:
        view = progress.ProgressView("t", live=True)
        with progress.activate(view):
            assert handler.console is not original  # log lines go through the live display's console
            with view.track("prepare", "prepare"):
                logger.warning("inside")
        assert handler.console is original
    finally:
        logger.removeHandler(handler)


def test_stage_output_logs_lines_and_leaves_inner_redirects_alone():
    import contextlib
    import io
    import logging
    import sys

    from flows.progress import stage_output

    records: list[tuple[int, str]] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append((record.levelno, record.getMessage()))

    logger = logging.getLogger("test.stage_output")
    logger.propagate = False
    logger.addHandler(Grab())
    logger.setLevel(logging.DEBUG)
    with stage_output(logger):
        print("base: corpus 200 problems")
        print("validation failed on row 3", file=sys.stderr)
        sys.stderr.write("10%\r50%\r100%\n")
        print("UserWarning: something odd", file=sys.stderr)
        inner = io.StringIO()
        with contextlib.redirect_stdout(inner):  # what dill does to read `dis` output
            print("LOAD_GLOBAL pa")
        print("no newline at the end", end="")
    assert inner.getvalue() == "LOAD_GLOBAL pa\n"
    assert records == [(logging.INFO, "base: corpus 200 problems"), (logging.WARNING, "validation failed on row 3"),
                       (logging.INFO, "100%"), (logging.WARNING, "UserWarning: something odd"),
                       (logging.INFO, "no newline at the end")]


def test_track_records_each_tasks_peak_memory():
    from flows.progress import ProgressView

    view = ProgressView("t", live=False)
    with view.track("train", "train-a"):
        block = bytearray(64 * 1024 * 1024)  # touch 64 MB so the task's peak rises above the baseline
        block[::4096] = b"x" * len(block[::4096])
    peaks = view.peak_memory()
    assert set(peaks) == {"train-a"} and peaks["train-a"] > 64
    assert view.timings()["train-a"] >= 0


def test_stderr_lines_are_warnings_only_when_they_say_so():
    import logging

    from flows.progress import stderr_level

    assert stderr_level("pretrain: 100%|##########| 6/6 [00:46<00:00]") == logging.INFO
    assert stderr_level("base: corpus 200 problems") == logging.INFO
    for line in ("WARNING: low disk", "UserWarning: x", "Traceback (most recent call last):", "stage failed",
                 "RuntimeError: boom"):
        assert stderr_level(line) == logging.WARNING, line
