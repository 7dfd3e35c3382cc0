"""What MLflowHandler and WandbHandler share: which values they log and when, the run's
parameters and outcome, and a run id that survives a resume.

A tracker module supplies only a *session*: an object that opens (or continues) one run of its
tracker and has ``send(rows)`` and ``finish(outcome)``. :class:`TrackingHandler` creates it on
global rank 0 only (:func:`estimatorch.distributed.rank_zero_writer`; other ranks hold a writer
that does nothing) and feeds it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional
from urllib.parse import urlsplit

import torch

from ... import distributed
from ..._batches import batch_size_of
from ..._checks import check_bool, check_positive_int, check_state_keys
from ..._schedule import EventFilter
from ...events import (
    AfterTrainEnd,
    BatchEnd,
    CheckpointSaved,
    EpochEnd,
    EstimatorView,
    StatefulHandler,
    TrainBegin,
    TrainEnd,
    ValidationEnd,
    handler_name,
)
from ...metrics.base import metric_name
from .._paths import check_run_id
from ..lr_scheduler import epoch_learning_rates, learning_rate_names
from ..speed_monitor import SplitReader, epoch_speed_values

__all__ = ["Outcome", "Row", "TrackingHandler", "check_reachable", "require"]

#: Keys on the epoch axis start with this; ``batch/`` keys are on the global batch count.
EPOCH_PREFIX, BATCH_PREFIX = "epoch/", "batch/"
#: Batch-level points wait on the host side for at most this long (or their epoch's end).
SEND_SECS = 30.0
#: Longest parameter value logged (longer ones are cut): below every tracker's limit.
MAX_PARAM_CHARS = 500
#: What a parameter key may not hold (MLflow's rule): a handler's name may (``Name[variant]``).
_KEY_OUTSIDE = re.compile(r"[^\w\-. /:]")
#: Default ports of the network schemes a tracking URI may use.
_PORTS = {"http": 80, "https": 443, "postgresql": 5432, "mysql": 3306, "mssql": 1433}


def require(module: str, extra: str, owner: str) -> Any:
    """Import an optional dependency, or raise ``ImportError`` saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f'{owner} needs the {module.split(".")[0]} package, which estimatorch does not '
                          f'install by default: pip install "estimatorch[{extra}]"') from err


def check_reachable(url: str, arg: str, timeout: float = 5.0) -> None:
    """Raise ``ValueError`` naming ``arg`` unless a TCP connection to ``url``'s host opens within
    ``timeout`` seconds (a tracker's own client would retry for minutes before failing)."""
    parts = urlsplit(url)
    scheme = parts.scheme.split("+")[0]
    try:
        host, port = parts.hostname, parts.port or _PORTS.get(scheme)
    except ValueError as err:  # a port that is not a number
        raise ValueError(f"{arg} {url!r} is malformed: {err}") from None
    if not host or port is None:
        raise ValueError(f"{arg} {url!r} is malformed: it names no host")
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        raise ValueError(f"{arg} {url!r} is unreachable ({host}:{port}: {err})") from None


@dataclasses.dataclass
class Row:
    """Values logged together: ``step`` on their axis (the epoch number for ``epoch/`` keys,
    else the global batch count) and ``batch``, the global batch count when they were taken.
    Values are floats, or tensors still on the device until :func:`to_host`."""

    step: int
    batch: int
    values: dict[str, Any]

    @property
    def on_epochs(self) -> bool:
        return next(iter(self.values), "").startswith(EPOCH_PREFIX)


def to_host(rows: list[Row]) -> list[Row]:
    """``rows`` with every value a float: the tensors among them cross to the host in one copy."""
    tensors = [v for row in rows for v in row.values.values() if isinstance(v, torch.Tensor)]
    if tensors:
        dtype = torch.float32 if any(t.device.type == "mps" for t in tensors) else torch.float64
        floats = iter(torch.stack([t.detach().reshape(()).to(dtype) for t in tensors]).tolist())
        rows = [Row(row.step, row.batch, {k: next(floats) if isinstance(v, torch.Tensor) else float(v)
                                          for k, v in row.values.items()}) for row in rows]
    return rows


@dataclasses.dataclass
class Outcome:
    """How a fit ended, for the tracker: ``status`` (MLflow's ``FINISHED``, ``FAILED`` or
    ``KILLED``), the process ``exit_code`` it implies, whether it was a preemption (SIGTERM),
    the final ``history`` and the ``checkpoints`` the fit wrote."""

    status: str
    exit_code: int
    preempted: bool
    history: dict[str, list[float]]
    checkpoints: list[str]


def _outcome(estimator: EstimatorView) -> tuple[str, int, bool]:
    if estimator.position.stop:  # the loop ends without an error only once a stop was decided
        return "FINISHED", 0, False
    reason = estimator.interruption  # a signal at a step boundary
    error = sys.exc_info()[1]  # train_end runs while the error that ended the fit propagates
    if reason is None and isinstance(error, KeyboardInterrupt):
        reason = "SIGINT"
    if reason is None and isinstance(error, SystemExit):
        reason = "SIGTERM"
    if reason is None:
        return "FAILED", 1, False
    return "KILLED", 128 + int(getattr(signal, reason)), reason == "SIGTERM"


