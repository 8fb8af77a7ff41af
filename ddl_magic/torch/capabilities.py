"""Horovod's build and capability checks, answered for ddl_magic.

Horovod scripts, and Horovod's own tests, ask which libraries Horovod was compiled with
before they choose a code path. ddl_magic compiles nothing and links no communication
library: its collectives are its own ring, over TCP between hosts and shared memory within
one. So the answers are:

- MPI, NCCL, oneCCL, ROCm and IBM's DDL (a library that shares only a name with ddl_magic)
  are absent: `mpi_built()`, `mpi_enabled()`, `ccl_built()`, `rocm_built()` and
  `ddl_built()` are False, `nccl_built()` is 0 (Horovod's answer without NCCL; with NCCL it
  is NCCL's version code), and `mpi_threads_supported()` raises, as Horovod's does whenever
  MPI is not enabled.
- Gloo's role is played by ddl_magic's runtime. Horovod without MPI coordinates ranks and
  moves CPU tensors with Gloo, over TCP, started by its own launcher: that is what ddl_magic
  does too. So `gloo_built()` is True and `gloo_enabled()` is True once `init()` has run,
  and Horovod code that branches on them takes its Gloo path, the one that needs no MPI.
- `cuda_built()` says whether CUDA tensors can be passed to the collectives. They can
  whenever the installed torch was built with CUDA (they are staged through host memory).

    >>> import ddl_magic.torch as hvd
    >>> hvd.gloo_built(), hvd.mpi_built(), hvd.nccl_built()
    (True, False, 0)
"""

from __future__ import annotations

import torch

from ..runtime import context


def mpi_built() -> bool:
    """False: ddl_magic does not use MPI."""
    return False


def mpi_enabled() -> bool:
    """False: no MPI communicator exists to share (with mpi4py, say)."""
    return False


def mpi_threads_supported() -> bool:
    """Raises, as Horovod does when MPI is not enabled: there is no MPI to ask."""
    raise ValueError("ddl_magic does not use MPI, so there are no MPI threads to mix with "
                     "(mpi4py cannot share ddl_magic's ranks); hvd.mpi_enabled() is False")


def gloo_built() -> bool:
    """True: ddl_magic's own runtime takes the place of Horovod's Gloo (see the module help)."""
    return True


def gloo_enabled() -> bool:
    """True once `init()` has run: collectives then go through ddl_magic's runtime."""
    return context.is_initialized()


def nccl_built() -> int:
    """0: no NCCL (Horovod returns NCCL's version code when it has it, so this is an int)."""
    return 0


def ddl_built() -> bool:
    """False: IBM's DDL library, which Horovod can use, is not ddl_magic and is not used."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False


def cuda_built() -> bool:
    """True when CUDA tensors can be passed to the collectives: torch was built with CUDA."""
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    """False: ddl_magic has no ROCm-specific code."""
    return False
