"""MLflow tracking (ddl_magic/driver/tracking.py), against real MLflow: its embedded local store
(sqlite, MLflow's default) and a real `mlflow server` on loopback. Every run is read back
through `MlflowClient`, as a user would read it.
"""

import _thread
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient

from ddl_magic import HorovodRunner, RankFailedError
from ddl_magic.driver.tracking import AUTOMATIC_VARIABLE, TrackingWarning

SERVER_START_TIMEOUT_S = 90.0
READY_TIMEOUT_S = 60.0


# ---- what the ranks run ---------------------------------------------------------------------

def log_from_every_rank(answer):
    import mlflow

    import ddl_magic.torch as hvd

    hvd.init()
    print(f"rank {hvd.rank()} says hello", flush=True)
    if hvd.rank() == 0:
        mlflow.log_metric("answer", answer)
    else:
        mlflow.log_metric(f"loss/rank{hvd.rank()}", 0.5)
    return mlflow.active_run().info.run_id


def allreduce_a_few_times():
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    for step in range(5):
        hvd.allreduce(torch.ones(1000), name=f"step{step}")


def rank_1_raises():
    import torch

    import ddl_magic.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank 1 broke on purpose")
    hvd.allreduce(torch.zeros(1), name="never completes")


def wait_until_stopped(ready_dir):
    import time

    import ddl_magic.torch as hvd

    hvd.init()
    open(os.path.join(ready_dir, f"rank-{hvd.rank()}"), "w").close()
    while True:
        time.sleep(0.05)


def return_seven():
    return 7


# ---- the stores and servers -------------------------------------------------------------------

@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    """One embedded store for the module: creating its sqlite database takes seconds."""
    return tmp_path_factory.mktemp("mlflow-store")


