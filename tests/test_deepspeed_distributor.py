"""`DeepspeedTorchDistributor` as pyspark's users call it: real DeepSpeed ZeRO-2 and ZeRO-3
code on the CPU (DeepSpeed's CPU accelerator), every rank's process group on the `ddl`
backend, locally and as Spark barrier tasks, training to the weights of one process."""

import pytest
import torch

from ddl_magic import DeepspeedTorchDistributor

deepspeed = pytest.importorskip("deepspeed", reason="pip install 'ddl_magic[deepspeed]'")

SAMPLES, STEPS, LR = 32, 4, 0.01
RTOL, ATOL = 1e-5, 1e-6


def model_and_data():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    generator = torch.Generator().manual_seed(1)
    return model, torch.randn(SAMPLES, 8, generator=generator), torch.randint(0, 4, (SAMPLES,),
                                                                              generator=generator)


def config(stage: int, batch_per_rank: int) -> dict:
    return {"train_micro_batch_size_per_gpu": batch_per_rank,
            "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": stage}}


def train_with_zero(stages: tuple) -> dict:
    """For each ZeRO stage, DeepSpeed training on this rank's share of the batch: the backend
    DeepSpeed runs on, and the full weights."""
    import deepspeed
    import torch
    import torch.distributed as dist

    seen = {}
    for stage in stages:
        model, x, y = model_and_data()
        rank, size = dist.get_rank(), dist.get_world_size()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config(stage, SAMPLES // size))
        for _ in range(STEPS):
            engine.backward(torch.nn.functional.cross_entropy(engine(x[rank::size]), y[rank::size]))
            engine.step()
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            seen[stage] = [p.detach().clone() for p in engine.module.parameters()]
    seen["backend"] = dist.get_backend()
    seen["accelerator"] = deepspeed.get_accelerator().device_name()
    return seen


def train_alone() -> list:
    model, x, y = model_and_data()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def assert_close(weights, reference) -> None:
    assert len(weights) == len(reference)
    for got, expected in zip(weights, reference):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def test_zero_2_and_zero_3_train_on_the_ddl_backend_to_the_weights_of_one_process():
    distributor = DeepspeedTorchDistributor(numGpus=2, nnodes=1, localMode=True, useGpu=False)
    seen = distributor.run(train_with_zero, (2, 3))
    assert (seen["backend"], seen["accelerator"]) == ("ddl", "cpu")
    reference = train_alone()
    assert_close(seen[2], reference)
    assert_close(seen[3], reference)


SCRIPT = """
import argparse, json
import deepspeed, torch, torch.distributed as dist

SAMPLES, STEPS = {SAMPLES}, {STEPS}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
generator = torch.Generator().manual_seed(1)
x, y = torch.randn(SAMPLES, 8, generator=generator), torch.randint(0, 4, (SAMPLES,), generator=generator)

parser = argparse.ArgumentParser()
parser.add_argument("--out")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
rank, size = dist.get_rank(), dist.get_world_size()
for _ in range(STEPS):
    engine.backward(torch.nn.functional.cross_entropy(engine(x[rank::size]), y[rank::size]))
    engine.step()
with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
    weights = [p.detach().tolist() for p in engine.module.parameters()]
if rank == 0:
    with open(args.out, "w") as f:
        json.dump({"backend": dist.get_backend(), "stage": engine.zero_optimization_stage(),
                   "weights": weights}, f)
"""


@pytest.mark.timeout(300)  # a SparkSession, and DeepSpeed imported on each rank (~10 s)
@pytest.mark.parametrize("spark", ["classic"], indirect=True)
def test_a_script_on_spark_gets_its_config_as_deepspeeds_arguments(spark, tmp_path):
    import json

    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("{SAMPLES}", str(SAMPLES)).replace("{STEPS}", str(STEPS)))
    out = tmp_path / "out.json"
    distributor = DeepspeedTorchDistributor(numGpus=2, nnodes=1, localMode=False, useGpu=False,
                                            deepspeedConfig=config(3, SAMPLES // 2))
    assert distributor.run(str(script), "--out", str(out)) is None
    seen = json.loads(out.read_text())
    assert (seen["backend"], seen["stage"]) == ("ddl", 3)
    assert_close([torch.tensor(w) for w in seen["weights"]], train_alone())


def test_what_pyspark_refuses_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="numGpus must be a positive integer"):
        DeepspeedTorchDistributor(numGpus=0)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        DeepspeedTorchDistributor(numGpus=2, useGpu=False, deepspeedConfig=str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="command-line arguments only"):
        DeepspeedTorchDistributor(numGpus=2, useGpu=False).run(str(tmp_path), epochs=3)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use_gpu=True"):
            DeepspeedTorchDistributor(numGpus=2).run(train_alone)  # pyspark's default: GPUs
