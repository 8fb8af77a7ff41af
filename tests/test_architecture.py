"""The architecture as a checked contract, run with the tests: the import rules written in
pyproject.toml (import-linter: the rank side never imports the driver or the notebook's UI,
no import loops) and a small set of lint rules (ruff)."""

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
    checked = run_tool("ruff", "check", "ddl_magic", "kernels", "tests", "benchmarks")
    assert checked.returncode == 0, checked.stdout + checked.stderr
