"""The runtime's tunables, read from the environment names Horovod users already know.

Kept free of torch: the driver checks them before launching ranks (a notebook should not
import torch just to launch a run).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TRANSPORT_VARIABLE = "DDL_MAGIC_TRANSPORT"
TRANSPORT_CHOICES = ("auto", "tcp", "shm")
DEFAULT_TIMEOUT_S = 300.0
TORCH_PLANE_VARIABLE = "DDL_MAGIC_TORCH_PLANE"
TORCH_PLANE_CHOICES = ("auto", "nccl", "gloo", "off")


def _choice(variable: str, choices: tuple[str, ...], value: str | None, meaning: str) -> str:
    """One of `choices`, from `value` or else the environment's `variable` (empty: the first,
    "auto"); anything else is refused with the choices and what they mean."""
    if value is None:
        value = os.environ.get(variable, "")
    choice = value.strip().lower() or choices[0]
    if choice not in choices:
        raise ValueError(f"{variable}={value!r} is not one of {', '.join(choices)}: {meaning}")
    return choice


def transport_choice(value: str | None = None) -> str:
    """`DDL_MAGIC_TRANSPORT` (or `value`): auto (shared memory within a host where it works), tcp or shm.

    >>> transport_choice("TCP")
    'tcp'
    """
    return _choice(TRANSPORT_VARIABLE, TRANSPORT_CHOICES, value,
                   "auto uses shared memory between ranks on one host and TCP between hosts; "
                   "tcp forces sockets everywhere")


ALGORITHM_VARIABLE = "DDL_MAGIC_ALLREDUCE_ALGORITHM"
ALGORITHM_CHOICES = ("auto", "ring", "recursive_doubling")


def allreduce_algorithm(value: str | None = None) -> str:
    """`DDL_MAGIC_ALLREDUCE_ALGORITHM` (or `value`): how a TCP ring allreduces. auto: recursive
    doubling for small buffers, the ring for large ones (the switch point of
    `planes/cost_model.py`); ring or recursive_doubling: always that one.

    >>> allreduce_algorithm(" Ring ")
    'ring'
    """
    return _choice(ALGORITHM_VARIABLE, ALGORITHM_CHOICES, value,
                   "auto picks recursive doubling for small allreduces and the ring for large ones")


def torch_plane_choice(value: str | None = None) -> str:
    """`DDL_MAGIC_TORCH_PLANE` (or `value`): which buffers go through a torch.distributed
    group (`planes/torch_distributed.py`): auto, nccl, gloo or off.

    >>> torch_plane_choice(" NCCL ")
    'nccl'
    """
    return _choice(TORCH_PLANE_VARIABLE, TORCH_PLANE_CHOICES, value,
                   "auto sends CUDA tensors through NCCL where they leave the host; nccl "
                   "everywhere; gloo sends every tensor through gloo (the CPU stand-in for "
                   "NCCL); off never uses NCCL")


@dataclass(frozen=True)
class Settings:
    """Tunables, read from the environment names Horovod users already know."""

    fusion_threshold: int
    cycle_time_s: float
    stall_time_s: float
    timeout_s: float
    transport: str  # DDL_MAGIC_TRANSPORT: auto, tcp or shm
    hierarchical: bool  # HOROVOD_HIERARCHICAL_ALLREDUCE, on unless set to 0
    allreduce_algorithm: str = "auto"  # DDL_MAGIC_ALLREDUCE_ALGORITHM: auto, ring, recursive_doubling
    torch_plane: str = "auto"  # DDL_MAGIC_TORCH_PLANE: auto, nccl, gloo or off

    @classmethod
    def from_environment(cls) -> "Settings":
        def number(names: tuple[str, ...], default: float) -> float:
            for name in names:
                if os.environ.get(name):
                    try:
                        return float(os.environ[name])
                    except ValueError:
                        raise ValueError(f"{name}={os.environ[name]!r} is not a number") from None
            return default

        return cls(
            fusion_threshold=int(number(("HOROVOD_FUSION_THRESHOLD",), 128 * 1024 * 1024)),
            cycle_time_s=number(("HOROVOD_CYCLE_TIME",), 1.0) / 1000.0,
            stall_time_s=number(("HOROVOD_STALL_CHECK_TIME_SECONDS",), 60.0),
            # Long enough for one rank's evaluation or checkpoint while the others wait in
            # the next collective (torch's own default is 30 minutes); the stall report
            # (60 s) says what is going on long before.
            timeout_s=number(("DDL_MAGIC_TIMEOUT", "HOROVOD_GLOO_TIMEOUT_SECONDS"),
                             DEFAULT_TIMEOUT_S),
            transport=transport_choice(),
            hierarchical=os.environ.get("HOROVOD_HIERARCHICAL_ALLREDUCE", "1").strip().lower()
            not in ("0", "false", "no", "off"),
            allreduce_algorithm=allreduce_algorithm(),
            torch_plane=torch_plane_choice(),
        )
