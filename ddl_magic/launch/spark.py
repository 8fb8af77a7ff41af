"""Ranks as Spark barrier tasks: one barrier stage of `np` tasks, each running one rank.

Barrier mode gives gang scheduling (all ranks start together or none does) and
all-or-nothing failure; everything else is ours. Spark Connect sessions (Databricks' shared
and serverless compute) have only the DataFrame API's barrier mode (``mapInArrow(...,
barrier=True)``), and every run over a DataFrame uses it; a classic session runs a run without
data as an RDD barrier stage, whose tasks start about a second sooner. How the stage is
submitted, counted and cancelled is all that differs (`_ClassicJobs`, `_ConnectJobs`). Each task
starts the same worker bootstrap as a local rank, ``python -m ddl_magic.worker``, as a child
process, so the rank is isolated from Spark's reused Python worker, and waits for it.
Rendezvous goes through the driver's control server, not Spark's ``allGather`` (about a
second per call).

Three Spark behaviours shape this module:

- A barrier stage that asks for more slots than the cluster has is retried by Spark for
  minutes before it fails, so `check` refuses it at once.
- Spark re-runs failed tasks. A task here never raises for a failed rank (the rank reports
  that itself over the control channel), and an attempt after the first returns at once, so
  a failure never starts the training a second time.
- The job returns only when every task has ended, but a rank that dies before it registers
  would leave the others waiting for it. Each task therefore relays to the driver's control
  server (`control.TaskRelay`) what its rank's process writes, then at once that it ended;
  a task that cannot (its Python lacks ddl_magic, the driver is out of reach) says so in the
  row it returns. The task, not the rank, reading the rank's output means a rank killed
  mid-line still has its last words shown.
"""

from __future__ import annotations

import builtins
import functools
import queue
import re
import threading
import time
import types
import uuid
from collections.abc import Callable

from pyspark import InheritableThread

from ..events import FailureKind, ProcessExited, RankFailed, describe_ranks
from ..liveness import report_interval_s
from ..protocol import peer_timeout_s
from . import spark_session

# How many lines of a rank's own stdout/stderr (what it printed before it could report over
# the control channel, e.g. an import error) come back with its task.
OUTPUT_TAIL_LINES = 40
# After the ranks were told to stop, how long their tasks may take to end by themselves
# before the Spark job is cancelled (cancelling kills Spark's Python workers with them).
STOP_GRACE_S = 2.0
STOP_TIMEOUT_S = 30.0
# What each barrier task returns: how its rank's process ended, and whether the driver has
# already heard so over the control server.
TASK_RESULT_SCHEMA = ("rank long, host string, returncode long, output string, "
                      "reported boolean")


