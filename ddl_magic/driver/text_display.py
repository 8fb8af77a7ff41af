"""Plain-text display of a run, for terminals, scripts and frontends without widgets.

Every line a rank prints comes out once, prefixed with its rank::

    [0] epoch 1 loss 0.41
    [1] epoch 1 loss 0.43
    ==== rank 1 (node-b) failed: exception ====
    Traceback (most recent call last):
      ...

A tqdm bar redraws itself many times a second; printing every redraw would bury the log,
so a rank's progress line is printed only when a normal line follows it, every couple of
seconds while it keeps changing, and when the run finishes.

A ``--timeline`` run also prints, every few seconds while new timeline batches arrive and
once at the end, where each rank's time went so far::

    [timeline] 12.0 s · % of time waiting/communicating/computing: rank 0 12/30/5.1 · rank 1 52/20/4.8
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from .events import Event, GroupRestarted, RankFailed, RankOutput, TimelineBatch, WorldReset
from .records import RankRecord
from .run_status import SHOWN_ENDS, RunStatus
from .tracebacks import without_machinery_frames

PROGRESS_INTERVAL_S = 2.0
TIMELINE_SUMMARY_INTERVAL_S = 5.0


class TextDisplay:
    """Prints a run's events as rank-prefixed text; same API as ``RunView``.

    ``ranks`` is the run's list of `RankRecord`, which the driver keeps up to date (it applies
    each event to its rank's record before handing it on).
    ``stream`` and ``error_stream`` default to ``sys.stdout`` and ``sys.stderr`` as they are
    when something is printed (so redirections made after construction apply). With
    ``quiet``, rank output is not printed; failures and the final line still are.

    Example::

        display = TextDisplay(new_records(2), log_dir="/tmp/ddl_magic/run-1")
        display.handle(RankOutput(rank=0, stream="stdout", text="hello"))  # prints "[0] hello"
        display.finish(RunStatus.DONE)
    """

    def __init__(
        self,
        ranks: list[RankRecord],
        stream: TextIO | None = None,
        log_dir: str | None = None,
        *,
        error_stream: TextIO | None = None,
        quiet: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        np = len(ranks)
        if np < 1:
            raise ValueError(f"np must be at least 1, got {np}")
        self._records = ranks
        self.np = np
        self.log_dir = log_dir
        self.quiet = quiet
        self._stream = stream
        self._error_stream = error_stream
        self._clock = clock
        self._started_at = clock()
        self._failures: dict[int, RankFailed] = {}  # as printed: the first is the cause
        # Each rank's newest progress redraw not printed yet, and when its last one was.
        self._pending_progress: list[RankOutput | None] = [None] * np
        self._progress_printed_at = [float("-inf")] * np
        self._last_written: TextIO | None = None
        self._finished = False
        self._timeline = None  # a LiveTimeline, once a --timeline run's first batch arrives
        self._timeline_printed = (0, clock())  # the LiveTimeline version printed, and when

    def display(self) -> None:
        """Nothing to show before the first event; present so both displays share one API."""

    def handle(self, event: Event) -> None:
        """Print what ``event`` says, if anything (progress lines may wait, see the module doc)."""
        if isinstance(event, WorldReset):  # an elastic run re-formed its world
            self._write(self._err(), f"==== elastic {event.describe()} ====")
            self._flush()
            return
        if isinstance(event, GroupRestarted):  # the whole group starts again (max_restarts)
            self._failures.clear()  # the new group's first failure is a cause again
            self._pending_progress = [None] * self.np
            self._write(self._err(), f"==== {event.describe()} ====")
            self._flush()
            return
        self._check_rank(event.rank)
        if isinstance(event, TimelineBatch):
            if self.quiet:
                return  # its summary would not be printed
            if self._timeline is None:
                from ..timeline.live import LiveTimeline

                self._timeline = LiveTimeline()
            self._timeline.add(event.rank, event.events)
        elif isinstance(event, RankOutput):
            if self.quiet:
                return
            if event.replace:
                self._pending_progress[event.rank] = event
                self._print_progress(event.rank, only_if_due=True)
            else:
                self._print_progress(event.rank)
                self._print_line(event)
        elif isinstance(event, RankFailed):
            if event.rank not in self._failures:
                self._failures[event.rank] = event
                self._print_progress(event.rank)
                self._print_failure(event)

    def refresh(self) -> None:
        """Print progress lines that have waited long enough, and flush what was printed."""
        for rank in range(self.np):
            self._print_progress(rank, only_if_due=True)
        self._print_timeline_summary(only_if_due=True)
        self._flush()

    def finish(self, status: RunStatus) -> None:
        """Print the last progress lines and one closing line; calling it again prints nothing."""
        if status not in SHOWN_ENDS:
            raise ValueError(f"status must be 'done', 'failed' or 'interrupted', got {status!r}")
        if self._finished:
            return
        self._finished = True
        for rank in range(self.np):
            self._print_progress(rank)
        self._print_timeline_summary()
        elapsed = f"{self._clock() - self._started_at:.1f} s"
        if status == RunStatus.DONE:
            summary = f"done: {self.np} ranks in {elapsed}"
        else:
            summary = f"{status} after {elapsed}"
            if self._failures:
                first = next(iter(self._failures.values()))
                summary += f" (rank {first.rank} on {self._host(first)}: {first.reason})"
        if self.log_dir:
            summary += f" · full logs in {self.log_dir}"
        self._write(self._out(), f"==== {summary} ====")
        self._flush()

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.np:
            raise ValueError(f"event for rank {rank}, but this run has ranks 0..{self.np - 1}")
        return rank

    def _print_progress(self, rank: int, only_if_due: bool = False) -> None:
        pending = self._pending_progress[rank]
        if pending is None:
            return
        now = self._clock()
        if only_if_due and now - self._progress_printed_at[rank] < PROGRESS_INTERVAL_S:
            return
        self._print_line(pending)
        self._pending_progress[rank] = None
        self._progress_printed_at[rank] = now

    def _print_timeline_summary(self, only_if_due: bool = False) -> None:
        """The running timeline summary, if batches arrived since it was last printed."""
        if self._timeline is None or self._timeline.version == self._timeline_printed[0]:
            return
        now = self._clock()
        if only_if_due and now - self._timeline_printed[1] < TIMELINE_SUMMARY_INTERVAL_S:
            return
        self._write(self._out(), self._timeline.summary_line(now - self._started_at))
        self._timeline_printed = (self._timeline.version, now)

    def _print_line(self, event: RankOutput) -> None:
        stream = self._err() if event.stream == "stderr" else self._out()
        self._write(stream, f"[{event.rank}] {event.text}")

    def _print_failure(self, failure: RankFailed) -> None:
        stream = self._err()
        where = f"rank {failure.rank} ({self._host(failure)})"
        if len(self._failures) > 1:
            # The first failure is the cause; the rest are ranks stopped because of it.
            self._write(stream, f"==== also stopped: {where}: {failure.reason} ====")
            return
        self._write(stream, f"==== {where} failed: {failure.reason} ====")
        if failure.traceback:
            full_log = self._records[failure.rank].log_path or "the rank's log"
            self._write(stream, without_machinery_frames(failure.traceback, full_log).rstrip("\n"))
        # A failure is the one thing that must be seen at once, not at the next refresh.
        self._flush()

    def _host(self, failure: RankFailed) -> str:
        return failure.host or self._records[failure.rank].host or "unknown host"

    def _write(self, stream: TextIO, text: str) -> None:
        # Flushing when switching streams keeps stdout and stderr lines in order on a terminal.
        if self._last_written is not None and self._last_written is not stream:
            self._last_written.flush()
        stream.write(text + "\n")
        self._last_written = stream

    def _flush(self) -> None:
        if self._last_written is not None:
            self._last_written.flush()

    def _out(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def _err(self) -> TextIO:
        return self._error_stream if self._error_stream is not None else sys.stderr
