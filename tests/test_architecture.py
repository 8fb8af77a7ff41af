"""The architecture as a checked contract, run with the tests: the import rules written in
pyproject.toml (import-linter: the sides of the system as layers that import only downwards,
no display library on a rank, no import loops), a small set of lint rules (ruff), and the
public import paths that notebooks use, kept while the code lives in its side's folder."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess:
    """A tool installed beside this Python (the test extra brings both)."""
    return subprocess.run([str(Path(sys.executable).parent / name), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_imports_flow_one_way_and_never_loop():
    checked = run_tool("lint-imports", "--no-cache")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_lint_rules_find_nothing():
    checked = run_tool("ruff", "check", "ddl_magic", "tests", "benchmarks")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_public_import_paths_are_the_modules_of_each_side():
    import ddl_magic
    from ddl_magic import datasets, estimator, kernels, spark_inference
    from ddl_magic.frontends.runner import HorovodRunner
    from ddl_magic.labs.datasets import load_iris
    from ddl_magic.spark.estimator import TorchEstimator
    from ddl_magic.spark.inference import predict_batches

    assert estimator.TorchEstimator is TorchEstimator
    assert datasets.load_iris is load_iris
    assert spark_inference.predict_batches is predict_batches
    assert ddl_magic.HorovodRunner is HorovodRunner
    assert kernels.__file__.startswith(str(ROOT / "ddl_magic" / "kernels"))
