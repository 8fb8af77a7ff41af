"""Elastic runs: recovery from a SIGKILLed rank, and what being elastic costs when nothing fails.

    python benchmarks/elastic.py            # 5 kills; 4 interleaved repeats of 300 steps per side, ~4 min
    python benchmarks/elastic.py --quick    # smoke run: 2 kills; 1 repeat of 50 steps per side, ~20 s

Both measurements train ``train_step.py``'s MLP (784-512-512-10, SGD lr 0.01 x size, momentum
0.9, synthetic MNIST-shaped batches of 64 per rank, one torch thread per rank) on 4 local
ranks started by ``HorovodRunner(np=-4, ...)``, as a notebook user would:

1. **Kill to next step.** ``HorovodRunner(np=-4, min_np=2)``; the loop is the README's
   (``for state.epoch ...: for state.batch ...: step; state.commit()``). In epoch 1, in the
   middle of a step (after ``backward()``, before ``optimizer.step()``, so the others wait in
   the gradients' allreduce), rank 2 writes the time and SIGKILLs itself. Every rank appends
   the time of every completed step (after its commit) to a file. The recovery time is from
   the kill to the first step completed in the new world: by a survivor after its reset
   callback ran, or by the replacement (a process started after the kill). Each repetition
   is a fresh run; the table shows the median and the max. Target: <= 2 s, replacement
   included.
2. **Steps per second, no failure.** Three sides, interleaved: **plain** (``np=-4``, no
   elastic API: ``hvd.DistributedOptimizer`` and a loop), **elastic, commit every step**
   (``np=-4, min_np=2``, ``@hvd.elastic.run``, ``TorchState``, ``state.commit()`` after every
   step, as a user writes it) and **elastic, commit every 10 steps**. After warm-up steps and
   a barrier, rank 0 times the steps up to a closing barrier (so the slowest rank counts):
   steps per second = steps / that time. The faster repeat of each side is reported (both
   are in the JSON) and the ratio elastic/plain; the ratio within each interleaved round is
   in the JSON too. Target: >= 0.97x. A fourth side is a control, not elastic: **plain + a
   4-float allreduce per step**, the collective that ``commit()``'s host-update check adds
   (a max-allreduce of 4 float64s), to tell the cost of one more synchronisation point per
   step from the cost of anything elastic.
3. **Commit cost**, cheaply, on rank 0 of the every-step side: each ``state.commit()`` in
   the timed loop (the copy of the weights and momentum into the saved clones, then the
   host-update check, a max-allreduce of 4 numbers over the 4 ranks, which also waits for
   the slowest rank: time it would otherwise wait in the next step's allreduce), and after
   the timed loop 20 copies alone (``state.save()``, no collective). The table shows both
   medians and the copy's µs per MB of state. ``benchmarks/elastic_commit.py`` measures
   commits on their own, on 1 and 2 ranks, against Horovod's deep copy.
4. **Where a commit's cost goes**: one more elastic run alternates blocks of 20 steps, each
   step followed by nothing, ``commit()``, its copy alone (``state.save()``) or its
   collective alone (``state.check_host_updates()``), the order rotated every round (16
   rounds, --quick 4). The table shows the plain step and, for each, the time added per
   step and the steps/s ratio to the plain blocks (medians over rounds of the ratio within
   a round): within one run, so far less exposed to other load than separate runs.

Writes ``benchmarks/results/elastic.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

from common import interleaved, print_table, warn_if_busy, write_results

NP, MIN_NP = 4, 2
KILLED_RANK = 2
BATCHES_PER_EPOCH, EPOCHS, KILL_AT = 20, 2, (1, 7)  # (epoch, batch): mid-epoch
TARGET_RECOVERY_S = 2.0
TARGET_RATIO = 0.97
COPY_TIMINGS = 20
CONTROL = "plain + a 4-float allreduce per step"
BLOCK_STEPS = 20


# ---- on the ranks ------------------------------------------------------------------------

def _model_and_step(hvd):
    """train_step.py's MLP, its SGD wrapped in DistributedOptimizer, and one step's parts."""
    import torch
    from torch import nn

    from train_step import WORKLOADS, mlp, sgd, synthetic_batches

    torch.set_num_threads(1)
    model = mlp()
    optimizer = hvd.DistributedOptimizer(sgd(model, hvd.size()),
                                         named_parameters=model.named_parameters())
    batches = synthetic_batches(hvd.rank(), WORKLOADS["mlp"])
    loss_fn = nn.CrossEntropyLoss()

    def forward_backward(number: int) -> None:
        inputs, labels = batches[number % len(batches)]
        optimizer.zero_grad()
        loss_fn(model(inputs), labels).backward()

    return model, optimizer, forward_backward


def train_plain(steps: int, warmup: int) -> dict:
    """Not elastic: DistributedOptimizer and a loop. Rank 0's steps per second."""
    import ddl_magic.torch as hvd

    hvd.init()
    _, optimizer, forward_backward = _model_and_step(hvd)
    for number in range(warmup):
        forward_backward(number)
        optimizer.step()
    hvd.barrier()
    started = time.perf_counter()
    for number in range(warmup, warmup + steps):
        forward_backward(number)
        optimizer.step()
    hvd.barrier()
    elapsed = time.perf_counter() - started
    return {"steps_per_s": steps / elapsed, "elapsed_s": elapsed, "size": hvd.size()}


