"""Horovod's own elastic tests, run on ddl_magic with `horovod.torch` changed to `ddl_magic.torch`.

    .venv/bin/python tests/horovod_elastic_compat.py            # the unit tests + every schedule
    .venv/bin/python tests/horovod_elastic_compat.py --short    # CI's: the unit tests + 2 schedules

Nothing is fetched: Horovod's two files are vendored in `tests/horovod_compat/` (see their
first line for the commit). Each check runs `ddlrun` as a user would, from the repository
root, and prints PASS or FAIL with what it saw; the script exits 1 if any check fails.

1. `test_torch_elastic.py` (Horovod's `test/single/`: `TorchState` commit/restore/sync and
   `ElasticSampler`) under `ddlrun -np 2 python -m pytest`: both ranks must pass both tests.
2. `elastic_torch_main.py` (Horovod's `test/integration/data/`) under `ddlrun --min-np`,
   with the exit schedules of Horovod's `test/integration/elastic_common.py`. Rank 0 writes
   one log line per epoch (start rank, rank, size, rendezvous count), which is checked as
   Horovod's test checks it, or, for a run that must fail, its exit code and message.

Horovod runs those tests on two hosts (`localhost:2,127.0.0.1:2`, or a discovery script
that adds and removes them); a local ddlrun has one host and replaces a lost rank with a
fresh process, so each schedule keeps Horovod's exit schedule where the test has one and
states what it maps to (`Schedule.maps`). Horovod blacklists a host at its first failure; ours after
`DDL_MAGIC_ELASTIC_BLACKLIST_AFTER` lost ranks (default 3), so the schedules that need a
blacklisted host set it. Not run: growing the world (`test_hosts_added_and_removed`'s
added host: a local run never has more than `-np` ranks; its removals are the two resets of
`reset_limit`). Not checked: the blacklist cooldown (ours has none: a blacklisted host stays
so; `repeated_rank_failure` runs that test's exit schedule and checks our blacklisting).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
VENDORED = Path(__file__).resolve().parent / "horovod_compat"
UNIT_TESTS = VENDORED / "test_torch_elastic.py"
TRAINING_SCRIPT = VENDORED / "elastic_torch_main.py"
RUN_TIMEOUT_S = 60.0  # a run takes 3 to 5 s on two cores; longer is a hang, not slowness
STOP_GRACE_S = 5.0  # for ddlrun to stop its ranks after Ctrl-C


@dataclass(frozen=True)
class Schedule:
    """One run of `elastic_torch_main.py`, and what must come of it.

    `epochs` lists, per logged epoch, the (start_rank, size, rendezvous) rank 0 must write;
    a run that must fail gives `fails_with` instead, a part of ddlrun's message.
    """

    name: str
    maps: str
    np: int
    min_np: int
    exit_schedule: dict[tuple[int, int], list[int]]
    exit_mode: str = "exception"
    env: dict[str, str] = field(default_factory=dict)
    epochs: list[tuple[int, int, int]] = field(default_factory=list)
    fails_with: str = ""
    script_args: tuple[str, ...] = ()

    def command(self, logfile: str) -> list[str]:
        exits = {str(point): ranks for point, ranks in self.exit_schedule.items()}
        return [sys.executable, "-m", "ddl_magic.frontends.ddlrun", "-np", str(self.np),
                "--min-np", str(self.min_np), "python", str(TRAINING_SCRIPT),
                "--logfile", logfile, "--exit-schedule", json.dumps(exits),
                "--exit-mode", self.exit_mode, *self.script_args]


def _single_rank_failure(exit_mode: str) -> Schedule:
    return Schedule(
        f"single_rank_failure[{exit_mode}]",
        "test_single_rank_failure / test_fault_tolerance_without_scaling: start rank 0 "
        "fails at epoch 1; Horovod drops its host (2 of 4 ranks), ours replaces the rank, so "
        "the world stays 4 and the oldest survivor (start rank 1) is rank 0",
        np=4, min_np=2, exit_schedule={(1, 0): [0]}, exit_mode=exit_mode,
        epochs=[(0, 4, 1), (1, 4, 2), (1, 4, 2)])


def _host_blacklisted(exit_mode: str) -> Schedule:
    return Schedule(
        f"single_rank_failure_host_blacklisted[{exit_mode}]",
        "test_single_rank_failure with Horovod's blacklisting (after 1 loss): no "
        "replacement, the run goes on with the 3 ranks left",
        np=4, min_np=2, exit_schedule={(1, 0): [0]}, exit_mode=exit_mode,
        env={"DDL_MAGIC_ELASTIC_BLACKLIST_AFTER": "1"},
        epochs=[(0, 4, 1), (1, 3, 2), (1, 3, 2)])


# Two losses, at epochs 1 and 2, on 3 ranks: start rank 1 is alone in raising at epoch 2 (a
# replacement takes HOROVOD_RANK of its new rank, 2 here, as a Horovod worker does).
TWO_RESETS = {(1, 0): [0], (2, 0): [1]}

SCHEDULES = [
    _single_rank_failure("exception"),
    _single_rank_failure("kill"),
    _host_blacklisted("exception"),
    _host_blacklisted("kill"),
    Schedule("all_ranks_failure", "test_all_ranks_failure: every rank raises at epoch 1; "
             "the run fails", np=4, min_np=2, exit_schedule={(1, 0): [0, 1, 2, 3]},
             fails_with="every rank of world 0 was lost at once"),
    Schedule("all_hosts_blacklisted", "test_all_hosts_blacklisted: start ranks 0 and 2 raise "
             "and their hosts are blacklisted; ours: the one host is blacklisted after 2 "
             "losses, 2 ranks are left of min_np 3, and the run fails after the elastic timeout",
             np=4, min_np=3, exit_schedule={(1, 0): [0, 2]},
             env={"DDL_MAGIC_ELASTIC_BLACKLIST_AFTER": "2", "DDL_MAGIC_ELASTIC_TIMEOUT": "1"},
             fails_with="needs at least 3 (min_np)"),
    Schedule("min_hosts_timeout", "test_min_hosts_timeout: np 4, min_np 4, a rank raises, "
             "its host is blacklisted and none comes back within ELASTIC_TIMEOUT 1 s",
             np=4, min_np=4, exit_schedule={(1, 0): [0]},
             env={"DDL_MAGIC_ELASTIC_BLACKLIST_AFTER": "1", "DDL_MAGIC_ELASTIC_TIMEOUT": "1"},
             fails_with="needs at least 4 (min_np); none came back within 1 s"),
    Schedule("reset_limit[1]", "test_reset_limit: a schedule with 2 resets fails with "
             "reset limit 1 (Horovod's resets are a host added then removed; ours, 2 losses)",
             np=3, min_np=2, exit_schedule=TWO_RESETS,
             env={"DDL_MAGIC_ELASTIC_RESET_LIMIT": "1"},
             fails_with="reset 1 times, its limit (DDL_MAGIC_ELASTIC_RESET_LIMIT=1)"),
    Schedule("reset_limit[2]", "test_reset_limit: ... and succeeds with limit 2, 3 epochs "
             "logged, the last after the 3rd rendezvous (as test_hosts_added_and_removed's)",
             np=3, min_np=2, exit_schedule=TWO_RESETS,
             env={"DDL_MAGIC_ELASTIC_RESET_LIMIT": "2"},
             epochs=[(0, 3, 1), (1, 3, 2), (2, 3, 3)]),
    Schedule("repeated_rank_failure", "test_resurrecting_blacklisted_hosts_exponential_backoff's "
             "exit schedule: start rank 3 raises at epoch 1; so does each replacement (it is "
             "rank 3 too, and resumes at epoch 1) until the host is blacklisted after 3 "
             "losses (our default); no cooldown brings it back: 4 more epochs on 3 ranks. "
             "The rendezvous count stays 2: the replacements fail before a commit, so each "
             "reset restores the count of the first",
             np=4, min_np=2, exit_schedule={(1, 0): [3], (3, 0): [3]},
             script_args=("--epochs", "5", "--epoch-wait", "0.25"),
             epochs=[(0, 4, 1), (0, 3, 2), (0, 3, 2), (0, 3, 2), (0, 3, 2)]),
]
SHORT = ["single_rank_failure[kill]", "reset_limit[2]"]


@dataclass
class Outcome:
    name: str
    ok: bool
    detail: str
    seconds: float


def run_unit_tests(timeout_s: float = RUN_TIMEOUT_S) -> Outcome:
    """Horovod's `test_torch_elastic.py` on 2 ranks; `--noconftest` because the folder's
    conftest keeps the file out of a plain `pytest tests`, which has no second rank."""
    started = time.monotonic()
    code, output = _run([sys.executable, "-m", "ddl_magic.frontends.ddlrun", "-np", "2",
                         "python", "-m", "pytest", "-p", "no:cacheprovider", "--noconftest",
                         "-q", str(UNIT_TESTS)], {}, timeout_s)
    passed = [line for line in output.splitlines() if "2 passed" in line]
    ok = code == 0 and len(passed) == 2
    detail = "both ranks: 2 passed" if ok else f"exit {code}:\n{output[-3000:]}"
    return Outcome("test_torch_elastic.py", ok, detail, time.monotonic() - started)


def run_schedule(schedule: Schedule, timeout_s: float = RUN_TIMEOUT_S) -> Outcome:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hvd-compat-") as folder:
        logfile = os.path.join(folder, "epochs.jsonl")
        code, output = _run(schedule.command(logfile), schedule.env, timeout_s)
        lines = Path(logfile).read_text().splitlines() if os.path.exists(logfile) else []
    logged = [json.loads(line) for line in lines]
    seen = [(e["start_rank"], e["size"], e["rendezvous"]) for e in logged]
    if schedule.fails_with:
        ok = code not in (0, 124) and schedule.fails_with in output
        detail = (f"failed as expected: {schedule.fails_with!r}" if ok else
                  f"expected a failure saying {schedule.fails_with!r}, got exit {code}:\n"
                  f"{output[-3000:]}")
    else:
        ok = code == 0 and seen == schedule.epochs
        detail = (f"(start_rank, size, rendezvous) per epoch: {seen}" if ok else
                  f"expected {schedule.epochs}, logged {seen}, exit {code}:\n{output[-3000:]}")
    return Outcome(schedule.name, ok, detail, time.monotonic() - started)


def _run(command: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """Run `command` from the repository root; a run past `timeout_s` is stopped with every
    process it started, and reads as exit code 124 (`timeout`'s)."""
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **env}, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = process.communicate(timeout=timeout_s)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        _stop(process)
        output, _ = process.communicate()
        return 124, f"{output}\n(stopped after {timeout_s:g} s)"
    finally:
        if process.poll() is None:  # interrupted (Ctrl-C): nothing it started stays behind
            _stop(process)


