"""The one-command GPU check, as it runs on a machine without a GPU (CI): it says "no GPU" in
its report and its JSON, and exits 0; a Python without torch is refused, saying what to do;
and `--on-cpu`, its every step tried on the CPU in an environment like a lent GPU machine's
(PyTorch's stack; no IPython, Spark or plotly; the project not installed). On a GPU it runs
the CUDA tests and benchmarks (`benchmarks/gpu_check.py`), far too long for CI."""

import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
import venv
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
NOT_ON_A_GPU_MACHINE = ("IPython", "ipykernel", "ipywidgets", "jupyter_client", "nbclient", "nbformat",
                        "pyspark", "py4j", "plotly", "anywidget", "mlflow", "deltalake")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="this machine has a GPU: run the check itself")


def test_without_a_gpu_the_check_says_so_and_exits_0(tmp_path):
    finished = subprocess.run(["bash", "benchmarks/gpu_check.sh", str(tmp_path / "out")], cwd=ROOT,
                              env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                              text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    assert "installing" not in finished.stdout  # this Python has ddl_magic: left as it is
    report = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "no GPU" in report and "no GPU" in finished.stdout
    results = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert results["gpu"] is False and results["steps"] == []


def test_a_python_without_torch_is_named_with_what_to_do(tmp_path):
    venv.EnvBuilder(with_pip=False).create(tmp_path / "bare")  # no torch, nothing installed
    finished = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_check.sh"), str(tmp_path / "out")],
                              cwd=tmp_path, env={**os.environ, "PYTHON": "bare/bin/python"},
                              capture_output=True, text=True, timeout=60)
    assert finished.returncode == 2 and not (tmp_path / "out").exists()
    assert finished.stderr == (f"gpu_check: '{tmp_path}/bare/bin/python' cannot import torch. Name the "
                               "Python that holds PyTorch: PYTHON=/path/to/bin/python bash "
                               "benchmarks/gpu_check.sh OUTDIR\n")


def test_a_check_stopped_from_outside_leaves_the_report_of_what_it_did(tmp_path):
    process = subprocess.Popen([sys.executable, "benchmarks/gpu_check.py", str(tmp_path), "--on-cpu"],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "cuda_tests.log").exists():  # the first step has begun
            assert process.poll() is None and time.monotonic() < deadline, "the first step never began"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # as the device machine's time limit ends it
        process.wait()
    report = (tmp_path / "gpu_check.md").read_text()
    assert re.search(r"INCOMPLETE after \d+ s: not run \(yet\): CUDA tests, allreduce on CPU "
                     r"tensors, MNIST CNN step", report), report
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["passed"] is None and len(results["not_run"]) == 3


def like_a_gpu_machine(folder: Path) -> Path:
    """A Python like a lent GPU machine's, as far as the check can tell: this one's packages
    (torch, triton, pytest, ...), but none of NOT_ON_A_GPU_MACHINE, and ddl_magic not
    installed. Returns its interpreter."""
    venv.EnvBuilder(with_pip=False).create(folder)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(folder), "platbase": str(folder)}))
    (site / "packages_of_the_machine.pth").write_text(sysconfig.get_path("purelib") + "\n")
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""\
        import importlib.abc, sys

        class NotOnThisMachine(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in {NOT_ON_A_GPU_MACHINE!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (not on a GPU machine)")

        sys.meta_path.insert(0, NotOnThisMachine())
        """))
    return folder / "bin" / "python"


def test_every_step_runs_where_only_pytorchs_stack_is(tmp_path):
    python = like_a_gpu_machine(tmp_path / "machine")
    unavailable = subprocess.run([python, "-c", "import ddl_magic"], cwd=tmp_path, capture_output=True)
    assert unavailable.returncode != 0, "the machine's Python should not have ddl_magic yet"
    process = subprocess.Popen(["bash", "benchmarks/gpu_check.sh", str(tmp_path / "out"), "--on-cpu"],
                               cwd=ROOT, env={**os.environ, "PYTHON": str(python)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=400)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert "installing ddl_magic from" in output
    report = (tmp_path / "out" / "gpu_check.md").read_text()
    assert process.returncode == 0, report
    assert "every step tried on the CPU (--on-cpu), PASSED" in report
    assert "MNIST CNN step on cpu" in report and "allreduce sum float32, np=2" in report
    results = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert results["gpu"] is False and results["passed"] is True and len(results["steps"]) == 3
