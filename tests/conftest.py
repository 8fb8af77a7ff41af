"""Fixtures shared by the test modules."""

import os
import shutil
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

from ddl_magic.rank.factory import SPARE_NAME
from two_host_cluster import TwoHostCluster, Unavailable

pytest_plugins = ["pytester"]  # test_cleanup.py runs a test session inside a test

# A local Spark Connect session (`remote("local[4]")`) serves on port 15002 unless pyspark
# is told it is under test: then its server takes a free port and its client asks which. So
# two test sessions at once on one machine (another checkout's, a busy CI host) never meet
# on one port. Kernels and subprocesses the tests start inherit it.
os.environ.setdefault("SPARK_TESTING", "1")


def pytest_sessionstart(session):
    """Byte-compile the package once, as pip does for an installed one: the tests install it
    editable, and where PYTHONDONTWRITEBYTECODE is set (CI's machine) every kernel, rank
    factory and Spark worker the suite starts would parse each module afresh (~0.4 s each)."""
    if hasattr(session.config, "workerinput"):  # the test processes under xdist: done once, before them
        return
    import compileall

    import ddl_magic

    compileall.compile_dir(os.path.dirname(ddl_magic.__file__), quiet=1)


# ---- two test processes at once (pytest-xdist, `-n 2` in pyproject.toml) ---------------------

_MULTI_HOST_MODULES = "test_*multi_host.py"  # test_multi_host.py too


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, called where it runs the tests
def pytest_xdist_make_scheduler(config, log):
    """Hand out whole modules, so each module's SparkSession, kernel or cluster is built once,
    and the multi-host modules as one: they share a two-host cluster, and two clusters at once
    would double the heaviest load of the suite for no gain in coverage."""
    from xdist.scheduler import LoadScopeScheduling

    class WholeModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return _MULTI_HOST_MODULES if fnmatch(Path(module).name, _MULTI_HOST_MODULES) else module

    config.option.loadscopereorder = False  # in the collection's order: the longest first
    return WholeModules(config, log)


# The modules that take longest (seconds of a CI run), handed out first so that no long one is
# left to run alone at the end (xdist would hand out the modules with the most tests first).
_LONGEST_FIRST = ("test_estimator.py", _MULTI_HOST_MODULES, "test_notebook_magic.py",
                  "test_example_notebooks.py", "test_browser.py", "test_ddlrun.py",
                  "test_pool.py", "test_mlflow.py", "test_fail_fast.py", "test_spark_launcher.py")


def _handed_out_at(item) -> int:
    name = item.path.name
    return next((at for at, pattern in enumerate(_LONGEST_FIRST) if fnmatch(name, pattern)),
                len(_LONGEST_FIRST))


def pytest_collection_modifyitems(items):
    """The longest modules first; a `long_on_connect` test's Spark Connect variant is a long
    check (`-m long`): the default run tries that behaviour on a classic session only."""
    items.sort(key=_handed_out_at)  # stable: each module's tests keep their order
    for item in items:
        if item.get_closest_marker("long_on_connect") and _on_connect(item):
            item.add_marker(pytest.mark.long)


def _on_connect(item) -> bool:
    params = getattr(item, "callspec", None)
    return params is not None and any(
        value == "connect" or (isinstance(value, str) and "Spark Connect" in value)
        for value in params.params.values())


SPARK_KINDS = ["classic", "connect"]


