"""Healthy runs must never fail, failing ones must be named in time: a soak, beside busy processes.

    .venv/bin/python tests/fail_fast_soak.py                  # 200 runs, 4 busy processes
    .venv/bin/python tests/fail_fast_soak.py --runs 20 --short

Each run is one workload on 2 real local ranks, started from this process as a notebook
kernel starts them (the rank factory stays warm between runs), in turn: healthy ones (DDP
over gloo and over `ddl`, FSDP, Horovod's API with `DistributedOptimizer`, a rank holding its
GIL in native code for longer than the peer timeout, a `torch.save` of a 200 MB state dict,
the Iris `TorchEstimator` on Spark `local[4]`) and one in ten a true failure (a rank
SIGKILLed, SIGSTOPped, raising, or absent from a collective). A healthy run passes when it
ends well; a failing one when the driver names the right rank, for the right reason, within
its deadline, counted from the moment the rank wrote that it is about to fail. `--short`
(CI's version) holds the GIL for 8 s against a 3 s peer timeout instead of 30 s against 10 s.

Prints a line per run and a table, writes ``benchmarks/results/fail_fast_soak.json``, and
exits 1 on any false or late failure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PRELUDE = """
import os, signal, sys, threading, time
import torch
torch.manual_seed(0)
"""

def trains(backend: str, wrapped: str) -> str:
    """20 steps of a small model, `wrapped` (DDP or FSDP of `net`), over `backend`; the group
    destroyed at the end, as the README's own torch.distributed code does."""
    return f"""
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("{backend}")
net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
model = {wrapped}
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(20):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(torch.randn(32, 20)), torch.randint(0, 2, (32,))).backward()
    opt.step()
dist.destroy_process_group()
"""


HEALTHY = {
    "ddp over gloo": trains("gloo", "DistributedDataParallel(net)"),
    "ddp over ddl": trains("ddl", "DistributedDataParallel(net)"),
    "fsdp": trains("gloo", 'FullyShardedDataParallel(net, device_id=torch.device("cpu"), '
                           "use_orig_params=True)"),
    "hvd DistributedOptimizer": """
import ddl_magic.torch as hvd
hvd.init()
model = torch.nn.Linear(20, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for _ in range(20):
    opt.zero_grad()
    model(torch.randn(32, 20)).sum().backward()
    opt.step()
""",
    "GIL held in native code": """
import ctypes
import ddl_magic.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(1), name="before")
if hvd.rank() == 1:
    ctypes.PyDLL(None).sleep(int(os.environ["SOAK_GIL_SECONDS"]))  # libc sleep, GIL held
assert hvd.allreduce(torch.ones(1), name="after").item() == 1.0
""",
    "torch.save 200 MB": """
import tempfile
import ddl_magic.torch as hvd
hvd.init()
state = {f"layer{i}": torch.randn(1024, 1024) for i in range(50)}  # 50 x 4 MiB
with tempfile.TemporaryDirectory() as folder:
    torch.save(state, os.path.join(folder, "state.pt"))
hvd.allreduce(torch.ones(1), name="saved")
""",
}

# The estimator runs in the soak's own process (a notebook's SparkSession), not under ddlrun.
ESTIMATOR = "Iris TorchEstimator on local[4]"


def fails_on_rank(rank: int, how: str) -> str:
    """Two ranks allreduce, then `rank` says when, and fails (`how`), before the second."""
    return f"""
import ddl_magic.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(1))
if hvd.rank() == {rank}:
    print("FAILING AT", time.time(), flush=True)
    {how}
hvd.allreduce(torch.ones(1))
"""


# kind -> (the rank's code, the rank that fails, the reason ddlrun must give, deadline in s)
FAILING = {
    "SIGKILL": (fails_on_rank(1, "os.kill(os.getpid(), signal.SIGKILL)"), 1, "killed by SIGKILL", 5.0),
    # deadline None: the peer timeout (a stop), DDL_MAGIC_TIMEOUT (an absent rank), + slack
    "SIGSTOP": (fails_on_rank(1, "os.kill(os.getpid(), signal.SIGSTOP)"), 1,
                "stopped: its process has been stopped", None),
    "raises": (fails_on_rank(0, 'raise ValueError("rank 0 is unhappy")'), 0, "exception", 5.0),
    "absent from a collective": ("""
import ddl_magic.torch as hvd
hvd.init()
if hvd.rank() == 0:
    print("FAILING AT", time.time(), flush=True)
    hvd.allreduce(torch.ones(1), name="lonely")
else:
    threading.Event().wait(300)
""", 0, "collective timed out", None),
}
SLACK_S = 1.0  # past a deadline: the driver's loop and the report's own way to it


