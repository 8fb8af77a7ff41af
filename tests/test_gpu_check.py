"""The one-command GPU check, as it runs on a machine without a GPU (CI): it says "no GPU" in
its report and its JSON, and exits 0. On a GPU it runs the CUDA tests and benchmarks
(`benchmarks/gpu_check.py`), far too long for CI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run the check itself")
def test_without_a_gpu_the_check_says_so_and_exits_0(tmp_path):
    finished = subprocess.run([sys.executable, "benchmarks/gpu_check.py", str(tmp_path / "out")],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    report = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "no GPU" in report and "no GPU" in finished.stdout
    results = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert results["gpu"] is False and results["steps"] == []
