"""`%%horovod` runs in one notebook kernel leave it as they found it: the same open files,
threads and child processes (as many of the rank factory's spares), and its memory within
20 MB (30 runs by default, a hundred in the long checks)."""

import json

import pytest

from kernel import Kernel

RSS_GROWTH_LIMIT = 20 * 2**20

SETUP = """
%load_ext ddl_magic
import gc, json, os, threading, time
import psutil
from ddl_magic.rank.factory import SPARE_NAME

def snapshot():
    gc.collect()
    me = psutil.Process()
    processes = me.children(recursive=True)
    # a rank factory's spares are forked afresh after each run: how many, not which
    spares = [c for c in processes if c.name() == SPARE_NAME]
    return {"fds": sorted(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
            "children": sorted(c.pid for c in processes if c not in spares),
            "spares": len(spares), "rss": me.memory_info().rss}

def the_factory_alone():
    '''The children a kernel keeps between runs, the spares aside: its rank factory (which
    forks the ranks: theirs are the factory's children, not the kernel's).'''
    return sorted(c.pid for c in psutil.Process().children() if c.name() != SPARE_NAME)

def settled(baseline, timeout_s=30):
    '''The snapshot once threads and processes of the last run have ended (or the timeout).'''
    deadline = time.monotonic() + timeout_s
    while True:
        now = snapshot()
        same = all(now[key] == baseline[key] for key in ("fds", "threads", "children", "spares"))
        if same or time.monotonic() > deadline:
            return now
        time.sleep(0.1)

BODY = "import torch, ddl_magic.torch as hvd\\nhvd.init()\\nprint(hvd.allreduce(torch.ones(2)).tolist())"
"""

WARM_UP = """
for _ in range(3):  # the rank factory, first imports, the widgets' first use
    get_ipython().run_cell_magic("horovod", "-np 2", BODY)
# Once the last run's ranks have exited and the factory has its spares.
baseline = settled({**snapshot(), "children": the_factory_alone(), "spares": 2}, timeout_s=30)
"""

SOAK = """
for _ in range({runs}):
    get_ipython().run_cell_magic("horovod", "-np 2", BODY)
after = settled(baseline)
print(json.dumps({{"baseline": baseline, "after": after}}))
"""


@pytest.fixture
def kernel():
    kernel = Kernel()
    yield kernel
    kernel.close()


@pytest.mark.parametrize("runs", [30, pytest.param(100, marks=pytest.mark.long)])
def test_runs_leave_the_kernel_as_they_found_it(kernel, runs):
    for cell in (SETUP, WARM_UP):
        out = kernel.run(cell, timeout=180)
        assert out.error is None, out.error
    out = kernel.run(SOAK.format(runs=runs), timeout=900)
    assert out.error is None, out.error
    state = json.loads(out.stdout.strip().splitlines()[-1])
    baseline, after = state["baseline"], state["after"]
    assert after["fds"] == baseline["fds"]
    assert after["threads"] == baseline["threads"]
    assert after["children"] == baseline["children"]  # the rank factory, no rank left
    assert after["spares"] == baseline["spares"] == 2  # as many as a run has ranks
    assert after["rss"] - baseline["rss"] < RSS_GROWTH_LIMIT, (
        f"RSS grew by {(after['rss'] - baseline['rss']) / 2**20:.1f} MB over {runs} runs")
