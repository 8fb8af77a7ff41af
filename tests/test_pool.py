"""A pool (`%horovod start`) in a real IPython kernel, cell by cell, as a user runs it: ranks
that keep their state and ring between cells, and survive what they can."""

import ast
import os
import re
import time

import pytest

from kernel import Kernel

HVD = "import torch\nimport ddl_magic.torch as hvd\nhvd.init()\n"
# Every rank adds rank + 1: with 2 ranks the sum is 3.0, whatever happened before.
SUM = "hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()"

START_SPARK = """
import os, sys
os.environ["PYSPARK_PYTHON"] = sys.executable
from pyspark.sql import SparkSession
spark = (SparkSession.builder.{master}.config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
"""
ACTIVE_SPARK_JOBS = ("from pyspark import SparkContext\n"
                     "SparkContext._active_spark_context.statusTracker().getActiveJobsIds()")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    # A short stall check, so that the stalled-collective test reports within seconds.
    kernel = Kernel(env={"DDL_MAGIC_DISPLAY": "text", "HOROVOD_STALL_CHECK_TIME_SECONDS": "2"},
                    cwd=str(tmp_path_factory.mktemp("pool")))
    setup = kernel.run("%load_ext ddl_magic\nimport torch")
    assert setup.error is None, setup.error
    yield kernel
    kernel.run("%horovod stop")
    kernel.close()


@pytest.fixture
def pool(kernel):
    """A pool of 2 ranks, started fresh for the test and stopped after it."""
    kernel.run("%horovod stop")
    started = kernel.run("%horovod start -np 2", timeout=180)
    assert started.error is None, started.error
    kernel.pids = [int(pid) for pid in re.findall(r"^\d+\s+\S+\s+(\d+)\s+idle", started.stdout, re.M)]
    assert len(kernel.pids) == 2, started.stdout
    yield kernel
    kernel.run("%horovod auto off\n")
    kernel.run("%horovod stop")
    for pid in kernel.pids:
        assert _gone_within(pid, 10), f"rank process {pid} outlived its pool"


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _cell(kernel, code: str, **kw):
    out = kernel.run(code, **kw)
    assert out.error is None, (out.error, out.text)
    return out


def test_start_shows_every_rank_and_the_ring_forms_once(pool):
    # hvd.init() in a cell returns the ring the pool formed: same world, no new ring
    first = _cell(pool, "%%horovod\n" + HVD + "import ddl_magic.runtime.context as c\n"
                        "ring = id(c.current('x'))\n(hvd.rank(), hvd.size())")
    assert first.result == "(0, 2)"
    again = _cell(pool, "%%horovod --all-ranks\nhvd.init()\nid(c.current('x')) == ring")
    assert again.result == "[True, True]"
    # what the driver did for the pool: one thread, Register and Start once per rank
    control = _cell(pool, "import ddl_magic\nc = ddl_magic.last_run().control\n"
                          "(c['threads'], c['rendezvous_messages'])")
    assert control.result == "(1, 4)"


def test_state_stays_on_the_ranks_between_cells(pool):
    _cell(pool, "%%horovod --quiet\n" + HVD + "model = torch.nn.Linear(2, 1)\n"
                "steps = 0")
    quiet = _cell(pool, "%%horovod --quiet\nsteps += 1\nmodel.weight.data += hvd.rank()\nprint('stepped')")
    # --quiet drops the capture line, not the run: its output shows as in any cell
    assert "[1] stepped" in quiet.stdout and "captured" not in quiet.stdout, quiet.stdout
    out = _cell(pool, "%%horovod --all-ranks --quiet\n(steps, type(model).__name__)")
    assert out.result == "[(1, 'Linear'), (1, 'Linear')]"


RESIDENT = "int(open('/proc/self/statm').read().split()[1]) * 4096"


def test_a_rank_hands_back_after_each_cell_what_the_cell_freed(pool):
    # Within a cell, freed tensors stay with the rank for the next step (rank/allocator.py);
    # an idle pool holds on to none of it.
    within = _cell(pool, "%%horovod --all-ranks --quiet\nimport torch\n"
                         "blocks = [torch.ones(1 << 20) for _ in range(20)]\n"  # 80 MiB, touched
                         f"full = {RESIDENT}\ndel blocks\n(full, {RESIDENT})")
    after = _cell(pool, f"%%horovod --all-ranks --quiet\n{RESIDENT}")
    for (full, freed), later in zip(ast.literal_eval(within.result), ast.literal_eval(after.result)):
        assert freed > full - (8 << 20), (full, freed)
        assert later < full - (60 << 20), (full, later)

