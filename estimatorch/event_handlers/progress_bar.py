"""ProgressBarHandler: tqdm bars for epochs, batches and validation."""

from __future__ import annotations

import functools
import logging
import numbers
import sys
import threading
import time
from typing import Any, Callable, Optional

from .. import distributed
from ..metrics.base import Metric, as_metric_list, metric_name
from ._base import StatefulHandler, check_state_keys
from .mixins import BatchEnd, EpochBegin, EpochEnd, TrainBegin, TrainEnd

__all__ = ["ProgressBarHandler"]


@functools.lru_cache(maxsize=None)
def _bar_class() -> type:
    """``tqdm.auto.tqdm`` (a widget in Jupyter, text elsewhere) whose postfix is read only when
    tqdm redraws the bar: on its own time throttle, never on other steps."""
    from tqdm.auto import tqdm

    class Bar(tqdm):  # type: ignore[misc, valid-type]
        read_postfix: Optional[Callable[[], dict[str, str]]] = None
        owner_thread: Optional[int] = None

        @property
        def format_dict(self) -> dict[str, Any]:
            read = self.read_postfix
            # Not from tqdm's monitor thread: values are read where the step runs.
            if read is not None and self.n > 0 and threading.get_ident() == self.owner_thread:
                self.set_postfix(read(), refresh=False)
            return super().format_dict

    return Bar


def _bar(read_postfix: Optional[Callable[[], dict[str, str]]] = None, **kwargs: Any) -> Any:
    bar = _bar_class()(dynamic_ncols=True, **kwargs)
    bar.owner_thread = threading.get_ident()
    bar.read_postfix = read_postfix
    return bar


def _values(metrics: list[Any]) -> dict[str, str]:
    """This rank's running values, formatted (no collective: the bars live on rank 0 only)."""
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


def _is_console(handler: logging.Handler) -> bool:
    return (isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            and any(handler.stream is s for s in (sys.stdout, sys.stderr)))


class _BarSafe(logging.Handler):
    """Stands in for a console handler while bars are drawn: writes through ``tqdm.write`` so
    log lines go above the bars instead of through them."""

    def __init__(self, wrapped: logging.Handler, bar_class: type):
        super().__init__(wrapped.level)
        self.wrapped = wrapped
        self.bar_class = bar_class
        # stands in for the estimatorch console handler: a new Estimator must not add another
        self._estimatorch_default = getattr(wrapped, "_estimatorch_default", False)

    def filter(self, record: logging.LogRecord) -> bool:  # type: ignore[override]
        return bool(self.wrapped.filter(record))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.bar_class.write(self.wrapped.format(record), file=self.wrapped.stream)  # type: ignore[attr-defined]
        except RecursionError:
            raise
        except Exception:  # logging's own policy: report, never break training
            self.handleError(record)


class _ConsoleRedirect:
    """Swap a logger's console handlers for :class:`_BarSafe` ones; :meth:`close` swaps back
    exactly those (other handlers, e.g. a log file added meanwhile, are left alone)."""

    def __init__(self, logger: logging.Logger, bar_class: type):
        self.logger = logger
        self.swapped: list[tuple[logging.Handler, logging.Handler]] = []
        handlers = logger.handlers
        for i, handler in enumerate(handlers):
            if _is_console(handler):
                handlers[i] = _BarSafe(handler, bar_class)  # in place: the order of handlers is kept
                self.swapped.append((handler, handlers[i]))

    def close(self) -> None:
        swapped, self.swapped = self.swapped, []
        handlers = self.logger.handlers
        for original, safe in swapped:
            for i, handler in enumerate(handlers):
                if handler is safe:
                    handlers[i] = original