def _param_value(value: Any) -> Optional[str]:
    """A handler option as a parameter string, or None for what is not a plain option."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        text = str(value)
    elif callable(getattr(value, "compute", None)):
        text = metric_name(value)  # a monitored metric
    elif isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        text = str(list(value))
    else:
        return None
    return text if len(text) <= MAX_PARAM_CHARS else text[:MAX_PARAM_CHARS - 3] + "..."


def run_params(estimator: EstimatorView) -> dict[str, Any]:
    """The run's parameters as ``fit`` begins (the learning rate before any step): model, loss,
    optimizer and its hyper-parameters, schedule, plan, world size, seed, precision, and every
    handler's options."""
    optimizer = estimator.optimizer
    params: dict[str, Any] = {
        "model": type(estimator.net).__name__,
        "loss": type(estimator.loss).__name__ if estimator.loss is not None else "the model's own",
        "optimizer": type(optimizer).__name__,
        "lr_scheduler": type(estimator.lr_scheduler).__name__ if estimator.lr_scheduler is not None else None,
        "epochs": estimator.max_epoch, "batches": estimator.max_batch,
        "world_size": distributed.get_world_size(), "seed": estimator.seed, "precision": estimator.precision,
    }
    groups = optimizer.param_groups
    for i, group in enumerate(groups):
        prefix = "optimizer." if len(groups) == 1 else f"optimizer.group{i}."
        params.update((prefix + k, v) for k, v in group.items() if k != "params")
    for handler in estimator.handlers:
        name = handler_name(handler)
        try:
            arguments = inspect.signature(type(handler).__init__).parameters
        except (TypeError, ValueError):  # no introspectable __init__: no options to show
            continue
        for arg, parameter in arguments.items():
            if arg != "self" and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) \
                    and hasattr(handler, arg):
                params[f"handler.{name}.{arg}"] = getattr(handler, arg)
    return params


def param_texts(params: dict[str, Any]) -> dict[str, str]:
    """``params`` as a tracker takes them: keys without characters MLflow refuses, plain values
    as text (cut to :data:`MAX_PARAM_CHARS`), anything else left out."""
    texts = {_KEY_OUTSIDE.sub("_", key): _param_value(value) for key, value in params.items()}
    return {key: text for key, text in texts.items() if text is not None}


