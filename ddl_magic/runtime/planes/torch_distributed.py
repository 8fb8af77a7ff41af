"""The torch.distributed plane: a ring's flat buffers through a torch.distributed process
group — NCCL for CUDA buffers, gloo standing in for it on CPU buffers.

What stays ours: the negotiation (which collective runs, in one order on every rank), the
fusion buffers, the prescale and postscale, the timeline, process sets, elastic resets and
fail-fast. What torch does: move the bytes of one flat buffer that every rank has already
agreed on, with the library that does it best on GPUs (NVLink within a host, the network
across hosts).

Which group a ring gets is decided once, when the ring forms (`choose_backend`, from
`DDL_MAGIC_TORCH_PLANE` and what every rank can do), and the same on every rank:

    auto   CUDA buffers through NCCL where the ring leaves the host and every rank has NCCL
           and a GPU of its own; within one host CUDA IPC and our Triton kernels carry them
           (until a GPU measures NCCL faster there). Where NCCL is wanted but cannot run on
           a rank, CUDA buffers are staged through host memory and rank 0 says why in one
           line.
    nccl   CUDA buffers through NCCL on every ring, within a host too (refused where a rank
           has no GPU or no NCCL).
    gloo   every buffer through gloo: the stand-in that runs the NCCL path's code on CPU
           tensors (tests compare it with the shared-memory plane op by op).
    off    never: CUDA buffers are staged through host memory onto our planes.

Forming a group (`form_group`, while the ring forms, over its coordination links). Rank 0 of
the ring opens a `TCPStore` on a listener bound to its own ring address and every rank
learns its port through the ring's agreement. The keys live under a prefix derived from the
run's secret, so a stranger who reaches the store can neither read nor set the group's keys.
The connections gloo and NCCL then open between the ranks are theirs, unauthenticated as in
any torch.distributed job; nothing read from them or from the store is unpickled. Every rank builds the backend object itself
rather than calling `init_process_group`: the group belongs to this ring alone, and the
user's default group (DDP's, the `ddl` backend's) is left as it is.

Why every wait ends. A collective waits for its work in slices (`_wait`): it ends when the
work completes, when `abort` is called from another thread (a pool's cell was stopped), or
at the op timeout. Every rank had submitted the collective (the negotiation saw to that), so
a timeout here means a rank stalled or died inside it: an NCCL communicator is aborted, and
`CollectiveTimeoutError` names the ring's ranks. The group's own timeout is set later than
ours, so ours is the one the user reads. gloo's flat reduce-scatter has neither a future nor
a completion flag: a thread of its own waits for it (`_WaitedInAThread`), so that its wait
is sliced as the others are, and that thread ends at the latest with gloo's own timeout.

The timeline. Each collective through the group is one event on a lane named as Horovod's
timeline names them (`NCCL_ALLREDUCE`, `GLOO_BROADCAST`, ...), which the summaries count as
communication; packing, unpacking and the negotiation keep their own lanes.

Closing (an elastic reset re-forms the ring, `shutdown()`, a process set removed): an NCCL
group is shut down; a gloo group is kept referenced until the process exits, never
destroyed, for the reason `ddl_magic/torch/group_lifetime.py` gives (gloo's destructor can
deadlock against its own worker threads on the GIL). A launched rank ends with `os._exit`,
so a kept group costs two idle threads until then.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from ..agreement import Exchange, gather
from ..errors import CollectiveAbortedError, CollectiveTimeoutError, HorovodInternalError
from ..reduce_ops import ReduceOp
from ..settings import TORCH_PLANE_VARIABLE
from ..timeline import recorder
from ..world import World

if TYPE_CHECKING:
    from . import Bounds, Labels

TIMEOUT_MARGIN_S = 30.0
"""The group's own timeout is this much later than ours, so ours fires first and names ranks."""
POLL_S = 50e-6
"""How often an NCCL collective is checked for completion (its work has no host callback)."""

_DEVICE_TYPE = {"nccl": "cuda", "gloo": "cpu"}
_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
              "product": dist.ReduceOp.PRODUCT}
_retired: list = []
"""Closed gloo groups (and every closed group's store), referenced until the process exits."""


# ---- deciding: which group a ring gets (pure) ------------------------------------------

