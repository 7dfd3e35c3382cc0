"""MLflowHandler: parameters, metric curves, the History and checkpoints in an MLflow run."""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Union
from urllib.parse import urlsplit

from ...events import EstimatorView
from .._paths import check_output_dir, check_output_file, path_argument
from ._base import Outcome, Row, TrackingHandler, check_reachable, require

__all__ = ["MLflowHandler"]

#: MLflow's limits per ``log_batch`` call.
_MAX_METRICS, _MAX_PARAMS = 1000, 100


def _sqlite_path(uri: str) -> Optional[str]:
    """The database file of a ``sqlite:///`` URI (relative after three slashes, absolute after
    four), or None for an in-memory database."""
    path = uri[len("sqlite://"):].split("?", 1)[0]
    path = path[1:] if path.startswith("/") else path
    return None if path in ("", ":memory:") else path


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


class _MLflowRun:
    """One open MLflow run on rank 0: batched, asynchronous metric writes, then its end."""

    def __init__(self, client: Any, run_id: str, logged: dict[str, int], log_checkpoints: bool):
        self.client, self.run_id, self.log_checkpoints = client, run_id, log_checkpoints
        self._logged = logged  # key -> the last step the run held when this process opened it
        self._entities = require("mlflow.entities", "mlflow", "MLflowHandler")
        self._operations: list[Any] = []

    def send(self, rows: list[Row]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._entities.Metric(key, value, now, row.step) for row in rows
                   for key, value in row.values.items() if row.step > self._logged.get(key, 0)]
        for chunk in _chunks(metrics, _MAX_METRICS):
            self._operations.append(self.client.log_batch(self.run_id, metrics=chunk, synchronous=False))

    def finish(self, outcome: Outcome) -> None:
        try:
            for operation in self._operations:
                operation.wait()  # raises what an asynchronous write met
            self.client.log_dict(self.run_id, outcome.history, "history.json")
            if outcome.checkpoints:
                self.client.set_tag(self.run_id, "estimatorch.checkpoints", "\n".join(outcome.checkpoints))
            if self.log_checkpoints:
                for path in outcome.checkpoints:
                    if os.path.isdir(path):  # a sharded checkpoint: the directory, under its name
                        self.client.log_artifacts(self.run_id, path, f"checkpoints/{os.path.basename(path)}")
                    else:
                        self.client.log_artifact(self.run_id, path, "checkpoints")
        finally:
            self.client.set_terminated(self.run_id, outcome.status)