class TrackingHandler(StatefulHandler, TrainBegin, TrainEnd, EpochEnd, BatchEnd, CheckpointSaved, AfterTrainEnd,
                      ValidationEnd):
    """Base of the experiment-tracker handlers (see :class:`~.MLflowHandler` for what they log).

    Subclasses implement :meth:`_check_tracker` (checks before any work, on rank 0) and
    :meth:`_open_session` (open or continue the run named ``self.run_id``, set ``self.run_id``,
    return a session with ``send(rows)`` and ``finish(outcome)``).
    """

    priority = -500  # after the optimizer step and validation, before an LR scheduler at 0
    state_attributes = ("run_id", "current_epoch", "total_batches", "history")

    def __init__(self, log_interval: Optional[int], log_checkpoints: bool):
        self.log_interval = check_positive_int(log_interval, "log_interval", allow_none=True)
        self.log_checkpoints = check_bool(log_checkpoints, "log_checkpoints")
        self._batch_filter = EventFilter(every=log_interval) if log_interval else None
        #: the tracker's id of this run, once it is open (on rank 0)
        self.run_id: Optional[str] = None
        self.current_epoch = 0
        self.total_batches = 0
        #: the epoch-level values logged, as ``fit``'s History holds them (``"epoch"`` first)
        self.history: dict[str, list[float]] = {}
        self._session: Any = None
        self._pending: list[Row] = []
        self._batch_size: Optional[int] = None
        self._params: dict[str, Any] = {}
        self._sent = 0.0
        #: the checkpoints the fit's handlers wrote and still hold (``checkpoint_saved``), in order
        self._checkpoints: dict[str, None] = {}
        self._split = SplitReader()

    # -- what subclasses provide -------------------------------------------------------------
    def _check_tracker(self, estimator: EstimatorView) -> None:
        raise NotImplementedError

    def _open_session(self, estimator: EstimatorView, params: dict[str, str]) -> Any:
        raise NotImplementedError

    # -- the session --------------------------------------------------------------------------
    def check_fit(self, estimator: EstimatorView, resume: bool) -> None:
        """Before any work, on rank 0 (which writes): the tracker's arguments are usable."""
        if distributed.is_main_process():
            self._check_tracker(estimator)

    def _open(self, estimator: EstimatorView) -> None:
        """At the first step's end, once a resume (if any) brought the run id back."""
        params = param_texts({**self._params, "batch_size": self._batch_size})
        self._session = distributed.rank_zero_writer(lambda: self._open_session(estimator, params))
        self._send()

    def _send(self) -> None:
        rows, self._pending = self._pending, []
        if rows and self._session is not None:
            self._session.send(to_host(rows))
            self._sent = time.perf_counter()
        else:
            self._pending = rows  # the run opens at the first step's end: they wait for it

    # -- events -------------------------------------------------------------------------------
    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._session, self._pending, self._batch_size = None, [], None
        self._params = run_params(estimator) if distributed.is_main_process() else {}
        self.run_id, self.current_epoch, self.total_batches, self.history = None, 0, 0, {}
        self._sent, self._checkpoints = time.perf_counter(), {}
        self._split.start(estimator)
        estimator.at_boundary(lambda: self._open(estimator))

    def batch_end(self, estimator: EstimatorView, *, label: Any, **kwargs: Any) -> None:
        self.total_batches += 1
        if self._batch_size is None:
            self._batch_size = batch_size_of(label, estimator.batch_axis)
        if self._batch_filter is None or not self._batch_filter(self.total_batches):
            return
        values = {f"{BATCH_PREFIX}{metric_name(m)}": m.compute() for m in estimator.train_metrics}  # every rank
        rates = [g["lr"] for g in estimator.optimizer.param_groups]
        values.update((f"{BATCH_PREFIX}{name}", rate) for name, rate in zip(learning_rate_names(len(rates)), rates))
        values.update((f"{BATCH_PREFIX}{key}", value) for key, value in self._split.read(estimator).items())
        if distributed.is_main_process():
            self._pending.append(Row(self.total_batches, self.total_batches, values))
            if time.perf_counter() - self._sent >= SEND_SECS:
                self._send()

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.current_epoch += 1
        metrics = list(estimator.train_metrics) + (list(estimator.val_metrics) if estimator.validated else [])
        values: dict[str, Any] = {metric_name(m): m.compute() for m in metrics}  # every rank: a collective
        values.update(epoch_learning_rates(estimator))
        values.update(epoch_speed_values(estimator))
        row = to_host([Row(self.current_epoch, self.total_batches, values)])[0]
        self._record(row.values)
        if distributed.is_main_process():
            self._pending.append(Row(row.step, row.batch, {EPOCH_PREFIX + k: v for k, v in row.values.items()}))
            self._send()

    def validation_end(self, estimator: EstimatorView, *, values: Any, step: int, phase: str, **kwargs: Any) -> None:
        """A step-level validation's values at the step it validated (``batch/val_loss``...);
        one at an epoch's end is among the epoch's values."""
        if phase == "epoch_end":
            return
        if distributed.is_main_process():
            self._pending.append(Row(step, step, {f"{BATCH_PREFIX}{name}": value for name, value in values.items()}))
            if time.perf_counter() - self._sent >= SEND_SECS:
                self._send()

    def _record(self, values: dict[str, float]) -> None:
        """Add an epoch to :attr:`history` (``nan`` where a metric was not computed)."""
        n = len(self.history.get("epoch", []))
        self.history.setdefault("epoch", []).append(self.current_epoch)
        for name, value in values.items():
            self.history.setdefault(name, [math.nan] * n).append(value)
        for column in self.history.values():
            if len(column) == n:
                column.append(math.nan)

    def checkpoint_saved(self, estimator: EstimatorView, *, written: Sequence[str], removed: Sequence[str],
                         **kwargs: Any) -> None:
        """Keep the list of checkpoints the run ends with: what the fit wrote, less what it removed."""
        for path in removed:
            self._checkpoints.pop(path, None)
        for path in written:
            self._checkpoints.pop(path, None)
            self._checkpoints[path] = None

    def train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if self._session is not None:  # else the fit ended before the first step's end: no run was opened
            self._send()  # what waited, also past a checkpoint: a resume does not log it twice

    def after_train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """End the run once every ``train_end`` is done: the checkpoint a signal's stop writes
        there is listed too."""
        session = self._session
        if session is None:
            return
        self._session, self._pending = None, []
        status, code, preempted = _outcome(estimator)
        session.finish(Outcome(status, code, preempted, self.history, sorted(self._checkpoints)))

    # -- state --------------------------------------------------------------------------------
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved run: its id (checked to be an id, not a path), counters and history."""
        check_state_keys(state, self.state_attributes, self.name)
        self.run_id = check_run_id(state["run_id"])
        self.current_epoch = check_positive_int(state["current_epoch"], f"state of {self.name}: current_epoch",
                                                minimum=0)
        self.total_batches = check_positive_int(state["total_batches"], f"state of {self.name}: total_batches",
                                                minimum=0)
        self.history = {str(k): [int(v) if k == "epoch" else float(v) for v in column]
                        for k, column in dict(state["history"]).items()}
        self._pending = []
