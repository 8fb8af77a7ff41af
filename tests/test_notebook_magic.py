"""`%%horovod` in a real IPython kernel, cell by cell, as a user runs it in a notebook."""

import os
import re

import pytest

from kernel import Kernel


SPARK_CLASSIC, SPARK_CONNECT = "Spark barrier tasks", "Spark barrier tasks (Spark Connect)"
START_SPARK = """
import os, sys
os.environ["PYSPARK_PYTHON"] = sys.executable
from pyspark.sql import SparkSession
spark = (SparkSession.builder.{master}.config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "4").getOrCreate())
"""
# The jobs of either kind of session, from the JVM both run in within the kernel.
ACTIVE_SPARK_JOBS = ("from pyspark import SparkContext\n"
                     "SparkContext._active_spark_context.statusTracker().getActiveJobsIds()")


@pytest.fixture(scope="module", params=["local processes", SPARK_CLASSIC, SPARK_CONNECT])
def kernel(request, tmp_path_factory):
    """A notebook kernel; in the later rounds a SparkSession is active (classic, then Spark
    Connect, as Databricks' shared and serverless compute give), so cells run on Spark."""
    # Plain text output: these tests read the ranks' lines from the cell's stream output
    # (the widget view has its own tests).
    kernel = Kernel(env={"DDL_MAGIC_DISPLAY": "text", "SPARK_LOCAL_IP": "127.0.0.1"},
                    cwd=str(tmp_path_factory.mktemp("nb")))
    setup = kernel.run("%load_ext ddl_magic\nimport torch")
    assert setup.error is None, setup.error
    if request.param != "local processes":
        master = 'remote("local[4]")' if request.param == SPARK_CONNECT else 'master("local[4]")'
        started = kernel.run(START_SPARK.format(master=master), timeout=180)
        assert started.error is None, started.error
    kernel.where = request.param
    kernel.on_spark = request.param != "local processes"
    yield kernel
    kernel.close()


def pids_alive(pids):
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


@pytest.mark.long_on_connect  # Spark Connect runs in CI: spark_launcher, estimator, inference
def test_notebook_names_are_captured_and_rank_0_result_is_the_cell_result(kernel):
    kernel.run("scale = 10\ndef times_scale(x):\n    return x * scale")
    out = kernel.run(
        "%%horovod -np 2 -o total\n"
        "import ddl_magic.torch as hvd\n"
        "hvd.init()\n"
        "print(f'rank {hvd.rank()} sees scale={scale}')\n"
        "times_scale(hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item())")
    assert out.error is None, out.error
    assert "captured" in out.stdout and "scale (int)" in out.stdout and "times_scale (function)" in out.stdout
    assert "[0] rank 0 sees scale=10" in out.stdout
    assert "[1] rank 1 sees scale=10" in out.stdout
    assert out.result == "30.0"
    assert kernel.run("total").result == "30.0"
    where = "Spark barrier tasks" if kernel.on_spark else "local processes"
    assert kernel.run("import ddl_magic\nddl_magic.last_run().where").result == repr(where)


@pytest.mark.long_on_connect
def test_names_the_cell_assigns_stay_on_the_ranks(kernel):
    kernel.run("model = 'the notebook model'")
    out = kernel.run("%%horovod -np 2 --quiet\nmodel = 'a rank model'\nmodel")
    assert out.result == "'a rank model'"
    assert "captured" not in out.stdout
    assert kernel.run("model").result == "'the notebook model'"


@pytest.mark.long_on_connect
def test_all_ranks_returns_every_ranks_value(kernel):
    out = kernel.run("%%horovod -np 3 --all-ranks --quiet\n"
                     "import ddl_magic.torch as hvd\nhvd.init()\nhvd.rank() * 10")
    assert out.error is None, out.error
    assert out.result == "[0, 10, 20]"


DDP_DATA = """
import torch
def ddp_model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)
def ddp_train(model, x, y, steps=5):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return sum(float(p.double().sum()) for p in model.parameters())
alone = ddp_train(*ddp_model_and_data())
"""

DDP_CELL = """%%horovod -np {np} -o ddp_checksums
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("{backend}")   # torchrun's environment: nothing else to say
rank, size = dist.get_rank(), dist.get_world_size()
model, x, y = ddp_model_and_data()
checksum = ddp_train(DistributedDataParallel(model), x[rank::size], y[rank::size])
checksums = [None] * size
dist.all_gather_object(checksums, checksum)
checksums
"""


