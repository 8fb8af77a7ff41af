"""hvd.start_timeline / stop_timeline / timeline_span, in a launched run and in a plain script."""

import json
import subprocess
import sys

from ranks import run_on_ranks
from trace_files import chrome_events, columnar_events


def traced_allreduce(path):
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(10), name="before")  # not recorded: the timeline is not on yet
    hvd.start_timeline(path)
    with hvd.timeline_span("forward", step=1):
        hvd.allreduce(torch.ones(1000), name="recorded")
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(10), name="after")


def events_by_rank(path):
    trace = json.loads(open(path).read())
    by_rank = {}
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            by_rank.setdefault(event["pid"], []).append(event)
    return by_rank


def test_start_timeline_on_ranks_gives_one_merged_trace(tmp_path):
    path = str(tmp_path / "trace.json")
    run_on_ranks(traced_allreduce, 2, path=path)
    by_rank = events_by_rank(path)
    assert sorted(by_rank) == [0, 1]
    for events in by_rank.values():
        names = {e["name"] for e in events}
        assert "forward" in names and "recorded" in names
        assert not names & {"before", "after"}
        span = next(e for e in events if e["name"] == "forward")
        assert span["cat"] == "user" and span["args"] == {"step": 1}


def test_a_plain_script_writes_its_own_trace(tmp_path):
    path = tmp_path / "solo.json"
    script = ("import torch, ddl_magic.torch as hvd\nhvd.init()\n"
              f"hvd.start_timeline({str(path)!r})\n"
              "with hvd.timeline_span('work'):\n    hvd.allreduce(torch.ones(3))\n"
              "with hvd.timeline_span(3):\n    pass\n"
              "hvd.stop_timeline()\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert {"work", "3"} <= {e["name"] for e in events_by_rank(path)[0]}
    assert columnar_events(path) == chrome_events(path)  # its columnar copy, as a run's
