"""`python -m ddl_magic`: the command line of ddl_magic.

    python -m ddl_magic demo            # train a small model on 2 local ranks: checks the install
    python -m ddl_magic demo -np 3 --timeline demo.timeline.json
"""

from __future__ import annotations

import argparse
import sys

from .frontends import demo
from .frontends.options import checked

DESCRIPTION = """\
ddl_magic runs a notebook cell on N ranks (%%horovod -np N) with its own ring-allreduce
runtime and a Horovod-compatible API (import ddl_magic.torch as hvd). After installing,
start with `python -m ddl_magic demo`: it trains an MLP on the Iris flowers on 2 local
ranks, with no notebook, prints each rank's progress, the test accuracy and where the
timeline was written, and exits 0 if the ranks learned together.
"""

EPILOG = """\
in a notebook:   %load_ext ddl_magic, then a cell starting with %%horovod -np 2
                 (%%horovod? shows every option)
from a terminal: ddlrun -np 2 python train.py
examples:        the notebooks in example_notebooks/ (Iris on Spark and torch, MNIST,
                 the ring drawn step by step, reading a timeline)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddl_magic", description=DESCRIPTION,
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(title="commands", dest="command", metavar="command")
    demo_parser = commands.add_parser(
        "demo", help="train a small model on local ranks to check the install",
        description=demo.__doc__.split("\n\n")[0].removeprefix("`python -m ddl_magic demo`: "))
    demo.add_arguments(demo_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    checked(args, parser.error, example="python -m ddl_magic demo -np 2")
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1 (got {args.epochs})")
    return demo.run_demo(np=args.np, epochs=args.epochs, timeline=args.timeline, timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
