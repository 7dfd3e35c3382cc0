"""LoggingHandler: training progress through ``est.logger`` and, optionally, a log file."""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any, Optional, Union

import torch

from .. import distributed
from .._batches import batch_size_of
from .._checks import check_file_prefix, check_state_keys, is_int
from .._schedule import EventFilter
from ..events import (
    BatchEnd,
    EpochBegin,
    EpochEnd,
    EstimatorView,
    StatefulHandler,
    TrainBegin,
    TrainEnd,
    ValidationEnd,
)
from ..metrics.base import as_metric_list, metric_name
from ._paths import check_output_dir, check_run_id, legacy_run_id, new_run_id, path_argument
from .lr_scheduler import epoch_learning_rates
from .speed_monitor import SplitReader, epoch_speed_values, format_speed

__all__ = ["LoggingHandler", "format_metrics", "model_summary"]


def format_metrics(values: dict[str, float]) -> str:
    """``"train_loss: 0.1234, train_accuracy: 0.9700"``."""
    return ", ".join(f"{name}: {value:.4f}" for name, value in values.items())


def _format_rates(rates: dict[str, float]) -> str:
    """``"lr: 0.001"``: learning rates keep their significant digits (``1e-05``, not ``0.0000``)."""
    return ", ".join(f"{name}: {value:.4g}" for name, value in rates.items())


def model_summary(net: Any, precision: str) -> str:
    """One line on ``net`` for the start summary: its class, parameters (all and trainable,
    counted once when shared), their dtypes and devices, and the training precision.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> net[0].requires_grad_(False)  # doctest: +ELLIPSIS
        Linear(...)
        >>> model_summary(net, "32")
        'Sequential, 58 parameters (18 trainable), float32 on cpu, precision 32'
        >>> model_summary(torch.nn.Linear(1000, 1000), "bf16-mixed")
        'Linear, 1.0M parameters (1.0M trainable), float32 on cpu, precision bf16-mixed'
    """
    params = list(net.parameters())  # each shared parameter once
    lazy = [p for p in params if isinstance(p, torch.nn.parameter.UninitializedParameter)]
    params = [p for p in params if not isinstance(p, torch.nn.parameter.UninitializedParameter)]
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    dtypes = "+".join(dict.fromkeys(str(p.dtype).replace("torch.", "") for p in params)) or "no parameters"
    devices = "+".join(dict.fromkeys(str(p.device) for p in params))
    where = f" on {devices}" if devices else ""
    later = f" + {len(lazy)} lazy, sized at the first batch" if lazy else ""
    return (f"{type(net).__name__}, {_count(total)} parameters ({_count(trainable)} trainable){later}, "
            f"{dtypes}{where}, precision {precision}")


def _count(n: int) -> str:
    """``58``, ``12,345``, ``1.0M``, ``7.2B``: exact below a million."""
    for size, unit in ((10**9, "B"), (10**6, "M")):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:,}"


