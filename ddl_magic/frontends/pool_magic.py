"""A pool from the notebook: `%horovod start|stop|status|restart|pull|auto` and
`ddl_magic.start()`, thin glue over `driver/pool.Pool`.

    %horovod start -np 2              ranks that keep their state and ring between cells
    %%horovod                         a cell on them (`magic.py` sends it here)
    %horovod pull model --rank 1      a rank's value, into the notebook
    %horovod status | restart | stop
    %horovod auto  /  %horovod auto off   every following cell runs on the ranks
    %horovod release                  end the rank factory local runs fork from (memory back)

or, in a script::

    with ddl_magic.start(np=2) as pool:
        pool.run(train, epochs=1)
        model = pool.pull("model")
"""

from __future__ import annotations

import argparse
import shlex
import time
from typing import Any

import cloudpickle

from ..driver.capture import capture_cell, format_bytes
from ..driver.pool import Pool, PoolError, RankInfo, active_pool
from ..driver.text_display import TextDisplay
from ..launch.local import release_rank_factory
from ..launch.shares import is_spark_dataframe
from ..wire.tasks import CellTask
from .data_options import parse_data, shares_for_run
from .options import (LAUNCH_OPTIONS, MAX_RESTARTS, NP, HorovodUsageError, checked,
                      make_display, make_launcher, wants_spark)


def start(np: int = 2, *, spark: bool | None = None, env: dict[str, str] | None = None,
          timeline: str | None = None, use_gpu: bool = False, quiet: bool = False,
          min_np: int | None = None, memory_per_rank: str | None = None,
          data: dict[str, object] | None = None) -> Pool:
    """Start `np` ranks that live between cells (Spark barrier tasks where `spark`, or where
    a SparkSession is active and `spark` is None; else local processes).

    Example::

        pool = ddl_magic.start(np=2)
        pool.run(build_model)            # every rank runs it; rank 0's value comes back
        pool.pull("model", rank=1)
        pool.stop()                      # or: with ddl_magic.start(np=2) as pool: ...

    `timeline=""` records every cell's timeline in the pool's log folder (a path: there).
    `min_np` makes the pool elastic: a lost rank is replaced by a fresh one (which starts
    empty; the others keep their state) while `min_np` ranks are left, instead of breaking
    the pool; `pool.replaced` says what each replacement said. `memory_per_rank` ('2GiB')
    caps each local rank's memory, as `%%horovod --memory-per-rank` does.

    `data={"train": df}` gives the ranks datasets at once (`load_data`): on Spark, a Spark
    DataFrame's shares are written by the pool's own tasks as it starts, beside each rank.
    """
    display = _quiet_display if quiet else make_display
    with shares_for_run(data or {}, np, wants_spark(spark), quiet) as prepared:
        pool = Pool(np, make_launcher(spark, data=prepared), env=env, timeline_path=timeline,
                    use_gpu=use_gpu, display=display, min_np=min_np,
                    memory_per_rank=memory_per_rank).start()
        if prepared.shares:
            _install(pool, prepared)
    return pool


def load_data(pool: Pool, datasets: dict[str, object], quiet: bool = False) -> None:
    """Give a pool's ranks datasets, kept on them across cells until replaced: each name on
    each rank is that rank's share (`%horovod data train=df`). The shares are made ready now
    (read from their source, for Parquet and Delta), not in the next cell.

    A Spark DataFrame reaches a Spark pool's ranks only as it starts (`start(data=...)`): its
    tasks, which hold their slots for the pool's life, are the ones that write the shares.
    """
    pool.check_usable()
    on_spark = pool.where.startswith("Spark")
    frames = [name for name, value in datasets.items() if is_spark_dataframe(value)]
    if on_spark and frames:
        raise PoolError(
            f"{', '.join(frames)}: a Spark DataFrame's shares are written by the Spark tasks "
            "of the pool's ranks, which only take rows as the pool starts: %horovod stop, "
            f"then %horovod start -np {pool.np} --data {frames[0]}=... (the ranks' state is "
            "lost); or write the DataFrame to Parquet and give the path here")
    with shares_for_run(datasets, pool.np, on_spark, quiet) as prepared:
        _install(pool, prepared)


