"""The proof that a model too big for one rank trains when sharded: under a memory cap per rank,
plain DDP with Adam runs out of memory, named so, while FSDP2, HSDP and DeepSpeed ZeRO-3 train
at np 4 to the loss of one uncapped process.

    python tests/large_model_proof.py              # 151M parameters: FSDP2 under 1 GiB a rank,
                                                   # HSDP, ZeRO-3 and DDP under 2 GiB (~3 min)
    python tests/large_model_proof.py --short      # CI's: 34M parameters, 600 MiB, DDP and FSDP2

The model is `layers` Linear(width, width) with ReLUs between, trained with Adam (lr 1e-4) on a
regression batch that the 4 ranks split evenly; one process trains the same steps on the whole
batch. With Adam in float32 a parameter costs 16 bytes (weight, gradient, two moments):
151M parameters are 2.4 GB per DDP rank (3 GB with its gradient buckets); FSDP2 holds a
quarter of it (0.6 GB), HSDP on a 2x2 mesh half (1.2 GB), and DeepSpeed's ZeRO-3 on a CPU a
quarter plus a float32 copy of its partition and of its gradients (1.4 GB over the baseline,
measured). So FSDP2 trains under 1 GiB a rank, HSDP and ZeRO-3 under 2 GiB (`Size.wider_cap`),
and DDP is run under the wider cap: out of memory there, it is out of memory under both.
What counts against a cap is what the rank allocates after it starts: the pages of torch it
shares with the process it was forked from do not.

Prints one line per strategy, and exits non-zero if any claim does not hold. Needs root and
cgroup v1 (the cap); DeepSpeed for ZeRO-3 (`pip install 'ddl_magic[deepspeed]'`; skipped
without it, and in --short).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass

BATCH, STEPS, LR = 32, 3, 1e-4
NP = 4


@dataclass(frozen=True)
class Size:
    layers: int
    width: int
    cap: str  # per rank, for FSDP2
    wider_cap: str | None = None  # for the strategies that hold more a rank (HSDP, ZeRO-3), and DDP

    @property
    def parameters(self) -> int:
        return self.layers * (self.width * self.width + self.width)

    def cap_of(self, strategy: str) -> str:
        return self.cap if strategy == "fsdp2" else self.wider_cap or self.cap


FULL = Size(layers=9, width=4096, cap="1GiB", wider_cap="2GiB")
SHORT = Size(layers=8, width=2048, cap="600MiB")


def model(size: Size):
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(size.layers):
        layers += [torch.nn.Linear(size.width, size.width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def batch(size: Size):
    import torch

    generator = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, size.width, generator=generator),
            torch.randn(BATCH, size.width, generator=generator))


def train(strategy: str, size: Size) -> dict:
    """On every rank: `strategy` ("ddp", "fsdp2", "hsdp" or "zero3") for STEPS steps on this
    rank's quarter of the batch; the whole batch's losses (the ranks' mean) and the memory
    that counted against this rank's cap."""
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    x, y = batch(size)
    if strategy == "zero3":
        import deepspeed

        # buckets sized for a small machine: DeepSpeed's defaults (5e8 elements to reduce at
        # once: 2 GB in float32) are made for GPUs with tens of GB
        buckets = {"reduce_bucket_size": 2 ** 24, "stage3_prefetch_bucket_size": 2 ** 24,
                   "stage3_max_live_parameters": 2 ** 25, "stage3_max_reuse_distance": 2 ** 25}
        config = {"train_micro_batch_size_per_gpu": BATCH // NP,
                  "zero_optimization": {"stage": 3, **buckets},
                  "optimizer": {"type": "Adam",
                                "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}}}
        # its config, not dtype=: on a CPU, DeepSpeed 0.19.8 makes parameters bf16 whatever
        # `dtype` says, unless a config says otherwise
        with deepspeed.zero.Init(config_dict_or_path=config):
            net = model(size)
        step_on, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                                config=config)
        optimizer = None
    else:
        dist.init_process_group("ddl")
        net = model(size)
        if strategy == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(net)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = (init_device_mesh("cpu", (2, NP // 2), mesh_dim_names=("replicate", "shard"))
                    if strategy == "hsdp" else init_device_mesh("cpu", (NP,)))
            for layer in net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(net, mesh=mesh)
        optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    rank = dist.get_rank()
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss((step_on if optimizer is None else net)(x[rank::NP]),
                                            y[rank::NP])
        if optimizer is None:
            step_on.backward(loss)
            step_on.step()
        else:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        mean = loss.detach().reshape(1)
        dist.all_reduce(mean)
        losses.append(mean.item() / NP)
    cgroup = f"/sys/fs/cgroup/memory/ddl_magic-rank-{os.getpid()}/memory.max_usage_in_bytes"
    with open(cgroup) as charged:
        return {"losses": losses, "charged_bytes": int(charged.read())}


def train_alone(size: Size) -> list[float]:
    import torch

    net = model(size)
    optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    x, y = batch(size)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def run(strategy: str, size: Size):
    """Every rank's result, or the RankFailedError of a rank that failed."""
    from ddl_magic.driver.job import Job, JobOptions
    from ddl_magic.driver.run_result import RankFailedError
    from ddl_magic.launch.local import LocalLauncher
    from ddl_magic.rank.memory_cap import capped_environment
    from ddl_magic.rank.deepspeed_rank import run_under_deepspeed
    from ddl_magic.wire.tasks import FunctionTask

    task = FunctionTask(train, {"strategy": strategy, "size": size})
    env = capped_environment(size.cap_of(strategy), on_spark=False)
    if strategy == "zero3":
        # the ranks of DeepspeedTorchDistributor(useGpu=False), under a cap
        task = FunctionTask(run_under_deepspeed, {"task": task, "config": None, "use_gpu": False})
        env["DS_ACCELERATOR"] = "cpu"
    options = JobOptions(timeout_s=900, return_all=True, hide_output=True, env=env)
    try:
        return Job(task, NP, LocalLauncher(), options).run().results
    except RankFailedError as failure:
        return failure


def prove(size: Size, strategies: tuple[str, ...]) -> dict:
    """Each strategy's outcome under the cap, and the one-process losses."""
    outcomes = {strategy: run(strategy, size) for strategy in strategies}
    return {"outcomes": outcomes, "alone": train_alone(size)}


def verdicts(proof: dict, size: Size, rtol: float = 1e-4) -> list[tuple[str, bool, str]]:
    """(strategy, whether its claim holds, what happened), for printing and for the test."""
    from ddl_magic.driver.run_result import RankFailedError

    alone = proof["alone"]
    lines = []
    for strategy, outcome in proof["outcomes"].items():
        if strategy == "ddp":
            holds = isinstance(outcome, RankFailedError) and outcome.reason.startswith("out of memory")
            said = outcome.reason if isinstance(outcome, RankFailedError) else "it trained"
            lines.append((strategy, holds, f"under {size.cap_of(strategy)}, expected out of "
                                           f"memory: {said}"))
            continue
        if isinstance(outcome, RankFailedError):
            lines.append((strategy, False, f"failed: rank {outcome.rank}: {outcome.reason}"))
            continue
        losses = outcome[0]["losses"]
        close = all(abs(a - b) <= rtol * abs(b) for a, b in zip(losses, alone))
        charged = max(rank["charged_bytes"] for rank in outcome) / 2 ** 20
        lines.append((strategy, close, f"trained: losses {[f'{v:.6f}' for v in losses]} vs one "
                      f"process {[f'{v:.6f}' for v in alone]}; at most {charged:.0f} MiB counted "
                      f"against the cap of {size.cap_of(strategy)}"))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="CI's version: a small model, a small cap")
    parser.add_argument("--only", choices=["ddp", "fsdp2", "hsdp", "zero3"], action="append",
                        help="run these strategies only")
    args = parser.parse_args()
    size = SHORT if args.short else FULL
    strategies = ("ddp", "fsdp2") if args.short else ("ddp", "fsdp2", "hsdp")
    if not args.short and importlib.util.find_spec("deepspeed") is not None:
        strategies += ("zero3",)
    strategies = tuple(args.only or strategies)
    caps = ", ".join(f"{strategy} {size.cap_of(strategy)}" for strategy in strategies)
    print(f"{size.parameters / 1e6:.0f}M parameters, Adam, np {NP}, caps per rank: {caps}")
    failed = False
    for strategy, holds, said in verdicts(prove(size, strategies), size):
        print(f"{'ok  ' if holds else 'FAIL'} {strategy}: {said}")
        failed |= not holds
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
