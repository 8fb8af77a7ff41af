"""How many bytes of model state each rank holds: the ZeRO paper's accounting, as a calculator.

    >>> plan = memory_per_rank(150e6, "fsdp2", ranks=4)
    >>> print(plan)
    fsdp2, 150M parameters, adam, fp32, 4 ranks: 0.60 GB per rank (parameters 0.15, gradients 0.15, optimizer 0.30)

A parameter costs, with Adam: in float32 4 bytes of weight, 4 of gradient and 8 of moments
(16 bytes, the ZeRO paper's 16Ψ with K = 8 + 4); in mixed precision (``bf16``/``fp16``) 2 of
weight, 2 of gradient and 12 of float32 master copy and moments (also 16, K = 12). SGD with
momentum keeps 4 bytes of state (8 with a master copy), plain SGD none. Strategies divide
what they shard by the N ranks:

| strategy | shards | per rank (Adam, mixed precision) |
|---|---|---|
| ``ddp`` | nothing | 2Ψ + 2Ψ + 12Ψ = 16Ψ |
| ``zero1`` (``shard_optimizer_state=True``) | optimizer state | 2Ψ + 2Ψ + 12Ψ/N |
| ``zero2`` | optimizer state, gradients | 2Ψ + (2Ψ + 12Ψ)/N |
| ``fsdp2``, ``zero3`` | everything | 16Ψ/N |
| ``hsdp`` (``shard_ranks`` of N) | everything, over a shard group | 16Ψ/shard_ranks |

What this leaves out, and a rank also holds: activations (which activation checkpointing
shrinks), the layers FSDP2 has all-gathered for the moment (one or two at a time), collective
buffers, and the few hundred MB of the process itself (torch imported): measure a real rank
with lab 06 or `benchmarks/large_models.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MemoryPlan", "memory_per_rank"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2", "hsdp")
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd_momentum": 4, "sgd": 0}
"""Bytes of optimizer state per parameter in float32 (Adam's two moments, SGD's momentum)."""
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of model state on each rank, by what they are."""

    strategy: str
    parameters: float
    optimizer: str
    precision: str
    ranks: int
    parameter_bytes: float
    gradient_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    def __str__(self) -> str:
        return (f"{self.strategy}, {self.parameters / 1e6:.0f}M parameters, {self.optimizer}, "
                f"{self.precision}, {self.ranks} ranks: {self.total_bytes / 1e9:.2f} GB per rank "
                f"(parameters {self.parameter_bytes / 1e9:.2f}, gradients "
                f"{self.gradient_bytes / 1e9:.2f}, optimizer {self.optimizer_bytes / 1e9:.2f})")


def memory_per_rank(parameters: float, strategy: str = "ddp", ranks: int = 1,
                    optimizer: str = "adam", precision: str = "fp32",
                    shard_ranks: int | None = None) -> MemoryPlan:
    """The model state each of `ranks` ranks holds under `strategy` (see the module's table).

    >>> memory_per_rank(150e6, "ddp").total_bytes / 1e9
    2.4
    >>> memory_per_rank(150e6, "zero1", ranks=4, precision="bf16").total_bytes / 1e9
    1.05
    >>> memory_per_rank(150e6, "hsdp", ranks=4, shard_ranks=2).total_bytes / 1e9
    1.2
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZER_STATE_BYTES)}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, not {ranks!r}")
    mixed = precision != "fp32"
    weight = 2 if mixed else 4
    state = OPTIMIZER_STATE_BYTES[optimizer] + (4 if mixed else 0)  # + the float32 master copy
    if strategy == "hsdp":
        shard_ranks = shard_ranks or ranks
        if ranks % shard_ranks:
            raise ValueError(f"hsdp: shard_ranks {shard_ranks} must divide ranks {ranks}")
    divide = {"ddp": (1, 1, 1), "zero1": (1, 1, ranks), "zero2": (1, ranks, ranks),
              "zero3": (ranks,) * 3, "fsdp2": (ranks,) * 3,
              "hsdp": (shard_ranks,) * 3}[strategy]
    return MemoryPlan(strategy, parameters, optimizer, precision, ranks,
                      weight * parameters / divide[0], weight * parameters / divide[1],
                      state * parameters / divide[2])