class LoggingHandler(StatefulHandler, TrainBegin, TrainEnd, EpochBegin, EpochEnd, BatchEnd, ValidationEnd):
    """Log a start summary, every ``log_interval`` batches, every epoch, and the totals.

    Lines go through ``est.logger`` (a :class:`logging.Logger`; only global rank 0 emits them).
    Metric values are read from the device only on the lines that show them (a collective under
    ``torch.distributed``: every rank computes, rank 0 prints); val metrics are shown in the
    epochs that validated, and the epoch line ends with the learning rate the epoch trained with
    (``lr``, or ``lr_group<i>`` per param group: the values ``History`` records). Runs last
    (priority +inf), after validation and checkpoints. The start line ends with a summary of
    the model (:func:`model_summary`). When the validation ran on weights a handler put into the
    net for it (an ``EMAHandler``'s average) the epoch line says so after the metrics: ``val_loss:
    0.9123 (val on the EMA weights)``. What a run prints::

        Training begin: SGD (lr 0.1) on cpu, 3 epochs, seed 0, 1 process. Model: Sequential, 67 parameters (...
        [Epoch 1/3][Batch 50][Samples 400] 0.120s/50 batches, train_loss: 1.0321, ...
        [Epoch 1/3] Finished in 0.250s, 100 batches: train_loss: 0.9876, ..., val_loss: 0.9123, lr: 0.1
        Train finished in 0.760s: 3 epochs, 300 batches. train_loss: 0.5012, ...

    A validation inside an epoch (``ValidationHandler(batch_period=N)``) gets a line of its own
    when it runs, with the step it validated (a per-epoch one is on the epoch's line)::

        [Epoch 1/3][Step 30] Validation: val_loss: 0.9512, val_accuracy: 0.6250

    A fit stopped by Ctrl-C or SIGTERM (at a step boundary) ends with ``Train interrupted after
    ...`` instead; one ended in the middle of a step (an error, a second Ctrl-C) with ``Train
    failed in step N ...``, with the values of the batches before it, if any. After a
    resume, times count this process only and the lines say how many batches ran since the
    resume: ``100 batches (40 since resume)``.

    Args:
        log_interval: ``"epoch"`` for a line per epoch, or an int ``N`` for a line every ``N``
            batches as well, at batches ``N``, ``2N``, ... of each epoch (counted from 1 in each
            epoch; Gluon's handler counts from 0 and so also logs the first batch). Defaults to
            ``"epoch"``.
        metrics: the metrics to show (names are unique: the estimator refuses two metrics of
            one name). Defaults to every train and val metric of the estimator.
        log_dir: also write the lines to ``<log_dir>/<run_name>_<MonthDay_H-M-S>.log`` (created
            if missing; the path is logged at the start). A resumed run continues the file of
            the run it resumes when that file is in this ``log_dir`` (found by its name: the
            saved state holds the run's time stamp, never a path). Must be a directory this
            process can write in or create: ``fit`` checks before any work. Defaults to None
            (no file).
        run_name: the log file's prefix. Defaults to ``"train"``.

    Example:
        >>> LoggingHandler(log_interval=50).log_interval
        50
    """

    #: state keys counting this process's batches (scaled by an elastic resume on another world size).
    elastic_batch_counters = ("batch_in_epoch", "samples_in_epoch")

    priority = float("inf")
    state_attributes = ("current_epoch", "batch_in_epoch", "samples_in_epoch", "run_id")

    def __init__(self, log_interval: Union[str, int] = "epoch", metrics: Any = None, *,
                 log_dir: Union[str, os.PathLike, None] = None, run_name: str = "train"):
        if log_interval != "epoch" and (not is_int(log_interval)
                                        or log_interval < 1):
            raise ValueError(f"log_interval must be 'epoch' or a positive int, got {log_interval!r}")
        check_file_prefix(run_name, "run_name")
        self.log_interval = log_interval
        self.metrics = None if metrics is None else as_metric_list(metrics, "metrics")
        self._filter = None if log_interval == "epoch" else EventFilter(every=int(log_interval))
        self.log_dir = None if log_dir is None else path_argument(log_dir, "log_dir")
        self.run_name = run_name
        self.current_epoch = 0
        #: the time stamp in this run's log file name (None without a file)
        self.run_id: Optional[str] = None
        #: this run's log file (on global rank 0, with ``log_dir``), else None
        self.log_file: Optional[str] = None
        self._file_handler: Optional[logging.FileHandler] = None
        self._logger: Optional[logging.Logger] = None
        self._estimator: Any = None
        self._in_fit = self._looped = False
        self._train_start = self._epoch_start = self._interval_start = time.perf_counter()
        self._validated = False
        self._split = SplitReader()
        self._reset_counts()

    def listens_to(self, event: str) -> bool:
        """A line per epoch needs nothing per step: ``batch_end`` only for batch lines."""
        return event != "batch_end" or self.log_interval != "epoch"

    @property
    def batch_lines(self) -> bool:
        """Whether lines are logged every ``log_interval`` batches (batches are counted then)."""
        return self._filter is not None

    def _reset_counts(self) -> None:
        # batches and samples of the epoch: counted only for batch lines (None otherwise)
        self.batch_in_epoch: Optional[int] = 0 if self.batch_lines else None
        self.samples_in_epoch: Optional[int] = 0 if self.batch_lines else None
        self._interval_batches = 0  # batches run in this process since the last batch line
        self._resumed = False
        self._continued = False  # a resume continues an earlier run's log file
        self._resume_step: Optional[int] = None  # the step a resume continued from (known at its first boundary)
        self._resume_epoch: Optional[int] = None  # the epoch it resumed in, when mid-epoch
        self._resume_batch = 0
        self._saved_validated: Optional[bool] = None  # whether the resumed run had validated (None: unknown)

    # -- helpers ---------------------------------------------------------------------------
    def _shown(self, estimator: EstimatorView, with_val: bool) -> list[Any]:
        metrics = self.metrics if self.metrics is not None else estimator.train_metrics + estimator.val_metrics
        if not with_val:  # val metrics hold a value only after a validation
            val = {id(m) for m in estimator.val_metrics}
            metrics = [m for m in metrics if id(m) not in val]
        return metrics

    def _values(self, metrics: list[Any]) -> dict[str, float]:
        return {metric_name(m): float(m.compute()) for m in metrics}

    def _epoch_label(self, estimator: EstimatorView) -> str:
        total = f"/{estimator.max_epoch}" if estimator.max_epoch else ""
        return f"[Epoch {self.current_epoch + 1}{total}]"

    def _path(self, run_id: str) -> str:
        return os.path.join(self.log_dir, f"{self.run_name}_{run_id}.log")  # type: ignore[arg-type]

    def _open_file(self, logger: logging.Logger, path: str, mode: str) -> None:
        handler = logging.FileHandler(path, mode=mode, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(handler)
        self._file_handler = handler

    def _close_file(self) -> None:
        if self._file_handler is not None and self._logger is not None:
            self._logger.removeHandler(self._file_handler)
            self._file_handler.close()
        self._file_handler = None

    def check_fit(self, estimator: EstimatorView, resume: bool) -> None:
        """Before any work: the log directory can be written (on rank 0, which writes it)."""
        if self.log_dir is not None and distributed.is_main_process():
            check_output_dir(self.log_dir, "log_dir")

    # -- events ----------------------------------------------------------------------------
    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.current_epoch = 0
        self._reset_counts()
        self._validated = False  # any validation in this fit: the final line shows val metrics
        self._train_start, self._looped = time.perf_counter(), False
        self._logger, self._estimator, self._in_fit = estimator.logger, estimator, True
        self._close_file()
        self.log_file = self.run_id = None
        if self.log_dir is not None and distributed.is_main_process():
            os.makedirs(self.log_dir, exist_ok=True)
            self.run_id = new_run_id(lambda run_id: os.path.exists(self._path(run_id)))  # never another run's
            self.log_file = self._path(self.run_id)
            self._open_file(estimator.logger, self.log_file, "w")
        optimizer = estimator.optimizer
        lrs = "; ".join(dict.fromkeys(_group_rate(g) for g in optimizer.param_groups))  # alike groups once
        plan = f"{estimator.max_epoch} epochs" if estimator.max_epoch else f"{estimator.max_batch} batches"
        estimator.logger.info("Training begin: %s (lr %s) on %s, %s, seed %d, %d process%s. Model: %s",
                              type(optimizer).__name__, lrs, estimator.device, plan, estimator.seed,
                              distributed.get_world_size(), "es" if distributed.get_world_size() > 1 else "",
                              model_summary(estimator.net, estimator.precision))
        if self.log_file is not None:
            if estimator.resume_pending:  # it may continue the resumed run's file: say which once known
                estimator.at_boundary(self._announce_file)
            else:
                estimator.logger.info("Log file: %s", self.log_file)

    def _announce_file(self) -> None:
        if self._logger is not None and self.log_file is not None:
            self._logger.info("Log file: %s%s", "continuing " if self._continued else "", self.log_file)

    def epoch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if self.batch_lines:
            self.batch_in_epoch = self.samples_in_epoch = 0
        self._interval_batches = 0
        self._epoch_start = self._interval_start = time.perf_counter()
        self._looped = True
        self._split.start(estimator)

    def batch_end(self, estimator: EstimatorView, *, label: Any, **kwargs: Any) -> None:
        """Subscribed only with an int ``log_interval``."""
        if self.batch_in_epoch is None:  # resumed from a state that did not count them
            self.batch_in_epoch = estimator.position.batch
        self.batch_in_epoch += 1
        if self.samples_in_epoch is not None:
            self.samples_in_epoch += batch_size_of(label, estimator.batch_axis)
        self._interval_batches += 1
        if not self._filter(self.batch_in_epoch):  # type: ignore[misc]
            return
        now = time.perf_counter()
        values = self._values(self._shown(estimator, with_val=False))
        samples = "" if self.samples_in_epoch is None else f"[Samples {self.samples_in_epoch}]"
        speed = format_speed(self._split.read(estimator))
        estimator.logger.info("%s[Batch %d]%s %.3fs/%d batches, %s%s", self._epoch_label(estimator),
                              self.batch_in_epoch, samples, now - self._interval_start,
                              self._interval_batches, format_metrics(values), f"; {speed}" if speed else "")
        self._interval_start, self._interval_batches = now, 0

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if self._resumed and self._resume_step is None:  # resumed at this epoch's last batch: none ran
            self._mark_resume(ran=0)
        elapsed = time.perf_counter() - self._epoch_start
        self._validated = self._validated or estimator.validated
        values = format_metrics(self._values(self._shown(estimator, with_val=estimator.validated)))
        if estimator.evaluated_on is not None and values:  # val metrics of a handler's weights (an average)
            values += f" (val on the {estimator.evaluated_on} weights)"
        rates = _format_rates(epoch_learning_rates(estimator))
        speed = format_speed(epoch_speed_values(estimator))
        batches = estimator.position.batch
        ran = f" ({batches - self._resume_batch} since resume)" if self._resume_epoch == self.current_epoch else ""
        estimator.logger.info("%s Finished in %.3fs, %d batches%s: %s%s", self._epoch_label(estimator),
                              elapsed, batches, ran, ", ".join(v for v in (values, rates) if v),
                              f"; {speed}" if speed else "")
        self.current_epoch += 1

    def validation_end(self, estimator: EstimatorView, *, values: Any, step: int, phase: str,
                       **kwargs: Any) -> None:
        """A line for a validation inside an epoch (one at an epoch's end is on its line)."""
        if phase == "epoch_end":
            return
        shown = values if self.metrics is None else \
            {name: value for name, value in values.items() if name in {metric_name(m) for m in self.metrics}}
        weights = f" (on the {estimator.evaluated_on} weights)" if estimator.evaluated_on is not None else ""
        estimator.logger.info("%s[Step %d] Validation: %s%s", self._epoch_label(estimator), step,
                              format_metrics(shown), weights)

    def train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if not self._in_fit:  # an earlier handler's train_begin failed (a refused resume): its error says it all
            return
        try:
            elapsed = time.perf_counter() - self._train_start
            position = estimator.position
            steps = position.step
            since = steps - self._resume_step if self._resume_step is not None else 0  # None: none ran
            # a resumed run shows the val metrics it restored when it had validated, also when nothing
            # was left to train (a state saved before that was recorded: whenever it resumed)
            with_val = self._validated or (self._resumed and self._saved_validated is not False)
            at_boundary = position.stop or estimator.interruption is not None
            # a stop, or a signal every rank agreed on: every rank is here, the values reduce
            if at_boundary or not distributed.is_distributed():
                values = format_metrics(self._values(self._shown(estimator, with_val=with_val)))
            else:  # stopped by an error or a second Ctrl-C: other ranks may not be here to reduce
                values = "(stopped early; values not reduced across processes)"
            ran = f" ({since} since resume)" if self._resumed else ""
            if not at_boundary and not self._looped:  # failed in train_begin, before any step
                estimator.logger.info("Train failed before its first step after %.3fs", elapsed)
                return
            if not at_boundary:  # the loop returns only at a stop: an error (or a second Ctrl-C) ended a step
                trained = since if self._resumed else steps
                estimator.logger.info("Train failed in step %d after %.3fs: %d epochs, %d batches completed%s. %s",
                                      steps + 1, elapsed, self.current_epoch, steps, ran,
                                      values if trained else "(no values: no batch completed)")
                return
            ended = "finished in" if position.stop else "interrupted after"
            estimator.logger.info("Train %s %.3fs: %d epochs, %d batches%s. %s", ended, elapsed,
                                  self.current_epoch, steps, ran, values)
        finally:
            self._in_fit = False
            self._close_file()

    # -- state -----------------------------------------------------------------------------
    def _mark_resume(self, ran: Optional[int] = None) -> None:
        """At the first boundary after a resume: where it continued from (one batch ago, unless
        this boundary is the end of the epoch the resume started at its last batch)."""
        position = self._estimator.position
        if self._resume_step is not None:  # marked already, at this epoch's end
            return
        if ran is None:  # a boundary: one batch ago, unless it is an epoch's end
            ran = 1 if position.phase == "batch_end" else 0
        self._resume_step = position.step - ran
        if position.batch > ran:  # it resumed in the middle of this epoch (or at its last batch)
            self._resume_epoch, self._resume_batch = self.current_epoch, position.batch - ran

    def state_dict(self) -> dict[str, Any]:
        """The counts, the run's time stamp, and whether the run validated so far (``validated``;
        optional on load: states saved without it resume as before)."""
        validated = self._validated or bool(self._saved_validated)
        return {**super().state_dict(), "validated": validated}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved counts; with ``log_dir``, continue the saved run's log file if this
        ``log_dir`` holds it (a state that names a path is not obeyed)."""
        check_state_keys(state, ("current_epoch", "batch_in_epoch", "samples_in_epoch"), self.name)
        self.current_epoch = int(state["current_epoch"])
        if self.batch_lines:  # None: the saved run did not count them
            self.batch_in_epoch = None if state["batch_in_epoch"] is None else int(state["batch_in_epoch"])
            self.samples_in_epoch = None if state["samples_in_epoch"] is None else int(state["samples_in_epoch"])
        self._interval_batches = 0
        self._epoch_start = self._interval_start = time.perf_counter()
        if self._in_fit:
            self._split.start(self._estimator)
        validated = state.get("validated")
        self._saved_validated = validated if isinstance(validated, bool) else None
        if self._in_fit:  # a resume: learn at its first boundary where it continued from
            self._resumed = True
            self._estimator.at_boundary(self._mark_resume)
        saved_id = check_run_id(state.get("run_id"))
        if saved_id is None and "log_file" in state:  # written by an older version: its name only
            saved_id = legacy_run_id(state["log_file"], self.run_name, ".log")
        self._continue_file(saved_id)

    def _continue_file(self, saved_id: Optional[str]) -> None:
        current = self.log_file
        if saved_id is None or current is None or saved_id == self.run_id:
            return
        saved_file = self._path(saved_id)
        logger = self._logger
        if not os.path.isfile(saved_file):
            if logger is not None:
                logger.info("No log file %s to continue in log_dir", saved_file)
            return
        # A resumed run continues its first file: move this run's opening lines there.
        self._close_file()
        with open(current, encoding="utf-8") as src, open(saved_file, "a", encoding="utf-8") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(current)
        self.log_file, self.run_id, self._continued = saved_file, saved_id, True
        if logger is not None:
            self._open_file(logger, saved_file, "a")


def _group_rate(group: dict[str, Any]) -> str:
    """A param group's learning rate, with the schedule's initial one when they differ (a resumed
    run at the end of its schedule shows ``lr 0, initial 0.003``, not a bare 0)."""
    rate, initial = f"{group['lr']:.6g}", group.get("initial_lr")
    if initial is None or f"{initial:.6g}" == rate:
        return rate
    return f"{rate}, initial {initial:.6g}"
