"""`hvd.DistributedOptimizer`: Horovod's factory, above the two optimizers it builds.

Every rank keeps the whole optimizer state and steps on allreduced gradients
(`optimizer.py`), or keeps 1/N of it and steps on its shard (`sharded_optimizer.py`, ZeRO
stage 1, with `shard_optimizer_state=True`).
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..runtime.reduce_ops import ReduceOp, as_reduce_op
from .compression import Compression, Compressor
from .optimizer import Groups, _DistributedOptimizer, _parameter_names, _predivided
from .process_sets import ProcessSet, global_process_set
from .sharded_optimizer import sharded


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: int = ReduceOp.AVERAGE,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Groups = None, sparse_as_dense: bool = False,
                         process_set=None,
                         shard_optimizer_state: bool = False) -> torch.optim.Optimizer:
    """Wrap `optimizer` so each `step()` uses gradients averaged over all ranks.

    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    >>> optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    Gradients are averaged in buckets of parameters, one allreduce each. `groups` chooses
    them, as in Horovod: None (buckets of up to 25 MiB, as DDP makes them), a number of
    buckets of about equal bytes, or a list of lists of parameters (every parameter in
    exactly one). `num_groups=k` is Horovod's older spelling of `groups=k`. A sparse
    gradient (`nn.Embedding(sparse=True)`) is averaged as indices and values, as Horovod's
    is, or sent dense with `sparse_as_dense=True`; either way the optimizer gets it sparse.

    `shard_optimizer_state=True` keeps the optimizer's state (Adam's moments) of only 1/N of
    the parameters on each rank (ZeRO stage 1, see `sharded_optimizer.py`): gradients are
    reduce-scattered and parameters allgathered in `step()`, the bytes of one allreduce.

    With `process_set`, gradients are averaged over that set's ranks only; a rank outside
    it steps on its own gradients (as in Horovod).
    """
    process_set = global_process_set if process_set is None else process_set
    if not isinstance(process_set, ProcessSet):
        raise TypeError("DistributedOptimizer: process_set must be a ProcessSet, not "
                        f"{type(process_set).__name__}")
    process_set.check_added("DistributedOptimizer")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be at least 1")
    reduce_op = as_reduce_op(op)
    if gradient_predivide_factor != 1.0 and reduce_op is not ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average")
    if groups is None and num_groups:
        groups = num_groups
    if shard_optimizer_state:
        if process_set is not global_process_set:
            raise NotImplementedError("DistributedOptimizer(shard_optimizer_state=True) shards "
                                      "over every rank: leave process_set out")
        if reduce_op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ValueError("DistributedOptimizer(shard_optimizer_state=True) averages or sums "
                             "gradients: pass op=hvd.Average or op=hvd.Sum")
        if groups is not None:
            raise ValueError("DistributedOptimizer(shard_optimizer_state=True) reduce-scatters "
                             "each dtype's gradients in one pass: groups and num_groups do not apply")
        prescale, postscale = _predivided(gradient_predivide_factor)
        every = [p for group in optimizer.param_groups for p in group["params"]]
        return sharded(optimizer, _parameter_names(every, named_parameters), compression, reduce_op, prescale, postscale,
                       sparse_as_dense)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               reduce_op, gradient_predivide_factor, groups, sparse_as_dense, process_set)