def train_plain_with_check(steps: int, warmup: int) -> dict:
    """Not elastic, with the collective a commit adds: a max-allreduce of 4 float64s after
    every step, as `check_host_updates()` does. A control: what one more synchronisation
    point per step costs without anything elastic."""
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    _, optimizer, forward_backward = _model_and_step(hvd)
    check = torch.zeros(4, dtype=torch.float64)
    for number in range(warmup):
        forward_backward(number)
        optimizer.step()
        hvd.allreduce_(check, op=hvd.Max, name="control.check")
    hvd.barrier()
    started = time.perf_counter()
    for number in range(warmup, warmup + steps):
        forward_backward(number)
        optimizer.step()
        hvd.allreduce_(check, op=hvd.Max, name="control.check")
    hvd.barrier()
    elapsed = time.perf_counter() - started
    return {"steps_per_s": steps / elapsed, "elapsed_s": elapsed, "size": hvd.size()}


def train_elastic(steps: int, warmup: int, commit_every: int) -> dict:
    """Elastic: the same loop in @hvd.elastic.run, state.commit() every `commit_every` steps."""
    import ddl_magic.torch as hvd
    from elastic_commit import saved_copies

    hvd.init()
    model, optimizer, forward_backward = _model_and_step(hvd)
    state = hvd.elastic.TorchState(model, optimizer, batch=0)

    @hvd.elastic.run
    def loop(state) -> dict:
        while state.batch < warmup:
            forward_backward(state.batch)
            optimizer.step()
            state.batch += 1
            if state.batch % commit_every == 0:
                state.commit()
        hvd.barrier()
        commits = []
        started = time.perf_counter()
        while state.batch < warmup + steps:
            forward_backward(state.batch)
            optimizer.step()
            state.batch += 1
            if state.batch % commit_every == 0:
                commit_started = time.perf_counter()
                state.commit()
                commits.append(time.perf_counter() - commit_started)
        hvd.barrier()
        elapsed = time.perf_counter() - started
        copies = []  # after the timed steps: the copy alone (`save()`), no collective
        for _ in range(COPY_TIMINGS):
            copy_started = time.perf_counter()
            state.save()
            copies.append(time.perf_counter() - copy_started)
        return {"steps_per_s": steps / elapsed, "elapsed_s": elapsed, "size": hvd.size(),
                "commits": len(commits), "save_median_s": statistics.median(copies),
                "commit_median_s": statistics.median(commits) if commits else None,
                "commit_bytes": sum(t.nbytes for t in saved_copies(state))}

    return loop(state)


