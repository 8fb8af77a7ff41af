"""Sharded optimizer state (ZeRO-1): the same training as the unsharded DistributedOptimizer,
with each rank holding the state of its share of the parameters only, and whole checkpoints."""

import copy

import pytest
import torch
from torch import nn

from ddl_magic.torch.sharded_optimizer import share_out
from ranks import run_on_ranks

STEPS = 100


def mnist_mlp() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 64),
                         nn.ReLU(), nn.Linear(64, 10))


def batch(rank: int, step: int):
    generator = torch.Generator().manual_seed(1000 * step + rank)  # different data on every rank
    return torch.rand(16, 1, 28, 28, generator=generator), torch.randint(0, 10, (16,), generator=generator)


def state_bytes(optimizer) -> int:
    """Bytes of the per-element state (Adam's moments), leaving out step counts."""
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor) and value.dim() > 0)


def train_both_ways(optimizer_name: str):
    """Train one model unsharded and one sharded, side by side on the same data."""
    import ddl_magic.torch as hvd

    hvd.init()
    make = {"adam": lambda params: torch.optim.Adam(params, lr=1e-3),
            "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
            "adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2)}[optimizer_name]
    models, optimizers = [], []
    for shard in (False, True):
        model = mnist_mlp()
        optimizer = hvd.DistributedOptimizer(make(model.parameters()),
                                             named_parameters=model.named_parameters(),
                                             shard_optimizer_state=shard)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        models.append(model)
        optimizers.append(optimizer)
    for step in range(STEPS):
        x, y = batch(hvd.rank(), step)
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    result = {"unsharded": {k: v.clone() for k, v in models[0].state_dict().items()},
              "sharded": {k: v.clone() for k, v in models[1].state_dict().items()},
              "state_bytes": [state_bytes(o) for o in optimizers],
              "stepped": sum(p.numel() for group in optimizers[1].param_groups
                             for p in group["params"])}
    hvd.shutdown()
    return result


@pytest.mark.parametrize("np", [2, 4])
def test_adam_sharded_trains_the_same_weights_with_a_share_of_the_state(np):
    results = run_on_ranks(train_both_ways, np, timeout_s=240, optimizer_name="adam")
    for rank, result in enumerate(results):
        for name, reference in result["unsharded"].items():
            torch.testing.assert_close(result["sharded"][name], reference, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")
            assert torch.equal(result["sharded"][name], results[0]["sharded"][name])  # allgathered
    unsharded = results[0]["state_bytes"][0]
    shares = [result["state_bytes"][1] for result in results]
    assert all(result["state_bytes"][0] == unsharded for result in results)
    assert sum(shares) == unsharded  # every element's state is kept, once
    assert max(shares) - min(shares) <= 8  # 1/N each: ranges differ by one element at most
    n_parameters = sum(p.numel() for p in mnist_mlp().parameters())
    assert sum(result["stepped"] for result in results) == n_parameters


@pytest.mark.parametrize("optimizer_name", ["sgd", "adafactor"])
def test_any_optimizer_steps_its_share_as_it_would_the_whole(optimizer_name):
    """SGD's momentum is cut at any element; Adafactor factors each matrix by rows and
    columns, so it is given whole parameters."""
    results = run_on_ranks(train_both_ways, 2, timeout_s=240, optimizer_name=optimizer_name)
    for result in results:
        for name, reference in result["unsharded"].items():
            torch.testing.assert_close(result["sharded"][name], reference, rtol=1e-4, atol=1e-5)


def share_out_examples():
    sizes = [[10, 10, 5, 15], [100, 1, 1, 1], [1, 1], [3]]
    return {str(s): share_out([torch.empty(n) for n in s], 2) for s in sizes}


def test_parameters_are_shared_out_whole_in_runs_of_about_equal_size():
    assert share_out_examples() == {"[10, 10, 5, 15]": [0, 0, 1, 1], "[100, 1, 1, 1]": [0, 1, 1, 1],
                                    "[1, 1]": [0, 1], "[3]": [1]}
    assert share_out([torch.empty(1)] * 3, 4) == [0, 2, 3]  # more ranks than parameters: some own none


def checkpoints_accumulation_clipping_and_errors():
    """Everything else a training script does with its optimizer, on each rank."""
    import ddl_magic.torch as hvd

    hvd.init()
    failures = []

    def build(shard, **options):
        model = mnist_mlp()
        optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                             named_parameters=model.named_parameters(),
                                             shard_optimizer_state=shard, **options)
        return model, optimizer

    def train(model, optimizer, steps, passes=1, clip=None):
        for step in range(steps):
            optimizer.zero_grad()
            for micro in range(passes):
                x, y = batch(hvd.rank(), 10 * step + micro)
                nn.functional.cross_entropy(model(x), y).backward()
            if clip is None:
                optimizer.step()
                continue
            optimizer.synchronize()
            norms.append(clip(model, optimizer))
            with optimizer.skip_synchronize():
                optimizer.step()

    # A whole checkpoint on rank 0, the unsharded optimizer's own format.
    plain_model, plain = build(False)
    model, sharded = build(True)
    train(plain_model, plain, 5)
    train(model, sharded, 5)
    try:
        sharded.state_dict()
        failures.append("state_dict() before consolidate_state_dict() did not raise")
    except RuntimeError as exc:
        if "consolidate_state_dict" not in str(exc):
            failures.append(f"state_dict() error: {exc}")
    sharded.consolidate_state_dict(to=0)
    whole = hvd.broadcast_object(sharded.state_dict() if hvd.rank() == 0 else None)
    reference = plain.state_dict()
    if sorted(whole["state"]) != sorted(reference["state"]) or any(
            not torch.allclose(whole["state"][i]["exp_avg_sq"], reference["state"][i]["exp_avg_sq"],
                               rtol=1e-4, atol=1e-9) for i in reference["state"]):
        failures.append("consolidated state differs from the unsharded optimizer's")
    if [g["params"] for g in whole["param_groups"]] != [g["params"] for g in reference["param_groups"]]:
        failures.append(f"consolidated param_groups {whole['param_groups']}")
    # ... loaded into a fresh sharded run and into a fresh unsharded one, both go on the same.
    resumed_model, resumed = build(True)
    resumed_model.load_state_dict(model.state_dict())
    resumed.load_state_dict(copy.deepcopy(whole))  # torch's optimizers adopt loaded tensors
    unsharded_model = mnist_mlp()
    unsharded_model.load_state_dict(model.state_dict())
    unsharded = hvd.DistributedOptimizer(torch.optim.Adam(unsharded_model.parameters(), lr=1e-3),
                                         named_parameters=unsharded_model.named_parameters())
    unsharded.load_state_dict(copy.deepcopy(whole))
    for m, o in ((model, sharded), (resumed_model, resumed), (unsharded_model, unsharded)):
        train(m, o, 3)
    for name, value in model.state_dict().items():
        if not torch.equal(resumed_model.state_dict()[name], value):
            failures.append(f"resumed sharded run differs at {name}")
        if not torch.allclose(unsharded_model.state_dict()[name], value, rtol=1e-4, atol=1e-6):
            failures.append(f"unsharded run from the checkpoint differs at {name}: "
                            f"{(unsharded_model.state_dict()[name] - value).abs().max()}")

    # Gradient accumulation: two backward passes per step, as backward_passes_per_step=2.
    norms = []
    plain_model, plain = build(False, backward_passes_per_step=2)
    model, sharded = build(True)
    train(plain_model, plain, 3, passes=2)
    train(model, sharded, 3, passes=2)
    for name, value in plain_model.state_dict().items():
        if not torch.allclose(model.state_dict()[name], value, rtol=1e-4, atol=1e-6):
            failures.append(f"accumulated gradients differ at {name}")

    # Clipping sees every rank's share: the same total norm as over the averaged gradients.
    plain_model, plain = build(False)
    model, sharded = build(True)
    train(plain_model, plain, 1,
          clip=lambda m, o: float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)))
    train(model, sharded, 1, clip=lambda m, o: float(o.clip_grad_norm_(0.1)))
    if abs(norms[0] - norms[1]) > 1e-5 * norms[0]:
        failures.append(f"clip_grad_norm_ total norms {norms}")
    for name, value in plain_model.state_dict().items():
        if not torch.allclose(model.state_dict()[name], value, rtol=1e-4, atol=1e-6):
            failures.append(f"clipped step differs at {name}")
    others = [p for p in model.parameters() if p.grad is None]
    if not others:
        failures.append("every parameter kept a gradient: nothing was sharded")

    # broadcast_optimizer_state gives every rank the root's hyperparameters.
    sharded.param_groups[0]["lr"] = 0.5 if hvd.rank() == 0 else 0.25
    hvd.broadcast_optimizer_state(sharded, root_rank=0)
    if sharded.param_groups[0]["lr"] != 0.5:
        failures.append(f"lr after broadcast_optimizer_state: {sharded.param_groups[0]['lr']}")

    # What cannot work says so.
    for call, expected in [
        (lambda: build(True, op=hvd.Max), ValueError),
        (lambda: build(True, groups=2), ValueError),
        (lambda: sharded.step(lambda: 0.0), ValueError),
        (lambda: sharded.add_param_group({"params": [torch.zeros(2, requires_grad=True)]}),
         NotImplementedError),
        (lambda: hvd.DistributedOptimizer(plain, shard_optimizer_state=True), ValueError),
    ]:
        try:
            call()
            failures.append(f"no {expected.__name__}")
        except expected:
            pass
    hvd.shutdown()
    return failures


def test_checkpoints_gradient_accumulation_clipping_and_refusals():
    failures = run_on_ranks(checkpoints_accumulation_clipping_and_errors, 2, timeout_s=240)
    assert failures == [[], []]
