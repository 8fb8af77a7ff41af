"""A finished run as a report to read: what `ddl_magic.last_run()` shows in a notebook (an
HTML table) and as text elsewhere (a few short lines, not the dataclass's one-line dump).

Example::

    >>> run = ddl_magic.last_run()          # doctest: +SKIP
    >>> run                                 # doctest: +SKIP
    run 20261125-100732-4a9ede: done in 3.6 s on local processes (2 ranks)
      rank 0  done  vm  exit 0  3.5 s
      rank 1  done  vm  exit 0  3.5 s
      logs: /tmp/ddl_magic-runs/20261125-100732-4a9ede
      timeline: /tmp/ddl_magic-runs/20261125-100732-4a9ede/timeline.json
"""

from __future__ import annotations

import html
from typing import Protocol

from .attribution import describe_exit
from .records import RankRecord, RankStatus
from .run_status import RunStatus


class RunResult(Protocol):
    """What a report reads of a run (`run_result.RunResult`, which shows itself with these)."""

    run_id: str
    np: int
    where: str
    status: RunStatus
    ranks: list[RankRecord]
    log_dir: str
    timeline_path: str | None
    started_at: float
    error: str | None

    @property
    def duration_s(self) -> float: ...

STATUS_COLOURS: dict[RankStatus | RunStatus, str] = {
    RankStatus.STARTING: "#9e9e9e",
    RankStatus.RUNNING: "#1e88e5",
    RankStatus.DONE: "#43a047",
    RankStatus.FAILED: "#e53935",
    RankStatus.STOPPED: "#757575",  # the run ended (interrupted, or a rank failed) before this rank did
    RunStatus.INTERRUPTED: "#fb8c00",
    RunStatus.TIMED_OUT: "#fb8c00",
}
"""The colour of a status, a rank's or a run's, in every display (the run view, `last_run()`).
The two enums are strs that share the values they have in common ("running", "done",
"failed"), so a run's status finds the same colour as a rank's of that name."""
FAILED_ROW_BACKGROUND = "#ffebee"
MONOSPACE = "font-family:var(--jp-code-font-family,monospace)"
"""Logs, tracebacks and last lines: monospace in JupyterLab, in nbconvert's HTML and on GitHub."""


def html_table(header: list[str], rows: list[tuple[str, list[str]]]) -> str:
    """A left-aligned table with spaced columns, the first flush with the text above it.

    Each row is (its `<tr>` attributes, its cells' HTML). The spacing is each cell's right
    padding, not a negative margin: renderers that clip what lies left of the output area
    (JupyterLab's rendered HTML, nbconvert) cut a negative margin's first letters off.

    >>> html_table(["rank"], [("", ["0"])])
    '<table style="border-collapse:collapse;margin:0"><tr><th style="padding:1px 12px 1px 0;text-align:left">rank</th></tr><tr><td style="padding:1px 12px 1px 0;text-align:left">0</td></tr></table>'
    """
    cell = 'style="padding:1px 12px 1px 0;text-align:left"'
    head = "".join(f"<th {cell}>{name}</th>" for name in header)
    body = "".join(f"<tr{attributes}>" + "".join(f"<td {cell}>{value}</td>" for value in values) + "</tr>"
                   for attributes, values in rows)
    return f'<table style="border-collapse:collapse;margin:0"><tr>{head}</tr>{body}</table>'


def exit_status(code: int | None) -> str:
    """How a rank's process ended, for a person: "0", "1", "killed by SIGKILL", or "—" where
    no exit is known (a Spark task's rank).

    Example:
        >>> exit_status(0), exit_status(-9), exit_status(None)
        ('0', 'killed by SIGKILL', '—')
    """
    if code is None:
        return "—"
    return describe_exit(code) if code < 0 else str(code)


def run_headline(run: RunResult) -> str:
    """'done in 3.6 s on local processes (2 ranks)'."""
    verb = {RunStatus.DONE: "done in", RunStatus.RUNNING: "running for"}.get(
        run.status, f"{run.status} after")
    return f"{verb} {run.duration_s:.1f} s on {run.where} ({run.np} ranks)"


def run_report_text(run: RunResult) -> str:
    """A few lines: the run, a line per rank, where its logs and timeline are."""
    lines = [f"run {run.run_id}: {run_headline(run)}"]
    if run.error:
        lines.append(f"  error: {run.error}")
    for rank in run.ranks:
        seconds = "—" if rank.duration_s is None else f"{rank.duration_s:.1f} s"
        reason = f"  ({rank.reason})" if rank.reason else ""
        lines.append(f"  rank {rank.rank}  {rank.status.value}  {rank.host or '—'}  "
                     f"exit {exit_status(rank.exit_code)}  {seconds}{reason}")
    lines.append(f"  logs: {run.log_dir}")
    if run.timeline_path:
        lines.append(f"  timeline: {run.timeline_path}")
    return "\n".join(lines)


def run_report_html(run: RunResult) -> str:
    """The same as a table: status per rank (coloured), host, exit, when it started and how
    long it ran (seconds, from the run's start), and why it failed or stopped."""
    colour = STATUS_COLOURS.get(run.status, "#757575")
    table = html_table(["rank", "status", "host", "pid", "exit", "started at s", "ran s", "reason"],
                       [_rank_row(run, rank) for rank in run.ranks])
    error = f"<div>{html.escape(run.error)}</div>" if run.error else ""
    timeline = (f"<div>timeline: <code>{html.escape(run.timeline_path)}</code></div>"
                if run.timeline_path else "")
    return (f"<div><b>run {html.escape(run.run_id)}</b> · "
            f'<b style="color:{colour}">{html.escape(run_headline(run))}</b></div>{error}'
            f"{table}"
            f"<div>logs: <code>{html.escape(run.log_dir)}</code> (<code>run.log(rank)</code> reads one)</div>"
            f"{timeline}")


def _rank_row(run: RunResult, rank: RankRecord) -> tuple[str, list[str]]:
    colour = STATUS_COLOURS[rank.status]
    started = "—" if rank.started_at is None else f"{rank.started_at - run.started_at:.2f}"
    ran = "—" if rank.duration_s is None else f"{rank.duration_s:.2f}"
    cells = [str(rank.rank), f'<span style="color:{colour}">{rank.status.value}</span>',
             html.escape(rank.host or "—"), "—" if rank.pid is None else str(rank.pid),
             html.escape(exit_status(rank.exit_code)), started, ran, html.escape(rank.reason)]
    background = f' style="background:{FAILED_ROW_BACKGROUND}"' if rank.status is RankStatus.FAILED else ""
    return background, cells