@pytest.fixture
def local_store(store_dir, monkeypatch):
    """MLflow's embedded default: no tracking URI set, `mlflow.db` in the working folder."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv(AUTOMATIC_VARIABLE, raising=False)
    monkeypatch.chdir(store_dir)
    mlflow.set_tracking_uri(None)
    assert mlflow.get_tracking_uri() == f"sqlite:///{store_dir}/mlflow.db"
    yield MlflowClient()
    while mlflow.active_run() is not None:
        mlflow.end_run()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 (sqlite backend, artifacts proxied through it),
    killed with its workers when the module's tests are done."""
    folder = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = open(folder / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{folder}/server.db",
         "--artifacts-destination", str(folder / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        # No background job runner: tracking needs none, and its store (a folder the server
        # makes in /dev/shm) would outlive a server killed outright.
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not _answers(f"{uri}/health"):
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start: {(folder / 'server.log').read_text()}")
        yield uri
    finally:
        # Killed outright, with the uvicorn workers it started: it holds nothing the tests
        # still need, and its graceful shutdown can take longer than a test should wait.
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
        log.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture
def server_store(mlflow_server, monkeypatch):
    monkeypatch.delenv(AUTOMATIC_VARIABLE, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    mlflow.set_tracking_uri(None)
    return MlflowClient(mlflow_server)


class RefusingServer(http.server.BaseHTTPRequestHandler):
    """A tracking server that answers 403 Forbidden to every request; or, where
    `creates_runs`, to every request but the one that creates a run."""

    creates_runs = False
    STUB_RUN = json.dumps({"run": {"info": {
        "run_id": "stubrun", "run_uuid": "stubrun", "experiment_id": "0", "user_id": "test",
        "status": "RUNNING", "start_time": 1, "lifecycle_stage": "active",
        "artifact_uri": "mlflow-artifacts:/0/stubrun/artifacts"}, "data": {}}}).encode()

    def _answer(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        created = self.creates_runs and self.path.endswith("/mlflow/runs/create")
        body = self.STUB_RUN if created else (
            b'{"error_code": "PERMISSION_DENIED", "message": "no entry"}')
        self.send_response(200 if created else 403)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _answer

    def log_message(self, *args):
        pass


@pytest.fixture(params=[False, True], ids=["refuses everything", "refuses all but runs"])
def refusing_server(request, monkeypatch):
    handler = type("Handler", (RefusingServer,), {"creates_runs": request.param})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    uri = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv(AUTOMATIC_VARIABLE, raising=False)
    mlflow.set_tracking_uri(None)
    server.creates_runs = request.param
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def the_run(client, experiment_name):
    """The one MLflow run of an experiment."""
    experiment = client.get_experiment_by_name(experiment_name)
    assert experiment is not None, f"no experiment {experiment_name!r}"
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [run.info.run_id for run in runs]
    return runs[0]


def artifact_paths(client, run_id, folder=None) -> list[str]:
    return sorted(item.path for item in client.list_artifacts(run_id, folder))


# ---- a run that is asked to be tracked ---------------------------------------------------------

def test_a_tracked_run_logs_its_parameters_status_and_logs_and_every_rank_logs_into_it(
        local_store):
    runner = HorovodRunner(np=-2, mlflow="success", env={"SECRET_TOKEN": "hunter2"})
    rank_run_id = runner.run(log_from_every_rank, answer=42.0)

    run = the_run(local_store, "success")
    assert run.info.run_id == rank_run_id == runner.last_run.mlflow.run_id
    assert run.info.status == "FINISHED"
    assert run.data.metrics == {"answer": 42.0, "loss/rank1": 0.5}
    params = run.data.params
    assert params["ddl_magic.np"] == "2" and params["ddl_magic.where"] == "local processes"
    assert params["ddl_magic.env"] == "SECRET_TOKEN"  # the name, never the value
    assert params["ddl_magic.hosts"] == socket.gethostname()
    assert run.data.tags["ddl_magic.run_id"] == runner.last_run.run_id
    assert artifact_paths(local_store, run.info.run_id, "logs") == ["logs/rank-0.log",
                                                                    "logs/rank-1.log"]
    log = local_store.download_artifacts(run.info.run_id, "logs/rank-1.log")
    assert "rank 1 says hello" in open(log).read()


def test_a_recorded_timeline_is_logged_with_each_ranks_shares_of_time(local_store, tmp_path):
    timeline = tmp_path / "run.timeline.json"
    HorovodRunner(np=-2, mlflow="timeline", timeline=str(timeline)).run(allreduce_a_few_times)

    run = the_run(local_store, "timeline")
    assert artifact_paths(local_store, run.info.run_id, "timeline") == [
        "timeline/run.timeline.arrow", "timeline/run.timeline.json"]
    metrics = run.data.metrics
    for rank in (0, 1):
        shares = [metrics[f"timeline.rank{rank}.{kind}_share"]
                  for kind in ("wait", "communicate")]
        assert all(0.0 <= share <= 1.0 for share in shares), metrics
        assert metrics[f"timeline.rank{rank}.wall_ms"] > 0


def test_a_failed_run_is_failed_with_the_failing_ranks_traceback(local_store):
    with pytest.raises(RankFailedError):
        HorovodRunner(np=-2, mlflow="failure").run(rank_1_raises)

    run = the_run(local_store, "failure")
    assert run.info.status == "FAILED"
    assert run.data.tags["ddl_magic.failed_rank"] == "1"
    assert run.data.tags["ddl_magic.error"] == "ValueError: rank 1 broke on purpose"
    failure = open(local_store.download_artifacts(run.info.run_id, "failure.txt")).read()
    assert "Traceback" in failure and "ValueError: rank 1 broke on purpose" in failure


def test_an_interrupted_run_is_killed(local_store, tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()

    def interrupt_once_both_ranks_wait():
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(os.listdir(ready)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        _thread.interrupt_main()  # what the notebook's stop button does to the driver

    interrupter = threading.Thread(target=interrupt_once_both_ranks_wait, daemon=True)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt):
        HorovodRunner(np=-2, mlflow="interrupted", timeout=READY_TIMEOUT_S * 2).run(
            wait_until_stopped, ready_dir=str(ready))
    interrupter.join(timeout=10)

    assert len(os.listdir(ready)) == 2  # interrupted while both ranks ran, not before
    run = the_run(local_store, "interrupted")
    assert run.info.status == "KILLED"
    assert "ddl_magic.error" not in run.data.tags


# ---- tracked because the notebook has an active run ------------------------------------------

def test_a_run_inside_an_active_mlflow_run_is_tracked_as_its_child(local_store):
    with mlflow.start_run(experiment_id=local_store.create_experiment("automatic")) as parent:
        first = HorovodRunner(np=-2)
        first.run(log_from_every_rank, answer=1.0)
        second = HorovodRunner(np=-2)
        second.run(log_from_every_rank, answer=2.0)

    children = local_store.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
        order_by=["attributes.start_time ASC"])
    assert [child.info.run_id for child in children] == [first.last_run.mlflow.run_id,
                                                         second.last_run.mlflow.run_id]
    assert [child.data.metrics["answer"] for child in children] == [1.0, 2.0]
    assert all(child.info.status == "FINISHED" for child in children)
    assert local_store.get_run(parent.info.run_id).data.metrics == {}


def test_the_automatic_part_turns_off(local_store, monkeypatch):
    monkeypatch.setenv(AUTOMATIC_VARIABLE, "off")
    with mlflow.start_run(experiment_id=local_store.create_experiment("turned-off")) as parent:
        runner = HorovodRunner(np=-2)
        runner.run(return_seven)
        explicit = HorovodRunner(np=-2, mlflow=True)  # asking still tracks
        explicit.run(return_seven)
    assert runner.last_run.mlflow is None
    runs = local_store.search_runs([parent.info.experiment_id])
    assert sorted(run.info.run_id for run in runs) == sorted(
        [parent.info.run_id, explicit.last_run.mlflow.run_id])


def test_nothing_is_tracked_without_an_active_run_or_a_request(local_store):
    runner = HorovodRunner(np=-2)
    assert runner.run(return_seven) == 7
    assert runner.last_run.mlflow is None


# ---- mistakes, said before anything starts ----------------------------------------------------

def test_asking_without_mlflow_installed_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r'pip install "ddl_magic\[mlflow\]"'):
        HorovodRunner(np=-2, mlflow=True).run(return_seven)


def test_a_setting_that_means_nothing_is_refused():
    with pytest.raises(TypeError, match="give True .*, an experiment name"):
        HorovodRunner(np=-2, mlflow=3)


def test_a_bad_automatic_setting_is_refused_before_launch(local_store, monkeypatch):
    monkeypatch.setenv(AUTOMATIC_VARIABLE, "sometimes")
    with pytest.raises(ValueError, match="DDL_MAGIC_MLFLOW='sometimes': set it to 'off'"):
        HorovodRunner(np=-2).run(return_seven)


# ---- over HTTP: a real server, one that is down, one that refuses ------------------------------

def test_a_run_tracked_on_a_tracking_server(server_store):
    runner = HorovodRunner(np=-2, mlflow="over-http")
    runner.run(log_from_every_rank, answer=3.0)

    run = the_run(server_store, "over-http")
    assert runner.last_run.mlflow.tracking_uri == server_store.tracking_uri
    assert run.info.status == "FINISHED"
    assert run.data.metrics["answer"] == 3.0
    assert artifact_paths(server_store, run.info.run_id, "logs") == ["logs/rank-0.log",
                                                                     "logs/rank-1.log"]


def test_a_server_that_is_down_does_not_fail_the_training(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    mlflow.set_tracking_uri(None)
    runner = HorovodRunner(np=-2, mlflow=True)
    started = time.monotonic()
    with pytest.warns(TrackingWarning, match="could not start a run .* goes on untracked"):
        assert runner.run(return_seven) == 7
    assert time.monotonic() - started < 30  # not MLflow's minutes of retries
    assert runner.last_run.mlflow is None


def test_a_server_that_refuses_does_not_fail_the_training(refusing_server):
    runner = HorovodRunner(np=-2, mlflow=True)
    with pytest.warns(TrackingWarning) as warned:
        assert runner.run(return_seven) == 7
    said = [str(warning.message) for warning in warned if warning.category is TrackingWarning]
    if not refusing_server.creates_runs:
        assert len(said) == 1 and "could not start a run" in said[0] and "no entry" in said[0]
        assert runner.last_run.mlflow is None
        return
    # The run was created, and the ranks told of it; nothing else was taken, and each
    # warning says what is missing.
    assert runner.last_run.mlflow.run_id == "stubrun"
    assert len(said) == 2
    assert "did not take its parameters (RestException: PERMISSION_DENIED" in said[0]
    for lost in ("its hosts", "the ranks' logs", "its status FINISHED"):
        assert lost in said[1]


# ---- the magic in a real kernel, cell after cell ------------------------------------------------

LOG_CELL = ("%%horovod -np 2 --quiet{option}\n"
            "import mlflow\nimport ddl_magic.torch as hvd\nhvd.init()\n"
            "if hvd.rank() == 0:\n    mlflow.log_metric('cell', {cell})\n")


def test_repeated_cells_in_a_notebook_each_get_a_run(store_dir):
    from kernel import Kernel

    kernel = Kernel(env={"DDL_MAGIC_DISPLAY": "text", "MLFLOW_TRACKING_URI": "",
                         AUTOMATIC_VARIABLE: "auto"}, cwd=str(store_dir))
    try:
        def run(code):
            out = kernel.run(code, timeout=120)
            assert out.error is None, out.error
            return out

        run("%load_ext ddl_magic\nimport mlflow, ddl_magic")
        for cell in (1, 2):
            run(LOG_CELL.format(option=" --mlflow notebook", cell=cell))
        run(LOG_CELL.format(option="", cell=3))  # no active run, not asked: not tracked
        run("parent = mlflow.start_run(experiment_id=mlflow.MlflowClient()"
            ".create_experiment('notebook-parent'))")
        run(LOG_CELL.format(option="", cell=4))
        child = run("print(ddl_magic.last_run().mlflow.run_id)").stdout.strip()
        run("mlflow.end_run()")
    finally:
        kernel.close()

    client = MlflowClient(f"sqlite:///{store_dir}/mlflow.db")
    asked = client.search_runs([client.get_experiment_by_name("notebook").experiment_id],
                               order_by=["attributes.start_time ASC"])
    assert [run.data.metrics for run in asked] == [{"cell": 1.0}, {"cell": 2.0}]
    assert all(run.data.params["ddl_magic.np"] == "2" for run in asked)
    # Cell 3's own mlflow.log_metric made a run of MLflow's, in the default experiment;
    # ddl_magic made none for it.
    [untracked] = client.search_runs(["0"], "metrics.cell = 3")
    assert "ddl_magic.run_id" not in untracked.data.tags
    parent_experiment = client.get_experiment_by_name("notebook-parent").experiment_id
    children = client.search_runs([parent_experiment], "tags.mlflow.parentRunId != ''")
    assert [(run.info.run_id, run.data.metrics) for run in children] == [(child, {"cell": 4.0})]


# ---- TorchEstimator: history and model ---------------------------------------------------------

@pytest.mark.parametrize("spark", ["classic"], indirect=True)
def test_a_tracked_fit_logs_its_history_per_epoch_and_a_model_that_loads_back(spark,
                                                                              local_store):
    import torch
    from pyspark.sql import functions

    from ddl_magic.spark.estimator import TorchEstimator

    rows = spark.range(0, 60, 1, 2).select((functions.col("id") % 7).cast("float").alias("x"),
                                           (functions.col("id") % 2).alias("label"))
    torch.manual_seed(0)
    net = torch.nn.Linear(1, 2)
    estimator = TorchEstimator(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                               loss=torch.nn.CrossEntropyLoss(), feature_cols=["x"],
                               label_cols=["label"], batch_size=10, epochs=3, num_proc=2,
                               metrics=["accuracy"], verbose=0, mlflow="fit")
    fitted = estimator.fit(rows)

    run = the_run(local_store, "fit")
    assert run.info.status == "FINISHED"
    assert run.data.params["ddl_magic.epochs"] == "3"
    assert run.data.params["ddl_magic.model"] == "Linear"
    for name in ("loss", "accuracy"):
        logged = local_store.get_metric_history(run.info.run_id, name)
        assert [(m.step, m.value) for m in sorted(logged, key=lambda m: m.step)] == [
            (row["epoch"], pytest.approx(row[name])) for row in fitted.history]
    loaded = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    inputs = torch.arange(7.0).reshape(-1, 1)
    assert torch.equal(loaded(inputs), fitted.getModel()(inputs))
