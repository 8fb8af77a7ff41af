"""The torch.distributed plane, with gloo standing in for NCCL on CPU tensors.

One launch of 3 ranks runs every Horovod op (and a process set's, and the `ddl` backend's),
and trains a little with what users train with (DistributedOptimizer, ZeRO-1, SyncBatchNorm,
DDP over `ddl`), twice: with `DDL_MAGIC_TORCH_PLANE=gloo`, every buffer through a gloo group (the code path
CUDA tensors take through NCCL), then, after an elastic-style reset (`shutdown`, `init`), on
the shared-memory plane. The results must agree: bit for bit for integers, within rounding
for floats (the two sum in different orders). A rank that stalls inside a collective ends the
run after our timeout, the ranks named (two real ranks, real gloo). The choice of backend, the
waits' deadline and abort are pure logic and small fakes, tested without processes.
"""

from __future__ import annotations

import functools
import re
import threading
from pathlib import Path

import pytest
import torch

from ddl_magic.driver.job import Job, JobOptions
from ddl_magic.launch.local import LocalLauncher
from ddl_magic.driver.run_result import RankFailedError
from ddl_magic.runtime.errors import CollectiveAbortedError, CollectiveTimeoutError, HorovodInternalError
from ddl_magic.runtime.planes.torch_distributed import (Abilities, DeviceGroup, TorchDistributedPlane,
                                                        choose_backend, wants_group)
from ddl_magic.runtime.settings import torch_plane_choice
from ddl_magic.runtime.world import single_process_world
from ddl_magic.timeline.analysis import lane_category
from ddl_magic.wire.tasks import FunctionTask
from trace_files import chrome_events

NP = 3
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.uint8)


def own(rank: int, dtype: torch.dtype, rows: int = 4, device: str = "cpu") -> torch.Tensor:
    """A rank's tensor: small values, exact in every dtype when summed or multiplied over 3."""
    return ((torch.arange(rows * 3).reshape(rows, 3) * 7 + rank * 5) % 4 + 1).to(device, dtype)


def every_op(hvd, device: str = "cpu") -> tuple[dict, str | None]:
    """Every op a user calls, on this rank, on tensors on `device`: name -> result (on the
    CPU); the plane of a process set of the first and last ranks (None where not a member)."""
    rank, results, set_transport = hvd.rank(), {}, None
    members = [0, hvd.size() - 1]
    tensor = functools.partial(own, device=device)

    for dtype in DTYPES:
        tag = str(dtype).removeprefix("torch.")
        for op_name, op in (("sum", hvd.Sum), ("min", hvd.Min), ("max", hvd.Max),
                            ("product", hvd.Product)):
            results[f"allreduce {op_name} {tag}"] = hvd.allreduce(tensor(rank, dtype), op=op)
        if dtype.is_floating_point:
            results[f"allreduce average {tag}"] = hvd.allreduce(tensor(rank, dtype))
            results[f"allreduce prescale {tag}"] = hvd.allreduce(
                tensor(rank, dtype), op=hvd.Sum, prescale_factor=0.5, postscale_factor=2.0)
        results[f"grouped {tag}"] = torch.cat([t.flatten() for t in hvd.grouped_allreduce(
            [tensor(rank, dtype, rows) for rows in (1, 2, 5)], op=hvd.Sum)])
        results[f"allgather {tag}"] = hvd.allgather(tensor(rank, dtype, rows=rank + 1))
        results[f"broadcast {tag}"] = hvd.broadcast(tensor(rank, dtype), root_rank=hvd.size() - 1)
        splits = torch.tensor([1, 2, 3][:hvd.size()], dtype=torch.int32)
        received, counts = hvd.alltoall(tensor(rank, dtype, rows=int(splits.sum())), splits=splits)
        results[f"alltoall {tag}"], results[f"alltoall counts {tag}"] = received, counts
        results[f"reducescatter {tag}"] = hvd.reducescatter(tensor(rank, dtype, rows=7), op=hvd.Sum)
        results[f"reducescatter even {tag}"] = hvd.reducescatter(tensor(rank, dtype, rows=6), op=hvd.Sum)
    in_place = tensor(rank, torch.float32)
    hvd.allreduce_(in_place, op=hvd.Sum)
    results["allreduce_ in place"] = in_place
    if hvd.size() < 2:
        return {name: t.cpu() for name, t in results.items()}, None
    process_set = hvd.add_process_set(members)
    try:
        if rank in members:
            set_transport = process_set.runtime("test").transport
            for dtype in (torch.float32, torch.int64):
                tag = str(dtype).removeprefix("torch.")
                results[f"set allreduce {tag}"] = hvd.allreduce(tensor(rank, dtype), op=hvd.Sum,
                                                               process_set=process_set)
                results[f"set allgather {tag}"] = hvd.allgather(tensor(rank, dtype, rows=rank + 1),
                                                               process_set=process_set)
                results[f"set broadcast {tag}"] = hvd.broadcast(tensor(rank, dtype), root_rank=members[-1],
                                                               process_set=process_set)
                results[f"set reducescatter {tag}"] = hvd.reducescatter(
                    tensor(rank, dtype, rows=5), op=hvd.Sum, process_set=process_set)
                results[f"set reducescatter even {tag}"] = hvd.reducescatter(
                    tensor(rank, dtype, rows=4), op=hvd.Sum, process_set=process_set)
    finally:
        hvd.remove_process_set(process_set)
    return {name: t.cpu() for name, t in results.items()}, set_transport