class SparkLauncher:
    """Starts `np` ranks as one barrier stage on a SparkSession and stops them on request.

    >>> launcher = SparkLauncher()          # the active SparkSession, classic or Connect
    >>> Job(task, 4, launcher, JobOptions()).run()
    """

    where = "Spark barrier tasks"
    forwards_output = True  # each task relays its rank's output, then its exit

    def __init__(self, spark=None, data=None):
        """`data`: a DataFrame the ranks train on. The stage then runs over it, repartitioned
        into one partition per rank, and each rank reads its partition with `read_shard`."""
        self._data = data
        if spark is None:
            spark = data.sparkSession if data is not None else _active_session()
        self._spark = spark
        self._jobs = _ConnectJobs(self._spark) if _is_connect(self._spark) else _ClassicJobs(
            self._spark)
        if self._conf("spark.master", "").startswith("local"):
            # Executors are threads of one JVM on this machine: nothing else needs to connect.
            self.bind_host = self.advertised_host = "127.0.0.1"
        else:  # the executors reach this process where they reach Spark's driver
            self.advertised_host = self._conf("spark.driver.host")
            self.bind_host = self._conf("spark.driver.bindAddress", self.advertised_host)
        self._job_tag: str | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    @staticmethod
    def describe_lost(host: str, ranks: list[int]) -> str:
        """Ranks of one host vanished, and no task reported their exit: what ran them is gone."""
        return (f"the Spark executor on {host} was lost, and {describe_ranks(ranks)} with it "
                "(its process or its worker was killed, ran out of memory, or the host went down)")

    def check(self, np: int) -> None:
        """Refuse at once a run with more ranks than task slots (its cores over
        `spark.task.cpus`): Spark would retry the barrier stage for minutes."""
        cores, cpus_per_task = self._jobs.default_parallelism(), self._cpus_per_task()
        slots = cores // cpus_per_task
        if np > slots:
            raise ValueError(
                f"np={np} needs {np} Spark task slots at once (barrier tasks start together), "
                f"but this SparkSession has {slots} ({cores} cores, "
                f"spark.task.cpus={cpus_per_task}). Run with np={slots} or fewer, give "
                "the cluster more executors or cores, or run the ranks as local processes. "
                "(Executors still starting do not count yet: on a cluster that just started, "
                "run again once they have registered.)")

    def check_gpus(self, np: int) -> None:
        """GPU ranks need Spark to hand each task a GPU: refuse before launching if it won't."""
        if float(self._conf("spark.task.resource.gpu.amount", "0")) <= 0:
            raise ValueError(
                "GPUs were asked for (--gpu / use_gpu=True), but this SparkSession gives its "
                "tasks no GPUs: create it with spark.task.resource.gpu.amount=1 (and "
                "spark.executor.resource.gpu.amount plus a GPU discovery script), or drop the "
                "GPU option")

    def start(self, np: int, control_address: tuple[str, int], secret: bytes,
              events: queue.Queue) -> None:
        """Submit the barrier stage from a background thread and return at once."""
        self._job_tag = f"ddl_magic-{uuid.uuid4().hex[:12]}"
        self._stopping.clear()
        task = functools.partial(_by_value(_run_rank_task), control_address, secret,
                                 OUTPUT_TAIL_LINES, report_interval_s(peer_timeout_s()),
                                 self._data is not None)
        run_tasks = self._jobs.barrier_stage(np, task, self._data)

        def run_stage() -> None:
            self._jobs.tag_this_thread(self._job_tag, f"ddl_magic: {np} ranks")
            try:
                ended = run_tasks()
            except Exception as exc:  # whatever ended the job, the run must hear of it
                if not self._stopping.is_set():
                    rank, reason, details = _describe_spark_error(exc)
                    # An executor that died took its ranks with it (the driver names its host).
                    kind = (FailureKind.VANISHED if "ExecutorLostFailure" in details
                            else FailureKind.TASK_FAILED)
                    events.put(RankFailed(rank, "", kind, details, reason,
                                          at_ns=time.monotonic_ns()))
                return
            for task_end in ended:  # what the control server has not heard already
                if not task_end["reported"]:
                    events.put(ProcessExited(task_end["rank"], task_end["returncode"],
                                             task_end["output"], task_end["host"]))

        # An InheritableThread keeps what the calling thread set, e.g. its scheduler pool.
        self._thread = InheritableThread(target=run_stage, session=self._spark,
                                         name="ddl-spark-stage", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the barrier stage: let the tasks of stopped ranks end, cancel what remains."""
        if self._thread is None:
            return
        self._stopping.set()
        self._thread.join(timeout=STOP_GRACE_S)
        if self._thread.is_alive():
            self._jobs.cancel(self._job_tag)
            self._thread.join(timeout=STOP_TIMEOUT_S)
        self._thread = None

    def _conf(self, key: str, default: str | None = None) -> str | None:
        return self._spark.conf.get(key, default)

    def _cpus_per_task(self) -> int:
        return int(self._conf("spark.task.cpus", "1"))


def _dataframe_stage(spark, np: int, task, data) -> Callable[[], list[dict]]:
    """The barrier stage in the DataFrame API: over `data` split into `np` partitions (round
    robin: sizes differ by one row at most), or over `np` empty ones."""
    partitions = spark.range(0, np, 1, np) if data is None else data.repartition(np)
    stage = partitions.mapInArrow(functools.partial(task, True), TASK_RESULT_SCHEMA,
                                  barrier=True)
    return lambda: [row.asDict() for row in stage.collect()]


class _ClassicJobs:
    """A classic session's jobs: counted and cancelled through its SparkContext.

    A run without data uses the RDD API's barrier stage: its tasks start about a second
    sooner than an Arrow stage's, whose Python workers import pyarrow and pandas.
    """

    def __init__(self, spark):
        self._spark = spark
        self._context = spark.sparkContext

    def barrier_stage(self, np: int, task, data) -> Callable[[], list[dict]]:
        if data is not None:
            return _dataframe_stage(self._spark, np, task, data)
        stage = self._context.parallelize(range(np), np).barrier().mapPartitions(
            functools.partial(task, False))
        return stage.collect

    def default_parallelism(self) -> int:
        return self._context.defaultParallelism

    def tag_this_thread(self, tag: str, description: str) -> None:
        # pyspark pins each Python thread to a JVM thread: the job group is this thread's.
        self._context.setJobGroup(tag, description, interruptOnCancel=True)

    def cancel(self, tag: str) -> None:
        self._context.cancelJobGroup(tag)


class _ConnectJobs:
    """A Spark Connect session's jobs: no SparkContext, so counted by a query, cancelled by tag."""

    def __init__(self, spark):
        self._spark = spark

    def barrier_stage(self, np: int, task, data) -> Callable[[], list[dict]]:
        return _dataframe_stage(self._spark, np, task, data)

    def default_parallelism(self) -> int:
        # `range` without a partition count splits into the default parallelism, the number
        # the classic session reads from its SparkContext. A JVM-only query: no Python worker.
        from pyspark.sql import functions

        partitions = self._spark.range(1 << 16).select(functions.spark_partition_id().alias("p"))
        return partitions.agg(functions.max("p")).first()[0] + 1

    def tag_this_thread(self, tag: str, description: str) -> None:
        self._spark.addTag(tag)  # a Connect session's tags are per thread, as job groups are

    def cancel(self, tag: str) -> None:
        self._spark.interruptTag(tag)


def _is_connect(spark) -> bool:
    return type(spark).__module__.startswith("pyspark.sql.connect")


def _active_session():
    session = spark_session()
    if session is None:
        raise RuntimeError(
            "ranks as Spark barrier tasks need an active SparkSession, and there is none. "
            "Create one first (SparkSession.builder.getOrCreate()), or run the ranks as local "
            "processes (%%horovod --local, HorovodRunner(np=-N)).")
    return session


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
    if cause.startswith("ModuleNotFoundError"):  # e.g. pyarrow, which the stage itself needs
        cause += (". The executors' Python lacks what ddl_magic needs: install ddl_magic on "
                  "every executor, or set PYSPARK_PYTHON to a Python that has it")
    if failed_task:
        return int(failed_task.group(1)), f"its Spark task failed: {cause}", "\n".join(lines) + "\n"
    return 0, f"the Spark job failed: {cause}", "\n".join(lines) + "\n"


def _by_value(function: types.FunctionType) -> types.FunctionType:
    """`function`, rebound to globals of a module nobody can import, so cloudpickle sends its
    code by value: an executor whose Python lacks ddl_magic still runs it and says so.
    The function must import what it uses itself."""
    namespace = {"__name__": "ddl_magic_spark_task", "__builtins__": builtins}
    return types.FunctionType(function.__code__, namespace, function.__name__,
                              function.__defaults__, function.__closure__)


def _run_rank_task(control_address, secret, tail_lines, report_interval, hand_over_rows,
                   as_arrow, batches):
    """One barrier task (runs on an executor, sent by value): run rank `partitionId` to its end.

    The task owns its rank's process: every `report_interval` seconds it tells the driver
    what state the kernel says the process is in (`liveness.py`), from a thread that the
    rank's own Python cannot starve.

    With `hand_over_rows`, the partition's rows are the rank's share of the data it trains
    on (`ddl_magic.shards`). Tells the driver how the rank's process ended (returncode None:
    it could not start, and the output says why), and returns that as one row of
    `TASK_RESULT_SCHEMA`: an Arrow batch of one row (`as_arrow`, in a DataFrame stage) or a
    dict (in an RDD stage). Never raises for a failed rank.
    """
    import collections
    import importlib.util
    import os
    import socket
    import subprocess
    import sys
    import threading

    from pyspark import BarrierTaskContext

    task = BarrierTaskContext.get()
    rank = task.partitionId()
    if task.attemptNumber() > 0:
        return  # Spark retried the task after a failure: a rank never runs twice
    host = socket.gethostname()

    relay = None
    try:
        from ddl_magic.control import TaskRelay

        relay = TaskRelay(control_address, secret, rank)
        relay.started([info.address for info in task.getTaskInfos()])  # the driver probes them
    except (ImportError, OSError):
        relay = None  # the rank forwards its own output; this task reports in the row it returns

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
                    [sys.executable, "-m", "ddl_magic.worker"], env=env,
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
            from ddl_magic.output_lines import forward_lines

            def forward(pipe, stream):
                forward_lines(lambda: pipe.read1(65536), lambda lines: relay.output(stream, lines))

            forwarders = [threading.Thread(target=forward, args=(pipe, stream), daemon=True)
                          for pipe, stream in ((process.stdout, "stdout"), (process.stderr, "stderr"))]
            for forwarder in forwarders:
                forwarder.start()
            from ddl_magic.liveness import process_state

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
        if hand_over_rows:  # written while the rank starts; it waits for the word on a pipe
            from ddl_magic import shards

            shard = shards.new_shard_path()
            ready_read, ready_write = os.pipe()
            try:
                returncode, output = run_rank(
                    {shards.SHARD_VARIABLE: shard, shards.READY_FD_VARIABLE: str(ready_read)},
                    (ready_read,), lambda: shards.write_shard(batches, shard, ready_write))
            finally:
                os.close(ready_write)
                shards.remove_shard(shard)
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
                              ("reported", pyarrow.bool_())])  # TASK_RESULT_SCHEMA
    yield pyarrow.RecordBatch.from_pylist([result], schema=columns)