def test_notebook_names_are_sent_each_cell_but_never_over_the_ranks_own(pool):
    _cell(pool, "lr = 0.1\nw = 'the notebook w'")
    _cell(pool, "%%horovod\n" + HVD + "w = torch.ones(1)")
    _cell(pool, "lr = 0.5")
    out = _cell(pool, "%%horovod\n(lr, w.item())")
    assert out.result == "(0.5, 1.0)"  # lr: the notebook's new value; w: the ranks' own
    assert "captured lr (float)" in out.stdout and "the ranks' own: w" in out.stdout
    assert pool.run("w").result == "'the notebook w'"


def test_a_cell_on_some_ranks_refuses_collectives_at_once(pool):
    _cell(pool, "%%horovod --quiet\n" + HVD)
    out = _cell(pool, "%%horovod --ranks 1 --all-ranks\nhvd.rank()")
    assert out.result == "[1]"
    began = time.monotonic()
    refused = pool.run("%%horovod --ranks 0\nhvd.allreduce(torch.ones(1))", timeout=60)
    assert time.monotonic() - began < 10
    assert refused.error is not None and "--ranks" in refused.text
    assert "other ranks would never join" in refused.text
    assert _cell(pool, "%%horovod\n" + SUM).result == "3.0"


def test_pull_one_rank_every_rank_a_missing_name_and_an_unpicklable_value(pool):
    _cell(pool, "%%horovod --quiet\n" + HVD + "value = hvd.rank() * 10\n"
                "import threading\nlock = threading.Lock()")
    assert _cell(pool, "%horovod pull value").result == "0"
    assert _cell(pool, "%horovod pull value --rank 1").result == "10"
    assert _cell(pool, "%horovod pull value --all-ranks").result == "[0, 10]"
    confirmed = _cell(pool, "%horovod pull value --rank 1 -o one")
    assert confirmed.stdout.strip() == "ddl_magic: one ← rank 1's value (int, 5 B)", confirmed.stdout
    _cell(pool, "%horovod pull value --all-ranks -o values")
    assert _cell(pool, "values").result == "[0, 10]"
    missing = pool.run("%horovod pull valeu")
    assert missing.error is not None and "has no name 'valeu'" in missing.error["evalue"]
    assert "did you mean 'value'" in missing.error["evalue"]
    unpicklable = pool.run("%horovod pull lock")
    assert unpicklable.error is not None and "cannot be pickled" in unpicklable.error["evalue"]


def test_status_restart_and_stop(pool):
    status = _cell(pool, "%horovod status")
    # the rank factory stays while its children, the pool's ranks, do
    refused = pool.run("%horovod release")
    assert refused.error is not None and "%horovod stop first" in refused.error["evalue"], refused.error
    assert re.search(r"^0\s+\S+\s+\d+\s+idle\s+\d+ MB\s+\d+ s", status.stdout, re.M), status.stdout
    _cell(pool, "%%horovod --quiet\nkept = 1")
    restarted = _cell(pool, "%horovod restart", timeout=180)
    assert "state" in restarted.stdout and "gone" in restarted.stdout
    for pid in pool.pids:
        assert _gone_within(pid, 10)
    pool.pids = [int(pid) for pid in re.findall(r"^\d+\s+\S+\s+(\d+)\s+idle", restarted.stdout, re.M)]
    gone = pool.run("%%horovod --quiet\nkept")
    assert gone.error is not None and "NameError" in gone.text


def test_auto_mode_sends_every_cell_to_the_ranks_until_turned_off(pool):
    _cell(pool, "%%horovod --quiet\n" + HVD)
    _cell(pool, "%horovod auto")
    assert _cell(pool, "hvd.rank()").result == "0"
    assert _cell(pool, "on_ranks = 5").error is None
    _cell(pool, "%horovod auto off")
    assert pool.run("on_ranks").error is not None  # it never was a notebook name
    assert _cell(pool, "%horovod pull on_ranks").result == "5"


def test_a_second_start_and_another_np_are_refused_saying_what_to_do(pool):
    again = pool.run("%horovod start -np 2")
    assert again.error is not None and "already" in again.error["evalue"]
    assert "%horovod stop" in again.error["evalue"]
    other = pool.run("%%horovod -np 3\n1")
    assert other.error is not None and "pool of 2 ranks is running" in other.error["evalue"]
    assert "-np" in other.error["evalue"] and "%horovod stop" in other.error["evalue"]


