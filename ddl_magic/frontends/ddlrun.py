"""`ddlrun`: run a Python command on N local ranks from a terminal.

    ddlrun -np 4 python train.py --epochs 3
    ddlrun -np 2 python -m my_package.train --epochs 3
    ddlrun -np 2 python -c "import ddl_magic.torch as hvd; hvd.init(); print(hvd.rank())"
    python -m ddl_magic.frontends.ddlrun -np 2 --timeline trace.json train.py

The command is what torchrun and horovodrun users type: `python script.py`, `python -m
module` or `python -c code`, each with its arguments, or the script alone. Each rank runs it
as `python` would (`__main__`, `sys.argv`, `sys.exit`), in a process forked from a warm
Python, so the command's `python` names no interpreter of its own: ranks use ddlrun's.

Every line a rank prints comes out prefixed with its rank (``[1] ...``). When one rank fails
the others are stopped within seconds, its traceback is printed once, and ddlrun exits with
that rank's exit code. Ctrl-C (SIGINT) stops every rank, also when ddlrun was started with
SIGINT ignored.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import signal
import sys

from .options import (ENV, MAX_NP, MAX_RESTARTS, MEMORY_PER_RANK, MIN_NP, NP, TIMELINE, TIMEOUT,
                      checked, make_display)
from ..driver.elastic import ElasticRunError
from ..driver.job import Job, JobOptions
from ..driver.run_result import RankFailedError, RunTimeoutError, restarts_made
from ..driver.watcher import RanksNotConnectedError
from ..launch.local import LocalLauncher
from ..wire.tasks import CodeTask, ModuleTask, ScriptTask
from .data_options import parse_data, shares_for_run

USAGE = ("ddlrun runs a Python command: ddlrun -np 2 python train.py [args], "
         "ddlrun -np 2 python -m package.module [args], ddlrun -np 2 python -c CODE [args], "
         "or ddlrun -np 2 train.py [args]")
# Python's options that change nothing on a rank, whose output is flushed line by line.
HARMLESS_PYTHON_OPTIONS = ("-u",)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddlrun", description=__doc__.split("\n\n")[0],
        epilog="examples: ddlrun -np 2 python train.py --epochs 3; "
               "ddlrun -np 2 python -m package.train --epochs 3; "
               "ddlrun -np 2 python -c 'import torch; ...'")
    for option in (NP.but(required=True), MIN_NP, MAX_NP, MAX_RESTARTS, TIMEOUT, ENV,
                   MEMORY_PER_RANK):
        option.add_to(parser)
    # A path is needed here (a bare --timeline would take the command for it).
    TIMELINE.but(nargs=None, const=None, default=os.environ.get("HOROVOD_TIMELINE"),
                 help="write every rank's timeline to PATH (Chrome trace format); "
                      "HOROVOD_TIMELINE does the same").add_to(parser)
    parser.add_argument("--data", action="append", default=[], metavar="NAME=PATH",
                        help="give the ranks a dataset: Parquet files or a folder, a Delta "
                             "table or an Arrow file; each rank reads its share with "
                             "ddl_magic.data.share(NAME).loader(batch_size=...) (repeatable)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="python script.py | python -m module | python -c code, then its "
                             "arguments (or just script.py [args...])")
    return parser


def command_task(command: list[str]) -> ScriptTask | ModuleTask | CodeTask:
    """The task that runs `command` on a rank, as `python` would run it there.

    >>> command_task(["python", "-m", "json.tool", "--help"])
    ModuleTask(module='json.tool', args=['--help'])

    Raises ValueError, saying what ddlrun runs, for anything else.
    """
    if not command:
        raise ValueError(f"give the command to run. {USAGE}")
    if os.path.basename(command[0]).startswith("python"):
        arguments = command[1:]
        while arguments and arguments[0] in HARMLESS_PYTHON_OPTIONS:
            arguments = arguments[1:]
        if not arguments:
            raise ValueError(f"give the script to run after {command[0]!r}. {USAGE}")
        if arguments[0] == "-m":
            return _module_task(arguments[1:])
        if arguments[0] == "-c":
            if len(arguments) < 2:
                raise ValueError(f"-c needs the code to run. {USAGE}")
            return CodeTask(arguments[1], arguments[2:])
        if arguments[0].startswith("-"):
            raise ValueError(f"python option {arguments[0]!r} is not passed on to the ranks "
                             f"(they are forked from a running Python). {USAGE}")
        return _script_task(arguments, is_python_command=True)
    return _script_task(command, is_python_command=False)


def _module_task(arguments: list[str]) -> ModuleTask:
    if not arguments or arguments[0].startswith("-"):
        raise ValueError(f"-m needs the module to run. {USAGE}")
    module = arguments[0]
    # Only the top-level package is looked for: finding a submodule would import its
    # package here, in the driver. Ranks find modules in the working directory, as `-m` does.
    top_level = module.split(".")[0]
    if importlib.machinery.PathFinder.find_spec(top_level, [os.getcwd(), *sys.path]) is None:
        raise ValueError(f"module {top_level!r} not found in the working directory "
                         f"({os.getcwd()}) or on sys.path: check its name, or run ddlrun where "
                         "the package is, or install it")
    return ModuleTask(module, arguments[1:])


def _script_task(arguments: list[str], is_python_command: bool) -> ScriptTask:
    path = arguments[0]
    if not is_python_command and not _looks_like_python(path):
        raise ValueError(f"{path!r} is not a Python script. {USAGE}")
    if not os.path.isfile(path):
        raise ValueError(f"script {path!r} not found (working directory: {os.getcwd()})")
    return ScriptTask(os.path.abspath(path), arguments[1:])


def _looks_like_python(path: str) -> bool:
    """A `.py` file (existing or not: then it is reported missing), or a file whose `#!`
    line names python."""
    if path.endswith(".py"):
        return True
    try:
        with open(path, "rb") as file:
            first_line = file.readline(200)
    except OSError:
        return False
    return first_line.startswith(b"#!") and b"python" in first_line


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C stops every rank even when ddlrun inherited SIGINT ignored (started as a
    # background job, or by some CI runners): Python then installs no handler of its own.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = _parser()
    args = parser.parse_args(argv)
    options = checked(args, parser.error, example="ddlrun -np 2 python train.py")
    try:
        task = command_task(args.command)
        datasets = parse_data(args.data, {})
    except ValueError as exc:
        parser.error(str(exc))
    job_options = JobOptions(display=make_display, timeout_s=args.timeout,
                             timeline_path=args.timeline, env=options.env,
                             title=" ".join(args.command), min_np=args.min_np,
                             max_np=args.max_np, max_restarts=args.max_restarts,
                             memory_per_rank=args.memory_per_rank)
    try:
        with shares_for_run(datasets, args.np, on_spark=False) as data:
            task.shares.update(data.shares)
            Job(task, args.np, LocalLauncher(), job_options).run()
    except (FileNotFoundError, TypeError, KeyError) as exc:  # a dataset refused before launch
        print(f"ddlrun: {exc}", file=sys.stderr)
        return 2
    except RankFailedError as exc:
        if exc.restarts:  # the display showed the failure; this says the restarts ran out
            print(f"ddlrun: rank {exc.rank} failed: {exc.reason}"
                  f"{restarts_made(exc.restarts)}", file=sys.stderr)
        code = exc.exit_code
        return 128 - code if code is not None and code < 0 else (code or 1)
    except (ElasticRunError, RanksNotConnectedError) as exc:
        print(f"ddlrun: {exc}", file=sys.stderr)
        return 1
    except RunTimeoutError as exc:
        print(f"ddlrun: {exc}", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        print("ddlrun: interrupted; all ranks stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
