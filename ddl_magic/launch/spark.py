"""Ranks as Spark barrier tasks: one barrier stage of `np` tasks, each running one rank.

Barrier mode gives gang scheduling (all ranks start together or none does) and
all-or-nothing failure; everything else is ours. Each task starts the same worker bootstrap
as a local rank, ``python -m ddl_magic.worker``, as a child process, so the rank is isolated
from Spark's reused Python worker, and waits for it. Rendezvous goes through the driver's
control server, not Spark's ``allGather`` (about a second per call).

Three Spark behaviours shape this module:

- A barrier stage that asks for more slots than the cluster has is retried by Spark for
  minutes before it fails, so `check` refuses it at once.
- Spark re-runs failed tasks. A task here never raises for a failed rank (the rank reports
  that itself over the control channel), and an attempt after the first returns at once, so
  a failure never starts the training a second time.
- ``collect()`` returns only when every task has ended, but a rank that dies before it
  registers would leave the others waiting for it. Each task's end therefore reaches the
  driver through an accumulator, which Spark merges on the driver as each task finishes.
"""

from __future__ import annotations

import builtins
import functools
import queue
import re
import threading
import types
import uuid

from pyspark import InheritableThread
from pyspark.accumulators import AccumulatorParam, AddingAccumulatorParam

from ..events import RankFailed
from . import spark_session
from .local import ProcessExited

# How many lines of a rank's own stdout/stderr (what it printed before it could report over
# the control channel, e.g. an import error) come back with its task.
OUTPUT_TAIL_LINES = 40
# After the ranks were told to stop, how long their tasks may take to end by themselves
# before the Spark job is cancelled (cancelling kills Spark's Python workers with them).
STOP_GRACE_S = 2.0
STOP_TIMEOUT_S = 30.0


