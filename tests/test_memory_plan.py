"""The memory calculator (`ddl_magic.torch.memory_plan`): the ZeRO paper's accounting."""

import doctest

import pytest

from ddl_magic.torch import memory_plan
from ddl_magic.torch.memory_plan import memory_per_rank

PSI = 1e9  # parameters: bytes per parameter read off directly


def test_its_examples_hold():
    assert doctest.testmod(memory_plan).failed == 0


@pytest.mark.parametrize("strategy, expected", [
    ("ddp", 16), ("zero1", 2 + 2 + 12 / 8), ("zero2", 2 + 14 / 8), ("zero3", 16 / 8), ("fsdp2", 16 / 8)])
def test_mixed_precision_adam_is_the_zero_papers_16_psi_split_as_it_says(strategy, expected):
    plan = memory_per_rank(PSI, strategy, ranks=8, precision="bf16")
    assert plan.total_bytes / PSI == pytest.approx(expected)


def test_float32_adam_is_16_bytes_a_parameter_and_sgd_less():
    assert memory_per_rank(PSI, "ddp").total_bytes / PSI == 16
    assert memory_per_rank(PSI, "ddp", optimizer="sgd_momentum").total_bytes / PSI == 12
    assert memory_per_rank(PSI, "fsdp2", ranks=4, optimizer="sgd").total_bytes / PSI == 2


def test_what_it_cannot_compute_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="ddp, zero1"):
        memory_per_rank(PSI, "zero4")
    with pytest.raises(ValueError, match="shard_ranks 3 must divide ranks 4"):
        memory_per_rank(PSI, "hsdp", ranks=4, shard_ranks=3)
    with pytest.raises(ValueError, match="positive integer"):
        memory_per_rank(PSI, "ddp", ranks=0)
