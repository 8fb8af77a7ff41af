"""A Horovod-style training script leaves the same parameters on every rank, equal to
training on all the data at once, however its gradients are grouped into buckets."""

from unittest import mock

import pytest
import torch
from torch import nn

from ranks import run_on_ranks

STEPS = 5
SMALL_BUCKET_BYTES = 64  # a cap every layer of `Net` reaches: one bucket per layer


class Net(nn.Module):
    """6-8-3 with tanh. `float64_head`: the output layer is float64 (parameters of two dtypes);
    `second_head`: a second output layer used on even shards only, so unused on odd ranks."""

    def __init__(self, float64_head: bool = False, second_head: bool = False):
        super().__init__()
        self.hidden = nn.Linear(6, 8)
        self.out = nn.Linear(8, 3, dtype=torch.float64 if float64_head else torch.float32)
        self.second = nn.Linear(8, 3) if second_head else None

    def forward(self, x: torch.Tensor, shard: int) -> torch.Tensor:
        hidden = torch.tanh(self.hidden(x))
        logits = self.out(hidden.to(self.out.weight.dtype))
        if self.second is not None and shard % 2 == 0:
            logits = logits + self.second(hidden)
        return logits


def make_model(**model_options) -> Net:
    torch.manual_seed(1234)
    return Net(**model_options)


def batch(shard, step):
    generator = torch.Generator().manual_seed(100 * step + shard)  # different data on every rank
    return torch.randn(4, 6, generator=generator), torch.randint(0, 3, (4,), generator=generator)


def train_with_hvd(model_options=None, compression_name="none", backward_passes_per_step=1,
                   groups=None, bucket_cap_bytes=None, gradient_predivide_factor=1.0):
    """Train on this rank's shards; the final state and the names of the optimizer's allreduces.

    `groups` names parameters (they exist only on the rank); `bucket_cap_bytes` replaces both
    caps of the automatic buckets.
    """
    import ddl_magic.torch as hvd
    from ddl_magic.torch import optimizer as optimizer_module

    model_options = model_options or {}
    caps = {"BUCKET_CAP_BYTES": bucket_cap_bytes or optimizer_module.BUCKET_CAP_BYTES,
            "FIRST_BUCKET_CAP_BYTES": bucket_cap_bytes or optimizer_module.FIRST_BUCKET_CAP_BYTES}
    with mock.patch.multiple(optimizer_module, **caps), \
            mock.patch.object(optimizer_module, "_allreduce_into",
                              wraps=optimizer_module._allreduce_into) as allreduce:
        hvd.init()
        torch.manual_seed(hvd.rank())  # different initial weights: broadcast must fix that
        model = Net(**model_options)
        if hvd.rank() == 0:
            model.load_state_dict(make_model(**model_options).state_dict())
        params = dict(model.named_parameters())
        if isinstance(groups, list):
            groups = [[params[name] for name in group] for group in groups]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(),
            compression=getattr(hvd.Compression, compression_name),
            backward_passes_per_step=backward_passes_per_step, groups=groups,
            gradient_predivide_factor=gradient_predivide_factor)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        for step in range(STEPS):
            optimizer.zero_grad()
            for micro in range(backward_passes_per_step):
                shard = hvd.rank() * backward_passes_per_step + micro
                x, y = batch(shard, step)
                loss = nn.functional.cross_entropy(model(x, shard), y) / backward_passes_per_step
                loss.backward()
            optimizer.step()
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "allreduces": [call.args[3] for call in allreduce.call_args_list]}  # the name


def train_with_each_grouping():
    """The same training with automatic buckets, explicit groups, and three equal buckets."""
    explicit = [["out.weight", "hidden.bias"], ["hidden.weight", "out.bias"]]
    return [train_with_hvd(groups=groups) for groups in (None, explicit, 3)]


