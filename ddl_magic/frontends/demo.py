"""`python -m ddl_magic demo`: the first run, with no notebook needed.

Trains a small MLP on the Iris flowers on two local ranks through the same machinery as
``%%horovod`` (``HorovodRunner``: capture, launch, ring-allreduce, per-rank output,
timeline), then prints the test accuracy and where the timeline was written. If this
works, the install works::

    $ python -m ddl_magic demo
    [0] rank 0 of 2: 53 training flowers (of 105), lr 0.02
    [1] rank 1 of 2: 52 training flowers (of 105), lr 0.02
    [0] epoch  30/150  loss 0.482
    ...
    accuracy: 0.978 on 45 held-out flowers (np=2, 150 epochs, 8.0 s)
    ranks agree: the model is the same on every rank (largest difference 0)
    timeline: /tmp/ddl_magic-runs/20260101-120000-ab12cd/timeline.json
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..driver.run_result import RankFailedError, RunTimeoutError
from ..launch.local import prewarm
from .options import NP, TIMELINE, TIMEOUT
from .runner import HorovodRunner

PASSING_ACCURACY = 0.9
"""Below this the demo exits with an error: the ranks did not learn together."""

BATCH_SIZE = 8  # per rank; the global batch is BATCH_SIZE * np
BASE_LR = 0.01  # for one rank; scaled by the number of ranks, as Horovod recommends


def train_iris(epochs: int = 150, seed: int = 0, report_every: int = 30) -> dict[str, Any]:
    """Train the 4-5-4-3 Iris MLP on this rank's shard of the data; runs on every rank.

    Every rank evaluates the same model (the optimizer averages gradients, so all ranks
    hold identical weights) and returns what it measured; rank 0's dict comes back.

    Example:
        >>> HorovodRunner(np=-2).run(train_iris)["accuracy"]   # doctest: +SKIP
        0.9777777777777777
    """
    import numpy as np
    import torch

    import ddl_magic.torch as hvd
    from ddl_magic.labs.datasets import load_iris, stratified_split

    hvd.init()
    X, y = load_iris(return_X_y=True)
    train, test = stratified_split(y, test_fraction=0.3, seed=seed)
    mean, std = X[train].mean(axis=0), X[train].std(axis=0)
    X = (X - mean) / std
    shard = train[hvd.rank()::hvd.size()]
    x_shard, y_shard = torch.from_numpy(X[shard]), torch.from_numpy(y[shard])

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Sigmoid(),
                                torch.nn.Linear(5, 4), torch.nn.Sigmoid(),
                                torch.nn.Linear(4, 3))
    lr = BASE_LR * hvd.size()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    print(f"rank {hvd.rank()} of {hvd.size()}: {len(shard)} training flowers "
          f"(of {len(train)}), lr {lr:g}")

    # Every rank must take the same number of steps, or one would wait in an allreduce the
    # others never start: count them from the smallest shard (like drop_last=True).
    steps = (len(train) // hvd.size()) // BATCH_SIZE
    generator = torch.Generator().manual_seed(seed + hvd.rank())
    for epoch in range(1, epochs + 1):
        order = torch.randperm(len(shard), generator=generator)
        total = 0.0
        for step in range(steps):
            batch = order[step * BATCH_SIZE:(step + 1) * BATCH_SIZE]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_shard[batch]), y_shard[batch])
            loss.backward()
            optimizer.step()
            total += loss.item()
        if epoch % report_every == 0 or epoch == epochs:
            print(f"epoch {epoch:3d}/{epochs}  loss {total / steps:.3f}")

    with torch.no_grad():
        predicted = model(torch.from_numpy(X[test])).argmax(dim=1).numpy()
        weights = torch.cat([p.reshape(-1) for p in model.parameters()])
        spread = (hvd.allreduce(weights, op=hvd.Max) - hvd.allreduce(weights, op=hvd.Min)).abs().max()
    return {"accuracy": float(np.mean(predicted == y[test])), "tested": len(test),
            "spread": float(spread), "np": hvd.size()}


def run_demo(np: int = 2, epochs: int = 150, timeline: str = "",
             timeout: float | None = 300.0) -> int:
    """Run ``train_iris`` on ``np`` local ranks, print what came of it; return an exit code.

    ``timeline`` is where the trace goes ("" for the run's log folder).

    Example:
        >>> run_demo(np=2)                # doctest: +SKIP
        0
    """
    prewarm()  # the rank factory imports torch while the driver gets ready
    print(f"ddl_magic demo: training an MLP on the Iris flowers on {np} local ranks "
          f"(HorovodRunner(np=-{np}), ring-allreduce, timeline on)")
    runner = HorovodRunner(np=-np, timeline=timeline, timeout=timeout)
    started = time.monotonic()
    try:
        result = runner.run(train_iris, epochs=epochs)
    except (RankFailedError, RunTimeoutError) as exc:
        print(f"ddl_magic demo failed: {exc}", file=sys.stderr)
        return 1
    elapsed = time.monotonic() - started
    print(f"accuracy: {result['accuracy']:.3f} on {result['tested']} held-out flowers "
          f"(np={result['np']}, {epochs} epochs, {elapsed:.1f} s)")
    agree = result["spread"] == 0.0
    print(f"ranks agree: {'the model is the same on every rank' if agree else 'NO, the models differ'} "
          f"(largest difference {result['spread']:g})")
    print(f"timeline: {runner.last_run.timeline_path}")
    print("  view it in a notebook with ddl_magic.show_timeline(path), "
          "or open it in chrome://tracing or https://ui.perfetto.dev")
    if not agree or result["accuracy"] < PASSING_ACCURACY:
        print(f"ddl_magic demo failed: expected the same model on every rank and an accuracy "
              f"of at least {PASSING_ACCURACY}; the logs are in {runner.last_run.log_dir}",
              file=sys.stderr)
        return 1
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line options (``python -m ddl_magic demo --help``)."""
    NP.but(default=2, help="number of local ranks (default: 2)").add_to(parser)
    parser.add_argument("--epochs", type=int, default=150, help="passes over the data (default: 150)")
    TIMELINE.but(nargs=None, const=None, default="",
                 help="where to write the timeline (default: the run's log folder)").add_to(parser)
    TIMEOUT.but(default=300.0, help="stop the ranks if the demo takes longer (default: 300)"
                ).add_to(parser)
