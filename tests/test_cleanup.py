"""The suite's own guard: a test that leaves a process running errors, and the process dies."""

from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")
CONFTEST_IMPORTS = Path(__file__).with_name("two_host_cluster.py")  # the conftest's `cluster` fixture

LEAKY_TEST = """
import subprocess, sys

def test_leaves_a_process_behind(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (tmp_path.parent / "leaked.pid").write_text(str(child.pid))
"""


def test_a_test_that_leaks_a_process_errors_and_the_process_is_killed(pytester, monkeypatch):
    import psutil

    monkeypatch.setenv("DDL_MAGIC_TEST_LEFTOVER_GRACE_S", "0.5")
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(two_host_cluster=CONFTEST_IMPORTS.read_text())
    pytester.makepyfile(test_leaky=LEAKY_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*processes still running 0.5 s after the test (killed)*time.sleep(600)*"])
    leaked = int(next(pytester.path.rglob("leaked.pid")).read_text())
    assert not psutil.pid_exists(leaked) or psutil.Process(leaked).status() == psutil.STATUS_ZOMBIE
