"""A pool's rank: the ring formed once, then cell after cell in a namespace that persists.

Two threads share the work:

    control thread (`_CellLoop.obey_driver`)     main thread (`_CellLoop.serve`)
    ────────────────────────────────────────     ───────────────────────────────
    FormRing, RunCell, Pull ──► inbox ─────────► form the ring / run the cell in the rank's
                                                  namespace / send a value back, then say so
    CancelCell ──► abort the cell's collectives,
                   KeyboardInterrupt in the main thread
    Probe ──► ProbeReply (memory, uptime), also while a cell runs
    Abort, or the driver gone ──► exit now: no rank outlives its pool

How a cell is stopped. The driver sends a message, never a signal (only processes the pool
started are ever signalled, and never the kernel's process group). The control thread
aborts the runtime's collectives (each ends with `CollectiveAbortedError` saying why: every
rank gets the message, so a collective in flight ends on every rank) and sends SIGINT to
its own main thread alone (`pthread_kill`), which wakes whatever it sleeps in, unless the
cell ended within `INTERRUPT_AFTER_S` (it was waiting in a collective); it repeats that until
the cell ends, for code that swallowed the first. The SIGINT handler raises
KeyboardInterrupt only in the cell's own code, and only while the cell the driver stopped
still runs: a signal that lands after the cell ended is ignored, and so is a Ctrl-C from a
terminal.

Every collective belongs to its cell. A cell that failed or was stopped leaves its ring
aborted, or something in flight, and the rank says so (`CellEnded.ring_ok`); the driver then
has every rank form a fresh ring before the next cell (`FormRing`): new connections, new
shared-memory segments, a new negotiation with empty caches and unnamed-op counters. Nothing
of a failed cell can pair with the next.

Which names are the ranks' own: those a cell assigned here (`CellEnded.names`). The driver
then never sends a notebook name of the same spelling, and the rank never lets one
overwrite them.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import difflib
import os
import queue
import signal
import symtable
import sys
import threading
import time
from typing import Callable

import cloudpickle

from ..runtime import context
from ..runtime.errors import CollectiveAbortedError, CollectiveRefusedError
from ..runtime.world import Peer
from ..wire.channel import ABORTED_EXIT_CODE, Channel, PeerClosedError
from ..wire.messages import (CELL_END_MARK, Abort, CancelCell, CellEnded, Failed, FailureKind,
                             Finished, FormRing, Probe, ProbeReply, Pull, Pulled, RunCell)
from ..wire.tasks import CellTask
from . import allocator

# A stopped cell waiting in a collective ends at once, with the error saying why; one busy
# elsewhere is interrupted after this long. Then again every INTERRUPT_AGAIN_S (it caught the
# KeyboardInterrupt), for INTERRUPT_FOR_S at most: the driver gives up on it before that.
INTERRUPT_AFTER_S = 0.2
INTERRUPT_AGAIN_S = 0.5
INTERRUPT_FOR_S = 30.0


def serve_cells(channel: Channel, rank: int, output, run_reporting: Callable,
                flush_timeline: Callable[[], None], driver_time_ns: Callable[[], int],
                first_epoch: int = 0) -> int:
    """Serve the pool's requests until the driver stops the pool; the process then exits.

    `output` forwards what this rank writes (a context manager, `worker.py`'s);
    `run_reporting(call, rank, return_all)` runs a cell and reports how it went;
    `first_epoch`: the epoch of the first ring (0 at the pool's start; a replacement in an
    elastic pool joins the survivors' fresh ring of a later one).
    """
    loop = _CellLoop(channel, rank, run_reporting, flush_timeline, driver_time_ns, first_epoch)
    signal.signal(signal.SIGINT, loop.on_sigint)
    threading.Thread(target=loop.obey_driver, name="ddl-control", daemon=True).start()
    with output:
        loop.serve()
    return 0  # not reached: the control thread ends the process


class _CellLoop:
    def __init__(self, channel: Channel, rank: int, run_reporting: Callable,
                 flush_timeline: Callable[[], None], driver_time_ns: Callable[[], int],
                 first_epoch: int):
        self.channel = channel
        self._first_epoch = first_epoch
        self.rank = rank
        self._run_reporting = run_reporting
        self._flush_timeline = flush_timeline
        self._driver_time_ns = driver_time_ns
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
        self.owned: set[str] = set()  # the names cells assigned here: the ranks' own
        self._started = time.monotonic()
        self._main_thread = threading.main_thread().ident
        # `_lock` pairs the running cell with a request to stop it, so that a request for one
        # cell never stops the next. The SIGINT handler (main thread) only reads them.
        self._lock = threading.Lock()
        self._running: int | None = None  # the epoch of the running cell
        self._stop_reason: str | None = None  # why the running cell is being stopped
        self._stopped_early: dict[int, str] = {}  # cells stopped before they started here: why
        self._ended = threading.Event()  # the running cell ended
        self._in_cell_code = False  # the main thread runs the cell's own code (not its report)

    # ---- the control thread ---------------------------------------------------------------

    def obey_driver(self) -> None:
        """Relay the driver's requests; exit when it says so or goes away."""
        try:
            while True:
                match self.channel.recv():
                    case CancelCell(epoch, reason):
                        self._stop(epoch, reason)
                    case Probe(probe_id):
                        self.channel.send(ProbeReply(probe_id, _resident_bytes(),
                                                     time.monotonic() - self._started))
                    case Abort():
                        break
                    case FormRing() | RunCell() | Pull() as request:
                        self.inbox.put(request)
                    case _:
                        break  # a malformed request: this rank cannot go on in step
        except (OSError, PeerClosedError, EOFError):
            pass  # the driver went away, and with it the pool
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(ABORTED_EXIT_CODE)

    def _stop(self, epoch: int, reason: str) -> None:
        with self._lock:
            if self._running != epoch:
                self._stopped_early[epoch] = reason  # not started yet (or already over)
                return
            self._stop_reason = reason
        context.abort(CollectiveAbortedError(f"the cell was stopped: {reason}"))
        threading.Thread(target=self._interrupt, args=(epoch,), name="ddl-interrupt",
                         daemon=True).start()

    def _interrupt(self, epoch: int) -> None:
        if self._ended.wait(INTERRUPT_AFTER_S):
            return
        deadline = time.monotonic() + INTERRUPT_FOR_S
        while self._running == epoch and time.monotonic() < deadline:
            signal.pthread_kill(self._main_thread, signal.SIGINT)
            if self._ended.wait(INTERRUPT_AGAIN_S):
                return

    # ---- the main thread ------------------------------------------------------------------

    def on_sigint(self, signum, frame) -> None:
        if self._in_cell_code and self._running is not None and self._stop_reason is not None:
            raise KeyboardInterrupt(self._stop_reason)

    def serve(self) -> None:
        self._form_ring(self._first_epoch)  # the pool's start: the ring is formed once, here
        # No timeout on waiting for the next request: the control thread ends this process
        # when the driver goes, and an idle rank costs nothing while it waits.
        while True:
            match self.inbox.get():
                case FormRing(epoch, peers):
                    if peers is not None:  # an elastic pool replaced lost ranks
                        context.bootstrap = dataclasses.replace(
                            context.bootstrap, peers=[Peer(*peer) for peer in peers])
                    self._form_ring(epoch)
                case RunCell() as cell:
                    self._run_cell(cell)
                case Pull(pull_id, name):
                    self.channel.send(self._pull(pull_id, name))

    def _form_ring(self, epoch: int) -> None:
        try:
            # Aborted first, so that no rank's shutdown waits for a last round with ranks
            # whose ring is already aborted.
            context.abort(CollectiveAbortedError("the pool is forming a fresh ring"))
            context.shutdown()
            context.init()
            outcome = Finished(None)
        except Exception as exc:
            outcome = Failed(FailureKind.RAISED, f"{type(exc).__name__}: {exc}\n",
                             f"could not form the ring: {exc}", 1, self._driver_time_ns())
        self._end(epoch, outcome)

    def _run_cell(self, cell: RunCell) -> None:
        with self._lock:
            stopped_before = self._stopped_early.pop(cell.epoch, None)
            if stopped_before is None:
                self._running, self._stop_reason = cell.epoch, None
                self._ended.clear()
        if stopped_before is not None:  # its log says why, as a rank stopped in the cell's code
            self._end(cell.epoch, self._stopped(
                "the cell was stopped before it started",
                f"the cell was stopped before it started here: {stopped_before}\n"))
            return
        if cell.only_ranks is not None:
            context.refuse_collectives(CollectiveRefusedError(
                f"this cell runs on ranks {list(cell.only_ranks)} only (%%horovod --ranks): "
                "the other ranks would never join a collective, so none can run in it. Run "
                "collectives in a cell on every rank (%%horovod without --ranks)"))
        outcome = None
        try:
            with contextlib.suppress(KeyboardInterrupt):  # it was stopped: said below
                _, outcome = self._run_reporting(lambda: self._call(cell.task), self.rank,
                                                 cell.return_all)
        finally:
            self._running = None  # first: from here on, SIGINT changes nothing
            self._ended.set()
            context.refuse_collectives(None)
        if self._stop_reason is not None:  # what it raised, if anything, was our doing
            raised = outcome.traceback if isinstance(outcome, Failed) else ""
            outcome = self._stopped(self._stop_reason, raised)
        elif outcome is None:
            outcome = self._stopped("interrupted")
        self._end(cell.epoch, outcome)
        allocator.give_back()  # what the cell freed: nobody waits for a step until the next one

    def _call(self, task_bytes: bytes):
        self._in_cell_code = True
        try:
            return self._call_task(task_bytes)
        finally:
            self._in_cell_code = False

    def _call_task(self, task_bytes: bytes):
        task = cloudpickle.loads(task_bytes)
        if not isinstance(task, CellTask):
            return task.run()
        before = {name: id(value) for name, value in self.namespace.items()}
        for name in self.owned.intersection(task.namespace):  # never sent; never overwritten
            del task.namespace[name]
        try:
            return task.run(self.namespace)
        finally:
            changed = {name for name, value in self.namespace.items()
                       if before.get(name) != id(value)} - set(task.namespace)
            self.owned = {name for name in self.owned | changed | _assigned(task.source)
                          if name in self.namespace and not name.startswith("__")}

    def _stopped(self, reason: str, traceback: str = "") -> Failed:
        return Failed(FailureKind.RAISED, traceback, f"stopped: {reason}", ABORTED_EXIT_CODE,
                      self._driver_time_ns())

    def _end(self, epoch: int, outcome) -> None:
        """Say the cell ended, after every line it wrote: the marks close its output."""
        sys.stdout.flush()
        sys.stderr.flush()
        mark = f"{CELL_END_MARK}{epoch}"
        print(mark, flush=True)
        print(mark, file=sys.stderr, flush=True)
        self._flush_timeline()
        self.channel.send(CellEnded(epoch, outcome, context.ring_is_clean(),
                                    tuple(sorted(self.owned))))

    def _pull(self, pull_id: int, name: str) -> Pulled:
        if name not in self.namespace or name.startswith("__"):
            close = difflib.get_close_matches(name, [n for n in self.namespace if not n.startswith("__")], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            return Pulled(pull_id, None, f"rank {self.rank} has no name {name!r}{hint}",
                          missing=True)
        value = self.namespace[name]
        try:
            return Pulled(pull_id, cloudpickle.dumps(value))
        except Exception as exc:
            return Pulled(pull_id, None,
                          f"{name!r} ({type(value).__name__}) on rank {self.rank} cannot be "
                          f"pickled: {type(exc).__name__}: {exc}. Pull what it is made of "
                          "instead (a state_dict, a list of numbers)")


def _assigned(source: str) -> set[str]:
    """The names the cell's top level binds (assignments, imports, defs, classes)."""
    try:
        table = symtable.symtable(source, "<cell>", "exec")
    except SyntaxError:
        return set()
    return {symbol.get_name() for symbol in table.get_symbols()
            if symbol.is_assigned() or symbol.is_imported()}


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
