"""`python -m ddl_magic demo`: the first run a new user makes, end to end in a subprocess."""

import json
import re
import subprocess
import sys

import pytest

DEMO_TIMEOUT_S = 100


def ddl_magic(*args, cwd, timeout=DEMO_TIMEOUT_S):
    return subprocess.run([sys.executable, "-m", "ddl_magic", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo")
    timeline = folder / "demo.timeline.json"
    return ddl_magic("demo", "--timeline", str(timeline), cwd=folder), timeline


def test_the_demo_trains_on_two_ranks_and_reports_its_accuracy(demo_run):
    done, _ = demo_run
    assert done.returncode == 0, done.stdout + done.stderr
    accuracy = re.search(r"^accuracy: (\d\.\d+) on 45 held-out flowers \(np=2, 150 epochs", done.stdout, re.MULTILINE)
    assert accuracy, done.stdout
    assert float(accuracy.group(1)) >= 0.9
    assert "ranks agree: the model is the same on every rank (largest difference 0)" in done.stdout


def test_each_rank_shows_its_own_progress(demo_run):
    out = demo_run[0].stdout
    for rank in (0, 1):
        assert f"[{rank}] rank {rank} of 2: " in out
        progress = re.findall(rf"^\[{rank}\] epoch +(\d+)/150  loss (\d+\.\d+)$", out, re.MULTILINE)
        assert [int(epoch) for epoch, _ in progress] == [30, 60, 90, 120, 150]
        assert float(progress[-1][1]) < float(progress[0][1])  # it learned


def test_the_timeline_is_where_the_demo_says_and_holds_both_ranks_allreduces(demo_run):
    done, timeline = demo_run
    assert f"timeline: {timeline}" in done.stdout
    events = json.loads(timeline.read_text())["traceEvents"]
    # Both ranks are on this host, so their allreduces go through shared memory.
    exchanges = [e for e in events if e.get("cat") == "shared_memory"]
    assert {e["pid"] for e in exchanges} == {0, 1}
    assert {e["args"]["op"] for e in exchanges} >= {"allreduce", "broadcast"}


def test_help_explains_the_commands(tmp_path):
    done = ddl_magic("--help", cwd=tmp_path, timeout=30)
    assert done.returncode == 0
    assert "python -m ddl_magic demo" in done.stdout and "%%horovod -np" in done.stdout
    demo_help = ddl_magic("demo", "--help", cwd=tmp_path, timeout=30)
    assert demo_help.returncode == 0 and "--timeline PATH" in demo_help.stdout


def test_no_command_prints_the_help_and_fails(tmp_path):
    done = ddl_magic(cwd=tmp_path, timeout=30)
    assert done.returncode == 2 and "usage: python -m ddl_magic" in done.stdout


def test_a_bad_rank_count_is_refused_before_anything_starts(tmp_path):
    done = ddl_magic("demo", "-np", "0", cwd=tmp_path, timeout=30)
    assert done.returncode == 2 and "-np must be at least 1" in done.stderr
