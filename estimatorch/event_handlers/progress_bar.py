"""ProgressBarHandler: tqdm bars for epochs, batches and validation."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Optional

from .. import distributed
from ..metrics.base import Metric, metric_name
from ._base import StatefulHandler, check_state_keys
from .mixins import BatchEnd, EpochBegin, EpochEnd, TrainBegin, TrainEnd

__all__ = ["ProgressBarHandler"]


def _bar(**kwargs: Any) -> Any:
    from tqdm.auto import tqdm

    return tqdm(dynamic_ncols=True, **kwargs)


def _running_values(metrics: list[Any]) -> dict[str, str]:
    """This rank's running values (no collective: the bar lives on rank 0 only)."""
    values: dict[str, str] = {}
    for metric in metrics:
        if isinstance(metric, Metric):
            value = metric.compute(sync=False)
        elif distributed.get_world_size() == 1:
            value = float(metric.compute())
        else:
            continue
        values[metric_name(metric)] = f"{value:.4g}"
    return values


class _ValidationBar(EpochBegin, BatchEnd, EpochEnd):
    """Attached to every ``evaluate`` during fit: a bar over the validation batches."""

    def __init__(self, owner: "ProgressBarHandler"):
        self.owner = owner
        self.bar: Any = None

    def epoch_begin(self, estimator: Any, **kwargs: Any) -> None:
        total = len(self.owner._val_data) if hasattr(self.owner._val_data, "__len__") else None
        self.bar = _bar(total=total, desc="validation", leave=False, file=self.owner.file,
                        mininterval=self.owner.refresh_interval)

    def batch_end(self, estimator: Any, **kwargs: Any) -> None:
        self.bar.update(1)

    def epoch_end(self, estimator: Any, **kwargs: Any) -> None:
        self.bar.close()
        self.bar = None


class ProgressBarHandler(StatefulHandler, TrainBegin, TrainEnd, EpochBegin, EpochEnd, BatchEnd):
    """Progress bars through ``tqdm.auto``: a widget in Jupyter, a text bar in a terminal.

    Training by epochs shows two bars (epochs, and batches in the current epoch); training by
    ``batches`` shows one. Validation during fit shows its own bar. The postfix shows the
    running loss and metrics, read from the device only when the bar refreshes (every
    ``refresh_interval`` seconds), so the step pays no host sync. Only global rank 0 draws;
    log lines printed meanwhile go above the bars, never into them. ``fit`` adds one when stderr
    is a terminal or in a notebook.

    Args:
        refresh_interval: seconds between postfix refreshes. Defaults to 0.5.
        metrics: metrics in the postfix. Defaults to the estimator's train metrics.
        file: where bars are drawn. Defaults to ``sys.stderr``.

    Example:
        >>> ProgressBarHandler(refresh_interval=1.0).refresh_interval
        1.0
    """

    priority = float("inf")
    _state_attrs = ("batch_in_epoch", "epochs_done", "total_batches")

    def __init__(self, refresh_interval: float = 0.5, metrics: Any = None, file: Any = None):
        if isinstance(refresh_interval, bool) or not isinstance(refresh_interval, (int, float)) or refresh_interval < 0:
            raise ValueError(f"refresh_interval must be a non-negative number of seconds, got {refresh_interval!r}")
        self.refresh_interval = float(refresh_interval)
        self.metrics = None if metrics is None else (list(metrics) if isinstance(metrics, (list, tuple)) else [metrics])
        self.file = file
        self.batch_in_epoch = self.epochs_done = self.total_batches = 0
        self._epoch_bar: Any = None
        self._batch_bar: Any = None
        self._redirect: Optional[contextlib.ExitStack] = None
        self._val_data: Any = None
        self._active = False

    # -- bars ------------------------------------------------------------------------------
    def _shown(self, estimator: Any) -> list[Any]:
        return self.metrics if self.metrics is not None else list(estimator.train_metrics)

    def _close(self) -> None:
        for bar in (self._batch_bar, self._epoch_bar):
            if bar is not None:
                bar.close()
        self._batch_bar = self._epoch_bar = None
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = None

    def train_begin(self, estimator: Any, **kwargs: Any) -> None:
        self._close()
        self.batch_in_epoch = self.epochs_done = self.total_batches = 0
        self._active = distributed.is_main_process()
        if not self._active:
            return
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.file = self.file if self.file is not None else sys.stderr
        self._redirect = contextlib.ExitStack()
        self._redirect.enter_context(logging_redirect_tqdm(loggers=[estimator.logger]))
        self._per_epoch = estimator.batches_per_epoch
        if estimator.max_epoch is not None:
            self._epoch_bar = _bar(total=estimator.max_epoch, desc="epochs", unit="epoch", file=self.file)
        else:
            self._batch_bar = _bar(total=estimator.max_batch, desc="batches", unit="batch", file=self.file,
                                   mininterval=self.refresh_interval)
        self._last_refresh = time.monotonic()

    def evaluation_handlers(self, val_data: Any) -> list[Any]:
        """The handlers ``evaluate`` attaches during fit: a validation bar (rank 0 only)."""
        if not self._active:
            return []
        self._val_data = val_data
        return [_ValidationBar(self)]

    def epoch_begin(self, estimator: Any, **kwargs: Any) -> None:
        self.batch_in_epoch = 0
        if not self._active or self._epoch_bar is None:
            return
        if self._batch_bar is not None:
            self._batch_bar.close()
        self._batch_bar = _bar(total=self._per_epoch, desc=f"epoch {self.epochs_done + 1}", unit="batch",
                               leave=False, file=self.file, mininterval=self.refresh_interval)

    def batch_end(self, estimator: Any, **kwargs: Any) -> None:
        self.batch_in_epoch += 1
        self.total_batches += 1
        if not self._active:
            return
        bar = self._batch_bar
        now = time.monotonic()
        if now - self._last_refresh >= self.refresh_interval:
            self._last_refresh = now
            bar.set_postfix(_running_values(self._shown(estimator)), refresh=False)
        bar.update(1)

    def epoch_end(self, estimator: Any, **kwargs: Any) -> None:
        self.epochs_done += 1
        if not self._active or self._epoch_bar is None:
            return
        if self._batch_bar is not None:
            self._batch_bar.close()
            self._batch_bar = None
        self._epoch_bar.set_postfix(_running_values(self._shown(estimator)), refresh=False)
        self._epoch_bar.update(1)

    def train_end(self, estimator: Any, **kwargs: Any) -> None:
        self._close()
        self._active = False

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, self._state_attrs, self.name)
        self.batch_in_epoch, self.epochs_done, self.total_batches = (
            state["batch_in_epoch"], state["epochs_done"], state["total_batches"])
        if not self._active:
            return
        if self._epoch_bar is not None:
            self._epoch_bar.n = self.epochs_done
            self._epoch_bar.refresh()
            if self._batch_bar is not None:
                self._batch_bar.set_description(f"epoch {self.epochs_done + 1}")
                self._batch_bar.n = self.batch_in_epoch
                self._batch_bar.refresh()
        elif self._batch_bar is not None:
            self._batch_bar.n = self.total_batches
            self._batch_bar.refresh()