def what_users_train(hvd, device: str = "cpu") -> dict:
    """Three steps of a small model with SyncBatchNorm under DistributedOptimizer, and again
    with its state sharded (ZeRO-1): name -> every weight and statistic it ends with. (SGD
    with momentum: linear in the gradients, so planes that sum in other orders stay close.)"""
    results = {}
    for sharded in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), hvd.SyncBatchNorm(8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 1)).to(device)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                             named_parameters=model.named_parameters(),
                                             shard_optimizer_state=sharded)
        for step in range(3):
            optimizer.zero_grad()
            model(own(hvd.rank() + step, torch.float32, device=device)).square().mean().backward()
            optimizer.step()
        kind = "ZeRO-1" if sharded else "DistributedOptimizer"
        results.update({f"{kind} {name}": value.cpu() for name, value in model.state_dict().items()})
    return results


def through_the_ddl_backend(rank: int, size: int, device: str = "cpu") -> dict:
    """DDP's calls through `init_process_group("ddl")`, over whichever plane the ring has,
    and two steps of DDP itself."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("ddl")
    try:
        summed = own(rank, torch.float32, device=device)
        dist.all_reduce(summed)
        gathered = [torch.empty(4, 3, device=device) for _ in range(size)]
        dist.all_gather(gathered, own(rank, torch.float32, device=device))
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(3, 2).to(device))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            optimizer.zero_grad()
            model(own(rank + step, torch.float32, device=device)).square().mean().backward()
            optimizer.step()
        return {"ddl all_reduce": summed.cpu(), "ddl all_gather": torch.cat(gathered).cpu(),
                **{f"DDP {name}": value.cpu() for name, value in model.module.state_dict().items()}}
    finally:
        dist.destroy_process_group()


def on_both_planes() -> dict:
    import os

    import ddl_magic.torch as hvd
    from ddl_magic.runtime import context

    runs = {}
    for plane in ("gloo", "auto"):
        os.environ["DDL_MAGIC_TORCH_PLANE"] = plane
        hvd.init()
        transport = context.current("test").transport
        results, set_transport = every_op(hvd)
        results.update(what_users_train(hvd))
        results.update(through_the_ddl_backend(hvd.rank(), hvd.size()))
        runs[plane] = ((transport, set_transport), results)
        hvd.shutdown()  # as an elastic reset does: the next init() forms the ring anew
    return runs


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[list, Path]:
    """Every rank's runs, and the run's timeline (recorded throughout)."""
    timeline = tmp_path_factory.mktemp("timeline") / "run.timeline.json"
    options = JobOptions(timeout_s=180, return_all=True, hide_output=True, timeline_path=str(timeline))
    return Job(FunctionTask(on_both_planes, {}), NP, LocalLauncher(), options).run().results, timeline


@pytest.fixture(scope="module")
def runs(recorded):
    return recorded[0]


def test_the_gloo_run_went_through_gloo_and_the_other_through_shared_memory_process_sets_too(runs):
    assert [rank_runs["gloo"][0] for rank_runs in runs] == [("gloo", "gloo"), ("gloo", None),
                                                            ("gloo", "gloo")]
    assert [rank_runs["auto"][0] for rank_runs in runs] == [("shm", "shm"), ("shm", None),
                                                            ("shm", "shm")]


def test_every_op_agrees_with_the_shared_memory_plane(runs):
    mismatches = []
    for rank, rank_runs in enumerate(runs):
        gloo, shm = rank_runs["gloo"][1], rank_runs["auto"][1]
        assert gloo.keys() == shm.keys()
        for name, expected in shm.items():
            got = gloo[name]
            if got.dtype != expected.dtype or got.shape != expected.shape:
                mismatches.append(f"rank {rank} {name}: {got.dtype} {tuple(got.shape)} vs "
                                  f"{expected.dtype} {tuple(expected.shape)}")
            elif expected.dtype.is_floating_point:
                if not torch.allclose(got.double(), expected.double(), rtol=1e-2, atol=1e-2):
                    mismatches.append(f"rank {rank} {name}: {got.tolist()} vs {expected.tolist()}")
            elif not torch.equal(got, expected):  # integers: bit for bit
                mismatches.append(f"rank {rank} {name}: {got.tolist()} vs {expected.tolist()}")
    assert not mismatches, "\n".join(mismatches)


def test_the_results_are_right_not_only_alike(runs):
    gloo = [rank_runs["gloo"][1] for rank_runs in runs]
    expected = sum(own(rank, torch.int64) for rank in range(NP))
    assert all(torch.equal(results["allreduce sum int64"], expected) for results in gloo)
    assert "set allreduce int64" in gloo[0] and "set allreduce int64" not in gloo[1]
    assert torch.equal(gloo[2]["set allreduce int64"], own(0, torch.int64) + own(2, torch.int64))
    assert torch.equal(gloo[1]["reducescatter int32"], sum(own(r, torch.int32, rows=7) for r in range(NP))[3:5])


def test_the_timeline_shows_each_collective_through_gloo_as_communication(recorded):
    lanes = {lane for _, lane, *_ in chrome_events(recorded[1])}
    through_gloo = {"GLOO_ALLREDUCE", "GLOO_REDUCESCATTER", "GLOO_ALLGATHER", "GLOO_BROADCAST"}
    assert through_gloo <= lanes and {"negotiate", "pack", "shared_memory"} <= lanes, lanes
    assert {lane_category(lane) for lane in through_gloo} == {"communicate"}


# ---- pure logic and small fakes ---------------------------------------------------------

GPU, NO_GPU = Abilities(True, None), Abilities(False, "no GPU is visible")


def test_auto_uses_nccl_only_where_the_ring_leaves_the_host():
    assert choose_backend("auto", True, [GPU, GPU]) == ("nccl", None)
    assert choose_backend("auto", False, [GPU, GPU]) == (None, None)  # one host: CUDA IPC
    assert wants_group("auto", spans_hosts=True, size=2)
    assert not wants_group("auto", spans_hosts=False, size=2)  # no round of agreement asked
    assert not wants_group("auto", spans_hosts=True, size=1)
    assert wants_group("nccl", spans_hosts=False, size=1)
    assert not wants_group("off", spans_hosts=True, size=2)


def test_missing_nccl_falls_back_with_one_line_or_is_refused_when_forced():
    backend, note = choose_backend("auto", True, [GPU, NO_GPU])
    assert backend is None and "rank 1: no GPU is visible" in note and "\n" not in note
    assert choose_backend("auto", True, [NO_GPU, NO_GPU]) == (None, None)  # CPU only: silent
    with pytest.raises(RuntimeError, match="NCCL cannot run on rank 1.*DDL_MAGIC_TORCH_PLANE=auto"):
        choose_backend("nccl", False, [GPU, NO_GPU])
    assert choose_backend("gloo", False, [None, None]) == ("gloo", None)


def test_this_machine_offers_what_it_has(monkeypatch):
    here = Abilities.of_this_process(ranks_on_host=2)
    assert here.has_gpu == torch.cuda.is_available() and (here.nccl_problem is None) == (
        torch.distributed.is_nccl_available() and torch.cuda.device_count() >= 2)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    shared = Abilities.of_this_process(ranks_on_host=2)
    assert shared.nccl_problem == "its host has 1 GPU(s) for 2 ranks, and NCCL needs a GPU per rank"


def test_a_bad_setting_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="auto, nccl, gloo, off"):
        torch_plane_choice("mpi")


def one_rank_stalls_inside(op: str) -> None:
    """Rank 1 submits `op` (the negotiation agrees on it on both ranks), then stalls inside
    it: its plane's method waits for ever in place of moving the bytes, while rank 0's gloo
    waits for them."""
    import threading

    import ddl_magic.torch as hvd
    from ddl_magic.runtime.planes import torch_distributed

    hvd.init()
    hvd.allreduce(torch.ones(1), name="warm-up")  # the ring works before the stall
    if hvd.rank() == 1:
        method = {"allreduce": "allreduce", "reducescatter": "reduce_scatter"}[op]
        setattr(torch_distributed.TorchDistributedPlane, method,
                lambda *args: threading.Event().wait(120))
    if op == "allreduce":
        hvd.allreduce(torch.ones(4), name="gradient.0")
    else:
        hvd.reducescatter(torch.ones(4), name="gradient.0", op=hvd.Sum)


@pytest.mark.parametrize("op", ["allreduce", "reducescatter"])  # gloo's work: a future; none
def test_a_collective_a_rank_stalls_inside_fails_after_our_timeout_naming_the_ranks(op):
    options = JobOptions(timeout_s=90, hide_output=True,
                         env={"DDL_MAGIC_TIMEOUT": "3", "DDL_MAGIC_TORCH_PLANE": "gloo"})
    with pytest.raises(RankFailedError) as failure:
        Job(FunctionTask(one_rank_stalls_inside, {"op": op}), 2, LocalLauncher(), options).run()
    error = failure.value
    # ours, not gloo's own timeout 30 s later ("lost a peer": "Timed out waiting 33000ms")
    assert error.rank == 0 and error.reason == "collective timed out", error
    assert f"{op} over gloo did not complete within 3 s on ranks [0, 1]" in error.traceback
    assert error.run.ranks[1].status == "stopped"  # the stalled rank ended by the driver


class _StuckWork:
    """A collective that never completes (a rank stalled inside it)."""

    def get_future(self):
        return torch.futures.Future()

    def is_completed(self):
        return False

    def release(self):
        """Nothing waits on it (a thread would, on the one below)."""


class _StuckWorkWithoutFuture:
    """The same, as gloo's flat reduce-scatter is: no future, `wait` the only way to know."""

    def __init__(self):
        self.released = threading.Event()

    def release(self):
        self.released.set()  # ends the thread that waits for it

    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented.")

    def wait(self):
        if not self.released.wait(10):
            raise RuntimeError("Timed out waiting 10000ms for recv operation to complete")


