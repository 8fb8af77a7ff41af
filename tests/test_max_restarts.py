"""`--max-restarts K`, torchrun's: when a rank of plain torch.distributed code fails, the whole
group is stopped and started again, at most K times, with TORCHELASTIC_RESTART_COUNT set, so
a script that resumes from its own checkpoint finishes as if nothing had failed."""

import os
import subprocess
import sys
from io import StringIO

import pytest
import torch

from ddl_magic import HorovodRunner, TorchDistributor, distributed
from ddl_magic.driver.events import FailureKind, GroupRestarted, RankFailed
from ddl_magic.driver.records import new_records
from ddl_magic.driver.run_result import RankFailedError
from ddl_magic.driver.text_display import TextDisplay
from displays import fed
from ddl_magic.frontends.pool_magic import run_line
from trace_files import chrome_events

# DDP over gloo that checkpoints every step (rank 0, atomically) and resumes from the
# checkpoint on a restart; rank 1 kills itself at step KILL_AT of the first attempt only.
# Each step's batch depends only on the step and the rank, so a resumed run trains on what a
# run that never failed trains on.
RESUMING_DDP = """
import os, signal, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

folder, kill_at, always = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "always"
checkpoint = os.path.join(folder, "checkpoint.pt")
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"attempt {restart}, max restarts {os.environ['TORCHELASTIC_MAX_RESTARTS']}")
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
first = 0
if restart > 0 and os.path.exists(checkpoint):
    saved = torch.load(checkpoint)
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    first = saved["step"] + 1
    print(f"resumed at step {first}")
for step in range(first, 12):
    if rank == 1 and step == kill_at and (always or restart == 0):
        os.kill(os.getpid(), signal.SIGKILL)
    batch = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(32, 20, generator=batch), torch.randint(0, 2, (32,), generator=batch)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                    "step": step}, checkpoint + ".tmp")
        os.replace(checkpoint + ".tmp", checkpoint)
if rank == 0:
    torch.save(model.module.state_dict(), os.path.join(folder, "final.pt"))
dist.destroy_process_group()
"""
NEVER = "-1"  # a step that never comes: the run does not fail


def ddlrun(tmp_path, folder, *options, kill_at=NEVER, always="once"):
    script = tmp_path / "resuming_ddp.py"
    script.write_text(RESUMING_DDP)
    os.makedirs(folder, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "ddl_magic.frontends.ddlrun", "-np", "2", *options, "python",
         str(script), str(folder), kill_at, always],
        capture_output=True, text=True, timeout=180, cwd=tmp_path)


def test_a_killed_rank_restarts_the_group_which_resumes_and_ends_as_if_never_failed(tmp_path):
    trace = tmp_path / "trace.json"
    restarted = ddlrun(tmp_path, tmp_path / "restarted", "--max-restarts", "2",
                       "--timeline", str(trace), kill_at="5")
    out = restarted.stdout + restarted.stderr
    assert restarted.returncode == 0, out
    assert "==== restart 1 of 2: rank 1 failed (killed by SIGKILL) ====" in out
    # on the timeline: a "restart" row per rank, from the failure to the new group
    assert {(rank, name) for rank, lane, name, *_ in chrome_events(trace) if lane == "restart"} \
        == {(0, "restart 1 of 2: rank 1 failed (killed by SIGKILL)"),
            (1, "restart 1 of 2: rank 1 failed (killed by SIGKILL)")}
    assert "[0] attempt 0, max restarts 2" in out and "[1] attempt 1, max restarts 2" in out
    assert "[1] resumed at step" in out
    assert "restart 2 of 2" not in out

    never_failed = ddlrun(tmp_path, tmp_path / "never_failed", "--max-restarts", "2")
    assert never_failed.returncode == 0, never_failed.stdout + never_failed.stderr
    assert "==== restart" not in never_failed.stderr
    got = torch.load(tmp_path / "restarted" / "final.pt")
    want = torch.load(tmp_path / "never_failed" / "final.pt")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_without_max_restarts_a_killed_rank_fails_the_run_fast_as_before(tmp_path):
    failed = ddlrun(tmp_path, tmp_path / "run", kill_at="3")
    out = failed.stdout + failed.stderr
    assert failed.returncode == 128 + 9, out  # rank 1's SIGKILL, as without the option
    assert "rank 1" in out and "killed by SIGKILL" in out
    assert "==== restart" not in out and "attempt 1" not in out