@pytest.mark.parametrize("np, backend", [(1, "ddl"), (2, "gloo"), (2, "ddl"), (3, "gloo"), (4, "ddl")])
def test_plain_ddp_code_trains_in_a_cell_to_the_weights_of_one_process(kernel, np, backend):
    if kernel.where == SPARK_CONNECT:
        pytest.skip("the ranks run the same code as on a classic session; launching on "
                    "Connect is tested by the other cells")
    if kernel.on_spark and np != 2:
        pytest.skip("on Spark, 2 ranks of each backend: other sizes run the same code, and "
                    "local processes train every size")
    setup = kernel.run(DDP_DATA)
    assert setup.error is None, setup.error
    out = kernel.run(DDP_CELL.format(np=np, backend=backend))
    assert out.error is None, out.error
    check = kernel.run("print(len(ddp_checksums), "
                       "max(abs(c - alone) for c in ddp_checksums) < 1e-4 * max(1, abs(alone)))")
    assert check.error is None, check.error
    assert check.stdout.strip() == f"{np} True", (check.stdout, out.stdout)


@pytest.mark.long_on_connect
def test_output_lines_are_attributed_to_their_rank(kernel):
    out = kernel.run("%%horovod -np 2\n"
                     "import sys, logging\nimport ddl_magic.torch as hvd\nhvd.init()\n"
                     "for i in range(3):\n    print(f'line {i} from rank {hvd.rank()}')\n"
                     "print(f'warning from rank {hvd.rank()}', file=sys.stderr)\n"
                     "logging.warning('logged by rank %d', hvd.rank())")
    for rank in range(2):
        for i in range(3):
            assert out.stdout.count(f"[{rank}] line {i} from rank {rank}\n") == 1
        assert f"[{rank}] warning from rank {rank}" in out.stderr
        assert f"[{rank}] WARNING:root:logged by rank {rank}" in out.stderr


@pytest.mark.long_on_connect
def test_a_failing_rank_shows_its_traceback_and_the_next_cell_runs(kernel):
    out = kernel.run("%%horovod -np 2 --quiet\n"
                     "import ddl_magic.torch as hvd\nhvd.init()\n"
                     "if hvd.rank() == 1:\n    raise RuntimeError('loss is nan on rank 1')\n"
                     "hvd.allreduce(torch.ones(1))")
    assert out.error is not None and out.error["ename"] == "RankFailedError"
    assert "rank 1" in out.error["evalue"] and "loss is nan on rank 1" in out.error["evalue"]
    assert "line 5" in out.error["evalue"]  # the line number as the notebook shows it
    # Shown once: the display printed the traceback; the error names who failed and the logs.
    assert out.text.count("RuntimeError: loss is nan on rank 1") == 1, out.text
    (shown,) = out.error["traceback"]
    assert "loss is nan" not in shown and "rank 1" in shown and "full log is in" in shown
    record = kernel.run("import ddl_magic\nr = ddl_magic.last_run()\n"
                        "[(x.rank, x.status) for x in r.ranks], r.status")
    assert record.result == "([(0, 'stopped'), (1, 'failed')], 'failed')"
    assert kernel.run("%%horovod -np 2 --quiet\n1 + 1").result == "2"


@pytest.mark.long_on_connect
def test_a_collectives_error_shows_the_users_line_not_ddl_magics_frames(kernel):
    out = kernel.run("%%horovod -np 2 --quiet\n"
                     "import ddl_magic.torch as hvd\nhvd.init()\n"
                     "hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0, 5]))")
    assert out.error is not None and out.error["ename"] == "RankFailedError"
    assert 'line 4, in <module>' in out.text and "process_set=hvd.ProcessSet([0, 5])" in out.text
    assert "ValueError" in out.text and "inside ddl_magic not shown" in out.text
    assert not re.search(r"ddl_magic/(runtime|torch)/\w+\.py", out.text), out.text
    # Both ranks raise; the first failure to arrive is the run's, and the other rank may have
    # been stopped before its own report came: read the log of a rank that failed.
    log = kernel.run("import ddl_magic\nr = ddl_magic.last_run()\n"
                     "print(r.log(next(x.rank for x in r.ranks if x.failure is not None)))")
    assert re.search(r"ddl_magic/(runtime|torch)/\w+\.py", log.stdout)  # the log keeps every frame


def test_unpicklable_variable_is_named_before_anything_starts(kernel):
    kernel.run("import threading\nlock = threading.Lock()")
    out = kernel.run("%%horovod -np 2\nwith lock:\n    pass")
    assert out.error is not None and out.error["ename"] == "CaptureError"
    assert "'lock'" in out.error["evalue"] and "Create it inside the cell" in out.error["evalue"]
    assert "captured" not in out.stdout  # nothing was launched


@pytest.mark.parametrize("line, message", [
    ("-np 0", "-np must be at least 1"),
    ("-np 2 --spark --local", "choose one of --spark and --local"),
    ("-np 2 -o 2bad", "valid Python name"),
    ("-np 2 --env NOEQUALS", "expected KEY=VALUE"),
])
def test_bad_options_say_how_to_write_them(kernel, line, message):
    out = kernel.run(f"%%horovod {line}\n1")
    assert out.error is not None and message in out.error["evalue"]


