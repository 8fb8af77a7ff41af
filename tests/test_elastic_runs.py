"""Elastic runs on local ranks: a rank that dies or raises resets the world, a replacement
forked from the rank factory takes its place, and training goes on from the last commit;
below min_np and past the reset limit the run fails, saying why. A run without min_np/max_np
still fails fast."""

import os
import time

import pytest

from ddl_magic import HorovodRunner
from ddl_magic.driver.elastic import ElasticRunError
from ddl_magic.driver.run_result import RankFailedError

STEPS = 12


def train_with_faults(log_dir, faults, steps=STEPS):
    """SGD on data that depends on the step only, so every world computes the same step; a
    commit after every step. `faults`: (kind, rank, step, once) — at that step the rank of
    that number SIGKILLs itself ("kill"), stops itself ("stop") or raises ("raise"), once (a marker file), or at that
    step and every later one; "kill_in_reset": that rank SIGKILLs itself in its first reset
    callback (the world was just re-formed; the others wait in the state's sync). Returns the
    weights, the steps done, the world's size and the plane its ring ended on."""
    import signal

    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0)

    def fault_now(step, in_reset=False):
        for number, (kind, rank, at_step, once) in enumerate(faults):
            marker = os.path.join(log_dir, f"fault-{number}")
            if (kind == "kill_in_reset") != in_reset:
                continue
            due = in_reset or (step == at_step if once else step >= at_step)
            if hvd.rank() == rank and due and not (once and os.path.exists(marker)):
                with open(marker, "w") as f:
                    f.write(repr(time.time()))
                if kind in ("kill", "stop", "kill_in_reset"):
                    os.kill(os.getpid(), signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
                    continue  # (SIGSTOP: until the driver kills it)
                raise RuntimeError(f"rank {rank} fails at step {step}")

    state.register_reset_callbacks([lambda: fault_now(state.step, in_reset=True)])

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            data = torch.Generator().manual_seed(state.step)
            x = torch.randn(8, 4, generator=data)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            optimizer.step()
            fault_now(state.step)
            state.step += 1
            state.commit()
            with open(os.path.join(log_dir, "steps"), "a") as f:
                f.write(f"{time.time()} {state.step}\n")
            time.sleep(0.05)
        return {name: value.clone() for name, value in model.state_dict().items()}, state.step

    weights, done = train(state)
    from ddl_magic.runtime import context

    return weights, done, hvd.size(), context.current("test").transport


def expected_weights(steps=STEPS):
    """What the commits imply: every step applied once, as one process would."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        optimizer.step()
    return model.state_dict()


def assert_trained_as_committed(result):
    import torch

    weights, done, *_ = result
    assert done == STEPS
    for name, value in expected_weights().items():
        assert torch.allclose(weights[name], value, atol=1e-6), name


def kill_to_next_step_s(log_dir) -> float:
    """From the fault to the next step completed by any rank."""
    with open(os.path.join(log_dir, "fault-0")) as f:
        fault_at = float(f.read())
    with open(os.path.join(log_dir, "steps")) as f:
        times = [float(line.split()[0]) for line in f]
    return min(t for t in times if t > fault_at) - fault_at


def elastic_run(np, faults, log_dir, **bounds):
    runner = HorovodRunner(np=-np, timeout=120, driver_log_verbosity="log_callback_only",
                           **bounds)
    return runner, runner.run(train_with_faults, log_dir=str(log_dir), faults=faults)


@pytest.mark.parametrize("np, killed", [(4, 2), (3, 0)], ids=["np4-rank2", "np3-rank0"])
def test_a_killed_rank_is_replaced_and_training_goes_on_from_the_last_commit(tmp_path, np,
                                                                               killed):
    runner, result = elastic_run(np, [("kill", killed, 5, True)], tmp_path, min_np=2)
    assert_trained_as_committed(result)
    assert result[2] == np  # the replacement brought the world back to np ranks
    (reset,) = runner.last_run.resets
    assert reset.left == (killed,) and "SIGKILL" in reset.reasons[0]
    assert reset.joined == (np - 1,) and reset.size == np
    # The rank died after step 5's allreduce: the survivors committed step 5 and lost it in
    # step 6's, so the run resumed from their sixth commit.
    assert reset.resumed_from_commit == 6
    assert [r.status for r in runner.last_run.ranks] == ["done"] * np
    print(f"\nnp={np}, rank {killed} SIGKILLed: {kill_to_next_step_s(tmp_path):.2f} s from the "
          "kill to the next completed step (replacement included)")


def test_a_killed_rank_is_replaced_where_the_ring_moves_its_bytes_through_torch_distributed(
        tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_MAGIC_TORCH_PLANE", "gloo")  # NCCL's code path, gloo standing in
    runner, result = elastic_run(3, [("kill", 1, 5, True)], tmp_path, min_np=2)
    assert_trained_as_committed(result)
    assert result[2:] == (3, "gloo")  # the new world's ring formed a gloo group of its own
    (reset,) = runner.last_run.resets
    assert reset.left == (1,) and reset.joined == (2,)


def test_two_ranks_lost_at_once_are_both_replaced_in_one_reset(tmp_path):
    runner, result = elastic_run(4, [("kill", 1, 4, True), ("kill", 2, 4, True)], tmp_path,
                                 min_np=2)
    assert_trained_as_committed(result)
    (reset,) = runner.last_run.resets
    assert reset.left == (1, 2) and reset.joined == (2, 3) and reset.slots == (0, 3, 1, 2)


def test_a_rank_lost_during_a_reset_starts_the_next_reset(tmp_path):
    runner, result = elastic_run(4, [("kill", 1, 4, True), ("kill_in_reset", 2, 0, True)],
                                 tmp_path, min_np=2)
    assert_trained_as_committed(result)
    first, second = runner.last_run.resets
    assert first.left == (1,) and first.joined == (3,) and first.size == 4
    # Rank 2 of the re-formed world died in its reset callback, before the state's sync.
    assert second.left == (2,) and "SIGKILL" in second.reasons[0] and second.size == 4
    assert [r.status for r in runner.last_run.ranks] == ["done"] * 4


def test_a_stopped_rank_is_killed_after_the_peer_timeout_and_replaced_with_the_dead_one(
        tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_MAGIC_PEER_TIMEOUT", "2")
    runner, result = elastic_run(3, [("stop", 1, 3, True), ("kill", 2, 3, True)], tmp_path,
                                 min_np=2)
    assert_trained_as_committed(result)
    (reset,) = runner.last_run.resets
    assert reset.left == (1, 2) and reset.joined == (1, 2)
    assert reset.reasons[0].startswith("stopped: its process has been stopped for 2 s")
    assert reset.reasons[1] == "killed by SIGKILL"


def test_a_reset_is_an_event_on_the_timeline_of_every_rank_of_the_new_world(tmp_path):
    import json

    trace = tmp_path / "trace.json"
    runner = HorovodRunner(np=-3, timeout=120, driver_log_verbosity="log_callback_only",
                           min_np=2, timeline=str(trace))
    runner.run(train_with_faults, log_dir=str(tmp_path), faults=[("kill", 1, 3, True)])
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    resets = [e for e in events if e.get("name", "").startswith("reset 1: rank 1 left")]
    assert sorted(e["pid"] for e in resets) == [0, 1, 2]
    assert all(e["ph"] == "X" and e["dur"] > 0 for e in resets)


def test_a_rank_that_raises_once_is_replaced(tmp_path):
    runner, result = elastic_run(3, [("raise", 1, 4, True)], tmp_path, min_np=2, max_np=3)
    assert_trained_as_committed(result)
    (reset,) = runner.last_run.resets
    assert reset.left == (1,) and reset.joined == (2,) and reset.resumed_from_commit == 5
    assert reset.reasons == ("RuntimeError: rank 1 fails at step 4",)
    # the new world's ranks 0 and 1 are the survivors 0 and 2, in their order
    assert reset.slots == (0, 2, 1)


def test_below_min_np_the_run_waits_a_bounded_time_then_says_how_many_it_had_and_needed(
        tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_MAGIC_ELASTIC_BLACKLIST_AFTER", "1")  # no replacement after a loss
    monkeypatch.setenv("DDL_MAGIC_ELASTIC_TIMEOUT", "2")
    started = time.monotonic()
    with pytest.raises(ElasticRunError, match=r"has 1 rank left and needs at least 2 \(min_np\)"
                                              r"; none came back within 2 s"):
        elastic_run(3, [("kill", 2, 3, True), ("kill", 1, 6, True)], tmp_path, min_np=2)
    assert time.monotonic() - started < 60
    from ddl_magic import last_run

    run = last_run()
    assert run.status == "failed" and len(run.resets) == 1 and run.resets[0].size == 2


def test_a_rank_that_keeps_failing_ends_the_run_at_the_reset_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_MAGIC_ELASTIC_RESET_LIMIT", "2")
    with pytest.raises(ElasticRunError, match="reset 2 times, its limit"):
        elastic_run(3, [("raise", 1, 2, False)], tmp_path, min_np=2)
    from ddl_magic import last_run

    resets = last_run().resets
    assert len(resets) == 2 and all(reset.left == (1,) for reset in resets)
    assert last_run().status == "failed" and "reset 2 times" in last_run().error


def test_a_run_without_min_np_still_fails_fast_on_a_killed_rank(tmp_path):
    runner = HorovodRunner(np=-3, timeout=60, driver_log_verbosity="log_callback_only")
    with pytest.raises(RankFailedError, match="rank 1 .*killed by SIGKILL"):
        runner.run(train_with_faults, log_dir=str(tmp_path), faults=[("kill", 1, 2, True)])
    from ddl_magic import last_run

    assert last_run().resets is None and last_run().status == "failed"


def test_bounds_are_checked_before_anything_starts():
    with pytest.raises(ValueError, match="min_np <= np <= max_np"):
        HorovodRunner(np=-2, min_np=3).run(train_with_faults, log_dir="", faults=[])
    with pytest.raises(ValueError, match="keeps at most its 2 ranks"):
        HorovodRunner(np=-2, max_np=4).run(train_with_faults, log_dir="", faults=[])


ELASTIC_SCRIPT = """
import os, signal, sys, torch
import ddl_magic.torch as hvd

hvd.init()
model = torch.nn.Linear(2, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())

@hvd.elastic.run
def train(state):
    while state.step < 8:
        optimizer.zero_grad()
        model(torch.ones(4, 2)).sum().backward()
        optimizer.step()
        if state.step == 3 and hvd.rank() == 1 and not os.path.exists("killed"):
            open("killed", "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        state.step += 1
        state.commit()
    print(f"rank {hvd.rank()} of {hvd.size()} done at step {state.step}")

train(hvd.elastic.TorchState(model, optimizer, step=0))
"""


def test_ddlrun_with_min_np_survives_a_killed_rank(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(ELASTIC_SCRIPT)
    finished = subprocess.run([sys.executable, "-m", "ddl_magic.frontends.ddlrun", "-np", "3",
                               "--min-np", "2", "python", str(script)], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert ("elastic reset 1: rank 1 left (killed by SIGKILL); rank 2 joined (replacement)"
            in finished.stderr)
    assert finished.stdout.count("of 3 done at step 8") == 3


def test_both_displays_show_a_reset_as_a_line():
    import io

    from ddl_magic.driver.events import WorldReset
    from ddl_magic.driver.records import new_records
    from ddl_magic.driver.text_display import TextDisplay
    from ddl_magic.ui import RunView

    reset = WorldReset(1, (2,), ("killed by SIGKILL",), (3,), 4, 6, (0, 1, 3, 2), time.time())
    line = ("reset 1: rank 2 left (killed by SIGKILL); rank 3 joined (replacement); now 4 "
            "ranks, resumed from commit 6")
    assert reset.describe() == line
    printed = io.StringIO()
    TextDisplay(new_records(4), stream=printed, error_stream=printed).handle(reset)
    assert printed.getvalue() == f"==== elastic {line} ====\n"
    view = RunView(new_records(4), "%%horovod -np 4 --min-np 2", log_dir="/tmp/ddl_magic/run-7")
    view.handle(reset)
    view.refresh()
    assert view.state()["all_ranks"]["lines"] == [f"[elastic] {line}"]


def test_a_horovod_cell_with_min_np_survives_a_killed_rank_in_a_notebook_kernel(tmp_path):
    from kernel import Kernel

    (tmp_path / "train.py").write_text(ELASTIC_SCRIPT)
    kernel = Kernel(env={"DDL_MAGIC_DISPLAY": "text"}, cwd=str(tmp_path))
    try:
        kernel.run("%load_ext ddl_magic")
        out = kernel.run("%%horovod -np 3 --min-np 2 --quiet\n"
                         "exec(open('train.py').read())", timeout=120)
        assert out.error is None, out
        assert "rank 1 left (killed by SIGKILL); rank 2 joined" in out.stdout + out.stderr
        resets = kernel.run("import ddl_magic\n[r.left for r in ddl_magic.last_run().resets]")
        assert resets.result == "[(1,)]"
    finally:
        kernel.close()