def fails_on_rank_1():
    import os

    if os.environ["RANK"] == "1":
        raise ValueError(f"bad batch (attempt {os.environ['TORCHELASTIC_RESTART_COUNT']})")
    return int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def test_a_run_that_always_fails_uses_up_its_restarts_and_says_so():
    runner = HorovodRunner(np=-2, max_restarts=1, driver_log_verbosity="log_callback_only",
                           timeout=120)
    with pytest.raises(RankFailedError) as failure:
        runner.run(fails_on_rank_1)
    assert failure.value.rank == 1 and failure.value.restarts == 1
    assert "after 1 restart of the whole group (max_restarts=1: none left)" in str(failure.value)
    assert "bad batch (attempt 1)" in str(failure.value)  # the last failure is the one raised
    run = failure.value.run
    assert run.status == "failed" and "after 1 restart" in run.error
    assert [(r.restart, r.max_restarts, r.rank, r.reason) for r in run.restarts] == [
        (1, 1, 1, "exception")]


def test_a_ddlrun_that_always_fails_says_how_many_restarts_it_made(tmp_path):
    failed = ddlrun(tmp_path, tmp_path / "run", "--max-restarts", "1", kill_at="2",
                    always="always")
    out = failed.stdout + failed.stderr
    assert failed.returncode == 128 + 9, out
    assert "restart 1 of 1: rank 1 failed (killed by SIGKILL)" in out
    assert "after 1 restart of the whole group" in failed.stderr


@pytest.mark.parametrize("options, says", [
    (["--max-restarts", "-1"], "max_restarts=-1: give how many times"),
    (["--max-restarts", "2", "--min-np", "1"], "use one or the other"),
])
def test_ddlrun_refuses_bad_max_restarts_before_starting_anything(tmp_path, options, says):
    refused = ddlrun(tmp_path, tmp_path / "run", *options)
    assert refused.returncode == 2 and says in refused.stderr, refused.stderr
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_every_front_end_refuses_bad_max_restarts():
    with pytest.raises(ValueError, match="max_restarts=-1"):
        HorovodRunner(np=-2, max_restarts=-1)
    with pytest.raises(ValueError, match="use one or the other"):
        HorovodRunner(np=-2, min_np=1, max_restarts=1)
    with pytest.raises(ValueError, match="max_restarts='3'"):
        TorchDistributor(num_processes=2, max_restarts="3")
    with pytest.raises(ValueError, match="max_restarts=True"):
        distributed(np=2, max_restarts=True)
    with pytest.raises(ValueError, match="not for a pool"):
        run_line(None, "start -np 2 --max-restarts 1")


RESTART = GroupRestarted(1, 3, 1, "node-b", "killed by SIGKILL", -9, 0.0)


def test_the_text_display_prints_each_restart_and_the_new_groups_failure_in_full():
    shown = StringIO()
    display = fed(lambda records: TextDisplay(records, shown, error_stream=shown), 2)
    display.handle(RankFailed(1, "node-b", FailureKind.DIED, "", "killed by SIGKILL", -9))
    display.handle(RESTART)
    display.handle(RankFailed(0, "node-a", FailureKind.RAISED, "Traceback: boom", "exception"))
    lines = shown.getvalue().splitlines()
    assert "==== restart 1 of 3: rank 1 failed (killed by SIGKILL) ====" in lines
    assert "==== rank 0 (node-a) failed: exception ====" in lines  # a cause, not "also stopped"


def test_the_run_view_shows_each_restart_in_all_ranks():
    from ddl_magic.ui import RunView

    view = RunView(new_records(2), "%%horovod -np 2 --max-restarts 3", "/tmp/ddl_magic/run-7")
    view.handle(RESTART)
    view.refresh()
    all_ranks = view.widget.children[3].children[0].value
    assert "restart 1 of 3: rank 1 failed (killed by SIGKILL)" in all_ranks
