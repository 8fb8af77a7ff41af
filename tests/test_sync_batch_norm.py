"""`hvd.SyncBatchNorm` on 2 and 3 ranks equals one BatchNorm over the ranks' batches put
together: outputs, input gradients, summed parameter gradients and running statistics."""

import pytest
import torch

from ranks import run_on_ranks

CHANNELS = 3


def batch(rank: int) -> torch.Tensor:
    """Ranks hold batches of different sizes and statistics."""
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(2 + rank, CHANNELS, 4, 5, generator=generator) * (rank + 1) + rank


def weights(rank: int) -> torch.Tensor:
    return torch.randn(batch(rank).shape, generator=torch.Generator().manual_seed(100 + rank))


def normalize_on_ranks():
    import ddl_magic.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = hvd.SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.BatchNorm2d(CHANNELS, momentum=0.3)))
    norm = model[0]
    with torch.no_grad():
        norm.weight.uniform_()
        norm.bias.uniform_()
    x = batch(hvd.rank()).requires_grad_()
    outputs = []
    for _ in range(2):  # twice: the running statistics move twice
        out = model(x)
        (out * weights(hvd.rank())).sum().backward()
        outputs.append(out.detach())
    model.eval()
    evaluated = model(batch(hvd.rank()))
    result = {"type": type(norm).__name__, "outputs": outputs, "input_grad": x.grad,
              "weight_grad": hvd.allreduce(norm.weight.grad, op=hvd.Sum),
              "bias_grad": hvd.allreduce(norm.bias.grad, op=hvd.Sum),
              "running_mean": norm.running_mean, "running_var": norm.running_var,
              "evaluated": evaluated}
    hvd.shutdown()
    return result


def one_batch_norm_over_all(np: int) -> dict:
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm2d(CHANNELS, momentum=0.3)
    with torch.no_grad():
        norm.weight.uniform_()
        norm.bias.uniform_()
    norm.double()  # after drawing: the same numbers as the ranks drew in float32
    batches = [batch(r).double().requires_grad_() for r in range(np)]
    outputs = []
    for _ in range(2):
        out = norm(torch.cat(batches))
        (out * torch.cat([weights(r).double() for r in range(np)])).sum().backward()
        outputs.append(out.detach().split([b.shape[0] for b in batches]))
    norm.eval()
    return {"outputs": outputs, "input_grads": [b.grad for b in batches],
            "weight_grad": norm.weight.grad, "bias_grad": norm.bias.grad,
            "running_mean": norm.running_mean, "running_var": norm.running_var,
            "evaluated": [norm(batch(r).double()) for r in range(np)]}


@pytest.mark.parametrize("np", [2, 3])
def test_sync_batch_norm_is_batch_norm_over_the_global_batch(np):
    results = run_on_ranks(normalize_on_ranks, np, timeout_s=120)
    reference = one_batch_norm_over_all(np)

    def same(actual, expected):
        torch.testing.assert_close(actual, expected.float(), rtol=1e-4, atol=1e-5)

    for rank, result in enumerate(results):
        assert result["type"] == "SyncBatchNorm"
        for step in range(2):
            same(result["outputs"][step], reference["outputs"][step][rank])
        same(result["input_grad"], reference["input_grads"][rank])
        for name in ("weight_grad", "bias_grad", "running_mean", "running_var"):
            same(result[name], reference[name])
        same(result["evaluated"], reference["evaluated"][rank])