def test_a_rank_that_raises_stops_the_others_and_the_next_cell_is_right(pool):
    _cell(pool, "%%horovod --quiet\n" + HVD + "kept = 'still here'")
    began = time.monotonic()
    failed = pool.run("%%horovod\nif hvd.rank() == 0:\n    raise ValueError('boom')\n"
                      "hvd.allreduce(torch.ones(1), name='left_over')\n"
                      "hvd.allreduce(torch.ones(1), name='left_over2')", timeout=60)
    assert time.monotonic() - began < 15
    assert failed.error is not None and failed.error["ename"] == "RankFailedError"
    assert "ValueError: boom" in failed.text and "rank 0" in failed.error["evalue"]
    # the traceback names the cell by the number its prompt shows (In [N]), the next cell's N + 1
    number = re.search(r'File "<%%horovod cell In\[(\d+)\]>", line 3', failed.text)
    assert number, failed.text
    assert pool.run("get_ipython().execution_count").result == str(int(number.group(1)) + 1)
    # the other rank's allreduce ended with an error naming the failing rank (in its log)
    log = pool.run("import ddl_magic\nprint(ddl_magic.last_run().log(1))").stdout
    assert "rank 0 failed" in log, log
    # the ranks stay, with their namespaces; the next cell's values are right: nothing of
    # the failed cell pairs with its collectives
    out = _cell(pool, "%%horovod --all-ranks\n(kept, " + SUM + ")")
    assert out.result == "[('still here', 3.0), ('still here', 3.0)]"


def test_an_interrupt_reaches_every_rank_and_the_ranks_stay(pool):
    _cell(pool, "%%horovod --quiet\n" + HVD + "kept = 1")
    # rank 0 sleeps in Python; rank 1 waits in an allreduce that rank 0 never reaches
    code = ("%%horovod\nimport time\nprint('going', flush=True)\n"
            "if hvd.rank() == 0:\n    time.sleep(600)\nelse:\n    hvd.allreduce(torch.ones(1))")
    msg_id = pool.client.execute(code)
    deadline = time.monotonic() + 60
    printed = ""
    while printed.count("going") < 2 and time.monotonic() < deadline:  # both ranks in the cell
        message = pool.client.get_iopub_msg(timeout=60)
        if message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "stream":
            printed += message["content"]["text"]
    assert printed.count("going") == 2, printed
    interrupted_at = time.monotonic()
    pool.interrupt()
    error = None
    while time.monotonic() < deadline:
        message = pool.client.get_iopub_msg(timeout=60)
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        if message["msg_type"] == "error":
            error = message["content"]
        if message["msg_type"] == "stream":
            printed += message["content"]["text"]
        if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            break
    assert error is not None and error["ename"] == "CellInterrupted", error
    assert time.monotonic() - interrupted_at < 5
    assert "ranks stay up" in error["evalue"]
    logs = _cell(pool, "import ddl_magic\nrun = ddl_magic.last_run()\nprint(run.log(0), run.log(1))").stdout
    # each rank's cell ended where it was (KeyboardInterrupt in rank 0's sleep, and in rank
    # 1's allreduce that or the collective's CollectiveAbortedError), said once, in words
    assert re.findall(r"^stopped: .*", logs, re.M) == ["stopped: the cell was interrupted"] * 2, logs
    assert "CollectiveAbortedError" not in printed and "KeyboardInterrupt" not in printed, printed
    out = _cell(pool, "%%horovod --all-ranks\n(kept, " + SUM + ")")
    assert out.result == "[(1, 3.0), (1, 3.0)]"


def test_a_stalled_collective_is_reported_and_the_cell_times_out_per_cell(pool):
    _cell(pool, "%%horovod --quiet\n" + HVD)
    began = time.monotonic()
    stalled = pool.run("%%horovod --timeout 6\nif hvd.rank() == 1:\n"
                       "    hvd.allreduce(torch.ones(1), name='lonely')", timeout=60)
    assert 5 < time.monotonic() - began < 20
    assert stalled.error is not None and stalled.error["ename"] == "RunTimeoutError"
    assert "stall" in stalled.text and "'lonely'" in stalled.text, stalled.text
    assert "ranks stay up" in stalled.error["evalue"]
    assert _cell(pool, "%%horovod\n" + SUM).result == "3.0"


