"""Ranks as Spark barrier tasks: one barrier stage of `np` tasks, each running one rank.
An elastic run's ranks are one-task jobs instead (below).

Barrier mode gives gang scheduling (all ranks start together or none does) and
all-or-nothing failure; everything else is ours. Spark Connect sessions (Databricks' shared
and serverless compute) have only the DataFrame API's barrier mode (``mapInArrow(...,
barrier=True)``), and every run over a DataFrame uses it; a classic session runs a run without
data as an RDD barrier stage, whose tasks start about a second sooner. How the stage is
submitted, counted and cancelled is all that differs (`_ClassicJobs`, `_ConnectJobs`). Each task
has its rank forked as a local rank is, by a rank factory (one per Python worker, which Spark
reuses from task to task, so a rank starts with torch already imported), so the rank is
isolated from Spark's reused Python worker, and waits for it.
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
  server (`rank/spark_task.TaskRelay`) what its rank's process writes, then at once that it ended;
  a task that cannot (its Python lacks ddl_magic, the driver is out of reach) says so in the
  row it returns. The task, not the rank, reading the rank's output means a rank killed
  mid-line still has its last words shown.

Elastic runs (min_np/max_np) live with barrier mode's all-or-nothing the other way round:
they are not one stage. Each rank is a Spark job of one task, so a lost executor fails the
tasks it ran and no other; the ranks left go on from their last commit. A lost rank's
replacement is a new one-task job, which Spark places on any free slot, or keeps waiting
until one frees up or a lost host comes back (`replacements_join_later`: the world does not
wait for it, and it joins at the ranks' next commit, `driver/elastic.py`). What barrier mode
gave is ours here: the driver waits for every rank to register, and a rank dies with its
task (`rank/spark_task.py`). Horovod's `run_elastic` does the same in its own way: long-lived
tasks that start and stop ranks.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import itertools
import queue
import re
import threading
import time
import types
import uuid
from collections.abc import Callable

from pyspark import InheritableThread

from ..driver.events import FailureKind, ProcessExited, RankFailed, describe_ranks
from ..wire.liveness import report_interval_s
from ..wire.channel import peer_timeout_s
from ..rank.spark_task import run_rank_task
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
    """Starts `np` ranks as one barrier stage on a SparkSession and stops them on request
    (the driver's `Launcher` contract, `driver/launcher.py`).

    >>> launcher = SparkLauncher()          # the active SparkSession, classic or Connect
    >>> Job(task, 4, launcher, JobOptions()).run()
    """

    where = "Spark barrier tasks"
    elastic_where = "Spark tasks, one job per rank"  # where an elastic run's ranks are
    forwards_output = True  # each task relays its rank's output, then its exit
    replacements_join_later = True  # an elastic run's replacement waits for a free slot
    caps_memory = False  # a rank has its executor's memory (spark.executor.memory)

    def __init__(self, spark=None, data=None):
        """`data`: the `ShareStage` of a run given Spark DataFrames (`spark_shares.py`). The
        barrier stage then runs over it, one partition per rank, and each task writes its
        rank's shares beside it."""
        self._data = data
        if spark is None:
            spark = data.frame.sparkSession if data is not None else _active_session()
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
        self._threads: list[threading.Thread] = []  # the stage's, or every elastic rank's job's
        self._stopping = threading.Event()
        self._start_task = None  # an elastic run's: (slot) -> start a one-task job for it
        self._rank_jobs: dict[int, _RankJob] = {}  # an elastic run's, by slot
        self._job_numbers = itertools.count()

    @staticmethod
    def describe_lost(host: str, ranks: list[int]) -> str:
        """Ranks of one host vanished, and no task reported their exit: what ran them is gone."""
        return (f"the Spark executor on {host} was lost, and {describe_ranks(ranks)} with it "
                "(its process or its worker was killed, ran out of memory, or the host went down)")

    def renewed(self) -> SparkLauncher:
        """A launcher on the session active now (a pool restarted after `spark.stop()` and a
        new session runs on the new one)."""
        return SparkLauncher(data=self._data)

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

    def check_elastic(self, np: int, max_np: int) -> None:
        """An elastic run keeps its `np` slots (a replacement takes a lost rank's), and its
        ranks read their own data: a DataFrame is split once, for the ranks it starts with."""
        if self._data is not None:
            raise ValueError("an elastic run on Spark cannot be given a Spark DataFrame: its "
                             "shares are written once, by the tasks the run starts with, and a "
                             "lost rank's would be lost with it. Write the DataFrame to Parquet "
                             "and give the path (a replacement then reads the lost rank's rows "
                             "again from the files), or drop min_np and max_np")
        if max_np > np:
            raise ValueError(f"max_np={max_np} is above np={np}: an elastic run on Spark "
                             f"replaces lost ranks and keeps at most its {np} ranks. Use "
                             f"-np {max_np}, or leave max_np out")

    def check_gpus(self, np: int) -> None:
        """GPU ranks need Spark to hand each task a GPU: refuse before launching if it won't."""
        if float(self._conf("spark.task.resource.gpu.amount", "0")) <= 0:
            raise ValueError(
                "GPUs were asked for (--gpu / use_gpu=True), but this SparkSession gives its "
                "tasks no GPUs: create it with spark.task.resource.gpu.amount=1 (and "
                "spark.executor.resource.gpu.amount plus a GPU discovery script), or drop the "
                "GPU option")

    def start(self, np: int, control_address: tuple[str, int], secret: bytes,
              events: queue.Queue, elastic: bool = False) -> None:
        """Submit the barrier stage (`elastic`: one job per rank) from background threads and
        return at once."""
        self._job_tag = f"ddl_magic-{uuid.uuid4().hex[:12]}"
        self._stopping.clear()
        task = functools.partial(_by_value(run_rank_task), control_address, secret,
                                 OUTPUT_TAIL_LINES, report_interval_s(peer_timeout_s()),
                                 self._data.plan if self._data is not None else None)
        if not elastic:
            self._submit(self._job_tag, f"ddl_magic: {np} ranks",
                         self._jobs.barrier_stage(np, task, self._data), events, slot=None)
            return
        self._rank_jobs = {}

        def start_rank(slot: int) -> None:
            job = self._rank_jobs[slot] = _RankJob(f"{self._job_tag}-{slot}-{next(self._job_numbers)}")
            job.thread = self._submit(job.tag, f"ddl_magic: rank slot {slot}",
                                      self._jobs.rank_job(slot, task), events, slot=slot)

        self._start_task = start_rank
        for slot in range(np):
            start_rank(slot)

    def _submit(self, tag: str, description: str, run_tasks: Callable[[], list[dict]],
                events: queue.Queue, slot: int | None) -> threading.Thread:
        """Run a Spark job on a thread of its own; tell the run how its tasks ended, or why
        the job failed (`slot`: the rank slot whose job it is; None: a barrier stage's)."""

        def run_job() -> None:
            self._jobs.tag_this_thread(tag, description)
            try:
                ended = run_tasks()
            except Exception as exc:  # whatever ended the job, the run must hear of it
                superseded = slot is not None and self._superseded(slot, tag)
                if not self._stopping.is_set() and not superseded:
                    rank, reason, details = _describe_spark_error(exc)
                    # An executor that died took its ranks with it (the driver names its host).
                    kind = (FailureKind.VANISHED if "ExecutorLostFailure" in details
                            else FailureKind.TASK_FAILED)
                    events.put(RankFailed(rank if slot is None else slot, "",
                                          kind, details, reason, at_ns=time.monotonic_ns()))
                return
            if slot is not None and self._superseded(slot, tag):
                return
            for task_end in ended:  # what the control server has not heard already
                if not task_end["reported"]:
                    events.put(ProcessExited(task_end["rank"], task_end["returncode"],
                                             task_end["output"], task_end["host"]))

        # An InheritableThread keeps what the calling thread set, e.g. its scheduler pool.
        thread = InheritableThread(target=run_job, session=self._spark, name="ddl-spark-job",
                                   daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    def _superseded(self, slot: int, tag: str) -> bool:
        """Whether the job `tag` ran a rank of `slot` that was since replaced or killed."""
        job = self._rank_jobs.get(slot)
        return job is None or job.tag != tag

    def replace(self, slot: int) -> bool:
        """Start a new rank in `slot` as a job of its own (an elastic run); the old one's job,
        if Spark still runs or retries it, is cancelled first. False: nothing of the old
        rank is reported from now on (the control server hears only a rank's newest task)."""
        self._end_rank_job(slot, wait_s=0.5)
        self._start_task(slot)
        return False

    def kill(self, slot: int) -> None:
        """Cancel the job of the rank in `slot` (stopped, unreachable or hung in an elastic
        run): its task ends, and the rank's process dies with it. Does not wait: a job on an
        executor out of reach ends only once Spark gives the executor up."""
        self._end_rank_job(slot, wait_s=0.0)

    def _end_rank_job(self, slot: int, wait_s: float) -> None:
        job = self._rank_jobs.pop(slot, None)  # what it reports from now on is old news
        if job is None:
            return
        job.thread.join(timeout=wait_s)
        if job.thread.is_alive():
            self._jobs.cancel(job.tag)

    def stop(self, finished: bool = False) -> None:
        """End the ranks' jobs: let the tasks of stopped ranks end, cancel what remains
        (`finished` or not: a task ends once its rank has)."""
        if not self._threads:
            return
        self._stopping.set()
        deadline = time.monotonic() + STOP_GRACE_S
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):
            self._jobs.cancel(self._job_tag)
            for job in self._rank_jobs.values():
                self._jobs.cancel(job.tag)
            # One deadline for all: a job whose executor is out of reach ends only when Spark
            # gives the executor up (spark.network.timeout), and its thread is a daemon.
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for thread in self._threads:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._threads, self._rank_jobs, self._start_task = [], {}, None

    def _conf(self, key: str, default: str | None = None) -> str | None:
        return self._spark.conf.get(key, default)

    def _cpus_per_task(self) -> int:
        return int(self._conf("spark.task.cpus", "1"))


@dataclasses.dataclass
class _RankJob:
    """An elastic run's rank: the tag of the Spark job that runs its task, and the thread
    that waits for the job."""

    tag: str
    thread: threading.Thread | None = None


def _dataframe_stage(spark, np: int, task, data) -> Callable[[], list[dict]]:
    """The barrier stage in the DataFrame API: over the run's `ShareStage` (its datasets
    keyed into `np` partitions), or over `np` empty partitions."""
    partitions = spark.range(0, np, 1, np) if data is None else data.frame
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

    def rank_job(self, slot: int, task) -> Callable[[], list[dict]]:
        return self._context.parallelize([slot], 1).mapPartitions(
            functools.partial(task, False, slot=slot)).collect

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

    def rank_job(self, slot: int, task) -> Callable[[], list[dict]]:
        job = self._spark.range(0, 1, 1, 1).mapInArrow(functools.partial(task, True, slot=slot),
                                                       TASK_RESULT_SCHEMA)
        return lambda: [row.asDict() for row in job.collect()]

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