@dataclass(frozen=True)
class Abilities:
    """What one rank can offer a torch.distributed plane."""

    has_gpu: bool
    nccl_problem: str | None  # None: NCCL can run here

    @classmethod
    def of_this_process(cls, ranks_on_host: int) -> "Abilities":
        """This rank's GPU and NCCL, its host running `ranks_on_host` ranks of the ring."""
        has_gpu = torch.cuda.is_available()
        problem = None
        if not dist.is_nccl_available():
            problem = "torch was built without NCCL (a CPU build?)"
        elif not has_gpu:
            problem = "no GPU is visible"
        elif torch.cuda.device_count() < ranks_on_host:
            problem = (f"its host has {torch.cuda.device_count()} GPU(s) for {ranks_on_host} ranks, "
                       "and NCCL needs a GPU per rank")
        return cls(has_gpu, problem)


def wants_group(setting: str, spans_hosts: bool, size: int) -> bool:
    """Whether forming this ring must ask every rank what it can do (one round of agreement).

    Every rank answers alike: it depends on the setting and the peer table only.

    >>> wants_group("auto", spans_hosts=False, size=4)
    False
    """
    if setting in ("gloo", "nccl"):
        return True
    return setting == "auto" and size > 1 and spans_hosts


def choose_backend(setting: str, spans_hosts: bool,
                   abilities: list[Abilities | None]) -> tuple[str | None, str | None]:
    """(the backend of the ring's group or None, a one-line note for the user or None).

    `abilities` is every rank's, the same list on every rank, so every rank decides alike.

    >>> choose_backend("auto", True, [Abilities(True, None), Abilities(True, None)])
    ('nccl', None)
    >>> choose_backend("auto", True, [Abilities(True, None), Abilities(False, "no GPU is visible")])[0] is None
    True
    """
    if setting == "gloo":
        return "gloo", None
    problems = [(rank, a.nccl_problem) for rank, a in enumerate(abilities) if a.nccl_problem]
    if setting == "nccl":
        if problems:
            rank, problem = problems[0]
            raise RuntimeError(f"{TORCH_PLANE_VARIABLE}=nccl, but NCCL cannot run on rank {rank}: "
                               f"{problem}. Set {TORCH_PLANE_VARIABLE}=auto to stage CUDA tensors "
                               "through host memory where NCCL is missing.")
        return "nccl", None
    if setting != "auto" or not spans_hosts:
        return None, None
    if not problems:
        return "nccl", None
    if any(a.has_gpu for a in abilities):  # someone trains on GPUs and NCCL is not there
        rank, problem = problems[0]
        return None, (f"ddl_magic note: CUDA tensors travel through host memory, not NCCL: "
                      f"rank {rank}: {problem}")
    return None, None


# ---- forming: one group per ring -------------------------------------------------------

@dataclass
class DeviceGroup:
    """A torch.distributed process group over the ranks of one ring (numbered as the ring)."""

    backend: str  # "nccl" or "gloo"
    group: object  # the backend object: ProcessGroupNCCL or ProcessGroupGloo
    store: object  # kept while the group lives: rank 0's store serves the others
    world: World

    @property
    def device_type(self) -> str:
        return _DEVICE_TYPE[self.backend]