def _plane(timeout_s: float) -> TorchDistributedPlane:
    world = single_process_world()
    return TorchDistributedPlane(DeviceGroup("gloo", object(), object(), world), timeout_s)


@pytest.mark.parametrize("work", [_StuckWork, _StuckWorkWithoutFuture])
def test_a_stalled_collective_times_out_naming_the_ranks(work):
    stuck = work()
    try:
        with pytest.raises(CollectiveTimeoutError, match=r"allreduce over gloo did not complete "
                                                         r"within 0 s on ranks \[0\]"):
            _plane(0.2)._wait(stuck, "allreduce")
    finally:
        stuck.release()


class _Communicator:
    """An NCCL group as far as a timeout touches it: `abort`, which may fail."""

    def __init__(self, failure: str | None = None):
        self.failure, self.aborted = failure, False

    def abort(self):
        if self.failure:
            raise RuntimeError(self.failure)
        self.aborted = True


@pytest.mark.parametrize("failure", [None, "NCCL error: unhandled system error"])
def test_on_nccl_a_timeout_aborts_the_communicator_and_says_how_that_went(failure):
    communicator = _Communicator(failure)
    plane = TorchDistributedPlane(DeviceGroup("nccl", communicator, object(), single_process_world()), 0.2)
    ended = f"; aborting its NCCL communicator failed: {failure}" if failure else \
        "; its NCCL communicator was aborted"
    with pytest.raises(CollectiveTimeoutError, match=r"allreduce over nccl did not complete within 0 s "
                                                     r"on ranks \[0\]: .* inside it" + re.escape(ended)):
        plane._wait(_StuckWork(), "allreduce")  # its end event is polled, as CUDA work's is
    assert communicator.aborted == (failure is None)


