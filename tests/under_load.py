"""Run the fail-fast tests again and again beside busy processes: they must hold under load.

    .venv/bin/python tests/under_load.py                  # 20 rounds, 4 busy processes
    .venv/bin/python tests/under_load.py --rounds 5 --hogs 2 -- -k killed

Each round runs pytest on the tests that kill, crash or lose a rank (`SELECTION`, or what
follows ``--``) while `--hogs` processes spin on the CPU, and prints how many rounds passed.
Not part of CI's run: twenty rounds take long on two cores. Exits 1 if any round failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SELECTION = [
    "tests/test_attribution.py", "tests/test_ddlrun.py", "tests/test_peer_loss.py",
    "tests/test_shared_memory.py", "tests/test_timeline_in_runs.py",
    "tests/test_torch_distributed.py", "tests/test_fail_fast.py",
    "-k", "kill or killed or lost or segfault or last_words or ctrl_c or raising or fails or stops"
          " or never_joins or gloo or gil",
]


def spin() -> None:
    while True:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--hogs", type=int, default=4, help="busy processes beside the tests")
    parser.add_argument("pytest_args", nargs="*", help="after --: what pytest runs instead")
    args = parser.parse_args()
    hogs = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    failed = []
    try:
        for round_number in range(1, args.rounds + 1):
            started = time.monotonic()
            result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x",
                                     "-p", "no:cacheprovider", *(args.pytest_args or SELECTION)],
                                    cwd=TESTS.parent, capture_output=True, text=True)
            summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
            print(f"round {round_number}: {summary} ({time.monotonic() - started:.0f} s)", flush=True)
            if result.returncode != 0:
                failed.append(round_number)
                print(result.stdout[-4000:], result.stderr[-2000:], sep="\n", flush=True)
    finally:
        for hog in hogs:
            hog.kill()
    print(f"{args.rounds - len(failed)} of {args.rounds} rounds passed with {args.hogs} busy "
          f"processes beside them" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
