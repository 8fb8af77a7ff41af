"""The merged timeline of real runs: `HorovodRunner(timeline=...)`, `%%horovod --timeline`, `ddlrun`.

Every rank records on its own clock and ships batches; the driver writes one Chrome trace.
These tests read that file as chrome://tracing would: one valid JSON document whatever
happened to the run, every rank in it, its events complete and on the driver's clock.
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest

from kernel import Kernel
from trace_files import chrome_events, columnar_events

# How far apart the ranks' clocks may read the same moment (the end of a barrier). The
# offsets are measured to well under a millisecond; scheduling on a busy CI machine adds
# the rest, so the best of several barriers has to meet the tight bound.
ALIGNED_WITHIN_MS = 5.0
ALIGNED_USUALLY_WITHIN_MS = 25.0

LOOPING_SCRIPT = """
import os, time, torch, ddl_magic.torch as hvd
hvd.init()
tensor = torch.ones(100_000)
started = time.monotonic()
while time.monotonic() - started < 1.0:  # long enough for batches of events to reach the driver
    hvd.allreduce(tensor, name="grad")
print(f"READY {os.getpid()}", flush=True)
while True:
    hvd.allreduce(tensor, name="grad")
"""


def load_events(path) -> tuple[list[dict], list[dict]]:
    """The trace's complete events and its metadata; json.load fails on an invalid file."""
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    return [e for e in events if e["ph"] != "M"], [e for e in events if e["ph"] == "M"]


def load_events_between_writes(path, timeout: float = 10) -> tuple[list[dict], list[dict]]:
    """`load_events` of a trace still being written: the file is valid JSON except inside the
    one write that appends a batch (see timeline/chrome.py), so a torn read is read again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return load_events(path)
        except json.JSONDecodeError:
            if time.monotonic() > deadline:
                raise


def process_names(metadata: list[dict]) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in metadata if e["name"] == "process_name"}


def barrier_steps(steps: int):
    """Each rank works a different time, then waits in a barrier, inside one timeline span."""
    import time

    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    for step in range(steps):
        with hvd.timeline_span("until barrier", step=step):
            time.sleep(0.02 * (hvd.rank() + 1))
            hvd.barrier()
        hvd.allreduce(torch.ones(50_000), name="grad")
    return hvd.rank()


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    """Three ranks of `barrier_steps`, and the driver's clock just before and after."""
    from ddl_magic import HorovodRunner

    path = tmp_path_factory.mktemp("timeline") / "run.timeline.json"
    runner = HorovodRunner(np=-3, timeline=str(path), driver_log_verbosity="log_callback_only")
    before_us = time.monotonic_ns() / 1000
    runner.run(barrier_steps, steps=6)
    after_us = time.monotonic_ns() / 1000
    return path, runner.last_run, before_us, after_us


def test_every_rank_is_in_the_trace_with_well_formed_events(traced_run):
    path, run, _, _ = traced_run
    events, metadata = load_events(path)
    assert {e["pid"] for e in events} == {0, 1, 2}
    for event in events:
        assert event["ph"] == "X", event
        assert type(event["pid"]) is int and type(event["tid"]) is int, event
        assert math.isfinite(event["ts"]) and event["dur"] >= 0, event
        assert isinstance(event["name"], str) and isinstance(event["cat"], str), event
    assert process_names(metadata) == {r.rank: f"rank {r.rank} ({r.host})" for r in run.ranks}
    assert all(r.host for r in run.ranks)
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in metadata if e["name"] == "thread_name"}
    for event in events:
        assert lanes[event["pid"], event["tid"]] == event["cat"]  # each lane is named once per rank
    for rank in range(3):
        seen = {e["cat"] for e in events if e["pid"] == rank}
        assert {"user", "negotiate", "shared_memory"} <= seen, (rank, seen)  # one host: no TCP ring
        spans = [e for e in events if e["pid"] == rank and e["name"] == "until barrier"]
        assert [s["args"] for s in spans] == [{"step": step} for step in range(6)]


def test_events_are_on_the_drivers_clock_and_in_order_per_lane(traced_run):
    path, _, before_us, after_us = traced_run
    events, _ = load_events(path)
    for event in events:
        assert before_us <= event["ts"] and event["ts"] + event["dur"] <= after_us, event
    last_start: dict[tuple[int, int], float] = {}
    for event in events:
        lane = (event["pid"], event["tid"])
        assert event["ts"] >= last_start.get(lane, -math.inf), f"out of order in {lane}: {event}"
        last_start[lane] = event["ts"]


