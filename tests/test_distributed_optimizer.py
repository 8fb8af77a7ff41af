"""A Horovod-style training script leaves the same parameters on every rank, equal to
training on all the data at once."""

import pytest
import torch

from ranks import run_on_ranks

STEPS = 5


def make_model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(rank, step):
    generator = torch.Generator().manual_seed(100 * step + rank)  # different data on every rank
    return torch.randn(4, 6, generator=generator), torch.randint(0, 3, (4,), generator=generator)


def train_with_hvd(compression_name="none", backward_passes_per_step=1):
    import ddl_magic.torch as hvd

    hvd.init()
    torch.manual_seed(hvd.rank())  # different initial weights: broadcast must fix that
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if hvd.rank() == 0:
        model.load_state_dict(make_model().state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=getattr(hvd.Compression, compression_name),
        backward_passes_per_step=backward_passes_per_step)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(backward_passes_per_step):
            x, y = batch(hvd.rank() * backward_passes_per_step + micro, step)
            loss = torch.nn.functional.cross_entropy(model(x), y) / backward_passes_per_step
            loss.backward()
        optimizer.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def train_on_all_data(world_size, backward_passes_per_step=1):
    """One process, every rank's batch each step: what averaging gradients must reproduce."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    shards = world_size * backward_passes_per_step
    for step in range(STEPS):
        optimizer.zero_grad()
        for shard in range(shards):
            x, y = batch(shard, step)
            (torch.nn.functional.cross_entropy(model(x), y) / shards).backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("np", [2, 3])
def test_ranks_end_identical_and_equal_to_training_on_all_data(np):
    states = run_on_ranks(train_with_hvd, np)
    for state in states[1:]:
        for name in state:
            assert torch.equal(state[name], states[0][name]), name
    reference = train_on_all_data(np)
    for name, value in reference.items():
        assert torch.allclose(states[0][name], value, atol=1e-5), name


def test_fp16_compression_and_gradient_accumulation():
    states = run_on_ranks(train_with_hvd, 2, compression_name="fp16", backward_passes_per_step=2)
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), name
    reference = train_on_all_data(2, backward_passes_per_step=2)
    for name, value in reference.items():
        assert torch.allclose(states[0][name], value, atol=1e-2), name


def test_api_before_init_says_to_call_init():
    import ddl_magic.torch as hvd

    hvd.shutdown()
    with pytest.raises(ValueError, match=r"rank\(\) was called before init\(\)"):
        hvd.rank()
    with pytest.raises(ValueError, match="hvd.init"):
        hvd.allreduce(torch.ones(1))
