"""One run of a task on `np` ranks, seen from the driver: launch, watch, stop, report.

`Job.run` checks what it can before anything starts (`run_options.check_options`,
`run_setup.prepare_run`), then starts the ranks and hands the run's one event queue, which
the control server and the launcher feed, to a `RunWatcher` (`watcher.py`) on the driver's
main thread, with the run's failure policy: fail-fast and restarts
(`failure_policies.py`), or elastic (`elastic.py`). That is what makes the notebook's stop
button work: KeyboardInterrupt is raised in the watch loop, and the run's end
(`watcher.ended_as`) stops every rank. The same end comes on success, on the first failing
rank, and on a timeout, so no process, thread, port or Spark job outlives the run.

With `max_restarts` (torchrun's `--max-restarts`), the policy's `Restart` stops the whole
group as after any failure, and `_start_again` starts it again: a new control server and
queue, so nothing the last group sends late can be taken for the new one's.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys

import cloudpickle

from .control import ControlServer
from .elastic import Elastic
from .failure_policies import FailFast
from .host_probe import HostProbes
from .launcher import Launcher
from .records import new_records
from .run_options import JobOptions, check_options
from .run_result import RunResult
from .run_setup import prepare_run
from .run_status import RunStatus
from .tracking import finish_tracking, start_tracking, wants_tracking
from .watch_loop import Restart
from .watcher import RunWatcher, ended_as
from ..wire.channel import peer_timeout_s
from ..wire.elastic_settings import ELASTIC_TIMEOUT_VARIABLE, RESET_LIMIT_VARIABLE
from ..wire.messages import RunSettings

__all__ = ["Job", "JobOptions", "last_run", "remember_run"]

_last_run: RunResult | None = None


def last_run() -> RunResult | None:
    """The record of the most recent run in this process (None before the first)."""
    return _last_run


def remember_run(record: RunResult) -> None:
    """`record` is the most recent run (a pool's cell: `pool.py`)."""
    global _last_run
    _last_run = record


class Job:
    """Runs one task on `np` ranks through a launcher (local processes or Spark)."""

    def __init__(self, task: object, np: int, launcher: Launcher, options: JobOptions):
        self.task_bytes = task if isinstance(task, bytes) else cloudpickle.dumps(task)
        self.np = np
        self.launcher = launcher
        self.options = options

    def run(self) -> RunResult:
        options, launcher = self.options, self.launcher
        bounds = check_options(self.np, min_np=options.min_np, max_np=options.max_np,
                               max_restarts=options.max_restarts)
        tracking_wanted = wants_tracking(options.mlflow)  # and a missing mlflow, when asked for
        timeline_path = options.timeline_path
        if timeline_path is None:
            timeline_path = os.environ.get("HOROVOD_TIMELINE") or None
        setup = prepare_run(self.np, launcher, env=options.env, use_gpu=options.use_gpu,
                            timeline_path=timeline_path, bounds=bounds,
                            memory_per_rank=options.memory_per_rank)
        self._secret = setup.secret
        record = RunResult(setup.run_id, self.np, launcher.where if bounds is None
                           else launcher.elastic_where, log_dir=setup.log_dir,
                           timeline_path=setup.timeline_path)
        record.ranks = new_records(self.np, setup.log_dir)
        remember_run(record)
        env = setup.env
        try:
            record.mlflow = start_tracking(options.mlflow, record, options) if tracking_wanted else None
            if record.mlflow is not None:  # every rank logs into the run (the user's env wins)
                env = {**record.mlflow.rank_environment(), **env}
            if bounds is not None:  # the ranks bound their resets and waits as the driver does
                env[RESET_LIMIT_VARIABLE] = str(bounds.reset_limit)
                env[ELASTIC_TIMEOUT_VARIABLE] = repr(bounds.wait_s)
            self._settings = RunSettings(setup.run_id, env, timeline=setup.timeline_path is not None,
                                         return_all=options.return_all, elastic=bounds is not None,
                                         max_restarts=options.max_restarts)
            events: queue.Queue = queue.Queue()
            display = options.display(record.ranks, quiet=options.hide_output,
                                      log_dir=setup.log_dir, title=options.title,
                                      timeline_path=setup.timeline_path)
            self._watcher = watcher = RunWatcher(
                record, display, setup.timeline_path, events, self._control_server(events),
                HostProbes(events, timeout_s=peer_timeout_s()))
            policy = (Elastic(watcher, launcher, bounds) if bounds is not None else FailFast(
                watcher, exits_follow_output=launcher.forwards_output,
                describe_lost=launcher.describe_lost, max_restarts=options.max_restarts))
            with ended_as(watcher, self._stop):
                display.display()
                launcher.start(self.np, watcher.server.address, setup.secret, events,
                               elastic=bounds is not None)
                watcher.watch(policy, options.timeout_s, start_again=self._start_again)
        finally:
            setup.release()
            finish_tracking(record, sys.exc_info()[1])
        return record

    def _control_server(self, events: queue.Queue) -> ControlServer:
        return ControlServer(self._secret, self.np, self.task_bytes, self._settings, events,
                             self.launcher.bind_host, self.launcher.advertised_host)

    def _stop(self, outcome: RunStatus) -> None:
        """The run ended (`outcome`): stop what is left of it, then take in its last words."""
        watcher = self._watcher
        if outcome is not RunStatus.DONE:
            watcher.server.abort("the run was interrupted" if outcome is RunStatus.INTERRUPTED
                                 else "the run failed")
        self.launcher.stop(finished=outcome is RunStatus.DONE)
        watcher.server.close()
        watcher.drain()
        watcher.record.control = watcher.server.counters.summary()

    def _start_again(self, decision: Restart) -> None:
        """The whole group is stopped, as after any failure, then started again: its own
        control server and queue, each rank told its restart."""
        restart, watcher = decision.restart, self._watcher
        watcher.server.abort(f"rank {restart.rank} failed: the whole group restarts")
        self.launcher.stop()
        watcher.server.close()
        watcher.drain()
        events: queue.Queue = queue.Queue()
        self._settings = dataclasses.replace(self._settings, restart_count=restart.restart)
        watcher.start_over(restart, events, self._control_server(events),
                           HostProbes(events, timeout_s=peer_timeout_s()))
        self.launcher.start(self.np, watcher.server.address, self._secret, events)
