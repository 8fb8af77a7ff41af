"""MLflow tracking of a run: decided before launch, a run started for it, logged at the end.

    %%horovod -np 2 --mlflow my-experiment
    import mlflow
    import ddl_magic.torch as hvd
    hvd.init()
    ...
    if hvd.rank() == 0:
        mlflow.log_metric("loss", loss.item(), step=epoch)   # lands in the run of this cell

A run is tracked when a front-end asks (`mlflow=True` or an experiment name), and on its
own when the notebook has an active MLflow run (`mlflow.start_run()` in an earlier cell),
unless `DDL_MAGIC_MLFLOW=off`. Each tracked run gets an MLflow run of its own (a child of
the notebook's active run, if there is one), so repeated cells never mix their parameters
or statuses. ddl_magic logs to it, with `MlflowClient` and never the notebook's fluent
state: its parameters before launch; after the run its hosts, status (FINISHED, FAILED,
KILLED on interrupt), the failing rank's traceback, every rank's log, the timeline files
and, from the timeline, each rank's share of time waiting, communicating and computing.

Every rank finds the run in its environment (`MLFLOW_TRACKING_URI`, `MLFLOW_RUN_ID`,
`MLFLOW_EXPERIMENT_ID`), so `mlflow.log_metric` and `mlflow.autolog()` on a rank log into
it. That holds for every rank, not only rank 0: log per-rank values under keys of their own
(`f"loss/rank{hvd.rank()}"`) and parameters from rank 0 only, since MLflow refuses a
parameter logged again with another value.

Tracking never fails the training: when the tracking server is down or refuses, a warning
says what was not logged, and the run goes on (untracked, if its MLflow run could not even
be created).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
import tempfile
import time
import warnings
from logging import ERROR, getLogger
from typing import Any, Callable, Iterator

from .run_options import JobOptions
from .run_result import RunResult, TrackedRun
from .run_status import RunStatus


AUTOMATIC_VARIABLE = "DDL_MAGIC_MLFLOW"
INSTALL_HINT = 'pip install "ddl_magic[mlflow]"'
# MLflow's client retries a failing request 7 times with backoff (minutes); ddl_magic's
# own calls give up after one try of at most this long, unless the user set these.
_PROMPT_REQUESTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
_PARENT_RUN_TAG = "mlflow.parentRunId"
_TAG_LIMIT = 5000  # characters MLflow keeps of a tag's value
_METRICS_PER_BATCH = 1000  # the most one log_batch request takes
# MLflow's status for how a run ended; anything else ended as FAILED
_STATUSES = {RunStatus.DONE: "FINISHED", RunStatus.INTERRUPTED: "KILLED"}


class TrackingWarning(UserWarning):
    """Something ddl_magic meant to log to MLflow was not logged; the run itself went on."""


def check_setting(mlflow: object) -> None:
    """Refuse an `mlflow=` setting that means nothing, saying what it takes.

    Example:
        >>> check_setting("my-experiment")
        >>> check_setting(1)
        Traceback (most recent call last):
        ...
        TypeError: mlflow=1: give True (track the run), an experiment name, False (never track it) or None (track it when the notebook has an active MLflow run)
    """
    if mlflow is None or isinstance(mlflow, bool) or (isinstance(mlflow, str) and mlflow.strip()):
        return
    raise TypeError(f"mlflow={mlflow!r}: give True (track the run), an experiment name, False "
                    "(never track it) or None (track it when the notebook has an active MLflow "
                    "run)")


def wants_tracking(mlflow: bool | str | None) -> bool:
    """Whether a run with this `mlflow=` setting is tracked; checked before anything starts.

    True or an experiment name: yes (an ImportError saying what to install if mlflow is
    not); False: no; None: if the notebook has an active MLflow run and `DDL_MAGIC_MLFLOW` is
    not "off".

    Example:
        >>> wants_tracking(False), wants_tracking(None)   # no active MLflow run here
        (False, False)
    """
    check_setting(mlflow)
    if mlflow is False:
        return False
    if mlflow is None:
        if not _automatic():
            return False
        # Not imported to find out: a notebook without `import mlflow` has no active run.
        module = sys.modules.get("mlflow")
        return module is not None and module.active_run() is not None
    _import_mlflow()
    return True


def start_tracking(mlflow: bool | str | None, run: RunResult,
                   options: JobOptions) -> TrackedRun | None:
    """Before launch, for a run that `wants_tracking`: create the MLflow run it logs to (a
    child of the notebook's active run, if any) and log the run's parameters. A tracking
    server that cannot create it gets a warning, and the run goes on untracked (None).

    Example:
        >>> tracked = start_tracking("iris", run, options)  # doctest: +SKIP
        >>> tracked.rank_environment()["MLFLOW_RUN_ID"]      # doctest: +SKIP
        '5f0c...'
    """
    module = _import_mlflow()
    parent = module.active_run()
    tracking_uri = module.get_tracking_uri()
    try:
        with _prompt_requests():
            client = module.MlflowClient(tracking_uri)
            experiment_id = _experiment_id(client, mlflow, parent)
            tags = {"ddl_magic.run_id": run.run_id}
            if parent is not None:
                tags[_PARENT_RUN_TAG] = parent.info.run_id
            run_id = client.create_run(experiment_id, tags=tags).info.run_id
    except Exception as exc:  # whatever the store raises: tracking must not stop the training
        _warn(f"MLflow at {tracking_uri} could not start a run ({_describe(exc)}): ddl_magic "
              f"run {run.run_id} goes on untracked")
        return None
    tracked = TrackedRun(tracking_uri, experiment_id, run_id)
    _Logging(tracked, run.run_id).attempt("its parameters", lambda client: client.log_batch(
        run_id, params=_params(_job_params(run, options)))).warn_if_failed()
    return tracked


def finish_tracking(run: RunResult, error: BaseException | None) -> None:
    """After the run: log its hosts, logs, timeline and failure, then end it with its status.

    Example:
        >>> finish_tracking(ddl_magic.last_run(), None)  # doctest: +SKIP
    """
    tracked = run.mlflow
    if tracked is None:
        return
    logging = _Logging(tracked, run.run_id)
    hosts = sorted({rank.host for rank in run.ranks if rank.host})
    if hosts:
        logging.attempt("its hosts", lambda client: client.log_param(
            tracked.run_id, "ddl_magic.hosts", ",".join(hosts)))
    if error is not None and not isinstance(error, KeyboardInterrupt):
        logging.attempt("its failure", lambda client: _log_failure(client, tracked.run_id, error))
    logging.attempt("the ranks' logs", lambda client: [
        client.log_artifact(tracked.run_id, rank.log_path, "logs")
        for rank in run.ranks if os.path.exists(rank.log_path)])
    if run.timeline_path and os.path.exists(run.timeline_path):
        logging.attempt("the timeline files", lambda client: _log_timeline_files(
            client, tracked.run_id, run.timeline_path))
        logging.attempt("the timeline's statistics", lambda client: _log_metrics(
            client, tracked.run_id, _timeline_metrics(run.timeline_path)))
    status = _STATUSES.get(run.status, "FAILED")
    logging.attempt(f"its status {status}", lambda client: client.set_terminated(
        tracked.run_id, status, end_time=int((run.ended_at or time.time()) * 1000)))
    logging.warn_if_failed()


def log_fitted_model(run: RunResult, params: dict[str, Any], history: list[dict[str, float]],
                     model: Any) -> None:
    """For a tracked estimator fit: log its parameters, its per-epoch history (step = epoch)
    and the trained module, which `mlflow.pytorch.load_model(f"runs:/{run_id}/model")` loads.

    Example:
        >>> log_fitted_model(estimator.last_run, {"epochs": 2},   # doctest: +SKIP
        ...                  [{"epoch": 0, "loss": 0.7}, {"epoch": 1, "loss": 0.5}], net)
    """
    tracked = run.mlflow
    if tracked is None:
        return
    from mlflow.entities import Metric

    logging = _Logging(tracked, run.run_id)
    logging.attempt("the estimator's parameters", lambda client: client.log_batch(
        tracked.run_id, params=_params(params)))
    now = int(time.time() * 1000)
    metrics = [Metric(name, float(value), now, int(row["epoch"]))
               for row in history for name, value in row.items() if name != "epoch"]
    logging.attempt("the training history", lambda client: _log_metrics(
        client, tracked.run_id, metrics))
    logging.attempt("the trained model", lambda client: _log_model(client, tracked.run_id, model))
    logging.warn_if_failed()


# ---- what is logged -----------------------------------------------------------------------

def _job_params(run: RunResult, options: JobOptions) -> dict[str, Any]:
    """The run's settings. Only the names of `env` variables: their values may be secrets."""
    return {"np": run.np, "where": run.where, "timeout_s": options.timeout_s,
            "timeline": run.timeline_path is not None, "return_all": options.return_all,
            "use_gpu": options.use_gpu, "env": ",".join(sorted(options.env)) or None}


def _params(values: dict[str, Any]) -> list:
    from mlflow.entities import Param

    return [Param(f"ddl_magic.{name}", str(value))
            for name, value in values.items() if value is not None]


def _log_metrics(client, run_id: str, metrics: list) -> None:
    for start in range(0, len(metrics), _METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=metrics[start:start + _METRICS_PER_BATCH])


def _log_failure(client, run_id: str, error: BaseException) -> None:
    """The whole message (for a failed rank: which, where, and its traceback) as failure.txt;
    as tags to search runs by, the failing rank and the error in a line (for a rank that
    raised, its exception: the traceback's last line)."""
    message = str(error) or type(error).__name__
    client.log_text(run_id, message, "failure.txt")
    traceback = (getattr(error, "traceback", "") or "").strip()
    summary = traceback.splitlines()[-1] if traceback else message.splitlines()[0]
    client.set_tag(run_id, "ddl_magic.error", summary[:_TAG_LIMIT])
    failed_rank = getattr(error, "rank", None)
    if failed_rank is not None:
        client.set_tag(run_id, "ddl_magic.failed_rank", str(failed_rank))


def _log_timeline_files(client, run_id: str, timeline_path: str) -> None:
    from ..timeline.columns import columnar_path

    for path in (timeline_path, str(columnar_path(timeline_path))):
        if os.path.exists(path):
            client.log_artifact(run_id, path, "timeline")


def _timeline_metrics(timeline_path: str) -> list:
    """Per rank, the shares of its wall time spent waiting, communicating and computing,
    and its busy share and bus bandwidth: what `show_timeline`'s table says, as numbers.
    What the timeline did not record is left out rather than logged as NaN."""
    from mlflow.entities import Metric

    from ..timeline.analysis import summarize
    from ..timeline.load import load_trace

    summary = summarize(load_trace(timeline_path))
    now = int(time.time() * 1000)
    metrics = []
    for rank, row in summary.iterrows():
        wall_ms = float(row["wall_ms"])
        values = {"wall_ms": wall_ms, "busy_share": row["busy_fraction"],
                  "bus_gbps": row["bus_gbps"]}
        for kind in ("wait", "communicate", "compute"):
            values[f"{kind}_share"] = row[f"{kind}_ms"] / wall_ms if wall_ms > 0 else math.nan
        metrics += [Metric(f"timeline.rank{rank}.{name}", float(value), now, 0)
                    for name, value in values.items() if not math.isnan(float(value))]
    return metrics


def _log_model(client, run_id: str, model) -> None:
    import mlflow.pytorch

    # Newer MLflow saves a traced graph ("pt2") unless told otherwise, which needs an input
    # example and a forward that traces; the fitted module should load back as its class.
    save = mlflow.pytorch.save_model
    formats = ({"serialization_format": "pickle"}
               if "serialization_format" in inspect.signature(save).parameters else {})
    with tempfile.TemporaryDirectory(prefix="ddl_magic-model-") as folder:
        path = os.path.join(folder, "model")
        with _mlflow_warnings_of_our_choices():
            # The flavor's own requirements (torch, cloudpickle): MLflow's inference of what
            # the model needs takes seconds per fit.
            requirements = mlflow.pytorch.get_default_pip_requirements()
            save(model, path, pip_requirements=requirements, **formats)
        client.log_artifacts(run_id, path, "model")


@contextlib.contextmanager
def _mlflow_warnings_of_our_choices() -> Iterator[None]:
    """MLflow warns of what ddl_magic chose on the user's behalf: the pickle format (so the
    module loads back as its own class) and torch's "+cpu" label dropped from the pinned
    requirement. Nothing the user can act on, so not shown; errors still are."""
    logger = getLogger("mlflow")
    level = logger.level
    logger.setLevel(ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# ---- how -------------------------------------------------------------------------------

class _Logging:
    """Runs each logging step on its own, so one refused step does not lose the others, and
    gathers what failed into one warning."""

    def __init__(self, tracked: TrackedRun, ddl_run_id: str):
        self._tracked = tracked
        self._ddl_run_id = ddl_run_id
        self._failed: dict[str, list[str]] = {}  # why -> what it kept from being logged
        self._client = None

    def attempt(self, what: str, step: Callable[[Any], Any]) -> _Logging:
        try:
            with _prompt_requests():
                if self._client is None:
                    import mlflow

                    self._client = mlflow.MlflowClient(self._tracked.tracking_uri)
                step(self._client)
        except Exception as exc:  # a server down, a refusal, a full disk: say so, go on
            self._failed.setdefault(_describe(exc), []).append(what)
        return self

    def warn_if_failed(self) -> None:
        if self._failed:
            lost = "; ".join(f"{', '.join(what)} ({why})" for why, what in self._failed.items())
            _warn(f"MLflow at {self._tracked.tracking_uri} did not take {lost}: MLflow run "
                  f"{self._tracked.run_id} (ddl_magic run {self._ddl_run_id}) lacks them; the "
                  "training itself was not affected")


@contextlib.contextmanager
def _prompt_requests() -> Iterator[None]:
    added = [name for name in _PROMPT_REQUESTS if name not in os.environ]
    os.environ.update({name: _PROMPT_REQUESTS[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _automatic() -> bool:
    value = os.environ.get(AUTOMATIC_VARIABLE, "auto").strip().lower()
    if value not in ("auto", "off"):
        raise ValueError(f"{AUTOMATIC_VARIABLE}={value!r}: set it to 'off' to not track runs "
                         "when the notebook has an active MLflow run, or 'auto' (the default) "
                         "to track them")
    return value == "auto"


def _import_mlflow():
    try:
        import mlflow
    except ImportError:
        raise ImportError(f"tracking runs in MLflow needs mlflow: {INSTALL_HINT}") from None
    return mlflow


def _experiment_id(client, requested: bool | str | None, parent) -> str:
    """The named experiment (created if new), else the active run's, else the notebook's."""
    if isinstance(requested, str):
        experiment = client.get_experiment_by_name(requested)
        return experiment.experiment_id if experiment else client.create_experiment(requested)
    if parent is not None:
        return parent.info.experiment_id
    # What mlflow.set_experiment() chose, or MLFLOW_EXPERIMENT_NAME/_ID, or the default (on
    # Databricks, the notebook's experiment): MLflow's own resolution, which it keeps private.
    from mlflow.tracking.fluent import _get_experiment_id

    return _get_experiment_id() or "0"


def _describe(exc: BaseException) -> str:
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line[:300]}" if first_line else type(exc).__name__


def _warn(message: str) -> None:
    warnings.warn(f"ddl_magic: {message}", TrackingWarning, stacklevel=3)