def train_commit_blocks(rounds: int, per_block: int, warmup: int) -> dict[str, list[float]]:
    """In one elastic run, blocks of `per_block` steps, each step followed by nothing, a
    `commit()`, its copy alone (`save()`) or its collective alone (`check_host_updates()`),
    the order rotated every round. Rank 0's seconds per step of every block, by kind."""
    import ddl_magic.torch as hvd

    hvd.init()
    model, optimizer, forward_backward = _model_and_step(hvd)
    state = hvd.elastic.TorchState(model, optimizer, batch=0)
    after_step = {"nothing": lambda: None, "commit()": state.commit, "save()": state.save,
                  "check_host_updates()": state.check_host_updates}
    kinds = list(after_step)

    @hvd.elastic.run
    def loop(state) -> dict[str, list[float]]:
        per_step: dict[str, list[float]] = {kind: [] for kind in kinds}
        for number in range(warmup):
            forward_backward(number)
            optimizer.step()
        for round_number in range(rounds):
            shift = round_number % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                hvd.barrier()
                started = time.perf_counter()
                for number in range(per_block):
                    forward_backward(number)
                    optimizer.step()
                    after_step[kind]()
                hvd.barrier()
                per_step[kind].append((time.perf_counter() - started) / per_block)
        return per_step

    return loop(state)


def train_killed(log_dir: str, batches: int, epochs: int, kill_at: tuple[int, int],
                 killed_rank: int) -> dict:
    """The README's elastic loop; rank `killed_rank` SIGKILLs itself mid-step at `kill_at`, once.

    Every rank appends "<time> <resets seen> <process start>" after each completed step."""
    import signal

    import ddl_magic.torch as hvd

    process_started = time.time()
    hvd.init()
    model, optimizer, forward_backward = _model_and_step(hvd)
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    resets = [0]
    state.register_reset_callbacks([lambda: resets.__setitem__(0, resets[0] + 1)])
    marker = os.path.join(log_dir, "killed")
    log = open(os.path.join(log_dir, f"steps-{os.getpid()}"), "a")

    @hvd.elastic.run
    def loop(state) -> dict:
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                forward_backward(state.epoch * batches + state.batch)
                if ((state.epoch, state.batch) == tuple(kill_at) and hvd.rank() == killed_rank
                        and not os.path.exists(marker)):
                    with open(marker, "w") as f:
                        f.write(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                optimizer.step()
                state.commit()
                log.write(f"{time.time()!r} {resets[0]} {process_started!r}\n")
                log.flush()
            state.batch = 0
        return {"size": hvd.size(), "epoch": state.epoch}

    try:
        return loop(state)
    finally:
        log.close()


# ---- on the driver -----------------------------------------------------------------------

def run_quietly(fn, np: int, min_np: int | None = None, **kwargs):
    """`HorovodRunner(np=-np, min_np=...).run(fn, **kwargs)`: rank 0's result and the runner,
    with the driver's lines held back (printed only if the run fails)."""
    from ddl_magic import HorovodRunner

    bounds = {"min_np": min_np} if min_np else {}
    runner = HorovodRunner(np=-np, timeout=300, driver_log_verbosity="log_callback_only", **bounds)
    lines = io.StringIO()
    try:
        with contextlib.redirect_stdout(lines), contextlib.redirect_stderr(lines):
            return runner.run(fn, **kwargs), runner
    except BaseException:
        print(lines.getvalue(), end="")
        raise


def recovery_from(log_dir: Path) -> dict:
    """Seconds from the kill to the first step completed in the new world."""
    killed_at = float((log_dir / "killed").read_text())
    after = []
    for path in log_dir.glob("steps-*"):
        for line in path.read_text().split("\n"):
            if line:
                at, resets, started = line.split()
                if float(at) > killed_at and (int(resets) > 0 or float(started) > killed_at):
                    after.append(float(at))
    return {"recovery_s": min(after) - killed_at}


def measure_kills(repeats: int) -> list[dict]:
    results = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="ddl-elastic-bench-") as folder:
            load = os.getloadavg()[0]
            result, runner = run_quietly(train_killed, NP, MIN_NP, log_dir=folder,
                                         batches=BATCHES_PER_EPOCH, epochs=EPOCHS,
                                         kill_at=KILL_AT, killed_rank=KILLED_RANK)
            resets = runner.last_run.resets or []
            if len(resets) != 1 or result["size"] != NP or result["epoch"] != EPOCHS - 1:
                raise RuntimeError(f"expected one reset back to {NP} ranks and a finished run, "
                                   f"got {resets!r}, rank 0 returned {result!r}")
            (reset,) = resets
            results.append(dict(recovery_from(Path(folder)), load_average=load,
                                left=list(reset.left), joined=list(reset.joined),
                                reasons=list(reset.reasons),
                                resumed_from_commit=reset.resumed_from_commit))
    return results


