"""`SyncBatchNorm`: batch normalization over the global batch, every rank's samples counted.

With data parallelism each rank sees batch/N samples; plain `BatchNorm` normalizes by the
statistics of those few, which grow noisy as N grows. Here each rank sums, per channel, its
count, its values and its squared deviations, one allreduce adds them up over the ranks,
and every rank normalizes by the mean and variance of the whole batch, exactly as one
process would over all the samples. The allreduce carries autograd (its gradient is the
allreduce of the incoming gradients), so backward is that of the global batch too.

    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)   # torch's, needs NCCL
    model = hvd.SyncBatchNorm.convert_sync_batchnorm(model)          # ours, CPU and GPU
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .ops import Sum, allreduce, size


class SyncBatchNorm(_BatchNorm):
    """`torch.nn.BatchNorm1d/2d/3d` over every rank's batch at once (Horovod's
    `hvd.SyncBatchNorm`); in eval mode, or in a world of one, plain batch normalization."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects a batch of at least 2 dimensions "
                             f"(batch, channels, ...), got {input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or size() == 1:
            return super().forward(input)
        self._check_input_dim(input)
        channels = input.shape[1]
        over = [0, *range(2, input.dim())]  # every dimension but the channels
        # Statistics in float64: summed over many samples, float32 would lose the variance.
        values = input.double()
        count = torch.tensor([input.numel() / channels], dtype=torch.float64, device=input.device)
        local_mean = values.mean(over)
        centred = values - local_mean.view(1, -1, *[1] * (input.dim() - 2))
        # Per channel, summed over ranks: n, n * mean and the squared deviations, and from
        # them the global mean and the global sum of squared deviations (Chan et al.).
        sums = allreduce(torch.cat([count, count * local_mean, (centred * centred).sum(over),
                                    count * local_mean * local_mean]), op=Sum)
        total = sums[0]
        mean = sums[1:1 + channels] / total
        squares = sums[1 + channels:1 + 2 * channels] + sums[1 + 2 * channels:] - total * mean * mean
        variance = squares / total
        self._update_running_stats(mean, squares, total)
        shape = (1, channels, *[1] * (input.dim() - 2))
        normalized = (values - mean.view(shape)) * torch.rsqrt(variance + self.eps).view(shape)
        output = normalized.to(input.dtype)
        if self.affine:
            output = output * self.weight.view(shape) + self.bias.view(shape)
        return output

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
