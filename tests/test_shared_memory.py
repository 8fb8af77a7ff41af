"""The shared-memory transport between ranks on one host: failures are loud, nothing is left.

The collectives' values over shared memory are checked in `test_collectives.py` (every dtype,
odd sizes, np 1 to 4, against the TCP ring's); here, what happens around them: a rank killed
in the middle of a shared-memory allreduce, the choice of transport, and the segments' life.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import pickle
import signal
import threading
import time

import pytest
import torch

from ddl_magic.driver.job import Job, JobOptions
from ddl_magic.driver.run_result import RankFailedError
from ddl_magic.launch.local import LocalLauncher
from ddl_magic.runtime.op_queue_shm import has_core_to_spare
from ddl_magic.runtime.planes import shared_memory
from ddl_magic.runtime.errors import PeerLostError
from ddl_magic.runtime.world import Peer, World
from ddl_magic.wire.tasks import FunctionTask

from ranks import run_on_ranks

pytestmark = pytest.mark.skipif(not shared_memory.supported(), reason="needs x86-64 Linux")


def shm_entries() -> set[str]:
    """Shared memory with a name. Python's multiprocessing semaphores (`sem.mp-*`) are left
    out: ddl_magic never makes one, but another test process on a busy machine may, at any time."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.")}


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def allreduce_until_rank_1_kills_itself():
    import ddl_magic.torch as hvd

    hvd.init()
    tensor = torch.ones(1 << 20)  # 4 MiB: the reduce-scatter path, two phases per call
    for step in range(1000):
        if hvd.rank() == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)  # rank 0 is in step 5's allreduce, or about to be
        hvd.allreduce(tensor, name="grad")
    return "finished"


def test_a_rank_killed_during_a_shared_memory_allreduce_fails_the_run_and_leaves_nothing():
    before = shm_entries()
    job = Job(FunctionTask(allreduce_until_rank_1_kills_itself, {}), 2, LocalLauncher(),
              JobOptions(timeout_s=60, hide_output=True, env={"DDL_MAGIC_TRANSPORT": "shm"}))
    with pytest.raises(RankFailedError) as failure:
        job.run()
    assert failure.value.rank == 1 and "SIGKILL" in str(failure.value)
    record = failure.value.run
    pids = [rank.pid for rank in record.ranks]
    assert all(pids) and not [pid for pid in pids if process_exists(pid)]
    assert shm_entries() == before


def test_transport_choice_is_honoured_and_a_wrong_one_is_refused_before_launch():
    def transport():
        import ddl_magic.torch as hvd
        from ddl_magic.runtime import context

        hvd.init()
        return context.current("transport").transport

    assert run_on_ranks(transport, 2) == ["shm", "shm"]  # auto, all on one host
    assert run_on_ranks(transport, 2, env={"DDL_MAGIC_TRANSPORT": "tcp"}) == ["tcp", "tcp"]
    with pytest.raises(ValueError, match="DDL_MAGIC_TRANSPORT='infiniband' is not one of auto, tcp, shm"):
        run_on_ranks(transport, 2, env={"DDL_MAGIC_TRANSPORT": "infiniband"})


# ---- the runtime on its own: no driver to stop anyone --------------------------------------

def _wait_to_be_killed(offers, ready) -> None:
    own = shared_memory.Segment.create()
    offers.put((os.getpid(), own.fd))
    ready.wait()  # killed here, by the test


def test_a_neighbour_that_dies_becomes_peer_lost_within_a_sleep_slice_not_the_timeout():
    context = multiprocessing.get_context("fork")
    offers, ready = context.Queue(), context.Event()
    neighbour = context.Process(target=_wait_to_be_killed, args=(offers, ready), daemon=True)
    neighbour.start()
    try:
        pid, fd = offers.get(timeout=30)
        own = shared_memory.Segment.create()
        peers = (Peer(0, "host", ("127.0.0.1", 1)), Peer(1, "host", ("127.0.0.1", 2)))
        world = World(rank=0, size=2, local_rank=0, local_size=2, cross_rank=0, cross_size=1,
                      peers=peers, run_ranks=(0, 1))
        other = shared_memory.Neighbour(1, shared_memory.Segment.open(pid, fd), os.pidfd_open(pid))
        group = shared_memory.HostGroup(world, [0, 1], own, {1: other}, op_timeout=600)
        outcome: list[BaseException | None] = []

        def reduce_alone():
            try:
                group.allreduce(torch.ones(1000), "sum")
                outcome.append(None)
            except BaseException as exc:  # recorded for the assertion below
                outcome.append(exc)

        waiter = threading.Thread(target=reduce_alone, daemon=True)
        waiter.start()
        os.kill(pid, signal.SIGKILL)
        waiter.join(timeout=30)  # far below op_timeout: only the pidfd can end the wait this soon
        assert not waiter.is_alive(), "the wait did not notice the neighbour's death"
        assert isinstance(outcome[0], PeerLostError)
        assert "rank 1 on host" in str(outcome[0]) and "process ended" in str(outcome[0])
        group.close()
    finally:
        neighbour.kill()
        neighbour.join(timeout=10)


