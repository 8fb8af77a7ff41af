"""One run of a task on `np` ranks, seen from the driver: launch, watch, stop, report.

`Job.run` checks what it can before anything starts, then starts the ranks and hands the
run's one event queue, which the control server and the launcher feed, to a `RunWatcher`
(`watcher.py`) on the driver's main thread. That is what makes the notebook's stop button
work: KeyboardInterrupt is raised in the watcher's loop, and `Job.run`'s cleanup stops every
rank. The same cleanup runs on success, on the first failing rank, and on a timeout, so no
process, thread, port or Spark job outlives the run.

With `max_restarts` (torchrun's `--max-restarts`), a failing rank stops the whole group as
always, and then the group starts again, at most that many times: the same record, display,
logs and trace, a new control server and queue, each rank told its restart
(TORCHELASTIC_RESTART_COUNT). Only a rank's failure restarts it: never an interrupt, a
timeout (which covers every attempt) or a refused option.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys
import time
import uuid
from dataclasses import dataclass, field

import cloudpickle

from .control import ControlServer
from .elastic import ElasticWatcher, elastic_bounds
from .elastic_plan import ElasticBounds
from .display import DisplayFactory, text_display
from .events import GroupRestarted
from .host_probe import HostProbes
from .records import new_records
from .run_folders import new_run_folder
from .run_result import RankFailedError, RunResult
from .run_status import RunStatus
from .tracking import finish_tracking, start_tracking, wants_tracking
from .watcher import RunWatcher
from ..runtime.settings import TRANSPORT_VARIABLE, transport_choice
from ..wire.channel import PEER_TIMEOUT_VARIABLE, new_secret, peer_timeout_s
from ..wire.elastic_settings import ELASTIC_TIMEOUT_VARIABLE, RESET_LIMIT_VARIABLE
from ..wire.messages import RunSettings

_last_run: RunResult | None = None


def last_run() -> RunResult | None:
    """The record of the most recent run in this process (None before the first)."""
    return _last_run


def remember_run(record: RunResult) -> None:
    """`record` is the most recent run (a pool's cell: `pool.py`)."""
    global _last_run
    _last_run = record


def ranks_environment(env: dict[str, str], use_gpu: bool) -> dict[str, str]:
    """What every rank of a run (or pool) gets in its environment on top of the user's
    `env`: the transport and peer timeout, checked here rather than first on every rank, and
    passed on, since Spark executors do not inherit the notebook's environment."""
    transport = transport_choice(env.get(TRANSPORT_VARIABLE, os.environ.get(TRANSPORT_VARIABLE)))
    peer_timeout_s()  # a bad DDL_MAGIC_PEER_TIMEOUT is refused before anything starts
    env = {**env, TRANSPORT_VARIABLE: transport}
    if PEER_TIMEOUT_VARIABLE in os.environ:
        env.setdefault(PEER_TIMEOUT_VARIABLE, os.environ[PEER_TIMEOUT_VARIABLE])
    if use_gpu:
        env["DDL_MAGIC_GPU"] = "1"
    return env


def check_max_restarts(max_restarts: int, elastic: bool) -> None:
    """Refuse, before anything starts, a `max_restarts` that is not a count, or one given
    with min_np/max_np (every front-end says it the same way).

    >>> check_max_restarts(-1, elastic=False)
    Traceback (most recent call last):
    ...
    ValueError: max_restarts=-1: give how many times the whole group may be restarted after a rank fails, 0 or more (e.g. --max-restarts 3)
    """
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r}: give how many times the whole group "
                         "may be restarted after a rank fails, 0 or more (e.g. --max-restarts 3)")
    if max_restarts and elastic:
        raise ValueError(f"max_restarts={max_restarts} restarts the whole group, which resumes "
                         "from your own checkpoint (torchrun's --max-restarts, for plain "
                         "torch.distributed code); min_np/max_np keep the run going on the "
                         "ranks that are left (hvd.elastic.run): use one or the other")


@dataclass
class JobOptions:
    timeout_s: float | None = None
    timeline_path: str | None = None
    return_all: bool = False
    env: dict[str, str] = field(default_factory=dict)
    hide_output: bool = False  # show only failures and the closing line, not what ranks print
    use_gpu: bool = False  # each rank pins the GPU of its local_rank
    title: str = ""
    # True or an experiment name: track the run in MLflow; False: never; None: when the
    # notebook has an active MLflow run (tracking.py)
    mlflow: bool | str | None = None
    # How the run shows itself: the front-end's choice (frontends/options.make_display)
    display: DisplayFactory = text_display
    # Either given: the run is elastic (`elastic.py`): a lost rank resets the world, which
    # keeps at least min_np ranks and at most max_np (each defaults to np). Neither: a lost
    # rank ends the run, as always.
    min_np: int | None = None
    max_np: int | None = None
    # Plain torch.distributed code's restarts, as torchrun's --max-restarts: a failed rank
    # stops the whole group, which starts again (at most this many times) with
    # TORCHELASTIC_RESTART_COUNT set, for code that resumes from its own checkpoint.
    max_restarts: int = 0

    @property
    def elastic(self) -> bool:
        return self.min_np is not None or self.max_np is not None


