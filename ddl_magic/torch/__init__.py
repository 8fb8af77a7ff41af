"""Horovod's PyTorch API on ddl_magic's runtime: port a script by changing one import.

    import ddl_magic.torch as hvd        # was: import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for x, y in shard_of_data(hvd.rank(), hvd.size()):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
"""

from ..runtime.errors import HorovodInternalError
from . import backend as _backend
from .capabilities import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built,
                           mpi_enabled, mpi_threads_supported, nccl_built, rocm_built)
from .compression import Compression
from .counters import negotiation_counters
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async, allreduce,
                  alltoall, alltoall_async,
                  allreduce_, allreduce_async, allreduce_async_, barrier, broadcast, broadcast_,
                  broadcast_async, broadcast_async_, cross_rank, cross_size, grouped_allgather,
                  grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                  grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                  grouped_reducescatter_async, is_homogeneous, join, local_rank, local_size, poll,
                  rank, reducescatter, reducescatter_async, size, sparse_allreduce_async,
                  synchronize)
from .distributed_optimizer import DistributedOptimizer
from .lifecycle import init, is_initialized, shutdown
from .process_set_rings import add_process_set, remove_process_set
from .process_sets import ProcessSet, global_process_set
from .sync_batch_norm import SyncBatchNorm
from .timeline import start_timeline, stop_timeline, timeline_span
from . import elastic  # hvd.elastic.run, TorchState, ElasticSampler: Horovod's elastic API

_backend.register()  # dist.init_process_group("ddl") works wherever this is imported

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_object", "allgather_object", "barrier",
    "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "alltoall", "alltoall_async", "sparse_allreduce_async", "poll", "synchronize", "join",
    "Sum", "Average", "Min", "Max", "Product", "Adasum", "Compression",
    "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "SyncBatchNorm",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "start_timeline", "stop_timeline", "timeline_span", "HorovodInternalError", "elastic",
    "negotiation_counters",
]