def wait_for_a_partner_that_leaves():
    import ddl_magic.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(3), name="together")
    if hvd.rank() == 1:
        hvd.shutdown()  # leaves without submitting "alone"
        return None
    try:
        hvd.allreduce(torch.ones(3), name="alone")
    except hvd.HorovodInternalError as exc:
        return str(exc)
    return "no error"


def test_a_rank_waiting_for_one_that_shut_down_is_told_so_not_left_to_time_out():
    # With a timeout longer than the test's, only rank 1's last cycle can end rank 0's wait.
    message = run_on_ranks(wait_for_a_partner_that_leaves, 2, timeout_s=60,
                           env={"DDL_MAGIC_TIMEOUT": "600"})[0]
    assert "rank 1 has shut down" in message


# ---- two ranks' groups in one process: the round protocol itself ----------------------------

def group_pair() -> tuple[shared_memory.HostGroup, shared_memory.HostGroup]:
    """Two local ranks' groups in this process, each mapping the other's segment."""
    peers = (Peer(0, "host", ("127.0.0.1", 1)), Peer(1, "host", ("127.0.0.1", 2)))
    segments = [shared_memory.Segment.create(), shared_memory.Segment.create()]
    groups = []
    for rank in (0, 1):
        world = World(rank=rank, size=2, local_rank=rank, local_size=2, cross_rank=0,
                      cross_size=1, peers=peers, run_ranks=(0, 1))
        other = segments[1 - rank]
        neighbour = shared_memory.Neighbour(1 - rank, shared_memory.Segment.open(os.getpid(), other.fd),
                                            os.pidfd_open(os.getpid()))
        groups.append(shared_memory.HostGroup(world, [0, 1], segments[rank], {1 - rank: neighbour},
                                              op_timeout=60))
    return groups[0], groups[1]


def on_both(groups, work):
    """`work(group)` on each group at once, one thread each; the two results."""
    results: list = [None, None]

    def run(index):
        results[index] = work(groups[index])

    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a round never completed"
    return results


def test_messages_longer_than_a_buffer_are_exchanged_in_several_rounds():
    groups = group_pair()
    long_message = os.urandom(shared_memory.BUFFER_BYTES * 2 + 12345)  # three rounds
    messages = [long_message, b"short"]
    results = on_both(groups, lambda group: group.exchange(messages[group.index]))
    assert results == [messages, messages]
    def allreduce(group):  # right after: the rounds are still in step
        tensor = torch.full((10,), group.index + 1.0)
        group.allreduce(tensor, "sum")
        return tensor.tolist()

    assert on_both(groups, allreduce) == [[3.0] * 10, [3.0] * 10]
    for group in groups:
        group.close()



def _rung_within(group: shared_memory.HostGroup, seen: int, seconds: float) -> bool:
    """Does `group`'s doorbell move past `seen` within `seconds`?"""
    deadline = time.monotonic() + seconds
    while group.own.doorbell == seen and time.monotonic() < deadline:
        group.sleep_on_doorbell(seen, deadline - time.monotonic())
    return group.own.doorbell != seen


@pytest.mark.parametrize("waits_for_a_round", [True, False])
def test_a_round_rings_a_neighbour_that_waits_for_one_at_once_and_a_busy_one_after_a_slice(
        monkeypatch, waits_for_a_round):
    # A neighbour with collectives outstanding sleeps until rung; a busy one (nothing
    # outstanding) comes by itself when its user next waits, and a ring would only make its
    # background thread announce that it has nothing.
    monkeypatch.setattr(shared_memory, "SLEEP_SLICE_S", 30.0)  # no slice ends in this test
    starter, late = group_pair()
    seen = late.own.doorbell
    results: list = []
    asleep = (late.index,) if waits_for_a_round else ()
    thread = threading.Thread(target=lambda: results.append(starter.exchange(b"start", None, asleep)),
                              daemon=True)
    thread.start()
    shared_memory.futex.wait(starter.own.progress_address, 0, 10.0)  # it has published
    assert starter.own.progress == 1
    assert _rung_within(late, seen, 10.0 if waits_for_a_round else 0.3) is waits_for_a_round
    assert late.exchange(b"late") == [b"start", b"late"]
    thread.join(timeout=10)
    assert results == [[b"start", b"late"]]
    for group in (starter, late):
        group.close()


# ---- GPU buffers: the mapping and the rounds over them, with host memory standing in ---------

