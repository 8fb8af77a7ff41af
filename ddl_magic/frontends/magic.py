"""The `%%horovod` cell magic: thin glue between IPython and the modules that do the work."""

from __future__ import annotations

import argparse
import collections
import difflib
import re

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .options import (HorovodUsageError, checked, launch_options, make_display, make_launcher,
                      run_options, shows_run_view, wants_spark)
from ..driver.capture import CaptureError, capture_cell, format_bytes, names_read, unknown_names
from ..driver.job import Job, JobOptions, last_run
from ..driver.pool import PoolError, active_pool
from ..driver.run_result import RankFailedError, RunTimeoutError
from ..driver.run_status import RunStatus
from .pool_magic import POOL_RESTARTS_REFUSED, cell_filename, run_cell_on_pool, run_line, transform_body
from .data_options import dataframes_read, parse_data, shares_for_run

__all__ = ["CellInterrupted", "HorovodMagics", "HorovodUsageError", "show_run_error"]


class CellInterrupted(KeyboardInterrupt):
    """The cell was interrupted (the stop button, Ctrl-C) and every rank was stopped.

    A KeyboardInterrupt still, so "Run All" stops here; shown as its one line, not as the
    driver's loop that the interrupt happened to land in.
    """


@magics_class
class HorovodMagics(Magics):
    @magic_arguments(name="%horovod")  # the usage line adds one "%": a cell magic has two
    @launch_options
    @run_options
    @argument("--ranks", metavar="R,R",
              help="in a pool: run the cell on these ranks only (inspection, printing, "
                   "saving); collectives are refused in such a cell")
    @argument("-o", "--out", metavar="NAME",
              help="store the result (rank 0's last expression) in the notebook as NAME")
    @argument("--all-ranks", action="store_true",
              help="the result is the list of every rank's last expression")
    @argument("--quiet", action="store_true",
              help="don't print the report of captured names and payload size")
    @line_cell_magic
    def horovod(self, line: str, cell: str | None = None):
        """Run this cell on N ranks with ddl_magic's ring-allreduce runtime.

        Example::

            %%horovod -np 2
            import torch
            import ddl_magic.torch as hvd
            hvd.init()
            total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
            total.item()          # rank 0's last expression is the cell's result: 3.0

        The cell runs as a function: the notebook names it reads (variables, functions,
        classes, modules) are sent to every rank; the names it assigns stay on the ranks.
        Ranks are Spark barrier tasks when a SparkSession is active, else local processes.
        Every rank's output is shown live, separately. If a rank fails, its traceback is
        shown and every other rank is stopped; the stop button stops all ranks.

        Ranks that live between cells (a pool)::

            %horovod start -np 2        # start 2 ranks; their ring forms once
            %%horovod                   # each cell runs on them, in each rank's namespace:
            model = build()             #   what a cell assigns is there for the next cell
            %%horovod
            train(model, epochs=1)      # notebook names it reads are sent each cell, but
                                        #   never over a name the ranks assigned
            %horovod pull model [--rank R | --all-ranks] [-o NAME]   # into the notebook
            %%horovod --ranks 0         # some ranks only (no collectives in such a cell)
            %horovod status             # each rank: state, host, pid, memory, uptime
            %horovod auto  /  %horovod auto off   # every following cell runs on the ranks
            %horovod restart            # fresh ranks, same options: their state is gone
            %horovod stop               # back to one-shot cells
            %horovod release            # end the rank factory that local runs fork from
                                        #   (torch imported, a few hundred MB kept warm)

        `%horovod start -np N [--min-np M] [--spark | --local] [--timeline [PATH]]
        [--env KEY=VALUE ...] [--memory-per-rank SIZE] [--gpu] [--data NAME=VALUE ...]`: the
        options are the pool's, for every cell. In a pool, a failing rank's
        traceback is shown and the other ranks' cells are stopped (their collectives end
        with an error naming it), the stop button interrupts every rank's cell, and
        `--timeout` stops the cell: the ranks stay up with their state, and the next cell
        runs on a fresh ring. A rank that dies (killed, crashed, its host gone) breaks the
        pool: the other ranks are stopped, and `%horovod restart` starts fresh ones; in a
        pool started with `--min-np M`, a fresh rank replaces it instead (it starts empty,
        the others keep their state, and the cell says so) while M ranks are left. The
        same from Python: `pool = ddl_magic.start(np=2)`, `pool.run(fn, *args)`,
        `pool.pull(name)`, `pool.restart()`, `pool.stop()`, or `with ddl_magic.start(np=2)`.
        """
        if cell is None:
            return run_line(self.shell, line)
        try:
            args = parse_argstring(self.horovod, line)
        except UsageError as exc:
            raise HorovodUsageError(f"{exc}{_did_you_mean(str(exc), self.horovod.parser)}. "
                                    "See %%horovod? for every option.") from None
        if args.out is not None and not args.out.isidentifier():
            raise HorovodUsageError(f"-o {args.out!r}: the result needs a valid Python name, e.g. -o result")
        pool = active_pool()
        if pool is not None and (args.min_np is not None or args.max_np is not None):
            raise HorovodUsageError(
                "--min-np/--max-np are not per cell in a pool: a pool is elastic from its start "
                "(%horovod start -np N --min-np M replaces lost ranks between cells). For an "
                "elastic loop that goes on within one cell (hvd.elastic.run), %horovod stop "
                "the pool and run a one-shot cell: %%horovod -np N --min-np M")
        if pool is not None and args.max_restarts:
            raise HorovodUsageError(POOL_RESTARTS_REFUSED)
        if pool is not None:
            return self._on_pool(pool, args, line, cell)
        if args.np is None:
            raise HorovodUsageError("-np is needed (no pool is running): e.g. %%horovod -np 2, "
                                    "or %horovod start -np 2 for ranks that stay between cells")
        if args.ranks is not None:
            raise HorovodUsageError("--ranks needs a pool: %horovod start -np N first")
        options = checked(args, HorovodUsageError, example="%%horovod -np 2")
        # The leading newline stands for the %%horovod line, so tracebacks from the ranks
        # give line numbers as the notebook shows them.
        source = "\n" + transform_body(self.shell, cell)
        try:
            datasets = parse_data(args.data, self.shell.user_ns)
        except ValueError as exc:
            raise HorovodUsageError(str(exc)) from None
        datasets.update(dataframes_read(names_read(source), self.shell.user_ns, datasets))
        job_options = JobOptions(display=make_display, timeout_s=args.timeout,
                                 return_all=args.all_ranks, env=options.env,
                                 timeline_path=args.timeline, use_gpu=args.gpu,
                                 title=f"%%horovod {line.strip()}", mlflow=args.mlflow,
                                 min_np=args.min_np, max_np=args.max_np,
                                 max_restarts=args.max_restarts,
                                 memory_per_rank=args.memory_per_rank)
        try:
            with shares_for_run(datasets, args.np, wants_spark(options.spark), args.quiet) as data:
                namespace = collections.ChainMap(data.shares, self.shell.user_ns)
                _refuse_unknown_names(source, namespace)
                captured = capture_cell(source, namespace, filename=cell_filename(self.shell))
                if not args.quiet:
                    print(captured.report())
                if captured.is_large:
                    print(f"ddl_magic warning: the payload is {format_bytes(len(captured.payload))}; "
                          "load large data on each rank (from files) instead of capturing it")
                launcher = make_launcher(options.spark, data)
                run = Job(captured.payload, args.np, launcher, job_options).run()
        except KeyboardInterrupt:
            record = last_run()
            logs = (f"; their logs are in {record.log_dir}"
                    if record is not None and record.status is RunStatus.INTERRUPTED else "")
            raise CellInterrupted(f"the cell was interrupted and every rank stopped{logs}") from None
        if run.timeline_path and not shows_run_view():  # the run view draws it in its own figure
            from ..ui.show_timeline import show_timeline  # plotly loads only when shown

            show_timeline(run)
        value = run.results if args.all_ranks else run.result
        if args.out:
            self.shell.user_ns[args.out] = value
        return value

    def _on_pool(self, pool, args, line: str, cell: str):
        try:
            run = run_cell_on_pool(self.shell, pool, args, line, cell)
        except KeyboardInterrupt:
            raise CellInterrupted("the cell was interrupted on every rank; the ranks stay up, "
                                  "with their state") from None
        value = run.results if args.all_ranks else run.result
        if args.out:
            self.shell.user_ns[args.out] = value
        return value


