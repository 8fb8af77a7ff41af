"""The body of one Spark barrier task, run on an executor: the parent of one rank.

The launcher (`launch/spark.py`) sends `run_rank_task` by value (cloudpickle), so it imports
what it uses inside: an executor whose Python lacks ddl_magic still runs it and says so. The
task has its rank forked by the rank factory its Python worker keeps (`rank/factory.py`,
torch already imported), relays what the rank writes and how it ended to the driver
(`TaskRelay`), and reports its state every report interval.
"""

from __future__ import annotations

import threading

from ..wire.channel import CONNECT_TIMEOUT_S, Channel
from ..wire.messages import TaskAlive, TaskExited, TaskOutput, TaskStarted
from .factory_client import RankFactory


def run_rank_task(control_address, secret, tail_lines, report_interval, shares,
                   as_arrow, batches, slot=None):
    """One barrier task (runs on an executor, sent by value): run rank `partitionId` to its end;
    or, with `slot`, the one task of an elastic run's rank job: run the rank in that slot.

    The task owns its rank's process, which dies with the task's Python (Linux: parent-death
    signals, from the worker to its factory to the rank), so a task Spark kills or cancels
    leaves no rank behind; every `report_interval` seconds it tells the driver what state the
    kernel says the process is in (`wire/liveness.py`), from a thread that the rank's own
    Python cannot starve.

    With `shares` (the plan of a run given Spark DataFrames, `launch/spark_shares.py`), the
    partition's rows are the rank's shares of them (`ddl_magic.rank.task_shares`). Tells the driver how the rank's process ended (returncode None:
    it could not start, and the output says why), and returns that as one row of
    `launch/spark.py`'s `TASK_RESULT_SCHEMA`: an Arrow batch of one row (`as_arrow`, in a DataFrame stage) or a
    dict (in an RDD stage). Never raises for a failed rank.
    """
    import collections
    import importlib.util
    import os
    import signal
    import socket
    import sys
    import threading

    from pyspark import BarrierTaskContext, TaskContext

    if slot is None:
        task = BarrierTaskContext.get()
        rank, executors = task.partitionId(), [info.address for info in task.getTaskInfos()]
    else:  # an elastic rank's task knows no other task: the driver probes no hosts for it
        task, rank, executors = TaskContext.get(), slot, []
    if task.attemptNumber() > 0:
        return  # Spark retried the task after a failure: a rank never runs twice
    host = socket.gethostname()

    relay = None
    try:
        from ddl_magic.rank.spark_task import TaskRelay

        relay = TaskRelay(control_address, secret, rank)
        relay.started(executors)  # the driver probes their hosts
    except (ImportError, OSError):
        relay = None  # the rank forwards its own output; this task reports in the row it returns

    def run_rank(extra_env=None, extra_fds=()):
        from ddl_magic.rank.factory_client import signal_rank_group
        from ddl_magic.rank.spark_task import rank_factory_for_this_task
        from ddl_magic.wire.liveness import process_state
        from ddl_magic.wire.messages import ForkRank

        env = dict(os.environ, **(extra_env or {}), PYTHONUNBUFFERED="1")
        gpus = task.resources().get("gpu")
        if gpus is not None:  # the GPUs Spark gave this task are the only ones the rank sees
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus.addresses)
        tail = collections.deque(maxlen=tail_lines)
        ended: dict = {}
        exited = threading.Event()

        def on_output(stream, lines):
            if relay is None:  # what it printed before it could forward its own output
                tail.extend(text + "\n" for text, _ in lines)
                return
            try:
                relay.output(stream, lines)
            except OSError:
                pass  # the driver is gone: the rank learns it too, and ends

        def on_exit(returncode, out_of_memory):
            ended.update(returncode=returncode, out_of_memory=out_of_memory)
            exited.set()

        factory, own_factory = rank_factory_for_this_task()
        try:
            try:
                pid = factory.fork_rank(
                    ForkRank(rank, tuple(control_address), secret, env, os.getcwd(),
                             [os.getcwd(), *sys.path], fds=tuple(extra_fds),
                             parent_forwards_output=relay is not None),
                    on_exit, on_output, on_state=lambda state: None)
            except (OSError, RuntimeError) as exc:
                return None, f"cannot start a rank on {host} ({sys.executable}): {exc}"
            finally:
                for fd in extra_fds:  # the rank's now
                    os.close(fd)
            try:
                # Every report interval, tell the driver the state the kernel gives the rank's
                # process: from this thread, which the rank's own Python cannot starve.
                reporting = relay is not None
                while not exited.wait(report_interval):
                    # A killed factory takes its ranks along; their exits are never reported.
                    if not factory.alive() and not exited.wait(report_interval):
                        return -9, f"the process that forked rank {rank} on {host} was killed"
                    if reporting:
                        try:
                            relay.alive(process_state(pid).value)
                        except OSError:
                            reporting = False
            except BaseException:
                signal_rank_group(pid, signal.SIGKILL)  # the task failed or was stopped: its rank too
                raise
        finally:
            if own_factory:
                factory.end()
        if ended["out_of_memory"]:
            tail.append(ended["out_of_memory"] + "\n")
        return ended["returncode"], "".join(tail)

    try:
        if importlib.util.find_spec("ddl_magic") is None:
            raise ModuleNotFoundError("No module named 'ddl_magic'")
    except (ImportError, ValueError) as exc:
        returncode, output = None, (
            f"the executors' Python ({sys.executable}) cannot import ddl_magic: {exc}. "
            "Install ddl_magic on every executor, or set PYSPARK_PYTHON to a Python that has it")
    else:
        if shares:
            from ddl_magic.rank.task_shares import TaskShares

            written = TaskShares(shares, rank)
            ready_read, ready_write = os.pipe()  # the rank waits for the writer's word on it
            # Written from the moment the task starts: while a cold worker's factory imports
            # torch, then while the rank does. The partition's batches are read by the writing
            # thread alone, which is joined before the task returns its row.
            writing = threading.Thread(target=written.write, args=(batches, ready_write),
                                       name="ddl-write-shares", daemon=True)
            writing.start()
            try:
                returncode, output = run_rank(written.environment(ready_read),
                                              (ready_read, *written.fds))
            finally:
                written.stop()  # a rank that ended (or never started) reads no more rows
                writing.join()
                written.close()
        else:
            returncode, output = run_rank()
    reported = False
    if relay is not None:
        try:
            relay.exited(host, returncode, output)
            reported = True
        except OSError:  # the row below is the driver's only word of it
            pass
        relay.close()
    result = {"rank": rank, "host": host, "returncode": returncode, "output": output,
              "reported": reported}
    if not as_arrow:
        yield result
        return
    import pyarrow

    columns = pyarrow.schema([("rank", pyarrow.int64()), ("host", pyarrow.string()),  # as
                              ("returncode", pyarrow.int64()), ("output", pyarrow.string()),
                              ("reported", pyarrow.bool_())])  # launch/spark.py's TASK_RESULT_SCHEMA
    yield pyarrow.RecordBatch.from_pylist([result], schema=columns)