@dataclass
class Outcome:
    workload: str
    expected_failure: bool
    ok: bool
    seconds: float
    named_after_s: float | None = None
    detail: str = ""


@dataclass
class Soak:
    peer_timeout_s: float
    gil_seconds: int
    collective_timeout_s: float = 5.0
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ddl_soak-")))

    def environment(self) -> dict[str, str]:
        """For this process (the driver, as a notebook kernel is) and the ranks it starts."""
        return {"DDL_MAGIC_PEER_TIMEOUT": str(self.peer_timeout_s), "DDL_MAGIC_DISPLAY": "text",
                "SOAK_GIL_SECONDS": str(self.gil_seconds)}

    def run(self, name: str, code: str, env: dict[str, str] | None = None):
        """Run `code` as a script on 2 local ranks, from this process, as a notebook runs a
        cell: (the run's record, its error or None, seconds)."""
        from ddl_magic.driver.job import Job, JobOptions
        from ddl_magic.driver.run_result import RankFailedError
        from ddl_magic.launch.local import LocalLauncher
        from ddl_magic.wire.tasks import ScriptTask

        script = self.folder / (name.replace(" ", "_").replace(".", "") + ".py")
        script.write_text(PRELUDE + code)
        options = JobOptions(timeout_s=300, env=env or {}, hide_output=True, title=name)
        started = time.monotonic()
        try:  # (a run that hangs ends at its timeout: RunTimeoutError, a wrong outcome)
            record = Job(ScriptTask(str(script), []), 2, LocalLauncher(), options).run()
            return record, None, time.monotonic() - started
        except RankFailedError as error:
            return error.run, error, time.monotonic() - started
        except Exception as error:  # a timeout, or a bug of ours: never a right outcome
            return None, error, time.monotonic() - started

    def healthy(self, name: str) -> Outcome:
        _, error, seconds = self.run(name, HEALTHY[name])
        return Outcome(name, False, error is None, seconds, detail=str(error or "")[-2000:])

    def failing(self, kind: str) -> Outcome:
        code, rank, reason, deadline = FAILING[kind]
        # Only the absent rank's run shortens the collective timeout: below the peer timeout it
        # would also end the others' wait for a stopped rank first (a peer timed out, as asked).
        absent = kind == "absent from a collective"
        if deadline is None:
            deadline = self.collective_timeout_s if absent else self.peer_timeout_s
        env = {"DDL_MAGIC_TIMEOUT": f"{self.collective_timeout_s:g}"} if absent else {}
        record, error, seconds = self.run(kind, code, env)
        outcome = Outcome(kind, True, False, seconds)
        failing_at = None
        if record is not None:
            failing_at = next((float(line.split("FAILING AT ")[1])
                               for line in record.log(rank).splitlines() if "FAILING AT " in line),
                              None)
        if error is None or not hasattr(error, "rank") or failing_at is None:
            outcome.detail = f"no failure named as expected: {error!r}"[-2000:]
            return outcome
        # When the driver judged the failure (the rank's record ended then; it shows at once).
        outcome.named_after_s = record.ranks[error.rank].ended_at - failing_at
        outcome.ok = (error.rank == rank and error.reason.startswith(reason)
                      and outcome.named_after_s <= deadline + SLACK_S)
        if not outcome.ok:
            outcome.detail = (f"rank {error.rank}: {error.reason}, after "
                              f"{outcome.named_after_s:.2f} s (deadline {deadline:g} s)")
        return outcome

    def estimator(self, spark) -> Outcome:
        from pyspark.ml import Pipeline
        from pyspark.ml.feature import VectorAssembler

        from ddl_magic.labs.datasets import IRIS_FEATURES, load_iris
        from ddl_magic.spark.estimator import TorchEstimator

        started = time.monotonic()
        try:
            import torch

            iris = spark.createDataFrame(load_iris().drop(columns=["species"]))
            net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
            estimator = TorchEstimator(
                model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.02),
                loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"],
                label_cols=["label"], batch_size=16, epochs=5, num_proc=2, verbose=0)
            Pipeline(stages=[VectorAssembler(inputCols=list(IRIS_FEATURES), outputCol="features"),
                             estimator]).fit(iris)
        except Exception as exc:
            return Outcome(ESTIMATOR, False, False, time.monotonic() - started, detail=repr(exc))
        return Outcome(ESTIMATOR, False, True, time.monotonic() - started)