def train_on_all_data(world_size, backward_passes_per_step=1, model_options=None):
    """One process, every rank's batch each step: what averaging gradients must reproduce."""
    model = make_model(**(model_options or {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    shards = world_size * backward_passes_per_step
    for step in range(STEPS):
        optimizer.zero_grad()
        for shard in range(shards):
            x, y = batch(shard, step)
            (nn.functional.cross_entropy(model(x, shard), y) / shards).backward()
        optimizer.step()
    return model.state_dict()


def assert_ranks_identical(results):
    for result in results[1:]:
        for name, value in result["state"].items():
            assert torch.equal(value, results[0]["state"][name]), name


def assert_equal_to_training_on_all_data(result, reference, atol=1e-5):
    for name, value in reference.items():
        assert torch.allclose(result["state"][name], value, atol=atol), name


def allreduces_per_step(result) -> set[str]:
    """The names of one step's allreduces, after checking every step made the same ones."""
    names = result["allreduces"]
    per_step = len(names) // STEPS
    steps = [sorted(names[i * per_step:(i + 1) * per_step]) for i in range(STEPS)]
    assert len(names) == per_step * STEPS and all(s == steps[0] for s in steps), names
    assert len(set(steps[0])) == per_step, names
    return set(steps[0])


@pytest.mark.parametrize("np", [2, 3])
def test_ranks_end_identical_and_equal_to_training_on_all_data(np):
    results = run_on_ranks(train_with_hvd, np)
    assert_ranks_identical(results)
    assert_equal_to_training_on_all_data(results[0], train_on_all_data(np))
    # A small model's gradients travel as one bucket, named after its parameters on every rank.
    for result in results:
        assert allreduces_per_step(result) == {"allreduce.out.bias+3"}


def test_fp16_compression_and_gradient_accumulation():
    results = run_on_ranks(train_with_hvd, 2, compression_name="fp16", backward_passes_per_step=2)
    assert_ranks_identical(results)
    assert_equal_to_training_on_all_data(results[0], train_on_all_data(2, backward_passes_per_step=2),
                                         atol=1e-2)
    assert allreduces_per_step(results[0]) == {"allreduce.out.bias+3"}  # once per 2 passes


def test_explicit_groups_and_a_number_of_groups_give_the_default_results():
    automatic, explicit, three = run_on_ranks(train_with_each_grouping, 2)[0]
    for grouped in (explicit, three):
        for name, value in automatic["state"].items():
            assert torch.equal(grouped["state"][name], value), name
    assert allreduces_per_step(explicit) == {"allreduce.out.weight+1", "allreduce.hidden.weight+1"}
    # Equal bytes, last layer first: out (108 B), hidden.bias (32 B), hidden.weight (192 B).
    assert allreduces_per_step(three) == {"allreduce.out.bias+1", "allreduce.hidden.bias",
                                          "allreduce.hidden.weight"}


@pytest.mark.parametrize("bucket_cap_bytes", [None, SMALL_BUCKET_BYTES],
                         ids=["shares_a_bucket", "bucket_of_its_own"])
def test_a_layer_unused_on_one_rank_still_trains(bucket_cap_bytes):
    model_options = {"second_head": True}
    results = run_on_ranks(train_with_hvd, 2, model_options=model_options,
                           bucket_cap_bytes=bucket_cap_bytes)
    assert_ranks_identical(results)
    # Rank 1 contributes zeros for the second head, as one process averaging both shards does.
    assert_equal_to_training_on_all_data(results[0], train_on_all_data(2, model_options=model_options))
    assert not torch.equal(results[0]["state"]["second.weight"],
                           make_model(**model_options).state_dict()["second.weight"])


def test_parameters_of_two_dtypes_travel_in_one_bucket_each():
    model_options = {"float64_head": True}
    results = run_on_ranks(train_with_hvd, 2, model_options=model_options)
    assert_ranks_identical(results)
    assert_equal_to_training_on_all_data(results[0], train_on_all_data(2, model_options=model_options))
    assert results[0]["state"]["out.weight"].dtype == torch.float64
    assert allreduces_per_step(results[0]) == {"allreduce.out.bias+1", "allreduce.hidden.bias+1"}


def test_several_small_buckets_with_predivided_gradients_equal_training_on_all_data():
    results = run_on_ranks(train_with_hvd, 3, bucket_cap_bytes=SMALL_BUCKET_BYTES,
                           gradient_predivide_factor=2.0)
    assert_ranks_identical(results)
    assert_equal_to_training_on_all_data(results[0], train_on_all_data(3))
    assert allreduces_per_step(results[0]) == {"allreduce.out.bias+1", "allreduce.hidden.bias+1"}


# ---- on a world of one: what the optimizer refuses, and what it does not repeat -------------

@pytest.fixture
def hvd():
    import ddl_magic.torch as hvd

    hvd.init()  # no launcher: a world of one
    yield hvd
    hvd.shutdown()


def sgd_on(model: nn.Module, hvd, **options) -> torch.optim.Optimizer:
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), **options)


def loss_of(model: nn.Module) -> torch.Tensor:
    x, y = batch(0, 0)
    return nn.functional.cross_entropy(model(x, 0), y)


def test_groups_must_hold_every_parameter_exactly_once():
    import ddl_magic.torch as hvd

    model = make_model()
    hidden, out = [model.hidden.weight, model.hidden.bias], [model.out.weight, model.out.bias]
    for groups, message in [([hidden], "leaves out 'out.weight', 'out.bias'"),
                            ([hidden, out, [model.out.bias]], "'out.bias' is in groups twice"),
                            ([hidden, out, [torch.zeros(3)]], r"shape \(3,\) that is not a parameter"),
                            (0, "groups=0")]:
        with pytest.raises(ValueError, match=message):
            sgd_on(model, hvd, groups=groups)


def test_a_second_backward_before_step_and_zero_grad_in_between_are_refused(hvd):
    model = make_model()
    optimizer = sgd_on(model, hvd)
    loss_of(model).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        optimizer.zero_grad()
    with pytest.raises(RuntimeError, match="backward_passes_per_step"):
        loss_of(model).backward()


def test_step_after_synchronize_and_skip_synchronize_averages_once(hvd):
    from ddl_magic.torch import optimizer as optimizer_module

    model = make_model()
    optimizer = sgd_on(model, hvd)
    with mock.patch.object(optimizer_module, "_allreduce_into",
                           wraps=optimizer_module._allreduce_into) as allreduce:
        loss_of(model).backward()
        optimizer.synchronize()
        nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        with optimizer.skip_synchronize():
            optimizer.step()
    assert allreduce.call_count == 1
    optimizer.zero_grad()  # nothing left in flight


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_a_sparse_gradient_is_averaged_and_reaches_the_optimizer_sparse(hvd, sparse_as_dense):
    embedding = nn.Embedding(10, 4, sparse=True)
    optimizer = sgd_on(embedding, hvd, sparse_as_dense=sparse_as_dense)
    before = embedding.weight.detach().clone()
    embedding(torch.tensor([1, 2, 2])).sum().backward()
    optimizer.step()
    assert embedding.weight.grad.is_sparse
    assert embedding.weight.grad.to_dense()[:3].tolist() == [[0.0] * 4, [1.0] * 4, [2.0] * 4]
    changed = (embedding.weight != before).any(dim=1)
    assert changed.tolist() == [row in (1, 2) for row in range(10)]


def test_api_before_init_says_to_call_init():
    import ddl_magic.torch as hvd

    hvd.shutdown()
    with pytest.raises(ValueError, match=r"rank\(\) was called before init\(\)"):
        hvd.rank()
    with pytest.raises(ValueError, match="hvd.init"):
        hvd.allreduce(torch.ones(1))