class SparkLauncher:
    """Starts `np` ranks as one barrier stage on a SparkSession and stops them on request.

    >>> launcher = SparkLauncher()          # the active SparkSession
    >>> Job(task, 4, launcher, JobOptions()).run()
    """

    where = "Spark barrier tasks"

    def __init__(self, spark=None):
        spark = spark if spark is not None else _active_session()
        self._context = _spark_context(spark)
        if self._context.master.startswith("local"):
            # Executors are threads of this JVM: nothing outside this machine needs to connect.
            self.bind_host = self.advertised_host = "127.0.0.1"
        else:
            self.bind_host = "0.0.0.0"
            self.advertised_host = self._context.getConf().get("spark.driver.host")
        self._job_group: str | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def task_slots(self) -> int:
        """How many tasks the cluster runs at once: its cores over `spark.task.cpus`."""
        return self._context.defaultParallelism // self._cpus_per_task()

    def check(self, np: int) -> None:
        """Refuse at once a run with more ranks than task slots; Spark would retry for minutes."""
        slots = self.task_slots()
        if np > slots:
            raise ValueError(
                f"np={np} needs {np} Spark task slots at once (barrier tasks start together), "
                f"but this SparkSession has {slots} ({self._context.defaultParallelism} cores, "
                f"spark.task.cpus={self._cpus_per_task()}). Run with np={slots} or fewer, give "
                "the cluster more executors or cores, or run the ranks as local processes.")

    def check_gpus(self, np: int) -> None:
        """GPU ranks need Spark to hand each task a GPU: refuse before launching if it won't."""
        amount = float(self._context.getConf().get("spark.task.resource.gpu.amount", "0"))
        if amount <= 0:
            raise ValueError(
                "GPUs were asked for (--gpu / use_gpu=True), but this SparkSession gives its "
                "tasks no GPUs: create it with spark.task.resource.gpu.amount=1 (and "
                "spark.executor.resource.gpu.amount plus a GPU discovery script), or drop the "
                "GPU option")

    def start(self, np: int, control_address: tuple[str, int], secret: bytes,
              events: queue.Queue) -> None:
        """Submit the barrier stage from a background thread and return at once."""
        context = self._context
        self._job_group = f"ddl_magic-{uuid.uuid4().hex[:12]}"
        self._stopping.clear()
        on_report = functools.partial(_report_rank_end, events)
        reports = context.accumulator([], _RankEndReports(on_report))
        task = functools.partial(_by_value(_run_rank_task), control_address, secret, reports,
                                 OUTPUT_TAIL_LINES)

        def run_stage() -> None:
            # pyspark pins each Python thread to a JVM thread: the job group is this thread's.
            context.setJobGroup(self._job_group, f"ddl_magic: {np} ranks", interruptOnCancel=True)
            try:
                context.parallelize(range(np), np).barrier().mapPartitions(task).collect()
            except Exception as exc:  # whatever ended the job, the run must hear of it
                if not self._stopping.is_set():
                    rank, reason, details = _describe_spark_error(exc)
                    events.put(RankFailed(rank, "", details, reason))

        # An InheritableThread keeps what the calling thread set, e.g. its scheduler pool.
        self._thread = InheritableThread(target=run_stage, name="ddl-spark-stage", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the barrier stage: let the tasks of stopped ranks end, cancel what remains."""
        if self._thread is None:
            return
        self._stopping.set()
        self._thread.join(timeout=STOP_GRACE_S)
        if self._thread.is_alive():
            self._context.cancelJobGroup(self._job_group)
            self._thread.join(timeout=STOP_TIMEOUT_S)
        self._thread = None

    def _cpus_per_task(self) -> int:
        return int(self._context.getConf().get("spark.task.cpus", "1"))


def _active_session():
    session = spark_session()
    if session is None:
        raise RuntimeError(
            "ranks as Spark barrier tasks need an active SparkSession, and there is none. "
            "Create one first (SparkSession.builder.getOrCreate()), or run the ranks as local "
            "processes (%%horovod --local, HorovodRunner(np=-N)).")
    return session


def _spark_context(spark):
    try:
        return spark.sparkContext
    except AttributeError as exc:  # a Spark Connect session has no SparkContext
        raise RuntimeError(
            f"this SparkSession cannot run barrier tasks ({exc}). "
            "ddl_magic needs a classic SparkSession (not Spark Connect), or run the ranks as "
            "local processes (%%horovod --local, HorovodRunner(np=-N)).") from None


def _report_rank_end(events: queue.Queue, rank: int, host: str, returncode: int | None,
                     output: str) -> None:
    """Put on `events` what a local rank's end puts there (`output`: what it printed itself)."""
    if returncode is None:  # the rank never started; `output` says why
        events.put(RankFailed(rank, host, "", output))
    else:
        events.put(ProcessExited(rank, returncode, output))


def _describe_spark_error(exc: Exception) -> tuple[int, str, str]:
    """(the rank whose task failed, or 0; a one-line reason; the message without JVM frames)."""
    java_exception = getattr(exc, "java_exception", None)
    message = java_exception.getMessage() if java_exception is not None else ""
    message = (message or f"{type(exc).__name__}: {exc}").split("\nDriver stacktrace:")[0]
    lines = [line for line in message.splitlines() if line and not line.startswith("\tat ")]
    failed_task = re.search(r"barrier task ResultTask\(\d+, (\d+)\)", message)
    if any("PythonException" in line for line in lines):
        # The task's own Python error: the last line of the traceback Spark quotes.
        cause = [line for line in lines if not line[0].isspace()][-1]
    elif failed_task and len(lines) > 1:
        cause = lines[1]  # under "Stage failed because barrier task ... finished unsuccessfully."
    else:
        cause = lines[0]
    if failed_task:
        return int(failed_task.group(1)), f"its Spark task failed: {cause}", "\n".join(lines) + "\n"
    return 0, f"the Spark job failed: {cause}", "\n".join(lines) + "\n"


class _RankEndReports(AccumulatorParam):
    """The accumulator param on the driver: each task's report goes to `on_report` at once.

    On the executors it is pyspark's own list-adding param, so they need nothing of ours.
    """

    def __init__(self, on_report):
        self._on_report = on_report

    def zero(self, value: list) -> list:
        return []

    def addInPlace(self, reports: list, new: list) -> list:
        for report in new:
            self._on_report(*report)
        return reports + new

    def __reduce__(self):
        return AddingAccumulatorParam, ([],)


def _by_value(function: types.FunctionType) -> types.FunctionType:
    """`function`, rebound to globals of a module nobody can import, so cloudpickle sends its
    code by value: an executor whose Python lacks ddl_magic still runs it and says so.
    The function must import what it uses itself."""
    namespace = {"__name__": "ddl_magic_spark_task", "__builtins__": builtins}
    return types.FunctionType(function.__code__, namespace, function.__name__,
                              function.__defaults__, function.__closure__)


def _run_rank_task(control_address, secret, reports, tail_lines, partition):
    """One barrier task (runs on an executor, sent by value): run rank `partitionId` to its end.

    Reports ``(rank, host, returncode, output tail)`` through `reports` (returncode None when
    the rank could not start) and returns nothing. Never raises for a failed rank.
    """
    import collections
    import importlib.util
    import os
    import socket
    import subprocess
    import sys

    from pyspark import BarrierTaskContext

    task = BarrierTaskContext.get()
    rank = task.partitionId()
    if task.attemptNumber() > 0:
        return []  # Spark retried the task after a failure: a rank never runs twice
    host = socket.gethostname()

    def finish(returncode, output):
        reports.add([(rank, host, returncode, output)])
        return []

    try:
        if importlib.util.find_spec("ddl_magic") is None:
            raise ModuleNotFoundError("No module named 'ddl_magic'")
    except (ImportError, ValueError) as exc:
        return finish(None, (
            f"the executors' Python ({sys.executable}) cannot import ddl_magic: {exc}. Install "
            "ddl_magic on every executor, or set PYSPARK_PYTHON to a Python that has it"))

    read_end, write_end = os.pipe()
    env = dict(os.environ, DDL_MAGIC_CONTROL=f"{control_address[0]}:{control_address[1]}",
               DDL_MAGIC_RANK=str(rank), DDL_MAGIC_SECRET_FD=str(read_end), PYTHONUNBUFFERED="1")
    gpus = task.resources().get("gpu")
    if gpus is not None:  # the GPUs Spark gave this task are the only ones the rank sees
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus.addresses)
    with os.fdopen(write_end, "wb") as pipe:
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "ddl_magic.worker"], env=env, pass_fds=(read_end,),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except OSError as exc:
            return finish(None, f"cannot start {sys.executable} on {host}: {exc}")
        finally:
            os.close(read_end)
        pipe.write(secret)
    # The rank forwards its output over the control channel once registered; what arrives
    # here is what it printed before that (e.g. why it could not connect) or after.
    tail = collections.deque((line.decode(errors="replace") for line in process.stdout),
                             maxlen=tail_lines)
    return finish(process.wait(), "".join(tail))
