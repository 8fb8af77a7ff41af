"""The architecture as a checked contract, run with the tests: the import rules written in
pyproject.toml (import-linter: the sides of the system as layers that import only downwards,
no display library on a rank, no import loops), a small set of lint rules (ruff), and the
public import paths that notebooks use, kept while the code lives in its side's folder."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]


def run_tool(name: str, *args: str, cwd: Path = ROOT,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A tool installed beside this Python (the test extra brings both)."""
    return subprocess.run([str(Path(sys.executable).parent / name), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env=env)


def as_installed(view: Path) -> Path:
    """The package as pip installs it, in `view`: ddl_magic/ with the folders that
    `package-dir` maps into it (kernels/ as ddl_magic/kernels), linked, not copied.
    import-linter reads a package from one folder, and knows nothing of package-dir."""
    package = view / "ddl_magic"
    package.mkdir()
    for entry in (ROOT / "ddl_magic").iterdir():
        (package / entry.name).symlink_to(entry)
    for name, folder in SETUPTOOLS["package-dir"].items():
        (view / name.replace(".", "/")).symlink_to(ROOT / folder)
    (view / "pyproject.toml").symlink_to(ROOT / "pyproject.toml")
    return view


def test_imports_flow_one_way_and_never_loop(tmp_path):
    view = as_installed(tmp_path)
    checked = run_tool("lint-imports", "--no-cache", cwd=view,
                       env={**os.environ, "PYTHONPATH": str(view)})
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_package_is_installed_and_none_at_the_top_but_ddl_magic():
    found = {str(path.parent.relative_to(ROOT)).replace("/", ".")
             for path in (ROOT / "ddl_magic").rglob("__init__.py")}
    mapped = {name for name in SETUPTOOLS["package-dir"]}
    assert set(SETUPTOOLS["packages"]) == found | mapped
    assert all(name.startswith("ddl_magic") for name in SETUPTOOLS["packages"])


def test_the_lint_rules_find_nothing():
    checked = run_tool("ruff", "check", "ddl_magic", "kernels", "tests", "benchmarks")
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
    assert kernels.__file__.startswith(str(ROOT / "kernels"))  # installed as ddl_magic.kernels