def _install(pool: Pool, prepared) -> None:
    """Each share under its name in every rank's namespace, its file opened (written first,
    for Parquet and Delta) before this returns; the ranks then hold what the driver lets go."""
    names = "\n".join(f"{name} = __ddl_magic_shares__[{name!r}]" for name in prepared.shares)
    source = ("for __ddl_magic_share__ in __ddl_magic_shares__.values():\n"
              "    __ddl_magic_share__.file()\n"
              f"{names}\ndel __ddl_magic_shares__, __ddl_magic_share__\n")
    task = CellTask(source, {"__ddl_magic_shares__": prepared.shares}, "<%horovod data>")
    pool.run_cell(cloudpickle.dumps(task), title=f"%horovod data {', '.join(prepared.shares)}",
                  quiet=True)


def _quiet_display(ranks, *, quiet=True, log_dir=None, title="", timeline_path=None):
    return TextDisplay(ranks, log_dir=log_dir, quiet=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="%horovod", add_help=False, exit_on_error=False)
    commands = parser.add_subparsers(dest="command", required=True)
    started = commands.add_parser("start", add_help=False, exit_on_error=False)
    for option in LAUNCH_OPTIONS:
        (option.but(required=True) if option is NP else option).add_to(started)
    # Known only to be refused in words (a pool's cells are never restarted), not argparse's.
    MAX_RESTARTS.add_to(started)
    loaded = commands.add_parser("data", add_help=False, exit_on_error=False)
    loaded.add_argument("datasets", nargs="+", metavar="NAME=VALUE")
    for name in ("stop", "status", "restart", "release"):
        commands.add_parser(name, add_help=False, exit_on_error=False)
    pulled = commands.add_parser("pull", add_help=False, exit_on_error=False)
    pulled.add_argument("name")
    which = pulled.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, default=0)
    which.add_argument("--all-ranks", action="store_true")
    pulled.add_argument("-o", "--out", metavar="NAME")
    auto = commands.add_parser("auto", add_help=False, exit_on_error=False)
    auto.add_argument("switch", nargs="?", choices=["on", "off"], default="on")
    return parser


LINE_USAGE = ("%horovod start -np N [--min-np M] [--spark | --local] [--timeline [PATH]] "
              "[--env KEY=VALUE ...] [--memory-per-rank SIZE] [--gpu] [--data NAME=VALUE ...] "
              "· %horovod data NAME=VALUE ... · %horovod status "
              "· %horovod pull NAME [--rank R | --all-ranks] [-o NAME] "
              "· %horovod restart · %horovod stop · %horovod auto [off] · %horovod release")


POOL_RESTARTS_REFUSED = (
    "--max-restarts is not for a pool: its ranks keep their state between cells, and a "
    "failed cell is never run again behind your back (%horovod restart starts fresh ranks "
    "when you choose). For restarts from your own checkpoint, %horovod stop the pool and run "
    "a one-shot cell: %%horovod -np N --max-restarts K")