class _ValidationBar(EpochBegin, BatchEnd, EpochEnd):
    """Attached to every ``evaluate`` during fit: a bar over the validation batches."""

    def __init__(self, owner: "ProgressBarHandler", val_data: Any):
        self.owner = owner
        self.total = len(val_data) if hasattr(val_data, "__len__") else None

    def epoch_begin(self, estimator: Any, **kwargs: Any) -> None:
        metrics = list(estimator.val_metrics)
        self.owner._val_bar = _bar(lambda: _values(metrics), total=self.total, desc="validation", unit="batch",
                                   leave=False, file=self.owner._file, mininterval=self.owner.refresh_interval)

    def batch_end(self, estimator: Any, **kwargs: Any) -> None:
        self.owner._val_bar.update(1)

    def epoch_end(self, estimator: Any, **kwargs: Any) -> None:
        self.owner._close_val_bar()


class ProgressBarHandler(StatefulHandler, TrainBegin, TrainEnd, EpochBegin, EpochEnd, BatchEnd):
    """Progress bars through ``tqdm.auto``: a widget in Jupyter, a text bar in a terminal.

    Training by epochs shows two bars (epochs, and batches in the current epoch); training by
    ``batches`` shows one. Validation during fit shows its own bar. The batch bar's postfix
    shows the running train metrics (the validation bar's, the val metrics), read from the
    device only when tqdm redraws the bar, at most every ``refresh_interval`` seconds, so other
    steps pay no host sync; the epoch bar shows each finished epoch's train and val values.
    Only global rank 0 draws; log lines printed to the console meanwhile go above the bars,
    never into them, and bars never reach a log file. Bars are closed when training ends or
    raises. ``fit`` adds one when stderr is a terminal or in a notebook.

    Args:
        refresh_interval: the least time between two redraws, in seconds (tqdm's
            ``mininterval``). Defaults to 0.5.
        metrics: the train metrics in the postfix. Defaults to the estimator's train metrics.
        file: where bars are drawn. Defaults to ``sys.stderr`` at ``fit`` start.

    Example:
        >>> ProgressBarHandler(refresh_interval=1.0).refresh_interval
        1.0
    """

    priority = float("inf")
    _state_attrs = ("batch_in_epoch", "epochs_done", "total_batches")

    def __init__(self, refresh_interval: float = 0.5, metrics: Any = None, file: Any = None):
        if isinstance(refresh_interval, bool) or not isinstance(refresh_interval, numbers.Real) \
                or not refresh_interval >= 0:
            raise ValueError(f"refresh_interval must be a non-negative number of seconds, got {refresh_interval!r}")
        items = None if metrics is None else as_metric_list(metrics, "metrics")
        if file is not None and not callable(getattr(file, "write", None)):
            raise TypeError(f"file must be a writable stream or None, got {file!r}")
        self.refresh_interval = float(refresh_interval)
        self.metrics = items
        self.file = file
        self.batch_in_epoch = self.epochs_done = self.total_batches = 0
        self._file: Any = None
        self._epoch_bar: Any = None
        self._batch_bar: Any = None
        self._val_bar: Any = None
        self._redirect: Optional[_ConsoleRedirect] = None
        self._active = False
        self._shown: list[Any] = []
        self._per_epoch: Optional[int] = None
        self._max_epoch: Optional[int] = None
        self._unshown = 0  # batches done but not yet passed to the bar
        self._next_draw = 0.0

    # -- bars ------------------------------------------------------------------------------
    def _close_val_bar(self) -> None:
        if self._val_bar is not None:
            self._val_bar.close()
        self._val_bar = None

    def _pass_batches(self) -> None:
        """Give the bar the batches done since it last heard: at most every ``refresh_interval``
        from ``batch_end`` (tqdm would not redraw sooner anyway), and before it closes."""
        if self._unshown and self._batch_bar is not None:
            self._batch_bar.update(self._unshown)
        self._unshown = 0
        self._next_draw = time.monotonic() + self.refresh_interval

    def _close(self) -> None:
        try:
            self._pass_batches()
            self._close_val_bar()
            for bar in (self._batch_bar, self._epoch_bar):
                if bar is not None:
                    bar.close()
        finally:
            self._batch_bar = self._epoch_bar = None
            if self._redirect is not None:
                self._redirect.close()
                self._redirect = None

    def _new_batch_bar(self, **kwargs: Any) -> Any:
        shown = self._shown
        return _bar(lambda: _values(shown), unit="batch", file=self._file, mininterval=self.refresh_interval,
                    **kwargs)

    def _epoch_desc(self, epoch: int) -> str:
        return f"epoch {epoch + 1}/{self._max_epoch}"

    def train_begin(self, estimator: Any, **kwargs: Any) -> None:
        self._close()
        self.batch_in_epoch = self.epochs_done = self.total_batches = 0
        self._active = distributed.is_main_process()
        if not self._active:
            return
        self._file = self.file if self.file is not None else sys.stderr
        self._shown = self.metrics if self.metrics is not None else list(estimator.train_metrics)
        self._redirect = _ConsoleRedirect(estimator.logger, _bar_class())
        self._per_epoch = estimator.batches_per_epoch
        self._max_epoch = estimator.max_epoch
        if self._max_epoch is not None:
            self._epoch_bar = _bar(total=self._max_epoch, desc="epochs", unit="epoch", file=self._file)
        else:
            self._batch_bar = self._new_batch_bar(total=estimator.max_batch, desc="batches")

    def evaluation_handlers(self, val_data: Any) -> list[Any]:
        """The handlers ``evaluate`` attaches during fit: a validation bar (rank 0 only)."""
        return [_ValidationBar(self, val_data)] if self._active else []

    def epoch_begin(self, estimator: Any, **kwargs: Any) -> None:
        self.batch_in_epoch = 0
        if not self._active or self._epoch_bar is None:
            return
        if self._batch_bar is not None:
            self._pass_batches()
            self._batch_bar.close()
        # The loop's position already names a resumed epoch (the counters come back later).
        self._batch_bar = self._new_batch_bar(total=self._per_epoch, desc=self._epoch_desc(estimator.position.epoch),
                                              leave=False)

    def batch_end(self, estimator: Any, **kwargs: Any) -> None:
        self.batch_in_epoch += 1
        self.total_batches += 1
        if self._active:
            self._unshown += 1
            if time.monotonic() >= self._next_draw:
                self._pass_batches()

    def epoch_end(self, estimator: Any, **kwargs: Any) -> None:
        self.epochs_done += 1
        if not self._active or self._epoch_bar is None:
            return
        if self._batch_bar is not None:
            self._pass_batches()
            self._batch_bar.close()
            self._batch_bar = None
        shown = self._shown + (list(estimator.val_metrics) if estimator.validated else [])
        self._epoch_bar.set_postfix(_values(shown), refresh=False)
        self._epoch_bar.update(1)

    def train_end(self, estimator: Any, **kwargs: Any) -> None:
        self._active = False
        self._shown = []
        self._close()

    # -- state -----------------------------------------------------------------------------
    def _move(self, bar: Any, n: int) -> None:
        self._unshown = 0
        bar.n = bar.initial = bar.last_print_n = n  # rates count from the resume
        bar.refresh()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, self._state_attrs, self.name)
        self.batch_in_epoch, self.epochs_done, self.total_batches = (
            int(state["batch_in_epoch"]), int(state["epochs_done"]), int(state["total_batches"]))
        if not self._active:
            return
        if self._epoch_bar is not None:
            self._move(self._epoch_bar, self.epochs_done)
            if self._batch_bar is not None:  # a mid-epoch resume: the epoch's bar exists
                self._batch_bar.set_description(self._epoch_desc(self.epochs_done), refresh=False)
                self._move(self._batch_bar, self.batch_in_epoch)
        elif self._batch_bar is not None:
            self._move(self._batch_bar, self.total_batches)
