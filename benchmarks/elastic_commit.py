"""`state.commit()` of an elastic `TorchState`: time per MB committed, and no allocation.

    python benchmarks/elastic_commit.py [--iterations 300] [--repeats 3]

Commits a `TorchState` holding an MLP and its Adam optimizer (after a few steps, so that
Adam's two moments exist), each model in turn:

- ``mnist-mlp``: 784-128-10, the MNIST MLP (102k parameters);
- ``mlp-784-512-512-10``: ``train_step.py``'s MLP (670k parameters).

The state is committed on one rank in this process (a world of one: `commit()` is the
copy into the saved clones plus a host-update check with nobody to agree with) and on
2 ranks started by ddl_magic's launcher, where the check is a max-allreduce of four
numbers (timed on its own too: a fixed cost, not per MB). Each iteration is timed on its own; the table shows the median (the slowest
rank's on 2 ranks) of the best of `--repeats` repeats, the MB committed (parameters,
buffers, Adam's moments and step counts) and µs per MB. For comparison, Horovod's way of
committing (`copy.deepcopy` of the model's and the optimizer's `state_dict()`) is timed
in the same process. A commit must allocate no tensor memory after the first: the saved
clones' storage addresses are compared across every commit, and the script fails if any
changed. One torch thread. Writes benchmarks/results/elastic_commit.json.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from common import (best_of, interleaved, print_table, run_ours, slowest_rank, summarize,
                    warn_if_busy, write_results)

MODELS = {"mnist-mlp": (784, 128, 10), "mlp-784-512-512-10": (784, 512, 512, 10)}


def mlp(widths: tuple[int, ...]) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def trained_state(hvd, widths: tuple[int, ...]):
    """A TorchState of the MLP and Adam after 3 steps on a random batch of 64."""
    torch.manual_seed(0)
    model = mlp(widths)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, widths[0]), torch.randint(0, widths[-1], (64,))
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)


def saved_copies(state) -> list[torch.Tensor]:
    return [tensor for handler in state._handlers.values() for tensor in handler._copies.saved]


def time_commits(hvd, widths: tuple[int, ...], iterations: int) -> dict:
    """Every commit timed on its own, after one that allocates the copies; on every rank."""
    torch.set_num_threads(1)
    state = trained_state(hvd, widths)
    state.commit()
    addresses = [t.untyped_storage().data_ptr() for t in saved_copies(state)]
    times, checks, moved = [], [], False
    hvd.barrier()
    for batch in range(iterations):
        state.batch = batch
        started = time.perf_counter()
        state.commit()
        times.append(time.perf_counter() - started)
        started = time.perf_counter()
        state.check_host_updates()  # the part of a commit that is not the copy
        checks.append(time.perf_counter() - started)
        moved = moved or any(a != t.untyped_storage().data_ptr()
                             for a, t in zip(addresses, saved_copies(state)))
    return dict(summarize(times), check_median_s=statistics.median(checks),
                bytes=sum(t.nbytes for t in saved_copies(state)), allocated_after_first=moved)


def time_commits_on_ranks(widths: tuple[int, ...], iterations: int) -> dict:
    import ddl_magic.torch as hvd

    hvd.init()
    try:
        return time_commits(hvd, widths, iterations)
    finally:
        hvd.shutdown()


def time_deepcopy(hvd, widths: tuple[int, ...], iterations: int) -> dict:
    """Horovod's commit: a deep copy of both state dicts, every time."""
    state = trained_state(hvd, widths)
    times = []
    for _ in range(iterations):
        started = time.perf_counter()
        copy.deepcopy(state.model.state_dict())
        copy.deepcopy(state.optimizer.state_dict())
        times.append(time.perf_counter() - started)
    return summarize(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    warn_if_busy()
    import ddl_magic.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    results, rows = {}, []
    for name, widths in MODELS.items():
        here, deep, ranks = interleaved(
            options.repeats,
            lambda: time_commits(hvd, widths, options.iterations),
            lambda: time_deepcopy(hvd, widths, options.iterations),
            lambda: slowest_rank(run_ours(time_commits_on_ranks, 2, widths=widths,
                                          iterations=options.iterations)))
        here_best, deep_best, ranks_best = best_of(here), best_of(deep), best_of(ranks)
        megabytes = here[0]["bytes"] / 1e6
        allocated = any(r["allocated_after_first"] for r in here + ranks)
        results[name] = {"widths": widths, "megabytes": megabytes, "one_rank": here_best,
                         "two_ranks": ranks_best, "deepcopy_state_dicts": deep_best,
                         "allocated_after_first": allocated}
        rows.append([name, f"{megabytes:.2f}",
                     f"{here_best['median_s'] * 1e6:.0f}",
                     f"{here_best['median_s'] * 1e6 / megabytes:.0f}",
                     f"{ranks_best['median_s'] * 1e6:.0f}",
                     f"{ranks_best['check_median_s'] * 1e6:.0f}",
                     f"{deep_best['median_s'] * 1e6 / megabytes:.0f}",
                     "yes" if allocated else "no"])
    hvd.shutdown()
    print_table("state.commit() of an MLP with Adam's state (median per commit, one torch thread)",
                ["model", "MB", "µs (1 rank)", "µs/MB", "µs (2 ranks)", "of which host check",
                 "deepcopy µs/MB", "allocates after 1st"], rows)
    path = write_results("elastic_commit", {"iterations": options.iterations,
                                            "repeats": options.repeats, "models": results})
    print(f"\nwrote {path}")
    if any(result["allocated_after_first"] for result in results.values()):
        raise SystemExit("a commit after the first allocated new copies")
    print("a deep copy of the state dicts takes " + ", ".join(
        f"{r['deepcopy_state_dicts']['median_s'] / r['one_rank']['median_s']:.1f}x ({name})"
        for name, r in results.items()) + " the time of a commit on 1 rank")


if __name__ == "__main__":
    main()