def test_ranks_timestamps_are_aligned(traced_run):
    """A barrier ends on every rank at the same moment, so every rank's span ends together.

    Local ranks share the driver's monotonic clock, so here this guards the conversion to the
    driver's clock (offsets, units) rather than the offset measurement across hosts.
    """
    path, _, _, _ = traced_run
    events, _ = load_events(path)
    ends: dict[int, list[float]] = {}
    for event in events:
        if event["name"] == "until barrier":
            ends.setdefault(event["args"]["step"], []).append(event["ts"] + event["dur"])
    assert sorted(ends) == list(range(6)) and all(len(at) == 3 for at in ends.values())
    skews_ms = [(max(at) - min(at)) / 1000 for at in ends.values()]
    assert min(skews_ms) <= ALIGNED_WITHIN_MS, skews_ms
    assert statistics.median(skews_ms) <= ALIGNED_USUALLY_WITHIN_MS, skews_ms


# ---- ddlrun -------------------------------------------------------------------------------

class RunningDdlrun:
    """A ddlrun whose lines are read as they come, to act on them mid-run."""

    def __init__(self, *args: str, cwd, env: dict | None = None):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ddl_magic.frontends.ddlrun", *args], cwd=cwd,
            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def ready_pids(self, np: int, timeout: float = 60) -> dict[int, int]:
        """{rank: pid} once every rank printed "READY pid"."""
        deadline = time.monotonic() + timeout
        ready: dict[int, int] = {}
        while len(ready) < np:
            line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            assert line is not None, f"ddlrun ended early: {self.seen}"
            self.seen.append(line)
            if match := re.match(r"\[(\d+)\] READY (\d+)", line):
                ready[int(match.group(1))] = int(match.group(2))
        return ready

    def finish(self, timeout: float = 30) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()


@pytest.fixture()
def scripts(tmp_path):
    (tmp_path / "looping.py").write_text(LOOPING_SCRIPT)
    (tmp_path / "short.py").write_text(
        "import torch, ddl_magic.torch as hvd\nhvd.init()\n"
        "with hvd.timeline_span('work'):\n    hvd.allreduce(torch.ones(1000), name='grad')\n")
    return tmp_path


def test_the_trace_stays_valid_json_when_a_rank_is_killed(scripts):
    path = scripts / "killed.timeline.json"
    run = RunningDdlrun("-np", "2", "--timeline", str(path), "python", "looping.py", cwd=scripts)
    try:
        pids = run.ready_pids(2)
        events, _ = load_events_between_writes(path)
        assert {e["pid"] for e in events} == {0, 1}
        os.kill(pids[1], signal.SIGKILL)
        assert run.finish() == 128 + signal.SIGKILL
    finally:
        run.finish(timeout=10)
    events_after, metadata = load_events(path)
    assert len(events_after) >= len(events)
    assert sorted(process_names(metadata)) == [0, 1]
    assert columnar_events(path) == chrome_events(path)


