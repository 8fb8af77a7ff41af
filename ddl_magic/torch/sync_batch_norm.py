"""`SyncBatchNorm`: batch normalization over the global batch, every rank's samples counted.

With data parallelism each rank sees batch/N samples; plain `BatchNorm` normalizes by the
statistics of those few, which grow noisy as N grows. Here every rank normalizes by the
mean and variance of the whole batch, exactly as one process would over all the samples,
and backward is that of the global batch too.

    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)   # torch's, needs NCCL
    model = hvd.SyncBatchNorm.convert_sync_batchnorm(model)          # ours, CPU and GPU

A layer costs what plain batch normalization costs plus one small allreduce each way, as
torch's own SyncBatchNorm does on GPUs. Every pass over the batch is one of torch's native
batch-norm kernels (they accumulate in double precision), and only per-channel sums cross
between ranks:

- forward: each rank's count, mean and variance per channel (`batch_norm_update_stats`);
  one allreduce adds up n, n * mean, the squared deviations and n * mean², from which every
  rank takes the global mean and variance (Chan et al.); the batch is normalized by them
  (`batch_norm` with those statistics);
- backward: each rank's per-channel sums of dy and of dy * x̂ (`native_batch_norm_backward`,
  which also gives the weight's and bias's gradients), one allreduce adds them up, and

      dx = w · invstd · (dy − Σdy / N − x̂ · Σ(dy · x̂) / N)

  is one pass, `dx = A·dy + B·x + C` with per-channel A, B and C.

Written instead as autograd through float64 tensor arithmetic, as it was first, the layer
cost six times a plain BatchNorm: the time went into a dozen full passes over the batch in
double precision and their backward, not into the collectives.
"""

from __future__ import annotations

import weakref

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .ops import Sum, _backward_over_forward_set, _unnamed_number, allreduce, size
from .process_sets import active_runtime

_STATISTICS_DTYPES = (torch.float32, torch.float64)
# Each layer's name on the ring it last ran over (kept beside the layer, not in it: a layer
# must stay picklable and deep-copyable, which a ring is not).
_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class SyncBatchNorm(_BatchNorm):
    """`torch.nn.BatchNorm1d/2d/3d` over every rank's batch at once (Horovod's
    `hvd.SyncBatchNorm`); in eval mode, or in a world of one, plain batch normalization.

    >>> norm = hvd.SyncBatchNorm(64)          # in place of torch.nn.BatchNorm2d(64)
    >>> out = norm(torch.randn(32, 64, 16, 16))
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects a batch of at least 2 dimensions "
                             f"(batch, channels, ...), got {input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or size() == 1:
            return super().forward(input)
        self._check_input_dim(input)
        name = self._name_on_ring()
        mean, squares, total = _global_statistics(input, name)
        self._update_running_stats(mean, squares, total)
        variance = squares / total
        return _NormalizeOverRanks.apply(input, self.weight, self.bias, mean, variance,
                                         total, self.eps, name)

    def _name_on_ring(self) -> str:
        """`sync_batch_norm.K`: this layer was the K-th to run over the active ring.

        Ranks that run their layers in the same order name them alike (as Horovod names
        unnamed collectives), and a layer keeps its name from step to step, so its
        allreduces are announced as cached requests instead of anew every time.
        """
        runtime = active_runtime("SyncBatchNorm")
        ring, name = _names.get(self, (None, ""))
        if ring is None or ring() is not runtime:
            name = f"sync_batch_norm.{_unnamed_number('sync_batch_norm')}"
            _names[self] = (weakref.ref(runtime), name)
        return name

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, squares: torch.Tensor,
                              total: torch.Tensor) -> None:
        if not self.track_running_stats:
            return
        self.num_batches_tracked.add_(1)
        # momentum=None: the cumulative average over batches, as torch's BatchNorm keeps it
        factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                  else self.momentum)
        unbiased = squares / (total - 1).clamp(min=1)
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module) -> torch.nn.Module:
        """`module` with every BatchNorm1d/2d/3d replaced by a `SyncBatchNorm` holding the same
        parameters and running statistics (as torch's `convert_sync_batchnorm`)."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats)
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            if module.track_running_stats:
                converted.running_mean = module.running_mean
                converted.running_var = module.running_var
                converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child))
        return converted


@torch.no_grad()
def _global_statistics(input: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global batch's mean and sum of squared deviations per channel (float64), and its
    count (a float64 scalar tensor)."""
    channels = input.shape[1]
    local = input if input.dtype in _STATISTICS_DTYPES else input.float()
    local_mean, local_variance = torch.batch_norm_update_stats(local, None, None, 0.0)
    local_mean, local_variance = local_mean.double(), local_variance.double()
    count = torch.full((1,), input.numel() / channels, dtype=torch.float64, device=input.device)
    # Per channel, summed over ranks: n, n * mean, the squared deviations and n * mean²; from
    # them the global mean and the global sum of squared deviations (Chan et al.).
    sums = allreduce(torch.cat([count, count * local_mean, count * local_variance,
                                count * local_mean * local_mean]), name=f"{name}.stats", op=Sum)
    total = sums[0]
    mean = sums[1:1 + channels] / total
    squares = sums[1 + channels:1 + 2 * channels] + sums[1 + 2 * channels:] - total * mean * mean
    return mean, squares.clamp(min=0), total


@_backward_over_forward_set
class _NormalizeOverRanks(torch.autograd.Function):
    """`(input - mean) / sqrt(variance + eps) * weight + bias` with the global statistics;
    its backward takes the statistics' dependence on every rank's input into account."""

    @staticmethod
    def forward(ctx, input, weight, bias, mean, variance, total, eps, name):
        # batch_norm takes the statistics in the parameters' dtype (float ones for a half batch)
        dtype = input.dtype if weight is None else weight.dtype
        mean, variance = mean.to(dtype), variance.to(dtype)
        ctx.save_for_backward(input, weight, mean, variance)
        ctx.total, ctx.eps, ctx.name = total, eps, name
        return torch.batch_norm(input, weight, bias, mean, variance, False, 0.0, eps,
                                torch.backends.cudnn.enabled)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, variance = ctx.saved_tensors
        wants_input, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        grad_output = grad_output.contiguous()
        # Eval mode: this rank's Σdy (the bias's gradient) and Σdy·x̂ (the weight's), per channel.
        _, dy_xhat, dy = torch.ops.aten.native_batch_norm_backward(
            grad_output, input, weight, mean, variance, None, None, False, ctx.eps,
            [False, True, True])
        grad_input = None
        if wants_input:
            channels = input.shape[1]
            sums = allreduce(torch.cat([dy, dy_xhat]).float(), name=f"{ctx.name}.grads", op=Sum)
            invstd = torch.rsqrt(variance.float() + ctx.eps)
            scale = invstd if weight is None else weight.float() * invstd
            total = ctx.total.to(scale.dtype)
            shape = (1, channels, *[1] * (input.dim() - 2))
            along_x = -scale * invstd * sums[channels:] / total  # B
            constant = -scale * sums[:channels] / total - along_x * mean.float()  # C
            grad_input = torch.mul(input, along_x.view(shape)).add_(constant.view(shape))
            grad_input.addcmul_(grad_output, scale.view(shape))  # + A·dy
            grad_input = grad_input.to(input.dtype)
        return (grad_input, dy_xhat if wants_weight else None, dy if wants_bias else None,
                None, None, None, None, None)
