"""The body of one Spark barrier task, run on an executor: the parent of one rank.

The launcher (`launch/spark.py`) sends `run_rank_task` by value (cloudpickle), so it imports
what it uses inside: an executor whose Python lacks ddl_magic still runs it and says so. The
task starts the rank's process (``python -m ddl_magic.rank.worker``), relays what it writes
and how it ended to the driver (`TaskRelay`), and reports its state every report interval.
"""

from __future__ import annotations

import threading

from ..wire.channel import CONNECT_TIMEOUT_S, Channel
from ..wire.messages import TaskAlive, TaskExited, TaskOutput, TaskStarted


def run_rank_task(control_address, secret, tail_lines, report_interval, shares,
                   as_arrow, batches, slot=None):
    """One barrier task (runs on an executor, sent by value): run rank `partitionId` to its end;
    or, with `slot`, the one task of an elastic run's rank job: run the rank in that slot.

    The task owns its rank's process, which dies with the task's Python (Linux: a parent-death
    signal), so a task Spark kills or cancels leaves no rank behind; every `report_interval`
    seconds it tells the driver
    what state the kernel says the process is in (`wire/liveness.py`), from a thread that the
    rank's own Python cannot starve.

    With `shares` (the plan of a run given Spark DataFrames, `launch/spark_shares.py`), the
    partition's rows are the rank's shares of them (`ddl_magic.rank.task_shares`). Tells the driver how the rank's process ended (returncode None:
    it could not start, and the output says why), and returns that as one row of
    `launch/spark.py`'s `TASK_RESULT_SCHEMA`: an Arrow batch of one row (`as_arrow`, in a DataFrame stage) or a
    dict (in an RDD stage). Never raises for a failed rank.
    """
    import collections
    import importlib.util
    import os
    import socket
    import subprocess
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

    def die_with_parent():
        """In the rank's process before it runs: SIGKILL it when this task's thread ends."""
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL

    def run_rank(extra_env=None, extra_fds=(), while_it_starts=None):
        read_end, write_end = os.pipe()
        env = dict(os.environ, **(extra_env or {}),
                   DDL_MAGIC_CONTROL=f"{control_address[0]}:{control_address[1]}",
                   DDL_MAGIC_RANK=str(rank), DDL_MAGIC_SECRET_FD=str(read_end),
                   PYTHONUNBUFFERED="1")
        if relay is not None:
            env["DDL_MAGIC_OUTPUT_FORWARDED"] = "1"
        gpus = task.resources().get("gpu")
        if gpus is not None:  # the GPUs Spark gave this task are the only ones the rank sees
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus.addresses)
        with os.fdopen(write_end, "wb") as pipe:
            try:
                process = subprocess.Popen(
                    [sys.executable, "-m", "ddl_magic.rank.worker"], env=env,
                    preexec_fn=die_with_parent,
                    pass_fds=(read_end, *extra_fds), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE if relay is not None else subprocess.STDOUT)
            except OSError as exc:
                return None, f"cannot start {sys.executable} on {host}: {exc}"
            finally:
                for fd in (read_end, *extra_fds):
                    os.close(fd)
            pipe.write(secret)
        if relay is not None:
            from ddl_magic.wire.output_lines import forward_lines

            def forward(pipe, stream):
                forward_lines(lambda: pipe.read1(65536), lambda lines: relay.output(stream, lines))

            forwarders = [threading.Thread(target=forward, args=(pipe, stream), daemon=True)
                          for pipe, stream in ((process.stdout, "stdout"), (process.stderr, "stderr"))]
            for forwarder in forwarders:
                forwarder.start()
            from ddl_magic.wire.liveness import process_state

            def report_liveness():
                while not process_ended.wait(report_interval):
                    try:
                        relay.alive(process_state(process.pid).value)
                    except OSError:
                        return  # the driver is gone: the rank learns it too, and ends

            process_ended = threading.Event()
            threading.Thread(target=report_liveness, daemon=True).start()
        if while_it_starts is not None:
            while_it_starts()
        if relay is not None:
            returncode = process.wait()
            process_ended.set()
            for forwarder in forwarders:  # all it wrote, unless a child of its own lives on
                forwarder.join(timeout=5)
            return returncode, ""
        # The rank forwards its output over the control channel once registered; what arrives
        # here is what it printed before that (e.g. why it could not connect) or after.
        tail = collections.deque((line.decode(errors="replace") for line in process.stdout),
                                 maxlen=tail_lines)
        return process.wait(), "".join(tail)

    try:
        if importlib.util.find_spec("ddl_magic") is None:
            raise ModuleNotFoundError("No module named 'ddl_magic'")
    except (ImportError, ValueError) as exc:
        returncode, output = None, (
            f"the executors' Python ({sys.executable}) cannot import ddl_magic: {exc}. "
            "Install ddl_magic on every executor, or set PYSPARK_PYTHON to a Python that has it")
    else:
        if shares:  # written while the rank starts; it waits for the word on a pipe
            from ddl_magic.rank.task_shares import TaskShares

            written = TaskShares(shares, rank)
            ready_read, ready_write = os.pipe()
            unsaid = [ready_write]  # `write` closes it when it has said its word

            def write_shares():
                written.write(batches, unsaid.pop())

            try:
                returncode, output = run_rank(
                    written.environment(ready_read), (ready_read, *written.fds), write_shares)
            finally:
                for fd in unsaid:  # the rank could not start: nobody waits for the word
                    os.close(fd)
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