class Job:
    """Runs one task on `np` ranks through a launcher (local processes or Spark)."""

    def __init__(self, task: object, np: int, launcher, options: JobOptions):
        self.task_bytes = task if isinstance(task, bytes) else cloudpickle.dumps(task)
        self.np = np
        self.launcher = launcher
        self.options = options

    def run(self) -> RunResult:
        global _last_run
        options = self.options
        check_max_restarts(options.max_restarts, options.elastic)
        self.launcher.check(self.np)  # before anything is created: a refused run leaves no trace
        bounds = self._elastic_bounds() if options.elastic else None
        env = ranks_environment(options.env, options.use_gpu)
        tracking_wanted = wants_tracking(options.mlflow)  # and a missing mlflow, when asked for
        if options.use_gpu:
            self.launcher.check_gpus(self.np)
        run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        log_dir = new_run_folder(run_id)
        timeline_path = options.timeline_path
        if timeline_path is None:
            timeline_path = os.environ.get("HOROVOD_TIMELINE") or None
        if timeline_path == "":  # asked for, no path given: keep it with the run's logs
            timeline_path = os.path.join(log_dir, "timeline.json")
        where = self.launcher.where if bounds is None else self.launcher.elastic_where
        record = RunResult(run_id, self.np, where, log_dir=log_dir,
                           timeline_path=timeline_path)
        record.ranks = new_records(self.np, log_dir)
        _last_run = record
        events: queue.Queue = queue.Queue()
        record.mlflow = start_tracking(options.mlflow, record, options) if tracking_wanted else None
        if record.mlflow is not None:  # every rank logs into the run (the user's env wins)
            env = {**record.mlflow.rank_environment(), **env}
        if bounds is not None:  # the ranks bound their resets and waits as the driver does
            env[RESET_LIMIT_VARIABLE] = str(bounds.reset_limit)
            env[ELASTIC_TIMEOUT_VARIABLE] = repr(bounds.wait_s)
        settings = RunSettings(run_id, env, timeline=timeline_path is not None,
                               return_all=options.return_all, elastic=bounds is not None,
                               max_restarts=options.max_restarts)
        secret = new_secret()
        server = ControlServer(secret, self.np, self.task_bytes, settings, events,
                               self.launcher.bind_host, self.launcher.advertised_host)
        display = options.display(record.ranks, quiet=options.hide_output, log_dir=log_dir,
                               title=options.title, timeline_path=timeline_path)
        watcher_args = dict(exits_follow_output=getattr(self.launcher, "forwards_output", False),
                            describe_lost=getattr(self.launcher, "describe_lost", None))
        if bounds is None:
            watcher = RunWatcher(record, display, timeline_path,
                                 HostProbes(events, timeout_s=peer_timeout_s()), **watcher_args)
        else:
            watcher = ElasticWatcher(record, display, timeline_path,
                                     HostProbes(events, timeout_s=peer_timeout_s()),
                                     launcher=self.launcher, bounds=bounds, **watcher_args)
        outcome = RunStatus.FAILED
        try:
            display.display()
            while True:
                self.launcher.start(self.np, server.address, secret, events,
                                    elastic=bounds is not None)
                try:
                    watcher.watch(events, server, options.timeout_s)
                    break
                except RankFailedError as failure:
                    if len(record.restarts) >= options.max_restarts:
                        raise
                    restart = GroupRestarted(len(record.restarts) + 1, options.max_restarts,
                                             failure.rank, failure.host, failure.reason,
                                             failure.exit_code, time.time())
                # The whole group is stopped, as after any failure, then started again. Each
                # group has its own control server and queue: nothing the last one sends
                # late can be taken for the new one's.
                server.abort(f"rank {restart.rank} failed: the whole group restarts")
                self.launcher.stop()
                server.close()
                watcher.drain(events)
                events = queue.Queue()
                watcher.start_over(restart, HostProbes(events, timeout_s=peer_timeout_s()))
                settings = dataclasses.replace(settings, restart_count=restart.restart)
                server = ControlServer(secret, self.np, self.task_bytes, settings, events,
                                       self.launcher.bind_host, self.launcher.advertised_host)
            outcome = RunStatus.DONE
        except KeyboardInterrupt:
            outcome = RunStatus.INTERRUPTED
            raise
        finally:
            if outcome is not RunStatus.DONE:
                server.abort("the run was interrupted" if outcome is RunStatus.INTERRUPTED
                             else "the run failed")
            self.launcher.stop()
            server.close()
            watcher.drain(events)
            watcher.close(outcome)
            finish_tracking(record, sys.exc_info()[1])
        return record

    def _elastic_bounds(self) -> ElasticBounds:
        """The elastic run's bounds, checked before anything starts; a launcher that cannot
        replace ranks refuses the run."""
        bounds = elastic_bounds(self.np, self.options.min_np, self.options.max_np)
        self.launcher.check_elastic(self.np, bounds.max_np)
        return bounds