def _refuse_unknown_names(source: str, namespace: dict) -> None:
    """A one-shot cell that reads names defined nowhere would fail on every rank with
    NameError: say so before starting any, and how to keep names between cells."""
    missing = unknown_names(source, namespace)
    if not missing:
        return
    listed = ", ".join(missing)
    raise CaptureError(
        f"the cell reads {listed}, defined neither in the notebook nor in the cell, so every "
        "rank would fail with NameError. Names assigned in earlier %%horovod cells lived on "
        "that cell's ranks, which are gone: a one-shot cell starts fresh ranks. "
        "%horovod start -np N starts ranks that keep their names between cells; or define "
        f"{listed} in this cell, or return it from the cell (-o NAME) to send it back in")


def _did_you_mean(message: str, parser: argparse.ArgumentParser) -> str:
    """'; did you mean --timeline?' for each unrecognised option close to a real one."""
    unknown = re.search(r"unrecognized arguments: (.*)", message)
    if unknown is None:
        return ""
    options = [option for action in parser._actions for option in action.option_strings]
    suggestions = [close[0] for word in unknown.group(1).split() if word.startswith("-")
                   and (close := difflib.get_close_matches(word.split("=")[0], options, n=1, cutoff=0.6))]
    return f"; did you mean {' and '.join(suggestions)}?" if suggestions else ""


def show_run_error(shell, etype, evalue, tb, tb_offset=None) -> None:
    """Show a failed, interrupted or refused run as one message, without the frames of the
    magic's machinery, which would only bury it.

    A failed rank's traceback is already shown, once, by the run's display (the run view's
    failure panel, or the text display's lines): the error says only who failed and where
    every rank's full log is.
    """
    if isinstance(evalue, RankFailedError):
        where = f"rank {evalue.rank} ({evalue.host})" if evalue.host else f"rank {evalue.rank}"
        shown = (f"{where} failed: {evalue.reason}; its traceback is shown above, and every "
                 f"rank's full log is in {evalue.run.log_dir}")
    else:
        shown = str(evalue)
    shell._showtraceback(etype, evalue, [f"{etype.__name__}: {shown}"])


show_run_error.handles = (RankFailedError, CaptureError, HorovodUsageError, RunTimeoutError, CellInterrupted,
                          PoolError)