def form_group(world: World, exchange: Exchange, secret: bytes, backend: str,
               timeout_s: float) -> DeviceGroup:
    """Build this rank's `backend` group over `world`'s ring: every rank of the ring calls it
    at the same point, `exchange` being the ring's agreement over its coordination links."""
    timeout = datetime.timedelta(seconds=timeout_s + TIMEOUT_MARGIN_S)
    # a world of one started without a launcher has no peer table: it talks to itself
    address = world.peers[world.rank].address[0] if world.peers else "127.0.0.1"
    if world.size == 1:
        store = dist.HashStore()
    elif world.rank == 0:
        listener = socket.create_server((address, 0))
        port = listener.getsockname()[1]
        store = dist.TCPStore(address, port, world.size, True, datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=listener.detach())
        gather(port, exchange)
    else:
        port = gather(None, exchange)[0]
        store = dist.TCPStore(world.peers[0].address[0], port, world.size, False,
                              datetime.timedelta(seconds=timeout_s))
    prefix = hmac.new(secret, f"{backend}:{world.run_ranks}".encode(), hashlib.sha256).hexdigest()
    keys = dist.PrefixStore(prefix[:32] + "/", store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        options._timeout = timeout
        group = dist.ProcessGroupGloo(keys, world.rank, world.size, options)
    else:
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = ProcessGroupNCCL(keys, world.rank, world.size, options)
    return DeviceGroup(backend, group, store, world)


# ---- the plane -------------------------------------------------------------------------

class TorchDistributedPlane:
    """A ring's buffers on one device type through its torch.distributed group, in place.

    Alone (gloo, the stand-in) it carries every buffer and closes the ring's transport with
    itself; beside a host plane (`SplitByDevicePlane`) it carries the CUDA buffers.
    """

    lockstep_group = None  # negotiation runs over TCP (`op_queue_tcp.py`)

    def __init__(self, device_group: DeviceGroup, op_timeout: float, transport=None):
        self.device_group = device_group
        self.name = device_group.backend
        self.device_types = frozenset({device_group.device_type})
        self._group = device_group.group
        self._rank, self._size = device_group.world.rank, device_group.world.size
        self._op_timeout = op_timeout
        self._transport = transport  # the ring's, where this plane is the ring's only plane
        # Horovod's lane names (NCCL_ALLREDUCE, ...): the summaries count them as communication
        self._lanes = {op: f"{self.name.upper()}_{op.upper()}"
                       for op in ("allreduce", "reducescatter", "allgather", "broadcast")}
        self._aborted: str | None = None
        self._wake = threading.Event()  # set by `abort`: ends a wait between its slices

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp, labels: Labels) -> None:
        options = dist.AllreduceOptions()
        options.reduceOp = _TORCH_OPS[op.kernel_name]
        with labels.span(self._lanes["allreduce"], size=self._size):
            self._wait(self._group.allreduce([buffer], options), "allreduce")

    def reduce_scatter(self, buffer: torch.Tensor, parts: Bounds, op: ReduceOp,
                       labels: Labels) -> None:
        options = dist.ReduceScatterOptions()
        options.reduceOp = _TORCH_OPS[op.kernel_name]
        start, end = parts[self._rank]
        with labels.span(self._lanes["reducescatter"], size=self._size):
            if not _equal_and_in_order(parts, buffer.numel()):
                # Uneven parts (torch's flat reduce-scatter takes equal ones): reduce
                # everything, keep this rank's part.
                allreduce = dist.AllreduceOptions()
                allreduce.reduceOp = options.reduceOp
                self._wait(self._group.allreduce([buffer], allreduce), "reducescatter")
                return
            mine = torch.empty(end - start, dtype=buffer.dtype, device=buffer.device)
            self._wait(self._group._reduce_scatter_base(mine, buffer, options), "reducescatter")
            buffer[start:end].copy_(mine)

    def allgather(self, buffer: torch.Tensor, parts: Bounds, name: str) -> None:
        longest = max(end - start for start, end in parts)
        start, end = parts[self._rank]
        with recorder.span(self._lanes["allgather"], name, bytes=_nbytes(buffer), size=self._size):
            if _equal_and_in_order(parts, buffer.numel()):
                self._wait(self._group._allgather_base(buffer, buffer[start:end].clone()), "allgather")
                return
            # Uneven parts: gather equal slots of the longest part's length, then unpad.
            slots = torch.empty(longest * self._size, dtype=buffer.dtype, device=buffer.device)
            own = torch.zeros(longest, dtype=buffer.dtype, device=buffer.device)
            own[:end - start].copy_(buffer[start:end])
            self._wait(self._group._allgather_base(slots, own), "allgather")
            for rank, (start, end) in enumerate(parts):
                buffer[start:end].copy_(slots[rank * longest:rank * longest + end - start])

    def broadcast(self, buffer: torch.Tensor, root: int, name: str) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = root
        with recorder.span(self._lanes["broadcast"], name, bytes=_nbytes(buffer)):
            self._wait(self._group.broadcast([buffer], options), "broadcast")

    def gpu_memory(self, device: torch.device) -> None:
        return None

    def abort(self, reason: str) -> None:
        self._aborted = reason
        self._wake.set()
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        if self.name == "nccl":
            try:
                self._group.shutdown()
            except RuntimeError as exc:  # closing goes on: the ring's sockets are ours to free
                print(f"ddl_magic note: shutting down the NCCL group failed: {exc}",
                      file=sys.stderr, flush=True)
        else:
            _retired.append(self._group)
        _retired.append(self.device_group.store)
        if self._transport is not None:
            self._transport.close()

    def _wait(self, work, what: str) -> None:
        """Wait for `work` until it completes, the plane is aborted, or the op timeout."""
        deadline = time.monotonic() + self._op_timeout
        if self.name == "nccl":  # its end event is queried: GPU work has no host callback
            done: Callable[[], bool] = work.is_completed
        else:  # gloo ends its work on its own threads: be woken
            future = _future_of(work)
            if future is None:
                work = _WaitedInAThread(work, self._wake)
                done = work.is_completed
            else:
                future.add_done_callback(lambda _: self._wake.set())
                done = future.done
        while not done():
            if self._aborted is not None:
                raise CollectiveAbortedError(f"{what} over {self.name} aborted: {self._aborted}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ended = self._end_group()
                raise CollectiveTimeoutError(
                    f"{what} over {self.name} did not complete within {self._op_timeout:.0f} s "
                    f"on ranks {list(self.device_group.world.run_ranks)}: every rank had submitted "
                    f"it, so a rank stalled or died inside it{ended} "
                    "(DDL_MAGIC_TIMEOUT sets the limit)")
            if self.name == "nccl":
                time.sleep(POLL_S)
            else:
                self._wake.wait(min(remaining, 0.05))
                self._wake.clear()
        try:
            work.wait()
        except RuntimeError as exc:  # a peer's connection broke inside the collective
            raise HorovodInternalError(
                f"{what} over {self.name} failed on rank {self.device_group.world.run_ranks[self._rank]} "
                f"(ring of ranks {list(self.device_group.world.run_ranks)}): {exc}") from exc

    def _end_group(self) -> str:
        """Abort an NCCL communicator, so that nothing stays stuck inside it; what was done,
        as the end of the timeout's sentence. (A gloo group cannot be aborted: its waits end
        with its own timeout, `TIMEOUT_MARGIN_S` later.)"""
        if self.name != "nccl":
            return ""
        try:
            self._group.abort()
        except RuntimeError as exc:
            return f"; aborting its NCCL communicator failed: {exc}"
        return "; its NCCL communicator was aborted"


class SplitByDevicePlane:
    """CUDA buffers through the torch.distributed plane, every other buffer through the host
    plane (shared memory, the TCP ring, or both): one ring, two ways of moving bytes."""

    def __init__(self, host, device: TorchDistributedPlane):
        self.host, self.device = host, device
        self.name = f"{host.name}+{device.name}"
        self.lockstep_group = host.lockstep_group
        self.device_types = host.device_types | device.device_types

    def _for(self, buffer: torch.Tensor):
        return self.device if buffer.device.type in self.device.device_types else self.host

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp, labels: Labels) -> None:
        self._for(buffer).allreduce(buffer, op, labels)

    def reduce_scatter(self, buffer: torch.Tensor, parts: Bounds, op: ReduceOp,
                       labels: Labels) -> None:
        self._for(buffer).reduce_scatter(buffer, parts, op, labels)

    def allgather(self, buffer: torch.Tensor, parts: Bounds, name: str) -> None:
        self._for(buffer).allgather(buffer, parts, name)

    def broadcast(self, buffer: torch.Tensor, root: int, name: str) -> None:
        self._for(buffer).broadcast(buffer, root, name)

    def gpu_memory(self, device: torch.device):
        """None where the torch.distributed plane carries `device`: a ring that has both
        (DDL_MAGIC_TORCH_PLANE=nccl on one host) was asked for NCCL."""
        return None if device.type in self.device.device_types else self.host.gpu_memory(device)

    def abort(self, reason: str) -> None:
        self.device.abort(reason)
        self.host.abort(reason)

    def close(self) -> None:
        self.device.close()
        self.host.close()


class _WaitedInAThread:
    """A gloo work with neither a future nor a completion flag (its flat reduce-scatter),
    waited for by a thread of its own, which wakes the plane's sliced wait when it ends."""

    def __init__(self, work, wake: threading.Event):
        self._work, self._wake = work, wake
        self._ended = threading.Event()
        self._error: RuntimeError | None = None
        threading.Thread(target=self._wait_for_it, name="ddl-gloo-work", daemon=True).start()

    def _wait_for_it(self) -> None:
        try:
            self._work.wait()
        except RuntimeError as exc:  # raised again, on the plane's thread, by `wait`
            self._error = exc
        self._ended.set()
        self._wake.set()

    def is_completed(self) -> bool:
        return self._ended.is_set()

    def wait(self) -> None:
        if self._error is not None:
            raise self._error


def _future_of(work):
    """`work`'s future, or None where its kind of work has none."""
    try:
        return work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        return None


def _equal_and_in_order(parts: Bounds, numel: int) -> bool:
    """Whether `parts` cut the whole buffer into equal pieces, rank after rank."""
    length = parts[0][1] - parts[0][0]
    return all(part == (rank * length, (rank + 1) * length) for rank, part in enumerate(parts)) \
        and length * len(parts) == numel


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