def run_line(shell, line: str):
    """`%horovod <command>`: what the line magic does."""
    try:
        args = _parser().parse_args(shlex.split(line))
    except (argparse.ArgumentError, SystemExit, ValueError) as exc:
        raise HorovodUsageError(f"{exc}. Usage: {LINE_USAGE}") from None
    pool = active_pool()
    match args.command:
        case "start":
            return _start(shell, args)
        case "data":
            try:
                datasets = parse_data(args.datasets, shell.user_ns)
            except ValueError as exc:
                raise HorovodUsageError(str(exc)) from None
            load_data(_the_pool(pool), datasets)
            print(f"ddl_magic: {', '.join(datasets)} on every rank of the pool, each its own "
                  "share, until replaced")
        case "stop":
            set_auto(shell, False)
            if pool is None:
                print("ddl_magic: no pool is running")
                return None
            pool.stop()
            print(f"ddl_magic: the pool's {pool.np} ranks were stopped; %%horovod -np N runs "
                  "one-shot cells again")
        case "restart":
            pool = _the_pool(pool)
            began = time.monotonic()
            pool.restart()
            print(f"ddl_magic: {pool.np} fresh ranks in {time.monotonic() - began:.1f} s; the "
                  "previous ranks' state (every name cells assigned on them) is gone")
            print(status_table(pool.status()))
        case "status":
            pool = active_pool()
            if pool is None:
                print("ddl_magic: no pool is running; %horovod start -np N starts one")
                return None
            print(f"ddl_magic: pool of {pool.np} ranks, {pool.state.value}, {pool.cells} cells run"
                  + (f": {pool.broken_reason}" if pool.broken_reason else ""))
            print(status_table(pool.status()))
        case "pull":
            pool = _the_pool(pool)
            value = pool.pull(args.name, args.rank, args.all_ranks)
            if args.out:
                shell.user_ns[args.out] = value
                print(pulled_line(args, value, pool.last_pull_bytes))
                return None
            return value
        case "release":
            print(release_line(pool))
        case "auto":
            _the_pool(pool) if args.switch == "on" else None
            set_auto(shell, args.switch == "on")
            print("ddl_magic: every following cell runs on the pool's ranks, until "
                  "%horovod auto off" if args.switch == "on" else
                  "ddl_magic: cells run in the notebook again")
    return None


def pulled_line(args: argparse.Namespace, value: Any, size: int) -> str:
    """The line confirming `%horovod pull NAME -o OUT`: what came from where, and how big.

    >>> pulled_line(argparse.Namespace(name="model", out="m", rank=0, all_ranks=False), [1], 1258291)
    "ddl_magic: m ← rank 0's model (list, 1.2 MB)"
    """
    if args.all_ranks:
        return (f"ddl_magic: {args.out} ← every rank's {args.name} (a list of {len(value)}, "
                f"{format_bytes(size)} in all)")
    return f"ddl_magic: {args.out} ← rank {args.rank}'s {args.name} ({type(value).__name__}, {format_bytes(size)})"


def release_line(pool: Pool | None) -> str:
    """`%horovod release`: end the rank factory that a kernel keeps after its first local run
    (torch imported, a few hundred MB, so that the next ranks start fast), and say so."""
    if pool is not None:
        raise PoolError("a pool is running: its local ranks are the rank factory's children. "
                        "%horovod stop first, then %horovod release")
    released = release_rank_factory()
    if released is None:
        return "ddl_magic: no rank factory is running (the first local run starts one)"
    pid, resident = released
    return (f"ddl_magic: the rank factory (pid {pid}, {format_bytes(resident)}) has ended; "
            "the next local run starts a new one")


def _the_pool(pool: Pool | None) -> Pool:
    if pool is None:
        raise PoolError("no pool is running: %horovod start -np N starts one")
    return pool


def _start(shell, args) -> None:
    if args.max_restarts:
        raise HorovodUsageError(POOL_RESTARTS_REFUSED)
    options = checked(args, HorovodUsageError, example="%horovod start -np 2")
    try:
        datasets = parse_data(args.data, shell.user_ns)
    except ValueError as exc:
        raise HorovodUsageError(str(exc)) from None
    running = active_pool()
    if running is not None:
        raise PoolError(running.already_running())
    began = time.monotonic()
    pool = start(args.np, spark=options.spark, env=options.env, timeline=args.timeline,
                 use_gpu=args.gpu, min_np=args.min_np, memory_per_rank=args.memory_per_rank,
                 data=datasets)
    print(f"ddl_magic: pool of {pool.np} ranks started in {time.monotonic() - began:.1f} s "
          f"({pool.where}); %%horovod cells now run on them, and what a cell assigns "
          "stays for the next. %horovod stop ends them")
    if args.min_np is not None:
        print(f"ddl_magic: elastic: a lost rank is replaced by a fresh, empty one while "
              f"{args.min_np} are left; the others keep their state")
    print(status_table(pool.status()))


