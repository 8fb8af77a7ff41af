"""`DistributedOptimizer`: averages gradients across ranks while backward is still running.

Gradients travel in buckets, as in torch's DistributedDataParallel. Every allreduce costs
tens of microseconds of Python whatever its size (a request, a handle, negotiation with
rank 0, fusion), so one allreduce per parameter would cost a small model most of its step.
At construction the parameters are grouped into buckets, each owning one flat buffer. A
hook on every parameter notes when autograd has accumulated its gradient; when the last
parameter of a bucket has reported, the bucket's gradients are copied into its buffer and
one in-place allreduce of the whole buffer starts, so the last layers' buckets travel while
autograd is still computing the first layers' (within one host, where the rank has a core to
spare for it: `op_queue_shm.has_core_to_spare`). `step()` starts the buckets that are still
waiting (for parameters this rank did not use), waits for every bucket, copies the averages
back into each `param.grad` and runs the wrapped optimizer.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Iterable, Sequence

import torch

from ..runtime.op_queue import Handle
from ..runtime.reduce_ops import ReduceOp
from .compression import Compressor
from .ops import _allreduce_into, sparse_allreduce_async, synchronize
from .process_sets import ProcessSet, entered

# DDP's default bucket size (bucket_cap_mb=25): an allreduce of 25 MiB takes long enough on
# the wire that its fixed cost hardly counts, yet a large model still gets several buckets,
# whose allreduces overlap the rest of backward.
BUCKET_CAP_BYTES = 25 * 1024 * 1024
# DDP's first bucket closes at 1 MiB: it holds the last layers, whose gradients are ready
# first, and sends them while autograd computes the rest. Without it, a model under 25 MiB
# would send nothing before backward has ended.
FIRST_BUCKET_CAP_BYTES = 1024 * 1024

Groups = int | Sequence[Sequence[torch.Tensor]] | None


class _Bucket:
    """Parameters whose gradients travel together: one flat buffer, one allreduce per step.

    `slots[i]` is `params[i]`'s part of the buffer, shaped like it; `passes[i]` counts its
    backward passes since the last step and `reported[i]` says whether its gradient is final.
    """

    def __init__(self, name: str, params: list[torch.Tensor]):
        self.name = name
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        sizes = [p.numel() for p in params]
        self.slots = [slot.view_as(p) for p, slot in zip(params, self.buffer.split(sizes))]
        self.passes = [0] * len(params)
        self.reported = [False] * len(params)
        self.waiting = len(params)  # parameters not reported yet
        self.in_flight: tuple[Handle, torch.Tensor, object] | None = None

    def report(self, position: int) -> None:
        self.reported[position] = True
        self.waiting -= 1

    # One torch call per bucket instead of one copy per parameter (torch.optim's foreach path):
    # on small tensors each call costs more than the bytes it moves.
    def gather(self) -> None:
        """Every parameter's gradient into its slot of the buffer."""
        torch._foreach_copy_(self.slots, [p.grad for p in self.params])

    def scatter(self, averaged: torch.Tensor) -> None:
        """The averaged buffer back into every parameter's gradient."""
        if averaged is not self.buffer:
            self.buffer.copy_(averaged)
        torch._foreach_copy_([p.grad for p in self.params], self.slots)

    def reset(self) -> None:
        """Ready for the next step: no pass counted, no parameter reported, nothing in flight."""
        self.passes = [0] * len(self.params)
        self.reported = [False] * len(self.params)
        self.waiting = len(self.params)
        self.in_flight = None


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class by `DistributedOptimizer` (as Horovod does)."""

    def __init__(self, params, named_parameters, compression: type[Compressor],
                 backward_passes_per_step: int, op: ReduceOp, gradient_predivide_factor: float,
                 groups: Groups, sparse_as_dense: bool, process_set: ProcessSet):
        super(self.__class__, self).__init__(params)
        self._process_set = process_set
        self._compression = compression
        self._passes_per_step = backward_passes_per_step
        self._op = op
        self._prescale, self._postscale = _predivided(gradient_predivide_factor)
        self._sparse_as_dense = sparse_as_dense
        self._made_dense: set[torch.Tensor] = set()  # parameters whose sparse gradient travels dense
        self._sparse_in_flight: dict = {}  # parameter -> its sparse allreduce's result function
        params = [p for group in self.param_groups for p in group["params"]]
        self._parameter_names = _parameter_names(params, named_parameters)
        # A rank outside the process set averages nothing: it steps on its own gradients.
        self._buckets = [_Bucket(_bucket_name(members, self._parameter_names), members)
                         for members in assign_buckets(params, groups, self._parameter_names)
                         ] if process_set.included() else []
        self._synchronized = False
        self._skip_synchronize = False
        # Each hook knows its bucket and position: no lookup keyed by tensor (each hashes in Python).
        self._hooks = [param.register_post_accumulate_grad_hook(
                           functools.partial(self._on_gradient, bucket, position))
                       for bucket in self._buckets for position, param in enumerate(bucket.params)]

    def _on_gradient(self, bucket: _Bucket, position: int, param: torch.Tensor) -> None:
        if bucket.reported[position]:
            raise RuntimeError(
                "DistributedOptimizer: a gradient was computed twice before step(). With "
                "gradient accumulation, pass backward_passes_per_step=N to DistributedOptimizer.")
        bucket.passes[position] += 1
        if bucket.passes[position] < self._passes_per_step:
            return
        self._make_dense(param)
        bucket.report(position)
        self._synchronized = False
        if bucket.waiting == 0:
            # The bucket that completes the backward pass is waited for by step() right away:
            # no thread needs waking to start it early.
            self._start(bucket, wait_follows=all(other.in_flight is not None
                                                 for other in self._buckets if other is not bucket))

    def _make_dense(self, param: torch.Tensor) -> None:
        """Give `param` a dense gradient for its bucket: zeros where this rank did not use it,
        since the other ranks still expect its slot. A sparse gradient is sent dense with
        `sparse_as_dense`, else as indices and values (Horovod's sparse allreduce), its slot
        in the bucket then carrying zeros; either way it is sparse again after the step."""
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        elif param.grad.is_sparse:
            if not self._sparse_as_dense:
                self._sparse_in_flight[param] = sparse_allreduce_async(
                    param.grad, name=f"sparse.{self._parameter_names[param]}", op=self._op,
                    process_set=self._process_set)
                param.grad = torch.zeros_like(param)
            else:
                param.grad = param.grad.to_dense()
                self._made_dense.add(param)

    def _start(self, bucket: _Bucket, wait_follows: bool) -> None:
        bucket.gather()
        compressed, ctx = self._compression.compress(bucket.buffer)
        with entered(self._process_set):
            handle = _allreduce_into(compressed, compressed, None, bucket.name, self._op,
                                     self._prescale, self._postscale, "DistributedOptimizer",
                                     wait_follows)
        bucket.in_flight = (handle, compressed, ctx)

    def _finish(self, bucket: _Bucket) -> None:
        handle, compressed, ctx = bucket.in_flight
        synchronize(handle)
        bucket.scatter(self._compression.decompress(compressed, ctx))
        bucket.reset()
        if self._made_dense or self._sparse_in_flight:  # no lookup keyed by tensor otherwise
            self._restore_sparse(bucket)

    def _restore_sparse(self, bucket: _Bucket) -> None:
        """Sparse gradients as they came: SparseAdam takes only sparse ones."""
        for param in bucket.params:
            if param in self._made_dense:
                param.grad = param.grad.to_sparse()
                self._made_dense.discard(param)
            elif param in self._sparse_in_flight:
                param.grad = self._sparse_in_flight.pop(param)()

    def synchronize(self) -> None:
        """Wait for every bucket's allreduce; start those still waiting for a parameter (unused)."""
        for bucket in self._buckets:
            if bucket.in_flight is None:
                for param, reported in zip(bucket.params, bucket.reported):
                    if not reported:
                        self._make_dense(param)
                self._start(bucket, wait_follows=True)  # waited for just below
        for bucket in self._buckets:
            self._finish(bucket)
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For `optimizer.synchronize(); clip_grad_norm_(...); with optimizer.skip_synchronize(): optimizer.step()`."""
        self._skip_synchronize = True
        try:
            yield
        finally:
            self._skip_synchronize = False

    def step(self, closure=None):
        if self._synchronized and not self._skip_synchronize:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                          "after optimizer.synchronize(): the gradients are averaged again, "
                          "which costs a second allreduce. Wrap step() in "
                          "`with optimizer.skip_synchronize():` after synchronize().",
                          stacklevel=2)
        if not (self._skip_synchronize and self._synchronized):
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def load_state_dict(self, state_dict: dict) -> None:
        # As Horovod's: loading a state (an elastic restore after a failed step, a checkpoint)
        # forgets the averaging of the step it replaces, so the next backward starts afresh.
        for bucket in self._buckets:
            bucket.reset()
        self._sparse_in_flight.clear()
        self._made_dense.clear()
        self._synchronized = False
        super(self.__class__, self).load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True):
        if any(bucket.waiting < len(bucket.params) for bucket in self._buckets):
            raise AssertionError("DistributedOptimizer: zero_grad() was called while gradients "
                                 "were being averaged; call step() (or synchronize()) first")
        return super(self.__class__, self).zero_grad(set_to_none)


def _predivided(factor: float) -> tuple[float, float]:
    """The prescale and postscale of Horovod's gradient_predivide_factor f: divide by f before
    summing and by (size / f) after (the average's 1/size does the rest), which keeps float16
    sums in range."""
    return 1.0 / factor, factor


def _parameter_names(params: list[torch.Tensor],
                     named_parameters: Iterable[tuple[str, torch.Tensor]] | None) -> dict[torch.Tensor, str]:
    if named_parameters is None:
        # Named by position, the same every step, so the response cache keeps them: not
        # "noname.", which marks a one-off name counted by call order (`ops.py`).
        return {p: f"parameter.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    names = {p: name for name, p in named}
    if len(set(names.values())) != len(named):
        raise ValueError("DistributedOptimizer: named_parameters has duplicate names")
    unnamed = [p for p in params if p not in names]
    if unnamed:
        raise ValueError(
            f"DistributedOptimizer: {len(unnamed)} optimized parameters are missing from "
            "named_parameters; pass model.named_parameters() of the model being optimized")
    return names


def _bucket_name(params: list[torch.Tensor], names: dict[torch.Tensor, str]) -> str:
    """'allreduce.fc2.bias+3': the bucket's first parameter and how many others; the same on every rank."""
    others = f"+{len(params) - 1}" if len(params) > 1 else ""
    return f"allreduce.{names[params[0]]}{others}"


# ---- which parameters share a bucket ------------------------------------------------------

def assign_buckets(params: list[torch.Tensor], groups: Groups,
                   names: dict[torch.Tensor, str]) -> list[list[torch.Tensor]]:
    """The buckets of the parameters of `params` that require grad, as `groups` asks.

    `None`: DDP's automatic buckets; an int k: k buckets of about equal bytes; a list of
    lists of parameters: those buckets, each parameter of `params` in exactly one. A bucket
    is one flat buffer, so a group mixing dtypes or devices becomes one bucket per kind.
    """
    trainable = [p for p in params if p.requires_grad]
    if groups is None:
        return automatic_buckets(trainable)
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError(f"DistributedOptimizer: groups={groups}; give a number of buckets "
                             "of at least 1, a list of lists of parameters, or None")
        return _one_kind_each(equal_buckets(trainable, groups))
    _check_groups(groups, params, names)
    chosen = [[p for p in group if p.requires_grad] for group in groups]
    return _one_kind_each([group for group in chosen if group])


def automatic_buckets(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """DDP's assignment: parameters in reverse order, one bucket open per dtype and device.

    Reverse, because autograd produces gradients roughly last layer first. A bucket closes
    once it holds its cap of bytes (`FIRST_BUCKET_CAP_BYTES` for the first, then
    `BUCKET_CAP_BYTES`), so it may pass the cap by its last parameter, as in DDP.

    >>> mlp = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.Linear(512, 512),
    ...                           torch.nn.Linear(512, 10))
    >>> [len(bucket) for bucket in automatic_buckets(list(mlp.parameters()))]  # 1 MiB reached at 1.weight
    [4, 2]
    """
    buckets: list[list[torch.Tensor]] = []
    open_buckets: dict[tuple, list[torch.Tensor]] = {}  # one per (dtype, device)
    open_bytes: dict[tuple, int] = {}
    for param in reversed(params):
        kind = (param.dtype, param.device)
        if kind not in open_buckets:
            open_buckets[kind], open_bytes[kind] = [], 0
            buckets.append(open_buckets[kind])
        open_buckets[kind].append(param)
        open_bytes[kind] += _nbytes(param)
        cap = FIRST_BUCKET_CAP_BYTES if open_buckets[kind] is buckets[0] else BUCKET_CAP_BYTES
        if open_bytes[kind] >= cap:
            del open_buckets[kind]
    return buckets


def equal_buckets(params: list[torch.Tensor], count: int) -> list[list[torch.Tensor]]:
    """`count` runs of consecutive parameters (in reverse order) holding about equal bytes.

    A parameter goes to the run its middle byte falls in; runs left empty by a parameter
    bigger than a share are dropped.
    """
    total = sum(map(_nbytes, params)) or 1
    runs: list[list[torch.Tensor]] = [[] for _ in range(count)]
    start = 0
    for param in reversed(params):
        middle = start + _nbytes(param) / 2
        runs[min(count - 1, int(middle * count / total))].append(param)
        start += _nbytes(param)
    return [run for run in runs if run]


def _check_groups(groups: Sequence[Sequence[torch.Tensor]], params: list[torch.Tensor],
                  names: dict[torch.Tensor, str]) -> None:
    known, seen = set(params), set()
    for group in groups:
        for param in group:
            if param not in known:
                raise ValueError(f"DistributedOptimizer: groups holds a tensor of shape "
                                 f"{tuple(param.shape)} that is not a parameter of the optimizer")
            if param in seen:
                raise ValueError(f"DistributedOptimizer: parameter {names[param]!r} is in groups "
                                 "twice; every parameter must be in exactly one group")
            seen.add(param)
    missing = [names[p] for p in params if p not in seen]
    if missing:
        raise ValueError(f"DistributedOptimizer: groups leaves out {', '.join(map(repr, missing))}; "
                         "every parameter of the optimizer must be in exactly one group")


def _one_kind_each(groups: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Each group split by dtype and device, keeping its order: a bucket is one flat buffer."""
    buckets = []
    for group in groups:
        kinds: dict[tuple, list[torch.Tensor]] = {}
        for param in group:
            kinds.setdefault((param.dtype, param.device), []).append(param)
        buckets += kinds.values()
    return buckets


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
