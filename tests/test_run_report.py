"""`ddl_magic.last_run()` reads as a report: an HTML table in a notebook, a few lines elsewhere."""

import re

import pytest

from ddl_magic.driver.run_result import RunResult
from ddl_magic.driver.records import RankStatus, new_records
from ddl_magic.driver.run_report import exit_status
from kernel import Kernel


def finished_run() -> RunResult:
    run = RunResult("20261125-100732-4a9ede", 2, "local processes", status="failed",
                    log_dir="/tmp/ddl_magic-runs/x", timeline_path="/tmp/ddl_magic-runs/x/timeline.json",
                    started_at=1000.0, ended_at=1004.5, error="rank 1 failed: exception")
    run.ranks = new_records(2, run.log_dir)
    for rank, (status, reason, code) in enumerate(((RankStatus.DONE, "", 0),
                                                   (RankStatus.FAILED, "exception <x>", 1))):
        record = run.ranks[rank]
        record.host, record.pid, record.started_at = "node-a", 100 + rank, 1000.25
        record.end(status, reason)
        record.ended_at = 1004.0
        record.exit_code = code
    return run


def test_the_text_is_a_few_short_lines_on_one_clock():
    text = repr(finished_run())
    lines = text.splitlines()
    assert lines[0] == "run 20261125-100732-4a9ede: failed after 4.5 s on local processes (2 ranks)"
    assert lines[2] == "  rank 0  done  node-a  exit 0  3.8 s"
    assert lines[3] == "  rank 1  failed  node-a  exit 1  3.8 s  (exception <x>)"
    assert lines[-1] == "  timeline: /tmp/ddl_magic-runs/x/timeline.json"
    assert max(map(len, lines)) < 100 and len(text) < 500


def test_the_html_is_a_table_with_a_row_per_rank():
    page = finished_run()._repr_html_()
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", page)
    assert len(rows) == 3  # the header, then a row per rank
    assert re.findall(r"<td[^>]*>(.*?)</td>", rows[1])[2:] == ["node-a", "100", "0", "0.25", "3.75", ""]
    assert "exception &lt;x&gt;" in rows[2] and "background:#ffebee" in page
    assert "failed after 4.5 s" in page and "/tmp/ddl_magic-runs/x" in page
    assert "margin-left:-" not in page  # which clipped the "rank" header to "ank"


@pytest.mark.parametrize("code, shown", [(0, "0"), (3, "3"), (-9, "killed by SIGKILL"), (None, "—")])
def test_exits_read_as_words(code, shown):
    assert exit_status(code) == shown


def test_a_real_runs_ranks_that_finished_exited_0_and_started_after_the_run():
    kernel = Kernel(env={"DDL_MAGIC_DISPLAY": "text"})
    try:
        assert kernel.run("%load_ext ddl_magic").error is None
        assert kernel.run("%%horovod -np 2 --quiet\nimport time\ntime.sleep(0.2)\n1").result == "1"
        shown = kernel.run("import ddl_magic\nrun = ddl_magic.last_run()\n"
                           "display(run)\n[(r.exit_code, r.started_at >= run.started_at, r.ended_at <= run.ended_at)"
                           " for r in run.ranks]")
        assert shown.error is None, shown.error
        assert shown.result == "[(0, True, True), (0, True, True)]"
        (bundle,) = shown.displays
        assert "<table" in bundle["text/html"] and bundle["text/plain"].startswith("run ")
        assert re.search(r"rank 1  done  \S+  exit 0  0\.\d s", bundle["text/plain"]), bundle["text/plain"]
    finally:
        kernel.close()
