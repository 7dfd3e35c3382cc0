"""TensorBoardHandler: metrics, learning rates, throughput and histograms as TensorBoard events."""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Union

from .. import distributed
from .._batches import batch_size_of
from .._checks import check_file_prefix, check_positive_int, check_state_keys
from .._schedule import EventFilter
from ..events import (
    BackwardEnd,
    BatchEnd,
    EpochBegin,
    EpochEnd,
    EstimatorView,
    StatefulHandler,
    TrainBegin,
    TrainEnd,
    ValidationEnd,
)
from ..metrics.base import metric_name
from ._event_files import carry_over_events, event_files
from ._paths import check_output_dir, check_run_id, legacy_run_id, new_run_id, path_argument
from .lr_scheduler import epoch_learning_rates, learning_rate_names
from .speed_monitor import SplitReader, epoch_speed_values

__all__ = ["TensorBoardHandler"]

#: Tags on the epoch axis start with this; every other tag's step is the global batch count.
EPOCH_PREFIX = "epoch/"


def _claim(path: str) -> bool:
    """Create the directory ``path``; False when it exists already (another run's)."""
    try:
        os.makedirs(path)
        return False
    except FileExistsError:
        return True


class TensorBoardHandler(StatefulHandler, TrainBegin, TrainEnd, EpochBegin, EpochEnd, BatchEnd, BackwardEnd,
                         ValidationEnd):
    """Write training curves to TensorBoard with ``torch.utils.tensorboard.SummaryWriter``.

    Tags and their step axis:

    - ``epoch/<metric>`` (``epoch/train_loss``, ``epoch/val_accuracy``...): every train metric,
      and every val metric in epochs that validated, at step = epoch number (1, 2, ...): the
      values ``fit``'s :class:`~estimatorch.History` records.
    - ``epoch/lr`` (``epoch/lr_group<i>`` per param group with several): the learning rate the
      epoch trained with, as ``History`` records it; ``epoch/samples_per_sec``: the epoch's
      throughput over all processes (counting only this process's batches after a resume).
    - with ``log_interval=N``, every N batches: ``batch/<train metric>`` (the running value in
      the epoch), ``batch/lr`` (or ``batch/lr_group<i>``), ``batch/samples_per_sec``, at step =
      global batch count (1, 2, ... over the run).
    - ``batch/<val metric>`` (``batch/val_loss``...): every step-level validation
      (``ValidationHandler(batch_period=N)``), at step = the global batch count it validated
      (as ``History.validations`` records it).
    - with ``histogram_period=N``, every N batches: ``weights/<parameter>`` (after the optimizer
      step) and ``gradients/<parameter>`` (after backward), at step = global batch count.

    Events go to ``<log_dir>/<run_name>_<MonthDay_H-M-S>/``, created at the first step's end and
    logged then, with the command that shows it. The state holds the run's time stamp, never a
    path: a resumed run continues ``<log_dir>/<run_name>_<stamp>/`` of its own arguments (a new
    directory of that name if it is not there), and first deletes the events written there past
    the resume point (epoch tags past its epoch, the others past its batch), so curves never
    fork.

    Only global rank 0 writes: the other ranks hold a writer that does nothing
    (:func:`estimatorch.distributed.rank_zero_writer`) but still take part in the metrics'
    reductions. Values cross to the host only when they are written. Runs at priority -500:
    after the optimizer step, the metric updates and validation, before handlers at 0 (an LR
    scheduler), so the learning rate written is the one the batch or epoch used. The event file
    is opened at the first step's end (or at the first write before it). Pass it to
    :class:`MeterHandler` as ``writer=`` to put statistics in the same run.

    Args:
        log_dir: the directory that holds the runs (created if missing). Must be a directory
            this process can write in or create: ``fit`` checks before any work.
        run_name: the run directory's prefix. Defaults to ``"train"``.
        log_interval: also write batch-level scalars every this many batches. Defaults to None
            (epoch-level only).
        histogram_period: write weight and gradient histograms every this many batches.
            Defaults to None (none).
        flush_secs: how often the writer flushes to disk, in seconds. Defaults to 120.

    Example:
        >>> import tempfile
        >>> h = TensorBoardHandler(tempfile.mkdtemp(), run_name="mnist", log_interval=50)
        >>> h.log_interval, h.run_dir is None
        (50, True)
    """

    #: state keys counting this process's batches (scaled by an elastic resume on another world size).
    elastic_batch_counters = ("total_batches",)

    priority = -500
    state_attributes = ("current_epoch", "total_batches", "run_id")

    def __init__(self, log_dir: Union[str, os.PathLike], *, run_name: str = "train",
                 log_interval: Optional[int] = None, histogram_period: Optional[int] = None,
                 flush_secs: int = 120):
        self.log_dir = path_argument(log_dir, "log_dir")
        check_file_prefix(run_name, "run_name")
        self.run_name = run_name
        self.log_interval = check_positive_int(log_interval, "log_interval", allow_none=True)
        self.histogram_period = check_positive_int(histogram_period, "histogram_period", allow_none=True)
        self.flush_secs = check_positive_int(flush_secs, "flush_secs")
        self._batch_filter = EventFilter(every=log_interval) if log_interval else None
        self._histogram_filter = EventFilter(every=histogram_period) if histogram_period else None
        #: the time stamp in this run's directory name, once chosen (on rank 0)
        self.run_id: Optional[str] = None
        #: ``<log_dir>/<run_name>_<run_id>``, once chosen (on rank 0)
        self.run_dir: Optional[str] = None
        self.current_epoch = 0
        self.total_batches = 0
        self._writer: Any = None
        self._logger: Any = None
        self._resume_at: Optional[tuple[int, int]] = None
        self._split = SplitReader()
        self._reset_counters()

    def listens_to(self, event: str) -> bool:
        """Gradients are read at ``backward_end``: heard only with ``histogram_period``."""
        return event != "backward_end" or self.histogram_period is not None

    # -- the writer ------------------------------------------------------------------------
    @property
    def writer(self) -> Any:
        """The ``SummaryWriter`` of this run (opened at first use), or a writer that does nothing
        on ranks other than 0. Epoch-level tags you add must start with ``"epoch/"``."""
        if self._writer is None:
            self._writer = distributed.rank_zero_writer(self._open)
        return self._writer

    def _path(self, run_id: str) -> str:
        return os.path.join(self.log_dir, f"{self.run_name}_{run_id}")

    def _open(self) -> Any:
        from torch.utils.tensorboard import SummaryWriter  # heavy: only once a writer opens

        if self.run_id is None:
            self.run_id = new_run_id(lambda run_id: _claim(self._path(run_id)))
            continuing = False
        else:  # a resumed run: its directory, found by name under this log_dir
            continuing = os.path.isdir(self._path(self.run_id))
            os.makedirs(self._path(self.run_id), exist_ok=True)
        self.run_dir = self._path(self.run_id)
        stale = event_files(self.run_dir) if self._resume_at is not None else []
        writer = SummaryWriter(self.run_dir, flush_secs=self.flush_secs)
        if stale:
            epoch, batch = self._resume_at  # type: ignore[misc]
            carry_over_events(stale, lambda tag, step: step <= (epoch if tag.startswith(EPOCH_PREFIX) else batch),
                              writer.file_writer)
        self._resume_at = None
        if self._logger is not None:
            self._logger.info("TensorBoard: %s %s (view with: tensorboard --logdir %s)",
                              "continuing" if continuing else "writing to", self.run_dir, self.log_dir)
        return writer

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = None

    # -- counters --------------------------------------------------------------------------
    def _reset_counters(self) -> None:
        now = time.perf_counter()
        self._epoch_start = self._interval_start = now
        self._epoch_samples = self._interval_samples = 0

    def check_fit(self, estimator: EstimatorView, resume: bool) -> None:
        """Before any work: the log directory can be written (on rank 0, which writes it)."""
        if distributed.is_main_process():
            check_output_dir(self.log_dir, "log_dir")

    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._close()
        self.run_dir = self.run_id = None
        self.current_epoch = self.total_batches = 0
        self._resume_at = None
        self._logger = estimator.logger
        self._reset_counters()
        # the run's directory is known once a resume (if any) is in: open and name it then
        estimator.at_boundary(self._open_writer)

    def _open_writer(self) -> None:
        self.writer  # noqa: B018 (opens it)

    def epoch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._reset_counters()
        self._split.start(estimator)

    # -- writes ----------------------------------------------------------------------------
    def _samples_per_sec(self, samples: int, since: float) -> float:
        if distributed.is_distributed():
            samples = int(distributed.all_reduce_sum({"samples": samples})["samples"])
        elapsed = time.perf_counter() - since
        return samples / elapsed if elapsed > 0 else float("nan")

    def _write_lrs(self, estimator: EstimatorView, prefix: str, step: int) -> None:
        if prefix == EPOCH_PREFIX:
            rates = epoch_learning_rates(estimator)
        else:
            groups = estimator.optimizer.param_groups
            rates = dict(zip(learning_rate_names(len(groups)), (float(g["lr"]) for g in groups)))
        for name, rate in rates.items():
            self.writer.add_scalar(f"{prefix}{name}", rate, step)

    def backward_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """Gradient histograms (subscribed only with ``histogram_period``)."""
        step = self.total_batches + 1
        if self._histogram_filter is None or not self._histogram_filter(step):
            return
        writer = self.writer
        for name, param in estimator.net.named_parameters():
            if param.grad is not None:
                writer.add_histogram(f"gradients/{name}", param.grad.detach(), step)

    def batch_end(self, estimator: EstimatorView, *, label: Any, **kwargs: Any) -> None:
        self.total_batches += 1
        samples = batch_size_of(label, estimator.batch_axis)
        self._epoch_samples += samples
        self._interval_samples += samples
        step = self.total_batches
        if self._histogram_filter is not None and self._histogram_filter(step):
            for name, param in estimator.net.named_parameters():
                self.writer.add_histogram(f"weights/{name}", param.detach(), step)
        if self._batch_filter is None or not self._batch_filter(step):
            return
        writer = self.writer
        for metric in estimator.train_metrics:
            writer.add_scalar(f"batch/{metric_name(metric)}", float(metric.compute()), step)
        self._write_lrs(estimator, "batch/", step)
        writer.add_scalar("batch/samples_per_sec",
                          self._samples_per_sec(self._interval_samples, self._interval_start), step)
        for key, value in self._split.read(estimator).items():
            writer.add_scalar(f"batch/{key}", value, step)
        self._interval_samples, self._interval_start = 0, time.perf_counter()

    def validation_end(self, estimator: EstimatorView, *, values: Any, step: int, phase: str, **kwargs: Any) -> None:
        """A step-level validation's values at the step it validated (``batch/val_loss``...);
        one at an epoch's end is among the epoch's values."""
        if phase == "epoch_end":
            return
        writer = self.writer
        for name, value in values.items():
            writer.add_scalar(f"batch/{name}", value, step)

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.current_epoch += 1
        step, writer = self.current_epoch, self.writer
        metrics = list(estimator.train_metrics) + (list(estimator.val_metrics) if estimator.validated else [])
        for metric in metrics:
            writer.add_scalar(f"{EPOCH_PREFIX}{metric_name(metric)}", float(metric.compute()), step)
        self._write_lrs(estimator, EPOCH_PREFIX, step)
        writer.add_scalar(f"{EPOCH_PREFIX}samples_per_sec",
                          self._samples_per_sec(self._epoch_samples, self._epoch_start), step)
        for key, value in epoch_speed_values(estimator).items():
            writer.add_scalar(f"{EPOCH_PREFIX}{key}", value, step)
        writer.flush()  # the epoch's curves show up now, not at the next timed flush

    def train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._close()

    # -- state -----------------------------------------------------------------------------
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved run: its directory under this handler's ``log_dir`` (a state that
        names a path is not obeyed), events past the saved point deleted when it is opened."""
        check_state_keys(state, ("current_epoch", "total_batches"), self.name)
        self._close()
        run_id = check_run_id(state.get("run_id"))
        if run_id is None and "run_dir" in state:  # written by an older version: its name only
            run_id = legacy_run_id(state["run_dir"], self.run_name)
        self.run_id, self.run_dir = run_id, None
        self.current_epoch = int(state["current_epoch"])
        self.total_batches = int(state["total_batches"])
        self._resume_at = (self.current_epoch, self.total_batches)
        self._reset_counters()
