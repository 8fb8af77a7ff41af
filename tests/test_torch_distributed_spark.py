"""Plain torch.distributed code (DDP) in Spark barrier tasks, on a real local SparkSession:
HorovodRunner and TorchDistributor(local_mode=False), over gloo and over the ddl backend.

A classic session only: the launcher itself is tested on Spark Connect too
(test_spark_launcher.py), and what runs inside its tasks is the same for both.
"""

import sys

import pytest

import training
from ddl_magic import HorovodRunner, RankFailedError, TorchDistributor
from spark_sessions import sent_by_value

RUN_TIMEOUT_S = 120
pytestmark = pytest.mark.parametrize("spark", ["classic"], indirect=True, scope="module")


@pytest.fixture(scope="module", autouse=True)
def functions_travel_by_value():
    with sent_by_value(training, sys.modules[__name__]):
        yield


@pytest.fixture(scope="module")
def reference_weights():
    return training.train_alone()


@pytest.mark.parametrize("np, backend", [(2, "gloo"), (2, "ddl"), (4, "ddl")])
def test_ddp_in_barrier_tasks_trains_to_the_weights_of_one_process(spark, np, backend,
                                                                   reference_weights):
    runner = HorovodRunner(np=np, driver_log_verbosity="log_callback_only", timeout=RUN_TIMEOUT_S)
    weights, checksums = runner.run(training.train, backend=backend)
    training.assert_same_weights(weights, reference_weights)
    assert len(set(checksums)) == 1, f"ranks ended with different weights: {checksums}"
    assert runner.last_run.where.startswith("Spark")


def test_barrier_tasks_see_torchruns_environment(spark):
    def environment_and_rank():
        return training.launcher_environment()

    distributor = TorchDistributor(num_processes=3, local_mode=False, use_gpu=False)
    seen = distributor.run(environment_and_rank)  # rank 0's
    assert (seen["RANK"], seen["WORLD_SIZE"], seen["LOCAL_WORLD_SIZE"]) == ("0", "3", "3")
    assert seen["GROUP_RANK"] == "0" and seen["GROUP_WORLD_SIZE"] == "1"  # one host: local[4]
    assert int(seen["MASTER_PORT"]) > 0 and seen["MASTER_ADDR"]


def test_a_rank_killed_mid_ddp_step_in_a_barrier_task_fails_the_run_naming_it(spark):
    runner = HorovodRunner(np=2, driver_log_verbosity="log_callback_only", timeout=RUN_TIMEOUT_S)
    with pytest.raises(RankFailedError) as failure:
        runner.run(training.train, backend="ddl", steps=10_000, kill_rank=1)
    assert failure.value.rank == 1


SCRIPT = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
print(f"rank {dist.get_rank()} args {sys.argv[1:]} total {total.item()}")
"""


def test_torch_distributor_runs_a_script_in_barrier_tasks(spark, tmp_path, capfd):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    assert distributor.run(str(path), "--lr", 0.5) is None
    out = capfd.readouterr().out
    assert "[1] rank 1 args ['--lr', '0.5'] total 1.0" in out
    assert distributor.last_run.where.startswith("Spark")