@pytest.fixture(scope="module", params=SPARK_KINDS)
def spark(request):
    """A local SparkSession with 4 task slots, one per test module and kind: classic, then
    Spark Connect (Databricks' shared and serverless compute). A cold start takes ~5 s.

    Both kinds run their JVM in this process (a local Connect server is a classic session
    with a plugin), so `spark_sessions.spark_context()` reaches the one behind either.
    """
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Spark needs Java")
    from pyspark.sql import SparkSession

    with pytest.MonkeyPatch.context() as patch:
        # Read when the session starts: Spark's Python workers are this Python, on loopback.
        patch.setenv("PYSPARK_PYTHON", sys.executable)
        patch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
        # A Connect session sets these for the whole process; the next classic one must not see them.
        for variable in ("SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE",
                         "SPARK_CONNECT_AUTHENTICATE_TOKEN", "SPARK_REMOTE"):
            patch.delenv(variable, raising=False)
        builder = SparkSession.builder.appName("ddl_magic tests")
        builder = (builder.remote("local[4]") if request.param == "connect"
                   else builder.master("local[4]"))
        session = (builder.config("spark.ui.enabled", "false")
                   .config("spark.ui.showConsoleProgress", "false")
                   .config("spark.sql.shuffle.partitions", "4")
                   .getOrCreate())
        from pyspark import SparkContext

        SparkContext._active_spark_context.setLogLevel("ERROR")  # the one behind either kind
        yield session
        session.stop()


# ---- no test leaves processes behind ---------------------------------------------------------

LEFTOVER_GRACE_S = float(os.environ.get("DDL_MAGIC_TEST_LEFTOVER_GRACE_S", "10"))  # a run's ranks may still be on their way out when its test returns
_FACTORY_COMMAND = "from ddl_magic.rank.factory import serve"
# Started once and reused by what starts them: Spark's JVM and Python workers, and Python's
# own per-process helpers (multiprocessing's resource tracker and forkserver).
_MAY_OUTLIVE_A_TEST = ("pyspark.daemon", "pyspark.worker", "org.apache.spark",
                       "multiprocessing.resource_tracker", "multiprocessing.forkserver")


@pytest.fixture(scope="session")
def _one_two_host_cluster():
    """One two-host Spark standalone cluster (`two_host_cluster.py`) for every module that
    asks for it (building one costs half a minute), removed with everything it created when
    the session ends; skips where it cannot be built."""
    try:
        cluster = TwoHostCluster().start()
    except Unavailable as why:
        pytest.skip(str(why))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def cluster(_one_two_host_cluster):
    """The two-host cluster, healed of what an earlier module's faults left (a cut link, a
    killed worker) before this module's tests use it."""
    _one_two_host_cluster.heal()
    return _one_two_host_cluster


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    """Whatever a test starts — ddlrun, ranks, a kernel — is gone when it ends, pass or fail.

    What outlives its test on purpose is left alone: a rank factory (one per driver process,
    kept warm) and its spares, Spark's JVM and its Python workers, multiprocessing's helpers.
    Anything else still running `LEFTOVER_GRACE_S` after the test is killed with its whole
    process tree, and the test errors, naming it: a leak found, not hidden.
    """
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    leftovers = _new_processes(before)
    if leftovers:
        _, alive = psutil.wait_procs(leftovers, timeout=LEFTOVER_GRACE_S)
        alive = [p for p in alive if not _is_spare(p)]  # (one just forked had no name yet)
        if alive:
            named = [f"{p.pid} {_command(p)[:120]}" for p in alive]
            for process in alive:
                _kill_tree(process)
            pytest.fail(f"processes still running {LEFTOVER_GRACE_S:g} s after the test (killed): "
                        f"{named}")


def _new_processes(before: set[int]) -> list:
    import psutil

    new = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.pid in before or process.status() == psutil.STATUS_ZOMBIE:
                continue
            command = _command(process)
            if any(marker in command for marker in _MAY_OUTLIVE_A_TEST):
                continue
            if _FACTORY_COMMAND in command and _FACTORY_COMMAND not in _command(process.parent()):
                continue  # a rank factory; its children (same command line) are ranks
            if _is_spare(process):
                continue  # a factory's spare, forked ahead of the next run's ranks
            new.append(process)
        except psutil.NoSuchProcess:
            continue
    return new


def _is_spare(process) -> bool:
    import psutil

    try:
        return _FACTORY_COMMAND in _command(process) and process.name() == SPARE_NAME
    except psutil.NoSuchProcess:
        return False


def _command(process) -> str:
    import psutil

    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
        return ""


def _kill_tree(process) -> None:
    import psutil

    try:
        tree = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for member in tree:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=5)