@pytest.mark.parametrize("work", [_StuckWork, _StuckWorkWithoutFuture])
def test_abort_ends_a_wait_at_once(work):
    plane, stuck = _plane(60), work()
    threading.Timer(0.1, plane.abort, args=("the cell was stopped",)).start()
    try:
        with pytest.raises(CollectiveAbortedError, match="the cell was stopped"):
            plane._wait(stuck, "broadcast")
    finally:
        stuck.release()


def test_a_work_without_a_future_ends_the_wait_when_it_ends_and_its_error_is_read():
    plane, stuck = _plane(60), _StuckWorkWithoutFuture()
    threading.Timer(0.1, stuck.release).start()
    plane._wait(stuck, "reducescatter")  # returns: the thread waiting for it woke the wait

    failing = _StuckWorkWithoutFuture()
    failing.wait = lambda: (_ for _ in ()).throw(RuntimeError("Connection closed by peer"))
    with pytest.raises(HorovodInternalError, match="reducescatter over gloo failed on rank 0 "
                                                   r"\(ring of ranks \[0\]\): Connection closed"):
        plane._wait(failing, "reducescatter")


def test_a_script_run_with_plain_python_honours_the_setting_too(monkeypatch):
    import ddl_magic.torch as hvd
    from ddl_magic.runtime import context

    monkeypatch.setenv("DDL_MAGIC_TORCH_PLANE", "gloo")
    hvd.shutdown()  # a world that an earlier test of this process left would be reused as it is
    hvd.init()
    try:
        assert context.current("test").transport == "gloo"
        assert hvd.allreduce(torch.arange(3.0), op=hvd.Sum).tolist() == [0.0, 1.0, 2.0]
        assert hvd.allgather(torch.ones(2, 1)).shape == (2, 1)
    finally:
        hvd.shutdown()
