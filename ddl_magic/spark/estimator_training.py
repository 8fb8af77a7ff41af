"""What every rank of `TorchEstimator.fit` runs: train on its share of the DataFrame.

Each rank reads its shard (`ddl_magic.rank.shards`), turns the feature and label columns into
tensors once, and trains with the Horovod-style API: `DistributedOptimizer` averages the
gradients on the ring, rank 0's weights and optimizer state are broadcast first. Shards may
differ in size, so the ranks agree on the smallest number of full batches before the first
epoch and every rank takes exactly that many steps (no rank waits in an allreduce the others
never reach). Each epoch every rank shuffles its own rows anew; a row is seen at most once
per epoch. Metrics are sums over every rank's rows, so they do not depend on how the rows
were split. Rank 0 writes the checkpoints and returns the trained weights and the history.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

CHECKPOINT_LAST = "last.pt"
CHECKPOINT_BEST = "best.pt"
VALIDATION_SEED = 1234  # the same split of a shard into training and validation rows every fit


@dataclass
class TrainingPlan:
    """Everything the ranks need, pickled once by the driver."""

    model: Any  # a torch.nn.Module
    make_optimizer: Callable  # parameters -> torch.optim.Optimizer
    loss: Callable  # (outputs, labels) -> scalar tensor
    feature_cols: list[str]
    label_cols: list[str]
    classification: bool  # labels are class indices (int64), else float32 targets
    batch_size: int
    epochs: int
    shuffle: bool
    seed: int
    validation_fraction: float = 0.0
    validation_col: str | None = None
    metrics: dict[str, Callable] = field(default_factory=dict)  # name -> (outputs, labels) -> value
    callbacks: list[Callable] = field(default_factory=list)  # (epoch, metrics, model), on rank 0
    checkpoint_dir: str | None = None  # this run's folder: last.pt, best.pt
    resume: dict | None = None  # the checkpoint a fit with the same run_id left
    use_gpu: bool = False
    verbose: int = 1  # 1: rank 0 prints a line per epoch


def train_on_shard(plan: TrainingPlan) -> dict | None:
    """Train `plan.model` on this rank's shard; rank 0 returns {"state", "history"}."""
    import torch

    import ddl_magic.torch as hvd
    from ddl_magic.rank.shards import read_shard

    hvd.init()
    torch.manual_seed(plan.seed)
    device = torch.device(f"cuda:{hvd.local_rank()}") if plan.use_gpu else torch.device("cpu")
    features, labels, is_validation = _tensors(read_shard(), plan)
    training_rows = np.flatnonzero(~is_validation)
    validation_rows = np.flatnonzero(is_validation)

    model = plan.model.to(device)
    optimizer = plan.make_optimizer(model.parameters())
    start_epoch, history = 0, []
    if plan.resume is not None:
        model.load_state_dict(plan.resume["model"])
        optimizer.load_state_dict(plan.resume["optimizer"])
        start_epoch, history = plan.resume["epoch"] + 1, list(plan.resume["history"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    steps = int(hvd.allreduce(torch.tensor(len(training_rows) // plan.batch_size),
                              op=hvd.Min, name="estimator.steps_per_epoch"))
    if hvd.rank() == 0 and plan.verbose:
        print(f"{hvd.size()} ranks, {steps} steps of {plan.batch_size} rows per rank per epoch",
              flush=True)
    best = min((row.get("val_loss", row["loss"]) for row in history), default=float("inf"))
    for epoch in range(start_epoch, plan.epochs):
        order = training_rows
        if plan.shuffle:
            order = np.random.default_rng((plan.seed, epoch, hvd.rank())).permutation(order)
        model.train()
        totals = _Totals(plan.metrics)
        for step in range(steps):
            rows = order[step * plan.batch_size:(step + 1) * plan.batch_size]
            x, y = features[rows].to(device), labels[rows].to(device)
            optimizer.zero_grad()
            outputs = model(x)
            loss = plan.loss(outputs, y)
            loss.backward()
            optimizer.step()
            totals.add(loss, outputs.detach(), y)
        row = {"epoch": epoch, **totals.reduced(hvd, "train")}
        if plan.validation_fraction or plan.validation_col:
            row.update(_validate(model, features, labels, validation_rows, plan, device, hvd))
        history.append(row)
        if hvd.rank() == 0:
            if plan.verbose:
                print(_epoch_line(row), flush=True)
            score = row.get("val_loss", row["loss"])
            _save_checkpoints(plan, model, optimizer, epoch, history, is_best=score < best)
            best = min(best, score)
            for callback in plan.callbacks:
                callback(epoch, dict(row), model)
    if hvd.rank() != 0:
        return None
    return {"state": {name: value.cpu() for name, value in model.state_dict().items()},
            "history": history}


class _Totals:
    """Sums of the loss and metrics over this rank's rows, reduced across ranks at the end."""

    def __init__(self, metrics: dict[str, Callable]):
        self._metrics = metrics
        self._sums = np.zeros(1 + len(metrics))  # loss, then each metric, times rows
        self._rows = 0

    def add(self, loss, outputs, labels) -> None:
        import torch

        n = len(labels)
        with torch.no_grad():
            values = [float(loss)] + [float(metric(outputs, labels))
                                      for metric in self._metrics.values()]
        self._sums += np.asarray(values) * n
        self._rows += n

    def reduced(self, hvd, prefix: str) -> dict[str, float]:
        import torch

        local = torch.tensor([*self._sums, self._rows], dtype=torch.float64)
        total = hvd.allreduce(local, op=hvd.Sum, name=f"estimator.{prefix}_metrics").numpy()
        rows = max(total[-1], 1.0)
        names = ["loss", *self._metrics]
        label = "" if prefix == "train" else f"{prefix}_"
        return {f"{label}{name}": float(value / rows) for name, value in zip(names, total)}


def _validate(model, features, labels, rows, plan, device, hvd) -> dict[str, float]:
    import torch

    model.eval()
    totals = _Totals(plan.metrics)
    with torch.no_grad():
        for start in range(0, len(rows), plan.batch_size):
            batch = rows[start:start + plan.batch_size]
            x, y = features[batch].to(device), labels[batch].to(device)
            outputs = model(x)
            totals.add(plan.loss(outputs, y), outputs, y)
    return totals.reduced(hvd, "val")


def _epoch_line(row: dict) -> str:
    values = " · ".join(f"{name} {value:.4f}" for name, value in row.items() if name != "epoch")
    return f"epoch {row['epoch'] + 1}: {values}"


def _save_checkpoints(plan, model, optimizer, epoch, history, is_best) -> None:
    import torch

    if plan.checkpoint_dir is None:
        return
    os.makedirs(plan.checkpoint_dir, exist_ok=True)
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "epoch": epoch, "history": history}
    names = [CHECKPOINT_LAST] + ([CHECKPOINT_BEST] if is_best else [])
    for name in names:
        path = os.path.join(plan.checkpoint_dir, name)
        torch.save(checkpoint, path + ".partial")
        os.replace(path + ".partial", path)  # a reader never sees half a checkpoint


def _tensors(table, plan: TrainingPlan):
    """(features float32 [n, d], labels, validation mask) from the shard's Arrow columns."""
    import torch

    if table.num_rows == 0:
        return torch.zeros(0, 0), torch.zeros(0), np.zeros(0, dtype=bool)
    features = np.concatenate([column_matrix(table.column(name)) for name in plan.feature_cols],
                              axis=1)
    labels = np.concatenate([column_matrix(table.column(name)) for name in plan.label_cols],
                            axis=1)
    if plan.classification:
        labels = torch.from_numpy(labels[:, 0].astype(np.int64))
    else:
        labels = torch.from_numpy(labels)
    if plan.validation_col is not None:
        is_validation = np.asarray(table.column(plan.validation_col).to_numpy(
            zero_copy_only=False), dtype=bool)
    else:
        is_validation = np.zeros(table.num_rows, dtype=bool)
        count = int(round(plan.validation_fraction * table.num_rows))
        chosen = np.random.default_rng(VALIDATION_SEED).permutation(table.num_rows)[:count]
        is_validation[chosen] = True
    return torch.from_numpy(features), labels, is_validation


def column_matrix(column) -> np.ndarray:
    """An Arrow column as a float32 matrix: one column for a number, `width` for an array."""
    import pyarrow

    column = column.combine_chunks() if isinstance(column, pyarrow.ChunkedArray) else column
    if pyarrow.types.is_list(column.type) or pyarrow.types.is_large_list(column.type):
        values = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
        return values.reshape(len(column), -1)  # the driver checked every row's length
    return column.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)[:, None]
