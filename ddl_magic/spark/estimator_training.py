"""What every rank of `TorchEstimator.fit` runs: train on its share of the DataFrame.

Each rank reads its share (`ddl_magic.data`: written by its Spark task beside it) through a
loader, batch by batch, and trains with the Horovod-style API: `DistributedOptimizer`
averages the gradients on the ring, rank 0's weights and optimizer state are broadcast
first. Shares may differ in size: the loader's ranks agree on the smallest number of full
batches before the first epoch, and every rank takes exactly that many steps (no rank waits
in an allreduce the others never reach). Each epoch every rank reads its rows in a new
order; a row is seen at most once per epoch. A share is never turned into tensors whole:
memory per rank is a batch and the loader's shuffle window, whatever the share's size.
Metrics are sums over every rank's rows, so they do not depend on how the rows were split.
Rank 0 writes the checkpoints and returns the trained weights and the history.
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


def train_on_shard(plan: TrainingPlan, data, validation=None) -> dict | None:
    """Train `plan.model` on this rank's share of `data` (a `ddl_magic.data.Share`), holding
    out `validation` (a share of the rows `validation_col` marks) or `validation_fraction`
    of the share's rows; rank 0 returns {"state", "history"}."""
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    torch.manual_seed(plan.seed)
    device = torch.device(f"cuda:{hvd.local_rank()}") if plan.use_gpu else torch.device("cpu")
    if validation is None and plan.validation_fraction:
        data, validation = data.split(plan.validation_fraction, seed=VALIDATION_SEED)
    columns = list(dict.fromkeys([*plan.feature_cols, *plan.label_cols]))
    loader = data.loader(batch_size=plan.batch_size, columns=columns, shuffle=plan.shuffle,
                         seed=plan.seed)

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

    steps = len(loader)  # agreed by every rank
    if hvd.rank() == 0 and plan.verbose:
        print(f"{hvd.size()} ranks, {steps} steps of {plan.batch_size} rows per rank per epoch",
              flush=True)
    best = min((row.get("val_loss", row["loss"]) for row in history), default=float("inf"))
    for epoch in range(start_epoch, plan.epochs):
        loader.set_epoch(epoch)
        model.train()
        totals = _Totals(plan.metrics)
        for batch in loader:
            x, y = _features_and_labels(batch, plan, device)
            optimizer.zero_grad()
            outputs = model(x)
            loss = plan.loss(outputs, y)
            loss.backward()
            optimizer.step()
            totals.add(loss, outputs.detach(), y)
        row = {"epoch": epoch, **totals.reduced(hvd, "train")}
        if validation is not None:
            row.update(_validate(model, validation, columns, plan, device, hvd))
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


def _features_and_labels(batch, plan: TrainingPlan, device):
    """(features float32 [n, d], labels: class indices int64 [n], or float32 targets [n, k])."""
    import torch

    def matrix(names):
        return torch.cat([batch[name].reshape(len(batch[name]), -1).float() for name in names],
                         dim=1)

    features = matrix(plan.feature_cols)
    if plan.classification:
        labels = batch[plan.label_cols[0]].reshape(-1).long()
    else:
        labels = matrix(plan.label_cols)
    return features.to(device), labels.to(device)


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


def _validate(model, validation, columns, plan, device, hvd) -> dict[str, float]:
    """Every row of this rank's validation share, whatever the others hold (no collective
    per batch: only the totals are reduced)."""
    import torch

    model.eval()
    totals = _Totals(plan.metrics)
    with torch.no_grad():
        for batch in validation.loader(batch_size=plan.batch_size, columns=columns,
                                       shuffle=False, drop_last=False, equal_steps=False):
            x, y = _features_and_labels(batch, plan, device)
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