class HostMemoryStandingInForGpu:
    """Plays `CudaIpcMemory`'s part with host memory, so that what the host group does with
    GPU buffers (agree on mapping them, run its rounds through them, fence every phase) runs
    here: 'exported' as a memfd, 'opened' through /proc, every fence counted."""

    refusing = threading.local()  # .now: the calling thread's export fails
    round_bytes = shared_memory.BUFFER_BYTES  # as the GPU's buffers take whole rounds

    def __init__(self, device, regions, own_fd, opened):
        self.device, self.regions, self.own_fd, self.fences = device, regions, own_fd, 0

    @classmethod
    def export(cls, device):
        if getattr(cls.refusing, "now", False):
            raise RuntimeError("cudaMalloc failed: out of memory (CUDA error 2)")
        fd = os.memfd_create("stand-in", os.MFD_CLOEXEC)
        os.ftruncate(fd, 2 * shared_memory.BUFFER_BYTES)
        return fd, pickle.dumps((os.getpid(), fd))

    @classmethod
    def open(cls, device, own_index, own_fd, handles):
        regions = []
        for handle in handles:
            pid, fd = pickle.loads(handle)
            with open(f"/proc/{pid}/fd/{fd}", "r+b") as file:
                regions.append(torch.frombuffer(mmap.mmap(file.fileno(), 2 * shared_memory.BUFFER_BYTES),
                                                dtype=torch.uint8))
        return cls(device, regions, own_fd, [])

    def view(self, index, buffer, dtype, numel, offset=0):
        start = buffer * shared_memory.BUFFER_BYTES + offset
        return self.regions[index][start:start + numel * dtype.itemsize].view(dtype)

    def fence(self):
        self.fences += 1

    def close(self):
        os.close(self.own_fd)


@pytest.fixture
def stand_in_for_gpu(monkeypatch):
    monkeypatch.setattr(shared_memory, "CudaIpcMemory", HostMemoryStandingInForGpu)
    return HostMemoryStandingInForGpu


def test_gpu_buffers_are_mapped_once_and_every_collective_runs_through_them(stand_in_for_gpu):
    groups = group_pair()
    device = torch.device("cpu")  # the stand-in's "GPU": tensors here use its buffers

    def collectives(group):
        memory = group.gpu_memory(device)
        assert group.gpu_memory(torch.device("cpu")) is memory  # mapped once
        me = group.index
        small, large = torch.full((1001,), me + 1.0), torch.arange(300_001.0) * (me + 1)
        group.allreduce(small, "sum")  # one phase
        group.allreduce(large, "max")  # two phases
        parts = [(0, 400), (400, 1001)]
        scattered = torch.full((1001,), me + 1.0)
        group.reduce_scatter(scattered, parts, "sum")
        blocks = [torch.full((3 + index,), -1.0) for index in range(2)]
        blocks[me].fill_(me)
        group.allgather(blocks)
        sent = torch.full((5,), 7.0) if me == 1 else torch.zeros(5)
        group.broadcast(sent, root_index=1)
        # the data went through the stand-in's buffers, never the segments' (whose first
        # bytes carried the mapping's messages: the large allreduce would have passed here)
        untouched = not any(buffer[1 << 16:1 << 20].any() for buffer in group.own.buffers)
        return (memory, small.unique().tolist(), torch.equal(large, torch.arange(300_001.0) * 2),
                scattered[slice(*parts[me])].unique().tolist(), [b.tolist() for b in blocks],
                sent.tolist(), untouched)

    results = on_both(groups, collectives)
    for me, (memory, small, large, scattered, blocks, sent, untouched) in enumerate(results):
        assert isinstance(memory, HostMemoryStandingInForGpu)
        assert small == [3.0] and large and scattered == [3.0] and untouched
        assert blocks == [[0.0] * 3, [1.0] * 4] and sent == [7.0] * 5
        assert memory.fences == 1 + 2 + 1 + 1 + 1  # every phase fenced before it was published
    for group in groups:
        group.close()


def test_gpu_buffers_that_one_rank_cannot_map_leave_every_rank_on_host_memory(stand_in_for_gpu, capfd):
    groups = group_pair()

    def map_then_reduce(group):
        stand_in_for_gpu.refusing.now = group.index == 1  # this thread plays rank 1: it fails
        memory = group.gpu_memory(torch.device("cpu"))
        tensor = torch.full((10,), group.index + 1.0)
        group.allreduce(tensor, "sum")
        return memory, tensor.tolist()

    results = on_both(groups, map_then_reduce)
    assert [memory for memory, _ in results] == [None, None]
    assert [values for _, values in results] == [[3.0] * 10] * 2
    assert "staged through host memory" in capfd.readouterr().err
    for group in groups:
        group.close()


def test_a_rank_overlaps_collectives_with_its_computation_only_on_a_core_to_spare():
    assert has_core_to_spare(ranks_on_host=1, cores=2, compute_threads=1)
    assert has_core_to_spare(ranks_on_host=2, cores=4, compute_threads=1)
    assert not has_core_to_spare(ranks_on_host=2, cores=3, compute_threads=1)
    assert not has_core_to_spare(ranks_on_host=2, cores=2, compute_threads=1)  # this CI machine
    assert not has_core_to_spare(ranks_on_host=4, cores=16, compute_threads=4)
    assert has_core_to_spare(ranks_on_host=4, cores=20, compute_threads=4)