_worker_factory: RankFactory | None = None


def rank_factory_for_this_task() -> tuple[RankFactory, bool]:
    """The rank factory a task forks its rank from, and whether it is the task's own (to end
    when the task ends).

    Spark reuses an executor's Python workers from task to task (`spark.python.worker.reuse`,
    the default), so a worker keeps the factory it started: every rank after the first on it
    starts with torch imported, not in seconds. The factory is tied to the thread that
    starts it: from the worker's main thread (where Spark runs tasks) it lives as long as the
    worker; from any other, it is that task's alone."""
    global _worker_factory
    if threading.current_thread() is not threading.main_thread():
        return RankFactory(tied=True), True
    if _worker_factory is None or not _worker_factory.alive():
        _worker_factory = RankFactory(tied=True)
    return _worker_factory, False


class TaskRelay:
    """The side of whatever starts a rank (a Spark task): relays the rank process's output
    and then its end to the run's driver. Raises OSError if the driver cannot be reached."""

    def __init__(self, control_address: tuple[str, int], secret: bytes, rank: int):
        self.rank = rank
        self._channel = Channel.connect(control_address, secret, "task", CONNECT_TIMEOUT_S)
        self._channel.sock.settimeout(None)
        self._lock = threading.Lock()  # stdout and stderr are forwarded from two threads

    def started(self, executors: list[str]) -> None:
        """The rank's process is starting; `executors`: where each rank of the stage runs."""
        with self._lock:
            self._channel.send(TaskStarted(self.rank, executors))

    def alive(self, state: str) -> None:
        """The task is there, and its rank's process is in `state` (a `ProcessState` value)."""
        with self._lock:
            self._channel.send(TaskAlive(self.rank, state))

    def output(self, stream: str, lines: list) -> None:
        with self._lock:
            self._channel.send(TaskOutput(self.rank, stream, lines))

    def exited(self, host: str, returncode: int | None, output: str) -> None:
        """The rank's process ended (`returncode` None: it could not start, `output` says why)."""
        with self._lock:
            self._channel.send(TaskExited(self.rank, host, returncode, output))

    def close(self) -> None:
        self._channel.close()
