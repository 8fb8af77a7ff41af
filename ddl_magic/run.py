"""`ddlrun`: run a Python script on N local ranks from a terminal.

    ddlrun -np 4 python train.py --epochs 3
    python -m ddl_magic.run -np 2 --timeline trace.json train.py

Every line a rank prints comes out prefixed with its rank (``[1] ...``). When one rank fails
the others are stopped within seconds, its traceback is printed once, and ddlrun exits with
that rank's exit code. Ctrl-C (SIGINT) stops every rank, also when ddlrun was started with
SIGINT ignored.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from .job import Job, JobOptions, RankFailedError, RunTimeoutError
from .launch.local import LocalLauncher
from .tasks import ScriptTask


def parse_env(pairs: list[str]) -> dict[str, str]:
    """['A=1', 'B=x'] -> {'A': '1', 'B': 'x'}, with an error that shows the expected form."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--env {pair!r}: expected KEY=VALUE, for example --env OMP_NUM_THREADS=2")
        env[key] = value
    return env


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddlrun", description=__doc__.split("\n\n")[0],
        epilog="example: ddlrun -np 2 python train.py --epochs 3")
    parser.add_argument("-np", "--num-proc", dest="np", type=int, required=True,
                        help="number of ranks to start on this machine")
    parser.add_argument("--timeline", metavar="PATH", default=os.environ.get("HOROVOD_TIMELINE"),
                        help="write every rank's timeline to PATH (Chrome trace format); "
                             "HOROVOD_TIMELINE does the same")
    parser.add_argument("--timeout", type=float, metavar="SECONDS",
                        help="stop all ranks if the run takes longer than this")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set an environment variable on every rank (repeatable)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="python script.py [args...]  (or just script.py [args...])")
    return parser


def _script_task(command: list[str], parser: argparse.ArgumentParser) -> ScriptTask:
    if command and os.path.basename(command[0]).startswith("python"):
        command = command[1:]
    if not command or command[0].startswith("-"):
        parser.error("give the script to run, for example: ddlrun -np 2 python train.py")
    path = command[0]
    if not os.path.isfile(path):
        parser.error(f"script {path!r} not found (working directory: {os.getcwd()})")
    return ScriptTask(os.path.abspath(path), command[1:])


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C stops every rank even when ddlrun inherited SIGINT ignored (started as a
    # background job, or by some CI runners): Python then installs no handler of its own.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.np < 1:
        parser.error(f"-np must be at least 1 (got {args.np})")
    try:
        env = parse_env(args.env)
    except ValueError as exc:
        parser.error(str(exc))
    task = _script_task(args.command, parser)
    options = JobOptions(timeout_s=args.timeout, timeline_path=args.timeline, env=env,
                         title=" ".join(args.command))
    try:
        Job(task, args.np, LocalLauncher(), options).run()
    except RankFailedError as exc:
        code = exc.exit_code
        return 128 - code if code is not None and code < 0 else (code or 1)
    except RunTimeoutError as exc:
        print(f"ddlrun: {exc}", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        print("ddlrun: interrupted; all ranks stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