def _stop(process: subprocess.Popen) -> None:
    """Ctrl-C to ddlrun, which stops its ranks; then SIGKILL to whatever is left of it,
    listed before and after the Ctrl-C: ranks run in sessions of their own, out of its
    process group, and one may have been forked (a replacement) in between."""
    listed = _process_tree(process.pid)
    process.send_signal(signal.SIGINT)
    try:
        process.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        listed += _process_tree(process.pid)
    for member in listed:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(listed, timeout=STOP_GRACE_S)


def _process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true",
                        help=f"the unit tests and {len(SHORT)} schedules: {', '.join(SHORT)}")
    args = parser.parse_args()
    schedules = [s for s in SCHEDULES if not args.short or s.name in SHORT]
    outcomes = [run_unit_tests()]
    _print(outcomes[-1], "Horovod's test/single/test_torch_elastic.py under ddlrun -np 2")
    for schedule in schedules:
        outcomes.append(run_schedule(schedule))
        _print(outcomes[-1], schedule.maps)
    failed = [o.name for o in outcomes if not o.ok]
    print(f"{len(outcomes) - len(failed)} of {len(outcomes)} passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _print(outcome: Outcome, maps: str) -> None:
    print(f"{'PASS' if outcome.ok else 'FAIL'} {outcome.name} ({outcome.seconds:.1f} s)\n"
          f"     {maps}\n     {outcome.detail}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
