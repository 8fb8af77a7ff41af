"""`DistributedOptimizer`: averages gradients across ranks while backward is still running.

A hook on every parameter fires as soon as that parameter's gradient is accumulated and
starts its allreduce right away, so the last layers' gradients travel while autograd is
still computing the first layers'. `step()` waits for whatever is still in flight and then
runs the wrapped optimizer. The op queue fuses gradients that become ready together.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from ..runtime.reduce_ops import ReduceOp, as_reduce_op
from .compression import Compression, Compressor
from .ops import allreduce_async_, synchronize


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class by `DistributedOptimizer` (as Horovod does)."""

    def __init__(self, params, named_parameters, compression: type[Compressor],
                 backward_passes_per_step: int, op: ReduceOp, gradient_predivide_factor: float):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        self._passes_per_step = backward_passes_per_step
        self._op = op
        self._prescale, self._postscale = 1.0, 1.0
        if gradient_predivide_factor != 1.0:
            # Divide by f before summing and by (size / f) after: keeps float16 sums in range.
            self._prescale, self._postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
        self._names = self._parameter_names(named_parameters)
        self._handles: dict[torch.Tensor, tuple] = {}
        self._passes: dict[torch.Tensor, int] = {}
        self._synchronized = False
        self._skip_synchronize = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient)
                       for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _parameter_names(self, named_parameters) -> dict[torch.Tensor, str]:
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is None:
            return {p: f"allreduce.noname.{i}" for i, p in enumerate(params)}
        named = list(named_parameters)
        names = {p: f"allreduce.{name}" for name, p in named}
        if len(set(names.values())) != len(named):
            raise ValueError("DistributedOptimizer: named_parameters has duplicate names")
        unnamed = [p for p in params if p not in names]
        if unnamed:
            raise ValueError(
                f"DistributedOptimizer: {len(unnamed)} optimized parameters are missing from "
                "named_parameters; pass model.named_parameters() of the model being optimized")
        return names

    def _on_gradient(self, param: torch.Tensor) -> None:
        if param in self._handles:
            raise RuntimeError(
                "DistributedOptimizer: a gradient was computed twice before step(). With "
                "gradient accumulation, pass backward_passes_per_step=N to DistributedOptimizer.")
        self._passes[param] = self._passes.get(param, 0) + 1
        if self._passes[param] == self._passes_per_step:
            self._passes[param] = 0
            self._handles[param] = self._start_allreduce(param)
            self._synchronized = False

    def _start_allreduce(self, param: torch.Tensor) -> tuple:
        compressed, ctx = self._compression.compress(param.grad)
        handle = allreduce_async_(compressed, name=self._names[param], op=self._op,
                                  prescale_factor=self._prescale, postscale_factor=self._postscale)
        return handle, compressed, ctx

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce; start those whose hook never fired (unused)."""
        for group in self.param_groups:
            for param in group["params"]:
                if param.requires_grad and param not in self._handles:
                    if param.grad is None:  # unused on this rank: others still expect its slot
                        param.grad = torch.zeros_like(param)
                    self._handles[param] = self._start_allreduce(param)
        for param, (handle, compressed, ctx) in self._handles.items():
            reduced = synchronize(handle)
            if compressed is not param.grad:
                param.grad.copy_(self._compression.decompress(reduced, ctx))
        self._handles.clear()
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
        if not (self._skip_synchronize and self._synchronized):
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._handles:
            raise AssertionError("DistributedOptimizer: zero_grad() was called while gradients "
                                 "were being averaged; call step() (or synchronize()) first")
        return super(self.__class__, self).zero_grad(set_to_none)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: int = ReduceOp.AVERAGE,
                         gradient_predivide_factor: float = 1.0, process_set=None,
                         **ignored) -> torch.optim.Optimizer:
    """Wrap `optimizer` so each `step()` uses gradients averaged over all ranks.

    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    >>> optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    """
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be at least 1")
    reduce_op = as_reduce_op(op)
    if gradient_predivide_factor != 1.0 and reduce_op is not ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               reduce_op, gradient_predivide_factor)