def status_table(infos: list[RankInfo]) -> str:
    """A plain table of the pool's ranks: rank, host, pid, state, memory, uptime."""
    rows = [("rank", "host", "pid", "state", "memory", "uptime")]
    for info in infos:
        rows.append((str(info.rank), info.host or "?", str(info.pid or "?"), info.state.value,
                     f"{info.rss_bytes / 2**20:.0f} MB" if info.rss_bytes else "-",
                     f"{info.uptime_s:.0f} s" if info.uptime_s is not None else "-"))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in rows)


def run_cell_on_pool(shell, pool: Pool, args, line: str, cell: str):
    """`%%horovod` while a pool runs: the cell on its ranks, in their own namespaces."""
    if args.np is not None and args.np != pool.np:
        raise HorovodUsageError(
            f"-np {args.np}, but a pool of {pool.np} ranks is running: drop -np to run the cell "
            f"on the pool (or write -np {pool.np}); for {args.np} ranks, %horovod stop the pool "
            f"first (its state is lost), then %horovod start -np {args.np}, or run one-shot cells")
    if args.data:
        raise HorovodUsageError(
            "--data is not per cell in a pool: %horovod data NAME=VALUE gives the ranks their "
            "shares once, and they keep them across cells until replaced")
    for option, given in (("--spark", args.spark), ("--local", args.local), ("--env", args.env),
                          ("--gpu", args.gpu), ("--timeline", args.timeline is not None),
                          ("--mlflow", args.mlflow is not None),
                          ("--memory-per-rank", args.memory_per_rank is not None)):
        if given:
            raise HorovodUsageError(f"{option} is chosen when the pool starts (%horovod start ... "
                              f"{option}), not per cell; %horovod restart keeps the pool's options")
    ranks = None
    if args.ranks is not None:
        try:
            ranks = sorted({int(rank) for rank in args.ranks.split(",") if rank.strip()})
        except ValueError:
            raise HorovodUsageError(f"--ranks {args.ranks!r}: expected rank numbers, e.g. --ranks 0,1") from None
    pool.check_usable()
    captured = capture_cell("\n" + transform_body(shell, cell), shell.user_ns, pool.rank_names,
                            filename=cell_filename(shell))
    if not args.quiet:
        print(captured.report())
    # --quiet drops the capture line only: the run shows as any cell's, as in a one-shot cell
    return pool.run_cell(captured.payload, ranks=ranks, return_all=args.all_ranks,
                         timeout_s=args.timeout, title=f"%%horovod {line.strip()} (pool)".replace("  ", " "))


def cell_filename(shell) -> str:
    """What the ranks' tracebacks call the cell: by the notebook's own number for it
    (IPython's `In [9]`), which the cell's prompt shows while it runs."""
    return f"<%%horovod cell In[{shell.execution_count}]>"


# ---- auto mode: every cell to the ranks (ipyparallel's %autopx) ------------------------------

def _to_the_ranks(lines: list[str]) -> list[str]:
    """An input transformer: a cell becomes a %%horovod cell, unless it is a %horovod or
    %%horovod cell itself (so that `%horovod auto off` works) or empty."""
    first = next((line.strip() for line in lines if line.strip()), "")
    if not first or first.startswith(("%horovod", "%%horovod")):
        return lines
    return ["%%horovod\n", *lines]


def transform_body(shell, cell: str) -> str:
    """The cell's body as IPython transforms it, without auto mode's own transformer (which
    would make the body a %%horovod cell again)."""
    transforms = shell.input_transformers_cleanup
    if _to_the_ranks not in transforms:
        return shell.transform_cell(cell)
    transforms.remove(_to_the_ranks)
    try:
        return shell.transform_cell(cell)
    finally:
        transforms.append(_to_the_ranks)


def set_auto(shell, on: bool) -> None:
    transforms = shell.input_transformers_cleanup
    if _to_the_ranks in transforms:
        transforms.remove(_to_the_ranks)
    if on:
        transforms.append(_to_the_ranks)