@pytest.mark.long_on_connect
def test_interrupt_stops_every_rank_and_the_next_cell_works(kernel):
    seen = []

    def on_output(text):
        seen.append(text)
        if len(re.findall(r"READY (\d+)", "".join(seen))) == 2 and not interrupted:
            interrupted.append(True)
            kernel.interrupt()

    interrupted = []
    out = kernel.run("%%horovod -np 2 --quiet\n"
                     "import os, time\nimport ddl_magic.torch as hvd\nhvd.init()\n"
                     "print('READY', os.getpid(), flush=True)\n"
                     "while True:\n    hvd.allreduce(torch.ones(1000))",
                     timeout=60, on_output=on_output)
    pids = [int(pid) for pid in re.findall(r"READY (\d+)", "".join(seen))]
    assert out.error is not None and out.error["ename"] == "CellInterrupted"
    # One line saying so and where the logs are, not the driver loop's 45 frames.
    assert len(out.error["traceback"]) == 1 and "interrupted" in out.error["traceback"][0], out.error
    assert re.search(r"their logs are in \S*ddl_magic-runs", out.error["traceback"][0])
    assert pids_alive(pids) == []
    if kernel.on_spark:
        assert kernel.run(ACTIVE_SPARK_JOBS).result == "[]"
    assert kernel.run("%%horovod -np 2 --quiet\n'still works'").result == "'still works'"


@pytest.mark.long_on_connect
def test_interrupt_stops_a_torch_estimator_fit(kernel):
    if not kernel.on_spark:
        pytest.skip("TorchEstimator trains on a Spark DataFrame")
    defined = kernel.run(
        "import os, time\n"
        "from pyspark.sql import functions\n"
        "from ddl_magic.spark.estimator import TorchEstimator\n"
        "class StuckLoss(torch.nn.CrossEntropyLoss):\n"
        "    def forward(self, outputs, labels):\n"
        "        print('READY', os.getpid(), flush=True)\n"
        "        while True:\n"
        "            time.sleep(0.05)\n"
        "net = torch.nn.Linear(1, 2)\n"
        "rows = spark.range(0, 64, 1, 2).select(functions.col('id').cast('float').alias('x'),\n"
        "                                       (functions.col('id') % 2).alias('label'))\n"
        "estimator = TorchEstimator(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),\n"
        "                           loss=StuckLoss(), feature_cols=['x'], label_cols=['label'],\n"
        "                           batch_size=8, num_proc=2)")
    assert defined.error is None, defined.error
    seen, interrupted = [], []

    def on_output(text):
        seen.append(text)
        if len(re.findall(r"READY (\d+)", "".join(seen))) == 2 and not interrupted:
            interrupted.append(True)
            kernel.interrupt()

    out = kernel.run("estimator.fit(rows)", timeout=120, on_output=on_output)
    pids = [int(pid) for pid in re.findall(r"READY (\d+)", "".join(seen))]
    assert out.error is not None and out.error["ename"] == "KeyboardInterrupt"
    assert len(pids) == 2 and pids_alive(pids) == []
    assert kernel.run(ACTIVE_SPARK_JOBS).result == "[]"


@pytest.mark.long_on_connect
def test_a_failing_rank_runs_once(kernel, tmp_path):
    marker = tmp_path / "runs.txt"
    out = kernel.run("%%horovod -np 2 --quiet\n"
                     "import ddl_magic.torch as hvd\nhvd.init()\n"
                     f"open({str(marker)!r}, 'a').write(f'rank {{hvd.rank()}} ran\\n')\n"
                     "hvd.barrier()\n"
                     "if hvd.rank() == 1:\n    raise ValueError('once')\n")
    assert out.error is not None and "once" in out.error["evalue"]
    assert sorted(marker.read_text().splitlines()) == ["rank 0 ran", "rank 1 ran"]


def test_more_ranks_than_spark_slots_is_refused_at_once(kernel):
    if not kernel.on_spark:
        pytest.skip("local processes have no slot limit")
    out = kernel.run("%%horovod -np 5\n1", timeout=30)
    assert out.error is not None and "np=5 needs 5 Spark task slots" in out.error["evalue"]
    assert "has 4" in out.error["evalue"]


def test_help_lists_every_option_with_an_example():
    from ddl_magic.frontends.magic import HorovodMagics

    help_text = HorovodMagics.horovod.__doc__
    for option in ("-np", "--spark", "--local", "--out", "--all-ranks", "--timeline", "--timeout",
                   "--env", "--gpu", "--quiet"):
        assert option in help_text, option
    assert "Example::" in help_text and "%%horovod -np 2" in help_text