class MLflowHandler(TrackingHandler):
    """Log a fit to an MLflow run: parameters, every metric's curve, the History, checkpoints.

    What the run holds (only global rank 0 writes; every rank takes part in the metrics'
    reductions):

    - parameters, once: ``model``, ``loss``, ``optimizer`` and its hyper-parameters
      (``optimizer.lr``, ``optimizer.momentum``...), ``lr_scheduler``, ``epochs`` / ``batches``,
      ``batch_size`` (per process), ``world_size``, ``seed``, ``precision``, and each handler's
      options (``handler.<name>.<argument>``).
    - metrics ``epoch/<metric>`` for every train metric, and every val metric in epochs that
      validated, and ``epoch/lr`` (``epoch/lr_group<i>`` per param group): the values
      :class:`~estimatorch.History` records, at step = epoch number.
    - with ``log_interval=N``, every N batches: ``batch/<train metric>`` (the running value in
      the epoch) and ``batch/lr``, at step = global batch count.
    - ``batch/<val metric>``: every step-level validation, at the step it validated.
    - at the end: the History as the artifact ``history.json``; the checkpoint and weights
      files this fit's :class:`CheckpointHandler` handlers wrote, as the tag
      ``estimatorch.checkpoints`` (and, with ``log_checkpoints=True``, as artifacts under
      ``checkpoints/``); the status ``FINISHED``, ``FAILED`` after an error, or ``KILLED`` after
      SIGTERM or Ctrl-C.

    The step never waits for MLflow: values are read when an epoch ends or at a ``log_interval``
    boundary, and sent in ``log_batch`` calls with ``synchronous=False`` at each epoch's end (and
    at a ``log_interval`` boundary 30 s after the last send); ``fit`` waits for them at its end.
    The run opens at the first step's end.

    **Resume continues the run.** The handler's state holds the MLflow run id, so a resumed fit
    (``fit(..., resume=True)`` or a ``CheckpointHandler`` resume) reopens that run (as
    ``mlflow.start_run(run_id=...)`` would) and logs into it. MLflow cannot delete points: the
    ones the interrupted fit logged after its checkpoint stay, and the resumed fit does not log
    them again (it logs only steps past the last one the run holds for each key; a resume is
    bit-identical, so they are the same values). Parameters the run holds are not logged again
    (MLflow cannot change them; one that changed, a larger ``epochs`` say, is named in a
    log line). A run id the tracking store does not know starts a new run, with a warning.

    Args:
        tracking_uri: where runs are stored: ``"sqlite:///runs.db"`` (a local database, no
            server; a relative path after three slashes, an absolute one after four), a server
            ``"http://host:5000"``, or a database URL. Defaults to None (MLflow's own default:
            ``MLFLOW_TRACKING_URI``, else ``mlflow.db`` in the working directory). ``fit``
            checks before any work that it is well-formed, reachable and writable.
        experiment_name: the experiment the run belongs to, created if missing. Defaults to None
            (``MLFLOW_EXPERIMENT_NAME``, else ``"Default"``).
        run_name: the run's name in the UI. Defaults to None (MLflow picks one).
        log_interval: also log batch-level values every this many batches. Defaults to None
            (epoch-level only).
        log_checkpoints: upload the checkpoint files as artifacts too. Defaults to False.
        artifact_location: where a new experiment keeps its artifacts. Defaults to None
            (MLflow's default: ``mlruns/`` in the working directory for a local store).

    Example:
        >>> h = MLflowHandler("sqlite:///runs.db", experiment_name="mnist", log_interval=50)
        >>> h.log_interval, h.run_id  # the run opens during fit
        (50, None)
    """

    def __init__(self, tracking_uri: Optional[str] = None, experiment_name: Optional[str] = None,
                 run_name: Optional[str] = None, log_interval: Optional[int] = None, *,
                 log_checkpoints: bool = False, artifact_location: Union[str, os.PathLike, None] = None):
        super().__init__(log_interval, log_checkpoints)
        self._mlflow = require("mlflow", "mlflow", "MLflowHandler")
        for arg, value in (("tracking_uri", tracking_uri), ("experiment_name", experiment_name),
                           ("run_name", run_name)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{arg} must be a non-empty str or None, got {value!r}")
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.artifact_location = None if artifact_location is None else path_argument(
            artifact_location, "artifact_location")
        self._uri = tracking_uri

    # -- checks before any work ---------------------------------------------------------------
    def _check_tracker(self, estimator: EstimatorView) -> None:
        uri = self._uri = self.tracking_uri or self._mlflow.get_tracking_uri()
        arg = "tracking_uri" if self.tracking_uri else "tracking_uri (MLflow's default)"
        scheme = urlsplit(uri).scheme.split("+")[0].lower()
        if scheme == "sqlite":
            path = _sqlite_path(uri)
            if path is not None:
                check_output_file(path, arg)
            require("sqlalchemy", "mlflow", "MLflowHandler with a sqlite tracking_uri")
        elif scheme in ("", "file"):
            check_output_dir(urlsplit(uri).path if scheme else uri, arg)
        elif scheme in ("http", "https", "postgresql", "mysql", "mssql"):
            check_reachable(uri, arg)
        if self.artifact_location is not None and urlsplit(self.artifact_location).scheme in ("", "file"):
            check_output_dir(urlsplit(self.artifact_location).path, "artifact_location")
        try:
            client = self._mlflow.MlflowClient(uri)
            if scheme in ("sqlite", "", "file"):  # a local store: open it now (it is created if new)
                client.search_experiments(max_results=1)
        except self._mlflow.exceptions.MlflowException as err:
            raise ValueError(f"{arg} {uri!r} cannot be used: {err.message}") from None

    # -- the run ------------------------------------------------------------------------------
    def _experiment_id(self, client: Any) -> str:
        name = self.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            return client.create_experiment(name, artifact_location=self.artifact_location)
        if experiment.lifecycle_stage != "active":
            raise ValueError(f"experiment_name {name!r} names a deleted MLflow experiment: restore it or "
                             "choose another name")
        return experiment.experiment_id

    def _open_session(self, estimator: EstimatorView, params: dict[str, str]) -> _MLflowRun:
        mlflow, entities = self._mlflow, require("mlflow.entities", "mlflow", "MLflowHandler")
        client = mlflow.MlflowClient(self._uri)
        run = None
        if self.run_id is not None:
            try:
                run = client.get_run(self.run_id)
            except mlflow.exceptions.MlflowException:
                estimator.logger.warning("MLflow: the resumed run %s is not in %s; logging to a new run",
                                         self.run_id, self._uri)
        logged: dict[str, int] = {}
        resumed = run is not None
        if run is None:
            run = client.create_run(self._experiment_id(client), run_name=self.run_name)
            new_params = params
        else:
            client.update_run(run.info.run_id, status="RUNNING")
            logged = {key: max(m.step for m in client.get_metric_history(run.info.run_id, key))
                      for key in run.data.metrics}
            held = run.data.params
            changed = sorted(key for key in params if key in held and held[key] != params[key])
            if changed:
                estimator.logger.info("MLflow: the resumed run keeps its parameters %s (MLflow cannot change "
                                         "them); this fit has %s", {k: held[k] for k in changed},
                                         {k: params[k] for k in changed})
            new_params = {key: value for key, value in params.items() if key not in held}
        self.run_id = run.info.run_id
        for chunk in _chunks(list(new_params.items()), _MAX_PARAMS):
            client.log_batch(self.run_id, params=[entities.Param(k, v) for k, v in chunk])
        estimator.logger.info("MLflow: %s run %s in %s", "continuing" if resumed else "logging to", self.run_id,
                              self._uri)
        return _MLflowRun(client, self.run_id, logged, self.log_checkpoints)
