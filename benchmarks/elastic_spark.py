"""Elastic runs on Spark: a host lost mid-training, and its return, on a two-host cluster.

    sudo python benchmarks/elastic_spark.py            # 3 losses, ~2.5 min (the cluster included)
    sudo python benchmarks/elastic_spark.py --quick    # 1 loss, ~1 min

Builds the tests' two-host Spark standalone cluster (`tests/two_host_cluster.py`: each worker
in network and UTS namespaces of its own, 2 task slots each; needs root) and runs
``HorovodRunner(np=4, min_np=2)`` on it, with the default peer timeout, as a user would. The
ranks train a small linear model (a commit after every step, then a 50 ms pause, so a step
is about 50 ms) until the world has shrunk and grown back. Each repeat, once the 4 ranks
have done 5 steps, the benchmark kills host b's whole worker (its JVM, its executor, the
ranks on it) and times:

1. **kill -> next step**: from the kill to the first step completed by the 2 ranks left
   (they go on at once; the replacements' tasks wait for a slot). Target: <= 15 s.
2. **return -> 4 ranks**: from the worker's restart to the reset that brings the world
   back to 4 ranks (a new executor, the replacements' tasks and ranks starting, and the
   ranks' next commit).

Writes ``benchmarks/results/elastic_spark.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import print_table, warn_if_busy, write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from two_host_cluster import TwoHostCluster, Unavailable  # noqa: E402

NP, MIN_NP = 4, 2
RUN_TIMEOUT_S = 240


def train_until_whole_again(log_dir: str, np: int, max_steps: int):
    """A commit after every step until the world shrank below `np` and grew back; each step's
    time and world size go to `log_dir/steps`."""
    import time

    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0, shrank=False)

    @hvd.elastic.run
    def train(state):
        while state.step < max_steps and not (state.shrank and hvd.size() == np):
            state.shrank = state.shrank or hvd.size() < np
            x = torch.randn(8, 4)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            optimizer.step()
            state.step += 1
            state.commit()
            with open(os.path.join(log_dir, "steps"), "a") as f:
                f.write(f"{time.time()} {state.step} {hvd.size()}\n")
            time.sleep(0.05)
        return state.step

    return train(state)


def steps(log_dir: str) -> list[tuple[float, int]]:
    try:
        with open(os.path.join(log_dir, "steps")) as f:
            return [(float(t), int(size)) for t, _, size in (line.split() for line in f)]
    except FileNotFoundError:
        return []


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s")
        time.sleep(0.05)


def lose_and_regain_a_host(cluster: TwoHostCluster) -> dict:
    import psutil

    from ddl_magic import HorovodRunner

    log_dir = tempfile.mkdtemp(prefix="ddl-elastic-spark-")
    runner = HorovodRunner(np=NP, min_np=MIN_NP, timeout=RUN_TIMEOUT_S,
                           driver_log_verbosity="log_callback_only")
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["steps"] = runner.run(train_until_whole_again, log_dir=log_dir, np=NP,
                                          max_steps=4000)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(lambda: sum(size == NP for _, size in steps(log_dir)) >= 5 * NP or outcome, 120,
             "4 ranks did not train")
    host = cluster.hosts[1]
    worker = psutil.Process(host.worker.pid)
    for process in [worker, *worker.children(recursive=True)]:
        process.kill()
    killed_at = time.time()
    wait_for(lambda: any(t > killed_at and size == MIN_NP for t, size in steps(log_dir))
             or outcome, 60, "the ranks left did not go on")
    next_step = min(t for t, size in steps(log_dir) if t > killed_at and size == MIN_NP)
    cluster.start_worker(host)
    returned_at = time.time()
    thread.join(timeout=RUN_TIMEOUT_S)
    if "error" in outcome or thread.is_alive():
        raise RuntimeError(f"the run did not end well: {outcome.get('error', 'still running')}")
    regrown = runner.last_run.resets[-1]
    if regrown.size != NP:
        raise RuntimeError(f"the world did not grow back: {runner.last_run.resets}")
    return {"kill_to_next_step_s": next_step - killed_at,
            "return_to_full_world_s": regrown.at - returned_at,
            "resets": len(runner.last_run.resets)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one loss instead of three")
    parser.add_argument("--repeats", type=int, help="losses (default 3, --quick 1)")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    warn_if_busy()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    try:
        cluster = TwoHostCluster().start()
    except Unavailable as why:
        sys.exit(f"cannot build the two-host cluster: {why}")
    try:
        import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        os.environ["SPARK_LOCAL_IP"] = cluster.driver_address
        session = cluster.spark_session("ddl_magic elastic benchmark", NP)
        try:
            measured = [lose_and_regain_a_host(cluster) for _ in range(repeats)]
        finally:
            session.stop()
    finally:
        cluster.stop()
    kills = [m["kill_to_next_step_s"] for m in measured]
    returns = [m["return_to_full_world_s"] for m in measured]
    print_table(f"Elastic on two Spark hosts, np={NP}, min_np={MIN_NP}, default peer timeout "
                f"({repeats} losses)",
                ["measure", "median", "max", "target"],
                [["a host's worker killed -> next step", f"{statistics.median(kills):.2f} s",
                  f"{max(kills):.2f} s", "<= 15 s"],
                 ["worker restarted -> 4 ranks again", f"{statistics.median(returns):.2f} s",
                  f"{max(returns):.2f} s", "reported"]])
    path = write_results("elastic_spark", {"np": NP, "min_np": MIN_NP, "losses": measured})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
