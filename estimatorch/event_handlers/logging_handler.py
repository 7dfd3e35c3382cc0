"""LoggingHandler: training progress through ``est.logger`` and, optionally, a log file."""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any, Optional, Union

from .. import distributed
from ..estimator._data import batch_size_of
from ..metrics.base import as_metric_list, metric_name
from ._base import StatefulHandler, check_file_prefix, check_state_keys
from ._schedule import EventFilter
from ._subscribe import with_events
from .mixins import EpochBegin, EpochEnd, TrainBegin, TrainEnd

__all__ = ["LoggingHandler", "format_metrics"]


def format_metrics(values: dict[str, float]) -> str:
    """``"train_loss: 0.1234, train_accuracy: 0.9700"``."""
    return ", ".join(f"{name}: {value:.4f}" for name, value in values.items())


class LoggingHandler(StatefulHandler, TrainBegin, TrainEnd, EpochBegin, EpochEnd):
    """Log a start summary, every ``log_interval`` batches, every epoch, and the totals.

    Lines go through ``est.logger`` (a :class:`logging.Logger`; only global rank 0 emits them).
    Metric values are read from the device only on the lines that show them (a collective under
    ``torch.distributed``: every rank computes, rank 0 prints); val metrics are shown in the
    epochs that validated. Runs last (priority +inf), after validation and checkpoints. What a
    run prints::

        Training begin: SGD (lr 0.1) on cpu, 3 epochs, seed 0, 1 process
        [Epoch 1/3][Batch 50][Samples 400] 0.120s/50 batches, train_loss: 1.0321, ...
        [Epoch 1/3] Finished in 0.250s, 100 batches: train_loss: 0.9876, ..., val_loss: 0.9123
        Train finished in 0.760s: 3 epochs, 300 batches. train_loss: 0.5012, ...

    A fit ended by an error or Ctrl-C ends with ``Train interrupted after ...`` instead.

    Args:
        log_interval: ``"epoch"`` for a line per epoch, or an int for a line every that many
            batches as well. Defaults to ``"epoch"``.
        metrics: the metrics to show. Defaults to every train and val metric of the estimator.
        log_dir: also write the lines to ``<log_dir>/<run_name>_<MonthDay_H-M-S>.log`` (created
            if missing). A run resumed from a checkpoint keeps writing to its first file.
            Defaults to None (no file).
        run_name: the log file's prefix. Defaults to ``"train"``.

    Example:
        >>> LoggingHandler(log_interval=50).log_interval
        50
    """

    priority = float("inf")
    _state_attrs = ("current_epoch", "batch_in_epoch", "samples_in_epoch", "log_file")

    def __new__(cls, log_interval: Union[str, int] = "epoch", *args: Any, **kwargs: Any) -> "LoggingHandler":
        # a line per epoch needs nothing per step: batch_end is subscribed only for batch lines
        return super().__new__(with_events(cls, [] if log_interval == "epoch" else ["batch_end"]))

    def __init__(self, log_interval: Union[str, int] = "epoch", metrics: Any = None, *,
                 log_dir: Union[str, os.PathLike, None] = None, run_name: str = "train"):
        if log_interval != "epoch" and (isinstance(log_interval, bool) or not isinstance(log_interval, int)
                                        or log_interval < 1):
            raise ValueError(f"log_interval must be 'epoch' or a positive int, got {log_interval!r}")
        check_file_prefix(run_name, "run_name")
        if log_dir is not None and (not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir)):
            raise TypeError(f"log_dir must be a directory path or None, got {log_dir!r}")
        self.log_interval = log_interval
        self.metrics = None if metrics is None else as_metric_list(metrics, "metrics")
        self._filter = None if log_interval == "epoch" else EventFilter(every=log_interval)
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.run_name = run_name
        self.current_epoch = 0
        self.batch_in_epoch = 0
        self.samples_in_epoch = 0
        self.log_file: Optional[str] = None
        self._file_handler: Optional[logging.FileHandler] = None
        self._logger: Optional[logging.Logger] = None
        self._train_start = self._epoch_start = self._interval_start = time.perf_counter()
        self._validated = False

    # -- helpers ---------------------------------------------------------------------------
    def _shown(self, estimator: Any, with_val: bool) -> list[Any]:
        metrics = self.metrics if self.metrics is not None else estimator.train_metrics + estimator.val_metrics
        if not with_val:  # val metrics hold a value only after a validation
            val = {id(m) for m in estimator.val_metrics}
            metrics = [m for m in metrics if id(m) not in val]
        return metrics

    def _values(self, metrics: list[Any]) -> dict[str, float]:
        return {metric_name(m): float(m.compute()) for m in metrics}

    def _epoch_label(self, estimator: Any) -> str:
        total = f"/{estimator.max_epoch}" if estimator.max_epoch else ""
        return f"[Epoch {self.current_epoch + 1}{total}]"

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

    # -- events ----------------------------------------------------------------------------
    def train_begin(self, estimator: Any, **kwargs: Any) -> None:
        self.current_epoch = self.batch_in_epoch = self.samples_in_epoch = 0
        self._validated = False  # any validation in this fit: the final line shows val metrics
        self._train_start = time.perf_counter()
        self._logger = estimator.logger
        self._close_file()
        self.log_file = None
        if self.log_dir is not None and distributed.is_main_process():
            os.makedirs(self.log_dir, exist_ok=True)
            stamp = time.strftime("%b%d_%H-%M-%S")
            path = os.path.join(self.log_dir, f"{self.run_name}_{stamp}.log")
            n = 1
            while os.path.exists(path):  # never append to another run's file
                n += 1
                path = os.path.join(self.log_dir, f"{self.run_name}_{stamp}_{n}.log")
            self.log_file = path
            self._open_file(estimator.logger, path, "w")
        optimizer = estimator.optimizer
        lrs = ", ".join(f"{g['lr']:.6g}" for g in optimizer.param_groups)
        plan = f"{estimator.max_epoch} epochs" if estimator.max_epoch else f"{estimator.max_batch} batches"
        estimator.logger.info("Training begin: %s (lr %s) on %s, %s, seed %d, %d process%s",
                              type(optimizer).__name__, lrs, estimator.device, plan, estimator.seed,
                              distributed.get_world_size(), "es" if distributed.get_world_size() > 1 else "")

    def epoch_begin(self, estimator: Any, **kwargs: Any) -> None:
        self.batch_in_epoch = self.samples_in_epoch = 0
        self._epoch_start = self._interval_start = time.perf_counter()

    def batch_end(self, estimator: Any, *, label: Any, **kwargs: Any) -> None:
        """Subscribed only with an int ``log_interval``."""
        self.batch_in_epoch += 1
        self.samples_in_epoch += batch_size_of(label, estimator.batch_axis)
        if self._filter is None or not self._filter(self.batch_in_epoch):
            return
        now = time.perf_counter()
        values = self._values(self._shown(estimator, with_val=False))
        estimator.logger.info("%s[Batch %d][Samples %d] %.3fs/%d batches, %s", self._epoch_label(estimator),
                              self.batch_in_epoch, self.samples_in_epoch, now - self._interval_start,
                              self.log_interval, format_metrics(values))
        self._interval_start = now

    def epoch_end(self, estimator: Any, **kwargs: Any) -> None:
        elapsed = time.perf_counter() - self._epoch_start
        self._validated = self._validated or estimator.validated
        values = self._values(self._shown(estimator, with_val=estimator.validated))
        estimator.logger.info("%s Finished in %.3fs, %d batches: %s", self._epoch_label(estimator),
                              elapsed, estimator.position.batch, format_metrics(values))
        self.current_epoch += 1

    def train_end(self, estimator: Any, **kwargs: Any) -> None:
        try:
            elapsed = time.perf_counter() - self._train_start
            if estimator.position.stop or not distributed.is_distributed():
                values = format_metrics(self._values(self._shown(estimator, with_val=self._validated)))
            else:  # stopped by an error or an interrupt: other ranks may not be here to reduce
                values = "(stopped early; values not reduced across processes)"
            # the loop returns only once a stop was requested: otherwise an error or Ctrl-C ended it
            ended = "finished in" if estimator.position.stop else "interrupted after"
            estimator.logger.info("Train %s %.3fs: %d epochs, %d batches. %s", ended, elapsed,
                                  self.current_epoch, estimator.position.step, values)
        finally:
            self._close_file()

    # -- state -----------------------------------------------------------------------------
    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, self._state_attrs, self.name)
        saved_file, current = state["log_file"], self.log_file
        for attr in self._state_attrs:
            if attr != "log_file":
                setattr(self, attr, state[attr])
        if saved_file and current and saved_file != current and os.path.exists(saved_file):
            # A resumed run continues its first file: move this run's opening lines there.
            logger = self._logger
            self._close_file()
            with open(current, encoding="utf-8") as src, open(saved_file, "a", encoding="utf-8") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(current)
            self.log_file = saved_file
            if logger is not None:
                self._open_file(logger, saved_file, "a")
