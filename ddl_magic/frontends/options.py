"""What every front-end does the same way: the options a run takes, declared once and checked
once, and the choices made from them (which launcher starts the ranks, which display shows
them).

The command-line options are declared here, once, as `Option`s, and attached to each parser
that takes them, as ipyparallel's `exec_args` attaches one argument group to `%px`, `%%px`
and `%pxconfig`: `%%horovod` and `%horovod start` take `LAUNCH_OPTIONS`, `%%horovod` and
`ddlrun` `RUN_OPTIONS`. Whatever spelled them (`-np 4`, `np=-4`, `num_processes=4`), the
numbers go through one check, `driver.run_options.check_options`, which each front-end says
in its own error type (`checked` for the magics, `ddlrun`'s `parser.error`, a `ValueError`
from Python).

Example::

    @magic_arguments(name="%horovod")
    @launch_options
    @run_options
    @line_cell_magic
    def horovod(self, line, cell=None): ...
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from IPython.core.magic_arguments import argument

from ..driver.display import RunDisplay
from ..driver.elastic_plan import ElasticBounds
from ..driver.launcher import Launcher
from ..driver.records import RankRecord
from ..driver.run_options import OptionError, check_options
from ..driver.text_display import TextDisplay
from ..launch import spark_session
from ..launch.local import LocalLauncher
from ..launch.shares import RunData

DISPLAY_ENV = "DDL_MAGIC_DISPLAY"
RUN_VIEW_WIDGETS_AFTER_S = 0.5
"""A run that ends sooner shows its final report (a table and the logs, as HTML and text)
instead of widgets: a dozen widget models cost a short pool cell more than its ranks do."""


class HorovodUsageError(ValueError):
    """A mistake in a %%horovod or %horovod line; the message says how to write it.

    Raised (unlike IPython's own UsageError) as a real error, so "Run All" stops here.
    """


@dataclass(frozen=True)
class Option:
    """One command-line option, as argparse's `add_argument` takes it; used as a decorator
    it is IPython's `magic_arguments.argument`."""

    flags: tuple[str, ...]
    settings: dict[str, Any] = field(default_factory=dict)

    def __call__(self, magic: Callable) -> Callable:
        return argument(*self.flags, **self.settings)(magic)

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(*self.flags, **self.settings)

    def but(self, **settings: Any) -> Option:
        """This option with some of its settings changed (`required=True`, where a parser
        cannot do without it); a setting given as None is dropped (argparse's default)."""
        changed = {**self.settings, **settings}
        return Option(self.flags, {key: value for key, value in changed.items() if value is not None})


NP = Option(("-np", "--num-proc"), dict(
    dest="np", type=int,
    help="number of ranks (in a notebook, not needed while a pool runs)"))
MIN_NP = Option(("--min-np",), dict(
    dest="min_np", type=int, metavar="N",
    help="elastic: a lost rank resets the world instead of failing the run, which goes on "
         "from the last state.commit() while N ranks are left (lost ranks are replaced). "
         "Needs hvd.elastic.run; see 'Elastic runs' in the README. A pool started with it "
         "replaces lost ranks between cells"))
MAX_NP = Option(("--max-np",), dict(dest="max_np", type=int, metavar="N",
                                     help="elastic: at most N ranks (-np at most)"))
MAX_RESTARTS = Option(("--max-restarts",), dict(
    dest="max_restarts", type=int, default=0, metavar="K",
    help="as torchrun's, for plain torch.distributed code: when a rank fails, stop every "
         "rank and start the whole group again, at most K times; each rank's "
         "TORCHELASTIC_RESTART_COUNT says which restart it is, for code that resumes from its "
         "own checkpoint (default 0). Not in a pool"))
SPARK = Option(("--spark",), dict(action="store_true",
                                  help="run the ranks as Spark barrier tasks on the active "
                                       "SparkSession"))
LOCAL = Option(("--local",), dict(action="store_true",
                                  help="run the ranks as local processes (the default when no "
                                       "SparkSession is active)"))
TIMELINE = Option(("--timeline",), dict(
    nargs="?", const="", metavar="PATH",
    help="record every rank's timeline (Chrome trace format) to PATH (default: in the run's "
         "log folder) and show it after the run; it opens in chrome://tracing and Perfetto "
         "too"))
TIMEOUT = Option(("--timeout",), dict(type=float, metavar="SECONDS",
                                      help="stop all ranks if the run takes longer than this"))
ENV = Option(("--env",), dict(action="append", default=[], metavar="KEY=VALUE",
                              help="set an environment variable on every rank (repeatable)"))
MEMORY_PER_RANK = Option(("--memory-per-rank",), dict(
    dest="memory_per_rank", metavar="SIZE",
    help="cap each local rank's memory (e.g. 2GiB): a rank that goes over it is killed by the "
         "OOM killer and named so, as on a machine that small (a memory cgroup per rank: Linux "
         "with cgroup v1, as root)"))
GPU = Option(("--gpu",), dict(action="store_true",
                              help="each rank pins the GPU of its local_rank; an error if there "
                                   "are too few GPUs"))
MLFLOW = Option(("--mlflow",), dict(
    nargs="?", const=True, metavar="EXPERIMENT",
    help="track the run in MLflow (in EXPERIMENT, if named): every rank logs into it. Runs are "
         "tracked anyway while the notebook has an active MLflow run, unless "
         "DDL_MAGIC_MLFLOW=off"))

DATA = Option(("--data",), dict(
    action="append", default=[], metavar="NAME=VALUE",
    help="give the ranks a dataset: VALUE a Spark or pandas DataFrame of the notebook, or the "
         "path of Parquet files, a Delta table or an Arrow file. On each rank NAME is that "
         "rank's share: NAME.loader(batch_size=...) yields dicts of tensors, every rank the "
         "same number of steps per epoch (repeatable). In a cell, a Spark DataFrame the cell "
         "reads is its share without it; a pool keeps its data across cells"))

LAUNCH_OPTIONS = (NP, MIN_NP, SPARK, LOCAL, TIMELINE, ENV, MEMORY_PER_RANK, GPU, DATA)
"""Where and how the ranks start: `%%horovod` and `%horovod start`."""
RUN_OPTIONS = (MAX_NP, MAX_RESTARTS, TIMEOUT, MLFLOW)
"""What one run may do: `%%horovod` (`ddlrun` takes those that make sense in a terminal)."""


def _attaching(options: tuple[Option, ...]) -> Callable[[Callable], Callable]:
    def attach(magic: Callable) -> Callable:
        for option in reversed(options):  # the help lists them in this order
            magic = option(magic)
        return magic

    return attach


launch_options = _attaching(LAUNCH_OPTIONS)
run_options = _attaching(RUN_OPTIONS)


@dataclass(frozen=True)
class CheckedOptions:
    """What the shared options of a command line say, once checked."""

    bounds: ElasticBounds | None  # an elastic run's, or None
    spark: bool | None  # True: Spark tasks; False: local processes; None: Spark if active
    env: dict[str, str]


def checked(args: argparse.Namespace, error: Callable[[str], BaseException],
            example: str) -> CheckedOptions:
    """Check the shared options a command line parsed into `args`, raising `error` with
    what to write instead (`example`: the front-end's command, e.g. '%%horovod -np 2')."""
    if getattr(args, "spark", False) and getattr(args, "local", False):
        raise error("choose one of --spark and --local")
    try:
        bounds = check_options(args.np, min_np=getattr(args, "min_np", None),
                               max_np=getattr(args, "max_np", None),
                               max_restarts=getattr(args, "max_restarts", 0))
        env = parse_env(getattr(args, "env", []))
    except OptionError as exc:
        raise error(f"{exc}; e.g. {example}" if exc.option == "np" else str(exc)) from None
    except ValueError as exc:
        raise error(str(exc)) from None
    spark = True if getattr(args, "spark", False) else False if getattr(args, "local", False) else None
    return CheckedOptions(bounds, spark, env)


def parse_env(pairs: list[str]) -> dict[str, str]:
    """['A=1', 'B=x'] -> {'A': '1', 'B': 'x'}, with an error that shows the expected form."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--env {pair!r}: expected KEY=VALUE, for example --env OMP_NUM_THREADS=2")
        env[key] = value
    return env


def make_launcher(spark: bool | None, data: RunData | None = None) -> Launcher:
    """Spark barrier tasks if asked (or, when `spark` is None, if a SparkSession is active);
    `data`: the run's datasets, whose Spark DataFrames the barrier stage then runs over."""
    if not wants_spark(spark):
        return LocalLauncher()
    from ..launch.spark import SparkLauncher

    return SparkLauncher(data=data.spark_stage if data is not None else None)


def wants_spark(spark: bool | None) -> bool:
    """Whether a run whose front-end said `spark` (None: not said) runs on Spark."""
    return spark_session() is not None if spark is None else spark


def make_display(ranks: list[RankRecord], *, quiet: bool = False, log_dir: str | None = None,
                 title: str = "", timeline_path: str | None = None) -> RunDisplay:
    """The display for a run: the widget run view in a Jupyter kernel, else text.

    ``ranks`` is the run's list of `RankRecord`, which the driver keeps and the display
    renders.

    The run view makes its widgets once the run has lasted ``RUN_VIEW_WIDGETS_AFTER_S``; a
    shorter run shows its final report. Set ``DDL_MAGIC_DISPLAY=widgets`` for the widgets
    from a run's first moment, ``DDL_MAGIC_DISPLAY=text`` for the text display in a kernel too
    (frontends that do not render widgets). ``quiet`` prints only failures and the closing
    line, in any setting.
    ``timeline_path``, for a run that records one, is where the run view reads the finished
    run's timeline from, to draw it in its own figure.

    Example::

        display = make_display(new_records(4), log_dir="/tmp/ddl_magic/run-1", title="%%horovod -np 4")
    """
    if quiet:
        return TextDisplay(ranks, log_dir=log_dir, quiet=True)
    if shows_run_view():
        from ..ui.run_view import RunView  # ipywidgets load only where a widget is shown

        at_once = _display_choice() == "widgets"
        return RunView(ranks, title, log_dir, timeline_path=timeline_path,
                       widget_after_s=None if at_once else RUN_VIEW_WIDGETS_AFTER_S)
    return TextDisplay(ranks, log_dir=log_dir)


def shows_run_view() -> bool:
    """Whether a (not quiet) run shows as the widget run view here, which draws the run's
    timeline itself: in a Jupyter kernel, unless ``DDL_MAGIC_DISPLAY=text``."""
    return _display_choice() != "text" and _in_jupyter_kernel()


def _display_choice() -> str:
    choice = os.environ.get(DISPLAY_ENV, "")
    if choice not in ("", "text", "widgets"):
        raise ValueError(f"{DISPLAY_ENV}={choice!r} is not understood: set it to 'text' or "
                         "'widgets', or unset it")
    return choice


def _in_jupyter_kernel() -> bool:
    from IPython import get_ipython

    return getattr(get_ipython(), "kernel", None) is not None