def measure_throughput(steps: int, warmup: int, repeats: int, np: int) -> dict[str, list[dict]]:
    min_np = min(MIN_NP, np)

    def side(fn, min_np=None, **kwargs):
        def measure() -> dict:
            load = os.getloadavg()[0]
            result, _ = run_quietly(fn, np, min_np, steps=steps, warmup=warmup, **kwargs)
            if result["size"] != np:
                raise RuntimeError(f"{fn.__name__} ran on {result['size']} ranks, not {np}")
            return dict(result, load_average=load)
        return measure

    plain, every_step, every_10, control = interleaved(
        repeats, side(train_plain), side(train_elastic, min_np, commit_every=1),
        side(train_elastic, min_np, commit_every=10), side(train_plain_with_check))
    return {"plain": plain, "elastic, commit every step": every_step,
            "elastic, commit every 10 steps": every_10, CONTROL: control}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 kills, 1 repeat of 50 steps per side")
    parser.add_argument("--kills", type=int, help="runs with a kill (default 5, --quick 2)")
    parser.add_argument("--steps", type=int, help="timed steps per run (default 300, --quick 50)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (default 20)")
    parser.add_argument("--repeats", type=int,
                        help="runs of each throughput side, interleaved (default 4, --quick 1)")
    parser.add_argument("--throughput-np", type=int, default=NP, metavar="N",
                        help=f"ranks of the steps/s sides and the commit blocks (default {NP}, "
                             "as the kills; on a 2-core machine 2 gives each rank a core)")
    args = parser.parse_args()
    throughput_np = args.throughput_np
    kills = args.kills or (2 if args.quick else 5)
    steps = args.steps or (50 if args.quick else 300)
    repeats = args.repeats or (1 if args.quick else 4)
    block_rounds = 4 if args.quick else 16
    load_at_start = warn_if_busy()

    started = time.monotonic()
    recoveries = measure_kills(kills)
    sides = measure_throughput(steps, args.warmup, repeats, throughput_np)
    blocks, _ = run_quietly(train_commit_blocks, throughput_np, min(MIN_NP, throughput_np),
                            rounds=block_rounds,
                            per_block=BLOCK_STEPS, warmup=args.warmup)
    wall_s = time.monotonic() - started

    recovery_times = [r["recovery_s"] for r in recoveries]
    recovery = {"median_s": statistics.median(recovery_times), "max_s": max(recovery_times)}
    best = {name: max(runs, key=lambda r: r["steps_per_s"]) for name, runs in sides.items()}
    plain = best["plain"]["steps_per_s"]
    ratios = {name: best[name]["steps_per_s"] / plain for name in sides if name != "plain"}
    round_ratios = {name: [run["steps_per_s"] / base["steps_per_s"]
                           for run, base in zip(sides[name], sides["plain"])]
                    for name in ratios}
    base_blocks = blocks["nothing"]
    block_costs = {kind: {
        "added_ms_per_step": statistics.median(b - a for a, b in zip(base_blocks, times)) * 1e3,
        "ratio": statistics.median(a / b for a, b in zip(base_blocks, times)),
        "per_step_s": times} for kind, times in blocks.items() if kind != "nothing"}
    every_step = best["elastic, commit every step"]
    commit_mb = every_step["commit_bytes"] / 1e6
    commit_us = every_step["commit_median_s"] * 1e6
    save_us = every_step["save_median_s"] * 1e6

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    rows = [
        [f"kill to next step, median of {kills}", f"{recovery['median_s']:.2f} s",
         f"<= {TARGET_RECOVERY_S:g} s", verdict(recovery["median_s"] <= TARGET_RECOVERY_S)],
        [f"kill to next step, max of {kills}", f"{recovery['max_s']:.2f} s",
         f"<= {TARGET_RECOVERY_S:g} s", verdict(recovery["max_s"] <= TARGET_RECOVERY_S)],
        ["plain (not elastic) steps/s", f"{plain:.1f}", "", ""],
    ]
    for name, ratio in ratios.items():
        rows.append([f"{name} steps/s", f"{best[name]['steps_per_s']:.1f}", "", ""])
        rows.append([f"  {name} / plain", f"{ratio:.3f}x",
                     f"{statistics.median(round_ratios[name]):.3f}x",
                     *(("(control)", "") if name == CONTROL else
                       (f">= {TARGET_RATIO:g}x", verdict(ratio >= TARGET_RATIO)))])
    rows.append([f"state.commit() on rank 0 ({commit_mb:.2f} MB), in the loop",
                 f"{commit_us:.0f} µs", "reported", ""])
    rows.append(["  of which the copy (state.save() alone)",
                 f"{save_us:.0f} µs = {save_us / commit_mb:.0f} µs/MB", "reported", ""])
    rows.append([f"plain step in the alternating blocks, median of {block_rounds}",
                 f"{statistics.median(base_blocks) * 1e3:.1f} ms", "", ""])
    for kind, cost in block_costs.items():
        rows.append([f"  + {kind} after every step", f"+{cost['added_ms_per_step']:.2f} ms "
                     f"= {cost['ratio']:.3f}x steps/s", "", ""])
    print_table(f"Elastic runs, np={NP} local, min_np={MIN_NP} (steps/s and blocks: np="
                f"{throughput_np}): MLP 784-512-512-10, SGD with "
                f"momentum, batch 64 per rank ({steps} timed steps per run, best of {repeats}; "
                f"load average {load_at_start:.1f} at start, {os.getloadavg()[0]:.1f} at end, "
                f"{os.cpu_count()} CPUs)",
                ["measure", "measured", "median of rounds", "target", "verdict"],
                [row if len(row) == 5 else [*row[:2], "", *row[2:]] for row in rows])
    print("\nkill to next step, each run: "
          + ", ".join(f"{r['recovery_s']:.2f} s" for r in recoveries)
          + f" (rank {KILLED_RANK} SIGKILLed at epoch {KILL_AT[0]}, batch {KILL_AT[1]}, mid-step)")
    for name, values in round_ratios.items():
        print(f"{name} / plain, each interleaved round: "
              + ", ".join(f"{value:.3f}" for value in values))
    for name, runs in sides.items():
        print(f"{name} steps/s, each run: " + ", ".join(f"{r['steps_per_s']:.1f}" for r in runs))
    print(f"(state.commit() alone on 1 and 2 ranks, vs Horovod's deep copy: benchmarks/elastic_commit.py; "
          f"this run took {wall_s:.0f} s)")

    path = write_results("elastic", {
        "np": NP, "min_np": MIN_NP, "quick": args.quick, "load_average_at_start": load_at_start,
        "kill_to_next_step": {"target_s": TARGET_RECOVERY_S, "killed_rank": KILLED_RANK,
                              "kill_at_epoch_batch": KILL_AT, "batches_per_epoch": BATCHES_PER_EPOCH,
                              **recovery, "runs": recoveries},
        "throughput": {"np": throughput_np, "steps": steps, "warmup": args.warmup,
                       "repeats": repeats,
                       "target_ratio": TARGET_RATIO, "runs": sides,
                       "best_steps_per_s": {name: run["steps_per_s"] for name, run in best.items()},
                       "ratio_to_plain": ratios, "ratio_to_plain_each_round": round_ratios},
        "commit_blocks": {"rounds": block_rounds, "steps_per_block": BLOCK_STEPS,
                          "plain_per_step_s": base_blocks, "kinds": block_costs},
        "commit": {"megabytes": commit_mb, "median_us": commit_us, "save_median_us": save_us,
                   "save_us_per_mb": save_us / commit_mb, "ranks": throughput_np,
                   "measured_on": "rank 0"},
        "wall_s": wall_s,
    })
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