def test_horovod_timeline_variable_gives_ddlrun_its_trace(scripts):
    path = scripts / "from_env.timeline.json"
    result = subprocess.run([sys.executable, "-m", "ddl_magic.frontends.ddlrun", "-np", "2", "short.py"],
                            cwd=scripts, env={**os.environ, "HOROVOD_TIMELINE": str(path)},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    # Where each rank's time went, printed as the run ends (and every few seconds of a long one).
    assert re.search(r"^\[timeline\] .* rank 0 .* · rank 1 ", result.stdout, re.MULTILINE), result.stdout
    events, metadata = load_events(path)
    assert sorted(process_names(metadata)) == [0, 1]
    for rank in range(2):
        assert {"work", "grad"} <= {e["name"] for e in events if e["pid"] == rank}


# ---- %%horovod --timeline in a kernel ---------------------------------------------------

@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    kernel = Kernel(env={"DDL_MAGIC_DISPLAY": "text"}, cwd=str(tmp_path_factory.mktemp("nb")))
    setup = kernel.run("%load_ext ddl_magic\nimport torch")
    assert setup.error is None, setup.error
    yield kernel
    kernel.close()


def test_timeline_option_records_into_the_log_folder_and_shows_the_viewer(kernel):
    out = kernel.run("%%horovod -np 2 --quiet --timeline\n"
                     "import ddl_magic.torch as hvd\nhvd.init()\n"
                     "with hvd.timeline_span('step'):\n"
                     "    hvd.allreduce(torch.ones(1000), name='grad')")
    assert out.error is None, out.error
    widgets = [bundle for bundle in out.displays if "application/vnd.jupyter.widget-view+json" in bundle]
    assert any("FigureWidget" in bundle.get("text/plain", "") for bundle in widgets), out.displays
    where = kernel.run("import ddl_magic\nr = ddl_magic.last_run()\nr.timeline_path, r.log_dir")
    path, log_dir = eval(where.result)
    assert os.path.dirname(path) == log_dir
    events, metadata = load_events(path)
    assert sorted(process_names(metadata)) == [0, 1]
    assert {e["pid"] for e in events if e["name"] == "step"} == {0, 1}


def test_the_trace_stays_valid_json_when_the_cell_is_interrupted(kernel, tmp_path):
    path = tmp_path / "interrupted.timeline.json"
    seen: list[str] = []
    interrupted: list[bool] = []

    def on_output(text: str) -> None:
        seen.append(text)
        if len(re.findall(r"READY (\d+)", "".join(seen))) == 2 and not interrupted:
            interrupted.append(True)
            kernel.interrupt()

    cell = LOOPING_SCRIPT.replace("import os, time, torch, ddl_magic.torch as hvd",
                                  "import os, time\nimport ddl_magic.torch as hvd")
    out = kernel.run(f"%%horovod -np 2 --quiet --timeline {path}\n{cell.strip()}",
                     timeout=60, on_output=on_output)
    assert out.error is not None and out.error["ename"] == "CellInterrupted"
    events, metadata = load_events(path)
    assert sorted(process_names(metadata)) == [0, 1]
    assert {e["pid"] for e in events} == {0, 1}
    assert columnar_events(path) == chrome_events(path)


# ---- the live lanes, as a notebook frontend receives them -------------------------------

def test_the_run_views_lanes_grow_while_the_run_trains(tmp_path):
    """The ranks train until the test has seen the lanes redrawn twice with new batches:
    what a user's browser receives, while the cell is still running."""
    stop_file = tmp_path / "seen"
    figure_ids: set[str] = set()
    redraws: list[dict] = []
    summaries: list[str] = []
    finals: list[str] = []  # the summary once the run is over
    saved: list[dict] = []  # what the cell's output becomes for frontends without widgets

    def on_message(message: dict) -> None:
        content = message["content"]
        state = content.get("data", {}).get("state", {})
        if message["msg_type"] == "comm_open" and "_widget_data" in state:
            figure_ids.add(content["comm_id"])  # the lanes: a plotly FigureWidget
        elif content.get("comm_id") in figure_ids and (state.get("_py2js_update") or state.get("_py2js_addTraces")):
            redraws.append(state.get("_py2js_update") or state["_py2js_addTraces"])  # in place, or new lanes
        elif "timeline so far" in str(state.get("value", "")):
            summaries.append(state["value"])
        elif str(state.get("value", "")).startswith("<b>timeline</b>"):
            finals.append(state["value"])
        elif message["msg_type"] == "update_display_data":
            saved.append(content["data"])
        if len(redraws) >= 2 and not stop_file.exists():
            stop_file.touch()

    kernel = Kernel(cwd=str(tmp_path))
    try:
        assert kernel.run("%load_ext ddl_magic").error is None
        out = kernel.run(
            "%%horovod -np 2 --timeline\n"
            "import os, time, torch, ddl_magic.torch as hvd\n"
            "hvd.init()\n"
            "deadline = time.monotonic() + 90\n"
            "while time.monotonic() < deadline:\n"
            "    hvd.allreduce(torch.ones(10_000), name='grad')\n"
            f"    seen = float(os.path.exists({str(stop_file)!r}))\n"
            "    if hvd.broadcast(torch.tensor([seen]), 0, name='stop').item():\n"
            "        break\n"
            "else:\n"
            "    raise TimeoutError('the test never saw the lanes redrawn')\n",
            timeout=150, on_message=on_message)
    finally:
        kernel.close()
    assert out.error is None, out.error
    assert len(figure_ids) == 1  # one figure: the live lanes become the whole trace's at the end
    assert len(finals) == 1 and "Waited longest" in finals[0] and "timeline so far" not in finals[0]
    assert out.displays == [] or all("FigureWidget" not in d.get("text/plain", "") for d in out.displays)
    (report,) = saved
    assert "application/vnd.jupyter.widget-view+json" in report
    assert re.search(r"· done in [\d.]+ s", report["text/plain"]), report["text/plain"]
    assert re.search(r"^1 +done ", report["text/plain"], re.M) and "\n\ntimeline\nWaited longest" in report["text/plain"]
    assert len(redraws) >= 2
    assert all(redraw.get("style_data") or redraw.get("trace_data") for redraw in redraws)
    recorded_s = [{int(rank): float(seconds) for rank, seconds in
                   re.findall(r"<tr><td[^>]*>(\d+)</td>.*?<td[^>]*>([\d.]+)</td></tr>", summary)}
                  for summary in summaries]
    assert sorted(recorded_s[-1]) == [0, 1]  # a row per rank
    rank = next(iter(recorded_s[0]))
    assert recorded_s[-1][rank] > recorded_s[0][rank]  # the running summary grew with the run