def test_a_killed_rank_breaks_the_pool_which_says_how_to_go_on(pool):
    _cell(pool, "%%horovod --quiet\n" + HVD)
    killed = pool.run(f"%%horovod\nimport os, signal, time\nprint('last words', flush=True)\n"
                      f"if hvd.rank() == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                      f"time.sleep(1)\n{SUM}", timeout=60)
    assert killed.error is not None and killed.error["ename"] == "RankFailedError"
    assert "rank 1" in killed.error["evalue"] and "SIGKILL" in killed.error["evalue"]
    assert "[1] last words" in killed.text
    for pid in pool.pids:  # the other rank was stopped too: nothing is left running
        assert _gone_within(pid, 10)
    broken = pool.run("%%horovod\n1")
    assert broken.error is not None and "broken" in broken.error["evalue"]
    assert "rank 1" in broken.error["evalue"] and "%horovod restart" in broken.error["evalue"]
    restarted = _cell(pool, "%horovod restart", timeout=180)
    pool.pids = [int(pid) for pid in re.findall(r"^\d+\s+\S+\s+(\d+)\s+idle", restarted.stdout, re.M)]
    assert _cell(pool, "%%horovod\n" + HVD + SUM).result == "3.0"


def test_a_one_shot_cell_reading_names_defined_nowhere_is_told_before_launch(kernel):
    kernel.run("%horovod stop")
    out = kernel.run("%%horovod -np 2\nmodel.train()\nsteps")
    assert out.error is not None and out.error["ename"] == "CaptureError"
    assert "model, steps" in out.error["evalue"] and "%horovod start" in out.error["evalue"]
    assert "earlier %%horovod cells" in out.error["evalue"]


@pytest.mark.parametrize("where", ["local", "spark"])
def test_kernel_shutdown_ends_every_rank(where):
    import shutil

    if where == "spark" and shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Spark needs Java")
    kernel = Kernel(env={"DDL_MAGIC_DISPLAY": "text", "SPARK_LOCAL_IP": "127.0.0.1"})
    try:
        if where == "spark":
            _cell(kernel, START_SPARK.format(master='master("local[4]")'), timeout=180)
        started = kernel.run("%load_ext ddl_magic\n%horovod start -np 2", timeout=180)
        assert started.error is None, started.error
        pids = [int(pid) for pid in re.findall(r"^\d+\s+\S+\s+(\d+)\s+idle", started.stdout, re.M)]
        assert len(pids) == 2
    finally:
        kernel.manager.shutdown_kernel(now=True)  # SIGKILL: no atexit runs
        kernel.client.stop_channels()
    for pid in pids:
        assert _gone_within(pid, 10), f"rank {pid} outlived its kernel"


def test_the_python_api_runs_functions_pulls_and_restarts():
    import ddl_magic
    from ddl_magic.driver.pool import PoolError

    def build(scale):
        import torch
        import ddl_magic.torch as hvd

        hvd.init()
        return hvd.allreduce(torch.tensor([hvd.rank() + scale]), op=hvd.Sum).item()

    with ddl_magic.start(np=2, quiet=True) as pool:
        pids = list(pool.pids)
        assert pool.run(build, 1.0) == 3.0
        assert pool.run(build, scale=2.0) == 5.0
        with pytest.raises(PoolError, match="already"):
            ddl_magic.start(np=2)
        pool.restart()
        assert pool.run(build, 1.0) == 3.0
        for pid in pids:
            assert _gone_within(pid, 10)
    assert pool.state.value == "stopped"
    for pid in pool.pids:
        assert _gone_within(pid, 10)


def test_pool_cells_pull_values_into_a_script():
    import ddl_magic
    from ddl_magic.driver.capture import capture_cell

    with ddl_magic.start(np=2, quiet=True) as pool:
        pool.run_cell(capture_cell("x = [1, 2]\ny = x + [3]", {}).payload)
        assert pool.pull("y") == [1, 2, 3]
        assert pool.pull("y", all_ranks=True) == [[1, 2, 3], [1, 2, 3]]
        with pytest.raises(KeyError):
            pool.pull("z")


def test_signals_are_only_for_the_pools_own_processes():
    """The pool never signals the kernel's process group: each rank leads its own group."""
    import ddl_magic

    with ddl_magic.start(np=1, quiet=True) as pool:
        assert os.getpgid(pool.pids[0]) == pool.pids[0] != os.getpgid(0)


@pytest.mark.parametrize("master", ['master("local[4]")', pytest.param(
    'remote("local[4]")', marks=pytest.mark.long)], ids=["classic", "connect"])  # Connect: long checks
def test_a_pool_on_spark_is_one_stage_that_keeps_state_and_releases_its_slots(master):
    import shutil

    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Spark needs Java")
    kernel = Kernel(env={"DDL_MAGIC_DISPLAY": "text", "SPARK_LOCAL_IP": "127.0.0.1"})
    try:
        _cell(kernel, "%load_ext ddl_magic\nimport torch")
        _cell(kernel, START_SPARK.format(master=master), timeout=180)
        started = _cell(kernel, "%horovod start -np 2", timeout=180)
        assert "Spark barrier tasks" in started.stdout
        pids = [int(pid) for pid in re.findall(r"^\d+\s+\S+\s+(\d+)\s+idle", started.stdout, re.M)]
        assert len(pids) == 2
        jobs = _cell(kernel, ACTIVE_SPARK_JOBS).result
        assert jobs != "[]"  # the pool's stage holds its slots while it lives
        _cell(kernel, "%%horovod --quiet\n" + HVD + "kept = hvd.rank()")
        failed = kernel.run("%%horovod\nif hvd.rank() == 1:\n    raise ValueError('boom')\n"
                            "hvd.allreduce(torch.ones(1))", timeout=60)
        assert failed.error is not None and "ValueError: boom" in failed.text
        out = _cell(kernel, "%%horovod --all-ranks\n(kept, " + SUM + ")")
        assert out.result == "[(0, 3.0), (1, 3.0)]"
        assert _cell(kernel, "%horovod pull kept --rank 1").result == "1"
        _cell(kernel, "%horovod stop")
        for pid in pids:
            assert _gone_within(pid, 15)
        deadline = time.monotonic() + 30
        while _cell(kernel, ACTIVE_SPARK_JOBS).result != "[]" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _cell(kernel, ACTIVE_SPARK_JOBS).result == "[]"  # its slots are free again
        _cell(kernel, "spark.stop()")
    finally:
        kernel.close()


def test_what_a_cell_leaves_behind_in_the_ring_never_reaches_the_next_cell():
    """A collective left in flight on one rank, or a ring shut down by the cell: every rank
    forms a fresh ring before the next cell, whose values are right."""
    import ddl_magic
    from ddl_magic.driver.capture import capture_cell

    def cell(pool, source):
        return pool.run_cell(capture_cell(source, {}, pool.rank_names).payload, quiet=True).result

    total = ("hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name='total').item()")
    with ddl_magic.start(np=2, quiet=True) as pool:
        cell(pool, "import torch\nimport ddl_magic.torch as hvd\nhvd.init()")
        # rank 0 submits 'total' and never waits; rank 1 never submits it
        cell(pool, "if hvd.rank() == 0:\n    left = hvd.allreduce_async(torch.full((1,), 100.0), name='total')")
        assert cell(pool, total) == 3.0  # not 100 + 2: the leftover never pairs with this one
        cell(pool, "hvd.shutdown()")
        assert cell(pool, "hvd.init()\n" + total) == 3.0


def test_a_pool_started_with_a_timeline_records_each_cell(kernel):
    kernel.run("%horovod stop")
    try:
        _cell(kernel, "%horovod start -np 2 --timeline", timeout=180)
        for cell in (1, 2):
            _cell(kernel, "%%horovod --quiet\n" + HVD +
                  f"for i in range(3):\n    hvd.allreduce(torch.ones(8), name=f'cell{cell}.{{i}}')")
            read = _cell(kernel, "import json, ddl_magic\npath = ddl_magic.last_run().timeline_path\n"
                                 "events = json.load(open(path))\n"
                                 "events = events if isinstance(events, list) else events['traceEvents']\n"
                                 "(path, sorted({e.get('pid') for e in events if 'pid' in e}), "
                                 "sorted({e['name'] for e in events if e.get('name', '').startswith('cell')}))")
            path, pids, names = eval(read.result)
            assert path.endswith(f"-cell-{cell}.json") and pids == [0, 1]
            assert names == [f"cell{cell}.{i}" for i in range(3)]  # this cell's, and only its
        session = _cell(kernel, "import json, ddl_magic\nsession = ddl_magic.active_pool().session_timeline()\n"
                                "sorted({e['name'] for e in json.load(open(session)) "
                                "if e.get('name', '').startswith('cell')})")
        assert eval(session.result) == [f"cell{cell}.{i}" for cell in (1, 2) for i in range(3)]
        shown = kernel.run("ddl_magic.show_timeline(session)")
        assert shown.error is None, shown.error
    finally:
        kernel.run("%horovod stop")
