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


def transport_choice(value: str | None = None) -> str:
    """`DDL_MAGIC_TRANSPORT` (or `value`): auto (shared memory within a host where it works), tcp or shm.

    >>> transport_choice("TCP")
    'tcp'
    """
    if value is None:
        value = os.environ.get(TRANSPORT_VARIABLE, "")
    choice = value.strip().lower() or "auto"
    if choice not in TRANSPORT_CHOICES:
        raise ValueError(f"{TRANSPORT_VARIABLE}={value!r} is not one of "
                         f"{', '.join(TRANSPORT_CHOICES)}: auto uses shared memory between ranks on "
                         "one host and TCP between hosts; tcp forces sockets everywhere")
    return choice


def torch_plane_choice(value: str | None = None) -> str:
    """`DDL_MAGIC_TORCH_PLANE` (or `value`): which buffers go through a torch.distributed
    group (`planes/torch_distributed.py`): auto, nccl, gloo or off.

    >>> torch_plane_choice(" NCCL ")
    'nccl'
    """
    if value is None:
        value = os.environ.get(TORCH_PLANE_VARIABLE, "")
    choice = value.strip().lower() or "auto"
    if choice not in TORCH_PLANE_CHOICES:
        raise ValueError(f"{TORCH_PLANE_VARIABLE}={value!r} is not one of "
                         f"{', '.join(TORCH_PLANE_CHOICES)}: auto sends CUDA tensors through NCCL "
                         "where they leave the host; nccl everywhere; gloo sends every tensor "
                         "through gloo (the CPU stand-in for NCCL); off never uses NCCL")
    return choice


@dataclass(frozen=True)
class Settings:
    """Tunables, read from the environment names Horovod users already know."""

    fusion_threshold: int
    cycle_time_s: float
    stall_time_s: float
    timeout_s: float
    transport: str  # DDL_MAGIC_TRANSPORT: auto, tcp or shm
    hierarchical: bool  # HOROVOD_HIERARCHICAL_ALLREDUCE, on unless set to 0
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
            torch_plane=torch_plane_choice(),
        )
