"""A memory cap per rank (`--memory-per-rank`): a rank over it is killed by the OOM killer and
named out of memory with its peak, not a bare SIGKILL; nothing is left behind; a cap that cannot
be set is refused before anything starts. And the proof, short: under a cap, DDP runs out of
memory while FSDP2 trains to the loss of one process (`large_model_proof.py`)."""

import os
import signal
import subprocess
import sys

import pytest

import large_model_proof
from ddl_magic.driver.run_result import RankFailedError
from ddl_magic.rank import memory_cap
from ranks import run_on_ranks

needs_cgroups = pytest.mark.skipif(memory_cap.unavailable() is not None,
                                   reason=str(memory_cap.unavailable()))


def allocate_on_rank_1(megabytes: int) -> str:
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        torch.ones(megabytes << 18)  # floats: 4 bytes each
    hvd.allreduce(torch.ones(1))
    return open("/proc/self/cgroup").read()


@needs_cgroups
def test_a_rank_over_its_cap_is_named_out_of_memory_with_its_peak_and_leaves_nothing():
    capped = {memory_cap.VARIABLE: str(256 << 20)}
    within = run_on_ranks(allocate_on_rank_1, 2, env=capped, megabytes=64)
    assert all("ddl_magic-rank-" in cgroups for cgroups in within)  # each rank in its own
    with pytest.raises(RankFailedError) as failure:
        run_on_ranks(allocate_on_rank_1, 2, env=capped, megabytes=512)
    assert failure.value.rank == 1 and failure.value.exit_code == -9
    reason = failure.value.reason
    assert reason.startswith("out of memory: killed by the kernel's OOM killer at its memory cap "
                             "of 256.00 MiB (--memory-per-rank)"), reason
    assert "peak resident memory was" in reason and "256.00 MiB counted against the cap" in reason
    assert not [name for name in os.listdir(memory_cap.CONTROLLER) if name.startswith("ddl_magic")]


@needs_cgroups
def test_a_process_killed_while_the_oom_killer_kills_another_is_not_named_out_of_memory():
    # The machine's OOM-kill count is every process's: CI once named a rank killed by SIGKILL
    # out of memory because something else on the machine ran out of memory meanwhile.
    kills_before = memory_cap.machine_oom_kills()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    hog = subprocess.Popen([sys.executable, "-c", (
        "from ddl_magic.rank import memory_cap\n"
        "memory_cap.cap_this_process(64 << 20)\n"
        "hog = bytearray(256 << 20)\n")])
    try:
        assert hog.wait(timeout=60) == -signal.SIGKILL
        bystander.send_signal(signal.SIGKILL)
        assert bystander.wait(timeout=60) == -signal.SIGKILL
        assert memory_cap.machine_oom_kills() > kills_before
        assert memory_cap.killed_by_the_oom_killer(hog.pid) in (True, None)
        hog_reason = memory_cap.out_of_memory(hog.pid, -signal.SIGKILL, 0, kills_before)
        assert hog_reason.startswith("out of memory: killed by the kernel's OOM killer at its "
                                     "memory cap of 64.00 MiB"), hog_reason
        bystander_reason = memory_cap.out_of_memory(bystander.pid, -signal.SIGKILL, 0, kills_before)
        if memory_cap.killed_by_the_oom_killer(bystander.pid) is None:  # no kernel log here
            assert bystander_reason.startswith("killed by SIGKILL while the kernel's OOM killer")
        else:
            assert bystander_reason == ""
    finally:
        for process in (hog, bystander):
            process.kill()
            process.wait(timeout=60)
    assert not os.path.isdir(memory_cap.cgroup_of(hog.pid))


def test_a_cap_that_cannot_be_set_is_refused_before_anything_starts(monkeypatch):
    with pytest.raises(ValueError, match="2GiB, 1.5G, 512MiB"):
        memory_cap.capped_environment("two gigs", on_spark=False)
    with pytest.raises(ValueError, match="less than 64 MiB"):
        memory_cap.capped_environment("1MiB", on_spark=False)
    with pytest.raises(ValueError, match="--local to rehearse"):
        memory_cap.capped_environment("1GiB", on_spark=True)
    monkeypatch.setattr(memory_cap, "CONTROLLER", "/nonexistent/memory")
    with pytest.raises(ValueError, match="no cgroup v1 memory controller at /nonexistent/memory"):
        memory_cap.capped_environment("1GiB", on_spark=False)


@needs_cgroups
@pytest.mark.timeout(300)
def test_under_a_cap_ddp_runs_out_of_memory_and_fsdp2_trains_to_one_processs_loss():
    # (HSDP and ZeRO-3 under a cap: the full script, `python tests/large_model_proof.py`)
    size = large_model_proof.SHORT
    proof = large_model_proof.prove(size, ("ddp", "fsdp2"))
    for strategy, holds, said in large_model_proof.verdicts(proof, size):
        assert holds, f"{strategy}: {said}"