def schedule(runs: int) -> list[tuple[str, str]]:
    """(healthy or failing, workload) for each run: one in ten a failure (in a short soak, often
    enough that every kind of failure comes once), the kinds in turn; the two slow healthy
    workloads (the GIL held for 30 s, a Spark fit) as often as each kind of failure."""
    failing = list(FAILING)
    slow = ["GIL held in native code", ESTIMATOR]
    quick = [name for name in HEALTHY if name not in slow]
    every = 10 if runs >= 10 * len(failing) else max(2, runs // len(failing))
    healthy = quick * 3 + slow if runs >= 10 * len(failing) else [*quick, *slow]
    plan = []
    for index in range(runs):
        failures_so_far = (index + 1) // every
        if (index + 1) % every == 0:
            plan.append(("failing", failing[(failures_so_far - 1) % len(failing)]))
        else:
            plan.append(("healthy", healthy[(index - failures_so_far) % len(healthy)]))
    return plan


def spin() -> None:
    while True:
        pass


def local_spark():
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return (SparkSession.builder.master("local[4]").config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false").getOrCreate())


def soak(runs: int, hogs: int, short: bool) -> list[Outcome]:
    """Run the soak; the outcome of every run, in order."""
    plan = schedule(runs)
    settings = Soak(peer_timeout_s=3.0, gil_seconds=8) if short else Soak(peer_timeout_s=10.0,
                                                                         gil_seconds=30)
    saved = {name: os.environ.get(name) for name in settings.environment()}
    os.environ.update(settings.environment())
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(hogs)]
    for spinner in spinners:
        spinner.start()
    spark = None
    outcomes = []
    try:
        for number, (kind, workload) in enumerate(plan, 1):
            if workload == ESTIMATOR:
                spark = spark or local_spark()
                outcome = settings.estimator(spark)
            elif kind == "healthy":
                outcome = settings.healthy(workload)
            else:
                outcome = settings.failing(workload)
            outcomes.append(outcome)
            named = f", named after {outcome.named_after_s:.2f} s" if outcome.named_after_s else ""
            print(f"run {number:3}: {workload:28} {'ok' if outcome.ok else 'WRONG'} "
                  f"({outcome.seconds:.1f} s{named})", flush=True)
            if not outcome.ok:
                print(outcome.detail, flush=True)
    finally:
        for spinner in spinners:
            spinner.kill()
        if spark is not None:
            spark.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return outcomes


def report(outcomes: list[Outcome], hogs: int) -> dict:
    healthy = [o for o in outcomes if not o.expected_failure]
    failing = [o for o in outcomes if o.expected_failure]
    summary = {"runs": len(outcomes), "busy_processes": hogs,
               "healthy_runs": len(healthy), "false_failures": sum(not o.ok for o in healthy),
               "true_failures": len(failing), "true_failures_named": sum(o.ok for o in failing),
               "named_after_s": {}}
    print(f"\n{len(outcomes)} runs beside {hogs} busy processes")
    print("| workload | runs | wrong | median s |")
    print("|---|---|---|---|")
    for workload in dict.fromkeys(o.workload for o in outcomes):
        mine = [o for o in outcomes if o.workload == workload]
        print(f"| {workload} | {len(mine)} | {sum(not o.ok for o in mine)} | "
              f"{statistics.median(o.seconds for o in mine):.1f} |")
        named = [o.named_after_s for o in mine if o.named_after_s is not None]
        if named:
            summary["named_after_s"][workload] = {"max": max(named), "median": statistics.median(named)}
    print(f"false failures: {summary['false_failures']} of {len(healthy)} healthy runs; true "
          f"failures named right and in time: {summary['true_failures_named']} of {len(failing)}")
    for workload, times in summary["named_after_s"].items():
        print(f"  {workload}: named after {times['median']:.2f} s median, {times['max']:.2f} s at most")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--hogs", type=int, default=4, help="busy processes beside the runs")
    parser.add_argument("--short", action="store_true",
                        help="CI's settings: a 3 s peer timeout, the GIL held for 8 s")
    args = parser.parse_args()
    outcomes = soak(args.runs, args.hogs, args.short)
    summary = report(outcomes, args.hogs)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "fail_fast_soak.json").write_text(json.dumps(summary, indent=2))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
